"""One demo worker process (``python -m store.demo.worker STORE JOB``), talking JSON lines.

With ``"socket"`` in the job, the worker first registers with the demo's checkpoint
coordinator (``WorkerClient.connect``) and says goodbye (``stop``) when it is done.  Each
rollout is decoded by its own ``LiveEngine`` (``store.demo.engine``: the toy, or a tiny
transformers Llama), driven by ``store.worker.engine``: every token is observed as decoded.

Attempt 0 (``"phase": "serve"``): for each rollout, completes the turns before its cut turn,
admits the cut turn and decodes part of it (flushing chunks as it goes), reports its
in-flight calls (``inflight``), then waits for the coordinator's cut inventory on stdin,
serves it (``receipt``), keeps decoding tokens the cut will not hold (``decoding``) and
waits to be killed.

Attempt 1 (``"phase": "resume"``): for each rollout, continues the cut call from the
acknowledgement (``RolloutTokenCapture.continue_cut``: lineage and parent tokens read back
from the store, the continuation validated, the next attempt's capture key derived), decodes
only the rest from prompt + restored prefix, completes the remaining turns, and reports
``done`` per rollout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from store.demo.engine import Script, script_for
from store.store import open_store
from store.wire.codec import from_json, to_json
from store.wire.cut_records import GenerationCutInventory, GenerationCutPrefixAck, capture_key
from store.wire.records import CaptureAdmission, CommitCoords
from store.worker.active_call import ActiveCall
from store.worker.capture import RolloutTokenCapture
from store.worker.engine import LiveEngine, decode, decoding_plan, generate

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

    def __init__(self, capture: RolloutTokenCapture, script: Script, index: int, key: str) -> None:
        self.capture, self.script, self.index, self.key = capture, script, index, key
        self.engine: LiveEngine = script.live(index)
        self.history: list[int] = []
        self.parent: tuple[str, str] | None = None  # (model_call_id, chain hash) of the previous call
        self.staged_tokens = 0

    def admit(self, turn: int) -> ActiveCall:
        """Admit and track the call of ``turn`` (its engine prompt: the history plus the user turn)."""
        user = self.script.user_turn(self.index, turn)
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
        call = self.capture.begin_call(admission)
        self.capture.track(call, prompt_token_ids=[*self.history, *user], effective_output_limit=self.script.tokens)
        return call

    def finish(self, call: ActiveCall) -> None:
        """Decode the call to its end (from prompt + restored prefix, for a continued call) and complete it."""
        prompt = list(decoding_plan(self.capture, call).prompt_token_ids)
        coords = _staged(decode(self.capture, call, self.engine))
        self.history = [*prompt, *self.engine.generated_token_ids]
        self.parent = (coords.model_call_id, coords.chain_hash or "")
        self.staged_tokens += coords.delta_len

    def play(self, turn: int) -> None:
        self.finish(self.admit(turn))


def serve(job: dict[str, Any], capture: RolloutTokenCapture, script: Script) -> None:
    inflight = []
    live: list[tuple[ActiveCall, Turns]] = []
    for plan in job["rollouts"]:
        turns = Turns(capture, script, plan["index"], plan["rollout_id"])
        for turn in range(plan["cut_turn"]):
            turns.play(turn)
        call = turns.admit(plan["cut_turn"])
        decoded = 0
        while decoded < plan["cut_after"]:
            more = min(STEP, plan["cut_after"] - decoded)
            generate(capture, call, turns.engine, prefill=decoded == 0, max_tokens=more)
            decoded += more
            capture.flush_due()
        live.append((call, turns))
        inflight.append(
            {"rollout_id": plan["rollout_id"], "model_call_id": call.model_call_id, "admitted_at": call.admitted_at}
        )
    emit("inflight", calls=inflight, pid=os.getpid())
    inventory = from_json(sys.stdin.readline().strip().encode(), GenerationCutInventory)
    receipt = capture.serve_generation_cut(inventory)
    emit("receipt", receipt=to_json(receipt).decode())
    lost = 0
    for call, turns in live:  # decoded after the cut: dies with this process
        before = len(turns.engine.generated_token_ids)
        generate(capture, call, turns.engine, prefill=False, max_tokens=STEP)
        lost += len(turns.engine.generated_token_ids) - before
    emit("decoding", lost=lost)
    time.sleep(3600)


def resume(job: dict[str, Any], capture: RolloutTokenCapture, script: Script) -> None:
    for plan in job["rollouts"]:
        index, cut_turn, rollout_id = plan["index"], plan["cut_turn"], plan["rollout_id"]
        ack = from_json(plan["ack"].encode(), GenerationCutPrefixAck)
        turns = Turns(capture, script, index, capture_key(rollout_id, 1))
        restored = 0
        if ack.disposition == "durable_prefix":
            call = capture.continue_cut(ack)  # admitted, validated and tracked: decode only the rest
            resumed = call.continuation
            assert resumed is not None
            restored = len(resumed.restored_token_ids)
            turns.finish(call)
        else:  # nothing durable to continue from: read the parent chain back and decode the call again
            chain = capture.store.fetch([f"{rollout_id}/c{turn}" for turn in range(cut_turn)])
            turns.history = [int(token) for record in chain for token in record.token_ids_delta]
            if chain:
                turns.parent = (chain[-1].model_call_id, chain[-1].chain_hash)
            turns.play(cut_turn)
        for turn in range(cut_turn + 1, script.turns):
            turns.play(turn)
        emit(
            "done",
            rollout_id=rollout_id,
            restored=restored,
            decoded=script.tokens - restored,
            staged_tokens=turns.staged_tokens,
        )


def main(argv: list[str]) -> int:
    path, job = argv[0], json.loads(argv[1])
    script = script_for(job.get("engine", "toy"), job["seed"], job["tokens"], job["turns"])
    version = job["version"]
    client = None
    if job.get("socket"):  # register with the coordinator: it logs this pid joining, stopping or lost
        from store.coordinator import WorkerClient

        client = WorkerClient.connect(job["socket"])
    with open_store(path) as store:
        capture = RolloutTokenCapture(
            store=store,
            weight_version_fn=lambda: version,
            flush_threshold_tokens=max(1, script.tokens // 3),
            flush_interval=3600.0,  # flush passes run only when this worker calls flush_due()
        )
        try:
            if job["phase"] == "serve":
                serve(job, capture, script)
            else:
                resume(job, capture, script)
        finally:
            capture.close()
    if client is not None:
        client.stop()  # the clean goodbye (a killed worker never says it: the coordinator logs it lost)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
