"""A worker process driven by a real engine (tests/test_real_engine.py): JSON lines on stdout.

``python engine_worker.py serve STORE``: a 4-call rollout ``r`` on a tiny transformers Llama at
policy version 1.  Calls c0 and c1 complete; c2 decodes on the main thread while a second
thread reads a cut inventory from stdin and serves it (``receipt``); decoding goes on, then
the worker reports ``decoding`` and waits to be killed.

``python engine_worker.py resume STORE``: a fresh process at policy version 2.  It first makes
each mistake a worker author makes and reports the refusals (``refused``: code and whether the
log changed), then continues c2 from the store alone (``continue_latest_cut``), decodes only
the rest from prompt + restored prefix, completes c2 and c3, and reports ``done``.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import torch

from store import CaptureAdmission, CaptureError, GenerationCutInventory, RolloutTokenCapture, from_json, open_store
from store.adapters.transformers import TransformersEngine, tiny_llama
from store.worker.engine import decode, generate

SEED = 11
TURNS = 4
LIMIT = 40  # each call's whole output limit
CUT_AT = 12  # c2 reports itself in flight after this many tokens
MAX_UNCUT = 20  # and decodes no further until the cut has started


def user(turn: int) -> list[int]:
    return [3 + (37 * turn + 11 * i) % 500 for i in range(5)]


def engine() -> TransformersEngine:
    torch.set_num_threads(1)
    return TransformersEngine(tiny_llama(SEED), seed=SEED)


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class Rollout:
    def __init__(self, capture: RolloutTokenCapture, key: str) -> None:
        self.capture, self.key, self.engine = capture, key, engine()
        self.history: list[int] = []
        self.parent: tuple[str, str] | None = None

    def admit(self, turn: int) -> Any:
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
        self.capture.track(call, prompt_token_ids=[*self.history, *user(turn)], effective_output_limit=LIMIT)
        return call

    def finish(self, call: Any, prompt: list[int]) -> None:
        coords = decode(self.capture, call, self.engine)
        assert coords.disposition == "staged", coords
        self.history = [*prompt, *self.engine.generated_token_ids]
        self.parent = (coords.model_call_id, coords.chain_hash)

    def play(self, turn: int) -> None:
        self.finish(self.admit(turn), [*self.history, *user(turn)])


def serve(path: str) -> None:
    with open_store(path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, flush_threshold_tokens=8)
        rollout = Rollout(capture, "r")
        rollout.play(0)
        rollout.play(1)
        call = rollout.admit(2)
        cut_started, receipt_done = threading.Event(), threading.Event()

        def serve_cut() -> None:  # the control route's thread: the decode thread never waits for it
            inventory = from_json(sys.stdin.readline().strip().encode(), GenerationCutInventory)
            cut_started.set()
            receipt = capture.serve_generation_cut(inventory)
            emit("receipt", receipt=json.loads(capture_json(receipt)))
            receipt_done.set()

        threading.Thread(target=serve_cut, daemon=True).start()
        decoded = 0

        def on_token(_token: int, _logprob: float) -> None:
            nonlocal decoded
            decoded += 1
            if decoded == CUT_AT:
                emit("inflight", model_call_id=call.model_call_id, admitted_at=call.admitted_at)
            if decoded == MAX_UNCUT:
                assert cut_started.wait(60), "no cut inventory arrived"

        generate(capture, call, rollout.engine, max_tokens=LIMIT - 6, on_token=on_token)
        assert receipt_done.wait(60), "the cut never finished"
        emit("decoding", decoded=decoded)
        threading.Event().wait(3600)  # killed here


def capture_json(receipt: Any) -> bytes:
    from store import to_json

    return to_json(receipt)


def resume(path: str) -> None:
    with open_store(path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 2)
        ack = store.latest_cut("r", "c2")
        assert ack is not None and ack.disposition == "durable_prefix"
        emit("refused", mistakes=mistakes(capture, ack))
        call = capture.continue_latest_cut("r", "c2", track=False)
        resumed = call.continuation
        assert resumed is not None
        try:  # the remaining limit is what the engine is told, never what track() wants
            capture.track(call, effective_output_limit=resumed.remaining_output_limit)
        except CaptureError as exc:
            limit_refusal = exc.code
        capture.track(call)
        rollout = Rollout(capture, "r-a1")
        coords = decode(capture, call, rollout.engine)  # re-prefills prompt + restored prefix
        assert coords.disposition == "staged", coords
        decoded = len(rollout.engine.generated_token_ids)  # only the rest of c2
        rollout.history = [*resumed.engine_prompt_token_ids, *rollout.engine.generated_token_ids]
        rollout.parent = (coords.model_call_id, coords.chain_hash or "")
        rollout.play(3)
        emit("done", restored=len(resumed.restored_token_ids), decoded=decoded, limit_refusal=limit_refusal)
        capture.close()


def mistakes(capture: RolloutTokenCapture, ack: Any) -> dict[str, Any]:
    """Each mistake of issue 21, tried on a real store: its refusal code, and whether the log grew."""
    from store.worker.resume import replacement_admission

    good = replacement_admission(capture.store, ack, None)
    fields = {name: getattr(good, name) for name in good.__struct_fields__}
    continuation = good.generation_cut
    assert continuation is not None
    cont = {name: getattr(continuation, name) for name in continuation.__struct_fields__}
    tampered = list(good.required_prefix_token_ids)
    tampered[-1] = (tampered[-1] + 1) % 512
    cases: dict[str, tuple[dict[str, Any], dict[str, Any], int | None]] = {
        "own_capture_key": ({"rollout_id": "r"}, {}, None),
        "wrong_parent_call_id": ({"parent_call_id": "c0"}, {}, None),
        "tampered_parent_token": ({"required_prefix_token_ids": tampered}, {}, None),
        "tampered_digest": ({}, {"digest": "0" * 64}, None),
        "wrong_token_count": ({}, {"generation_token_count": ack.prefix_token_count - 1}, None),
        "older_policy_version": ({}, {}, 0),
    }
    found: dict[str, Any] = {}
    for name, (admission_fields, continuation_fields, version) in cases.items():
        before = capture.store.replay().events
        admission = CaptureAdmission(
            **{**fields, **admission_fields, "generation_cut": type(continuation)(**{**cont, **continuation_fields})}
        )
        try:
            capture.begin_call(admission, weight_version=version)
        except CaptureError as exc:
            found[name] = {"code": exc.code, "message": str(exc), "wrote": capture.store.replay().events != before}
        else:
            found[name] = {"code": None, "message": "admitted", "wrote": True}
    return found


if __name__ == "__main__":
    {"serve": serve, "resume": resume}[sys.argv[1]](sys.argv[2])
