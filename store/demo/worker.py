"""One demo worker process (``python -m store.demo.worker STORE JOB``), talking JSON lines.

With ``"socket"`` in the job, the worker first registers with the demo's checkpoint
coordinator (``WorkerClient.connect``) and says goodbye (``stop``) when it is done.

Attempt 0 (``"phase": "serve"``): for each rollout, completes the turns before its cut turn,
admits the cut turn and decodes part of it (flushing chunks as it goes), reports its
in-flight calls (``inflight``), then waits for the coordinator's cut inventory on stdin,
serves it (``receipt``), keeps decoding tokens the cut will not hold (``decoding``) and
waits to be killed.

Attempt 1 (``"phase": "resume"``): for each rollout, reads the parent chain back from the
store, admits the cut call again as the next attempt with the continuation its
acknowledgement names (``begin_call`` validates the staged prefix), decodes only the rest,
completes the remaining turns, and reports ``done`` per rollout.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from store.demo.engine import ToyEngine
from store.store import open_store
from store.wire.cut_records import GenerationCutInventory, GenerationCutPrefixAck, capture_key
from store.wire.records import CaptureAdmission, CommitCoords, GenerationCutContinuation, from_json, to_json
from store.worker.active_call import ActiveCall
from store.worker.capture import RolloutTokenCapture

STEP = 8  # tokens decoded between flush passes


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _staged(coords: CommitCoords) -> CommitCoords:
    if coords.disposition != "staged":
        raise RuntimeError(f"{coords.rollout_id}/{coords.model_call_id} was not staged: {coords.disposition}")
    return coords


class Turns:
    """Plays a rollout's turns as calls of one capture key, keeping its token history."""

    def __init__(self, capture: RolloutTokenCapture, engine: ToyEngine, index: int, key: str) -> None:
        self.capture, self.engine, self.index, self.key = capture, engine, index, key
        self.history: list[int] = []
        self.parent: tuple[str, str] | None = None  # (model_call_id, chain hash) of the previous call
        self.staged_tokens = 0

    def admit(self, turn: int) -> tuple[ActiveCall, list[int]]:
        user = self.engine.user_turn(self.index, turn)
        if self.parent is None:
            admission = CaptureAdmission(rollout_id=self.key, model_call_id=f"c{turn}", mode="text")
        else:
            admission = CaptureAdmission(
                rollout_id=self.key,
                model_call_id=f"c{turn}",
                parent_call_id=self.parent[0],
                prev_len=len(self.history),
                mode="token_in",
                required_prefix_token_ids=self.history,
                parent_chain_hash=self.parent[1],
            )
        return self.capture.begin_call(admission), [*self.history, *user]

    def complete(self, call: ActiveCall, prompt: list[int], ids: list[int], logprobs: list[float]) -> None:
        coords = _staged(
            self.capture.complete_call(
                call, prompt_token_ids=prompt, generated_token_ids=ids, generated_logprobs=logprobs
            )
        )
        self.history = [*prompt, *ids]
        self.parent = (coords.model_call_id, coords.chain_hash or "")
        self.staged_tokens += coords.delta_len

    def play(self, turn: int) -> None:
        call, prompt = self.admit(turn)
        ids, logprobs = self.engine.generate(self.index, turn, 0, self.engine.tokens)
        self.complete(call, prompt, ids, logprobs)


def serve(job: dict[str, Any], capture: RolloutTokenCapture, engine: ToyEngine) -> None:
    inflight = []
    live: list[tuple[ActiveCall, int, int, int]] = []
    for plan in job["rollouts"]:
        turns = Turns(capture, engine, plan["index"], plan["rollout_id"])
        for turn in range(plan["cut_turn"]):
            turns.play(turn)
        call, prompt = turns.admit(plan["cut_turn"])
        capture.track(call, prompt_token_ids=prompt, effective_output_limit=engine.tokens)
        for start in range(0, plan["cut_after"], STEP):
            stop = min(start + STEP, plan["cut_after"])
            capture.observe(call, *engine.generate(plan["index"], plan["cut_turn"], start, stop))
            capture.flush_due()
        live.append((call, plan["index"], plan["cut_turn"], plan["cut_after"]))
        inflight.append(
            {"rollout_id": plan["rollout_id"], "model_call_id": call.model_call_id, "admitted_at": time.time()}
        )
    emit("inflight", calls=inflight, pid=_pid())
    inventory = from_json(sys.stdin.readline().strip().encode(), GenerationCutInventory)
    receipt = capture.serve_generation_cut(inventory)
    emit("receipt", receipt=to_json(receipt).decode())
    lost = 0
    for call, index, turn, done in live:  # decoded after the cut: dies with this process
        more = min(STEP, engine.tokens - done)
        capture.observe(call, *engine.generate(index, turn, done, done + more))
        lost += more
    emit("decoding", lost=lost)
    time.sleep(3600)


def resume(job: dict[str, Any], capture: RolloutTokenCapture, engine: ToyEngine) -> None:
    store = capture.store
    for plan in job["rollouts"]:
        index, cut_turn, rollout_id = plan["index"], plan["cut_turn"], plan["rollout_id"]
        ack = from_json(plan["ack"].encode(), GenerationCutPrefixAck)
        turns = Turns(capture, engine, index, capture_key(rollout_id, 1))
        # The parent chain, read back from the store (attempt 0 staged it before it died).
        chain = store.fetch([f"{rollout_id}/c{turn}" for turn in range(cut_turn)])
        turns.history = [int(token) for record in chain for token in record.token_ids_delta]
        if chain:
            turns.parent = (chain[-1].model_call_id, chain[-1].chain_hash)
        restored = 0
        if ack.disposition == "durable_prefix":
            call = _continue(turns, cut_turn, ack)
            resumed = call.continuation
            assert resumed is not None
            restored = len(resumed.restored_token_ids)
            # The engine continues from prompt + restored tokens: only the rest is decoded.
            ids, logprobs = engine.generate(index, cut_turn, restored, engine.tokens)
            turns.complete(call, list(resumed.engine_prompt_token_ids), ids, logprobs)
        else:  # nothing durable to continue from: decode the call again
            turns.play(cut_turn)
        for turn in range(cut_turn + 1, engine.turns):
            turns.play(turn)
        emit(
            "done",
            rollout_id=rollout_id,
            restored=restored,
            decoded=engine.tokens - restored,
            staged_tokens=turns.staged_tokens,
        )


def _continue(turns: Turns, cut_turn: int, ack: GenerationCutPrefixAck) -> ActiveCall:
    assert ack.prefix_token_count is not None and ack.prefix_digest is not None
    continuation = GenerationCutContinuation(
        source_capture_key=capture_key(ack.rollout_id, ack.attempt_index),
        source_model_call_id=ack.model_call_id,
        staging_keys=ack.staging_keys,
        generation_token_count=ack.prefix_token_count,
        digest=ack.prefix_digest,
        effective_output_limit=ack.effective_output_limit or 0,
        terminal_finish_reason=ack.terminal_finish_reason,
        terminal_stop_reason=ack.terminal_stop_reason,
    )
    assert turns.parent is not None  # the demo cuts turn 1 or later
    admission = CaptureAdmission(
        rollout_id=turns.key,
        model_call_id=f"c{cut_turn}",
        parent_call_id=turns.parent[0],
        prev_len=len(turns.history),
        mode="token_in",
        required_prefix_token_ids=turns.history,
        parent_chain_hash=turns.parent[1],
        generation_cut=continuation,
    )
    return turns.capture.begin_call(admission)  # resolves and validates the staged prefix


def _pid() -> int:
    import os

    return os.getpid()


def main(argv: list[str]) -> int:
    path, job = argv[0], json.loads(argv[1])
    engine = ToyEngine(job["seed"], job["tokens"], job["turns"])
    version = job["version"]
    client = None
    if job.get("socket"):  # register with the coordinator: it logs this pid joining, stopping or lost
        from store.coordinator import WorkerClient

        client = WorkerClient.connect(job["socket"])
    with open_store(path) as store:
        capture = RolloutTokenCapture(
            store=store,
            weight_version_fn=lambda: version,
            flush_threshold_tokens=max(1, engine.tokens // 3),
            flush_interval=3600.0,  # flush passes run only when this worker calls flush_due()
        )
        try:
            if job["phase"] == "serve":
                serve(job, capture, engine)
            else:
                resume(job, capture, engine)
        finally:
            capture.close()
    if client is not None:
        client.stop()  # the clean goodbye (a killed worker never says it: the coordinator logs it lost)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
