"""A deterministic rollout for the durability-domain tests, the host-loss test and its soak,
and the replicated-cut benchmark (not a test module).

Rollout ``r0``: a root call ``c0`` (prompt [1, 2, 3], generated [4, 5]) and ``n`` child calls
``c1``..``cn`` that continue it, each decoding ``TOTAL`` tokens from a fixed function of (call,
position): a continued call regenerates exactly what the uninterrupted one produced, so the
final records of the two runs are compared token for token.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass

from store import (
    ActiveCall,
    CaptureAdmission,
    CommitCoords,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutReceipt,
    RolloutTokenCapture,
    Store,
)

POLICY = 3
ROOT_PROMPT = [1, 2, 3]
ROOT_GENERATED = [4, 5]
PREFIX = [*ROOT_PROMPT, *ROOT_GENERATED]
TOTAL = 12  # tokens each child call generates
LIMIT = 16  # each child's output limit


def token(call: int, position: int) -> int:
    return 1000 * call + position


def logprob(call: int, position: int) -> float:
    return -((call + position) % 7 + 1) / 8.0  # exact in binary: compared with ==


def carry(call: int) -> list[int]:
    return [900 + call]


def model_call_id(call: int) -> str:
    return f"c{call}"


def capture_on(store: Store) -> RolloutTokenCapture:
    return RolloutTokenCapture(store=store, weight_version_fn=lambda: POLICY)


def stage_root(capture: RolloutTokenCapture, rollout: str = "r0") -> CommitCoords:
    root = capture.begin_call(CaptureAdmission(rollout_id=rollout, model_call_id="c0", mode="text"))
    return capture.complete_call(
        root, prompt_token_ids=ROOT_PROMPT, generated_token_ids=ROOT_GENERATED, generated_logprobs=[-0.5, -0.25]
    )


def admit(capture: RolloutTokenCapture, root: CommitCoords, call: int, limit: int = LIMIT) -> ActiveCall:
    """Attempt 0 of child ``call`` (of the root's rollout), tracked with its engine prompt."""
    admission = CaptureAdmission(
        rollout_id=root.rollout_id,
        model_call_id=model_call_id(call),
        parent_call_id="c0",
        prev_len=len(PREFIX),
        mode="token_in",
        required_prefix_token_ids=PREFIX,
        parent_chain_hash=root.chain_hash,
    )
    active = capture.begin_call(admission)
    capture.track(active, prompt_token_ids=[*PREFIX, *carry(call)], effective_output_limit=limit)
    return active


def decode(capture: RolloutTokenCapture, active: ActiveCall, call: int, start: int, stop: int) -> None:
    """Observe generated positions ``start``..``stop - 1`` of ``call`` (the last one finishes it)."""
    if stop <= start:
        return
    finish = "length" if stop == TOTAL else None
    positions = range(start, stop)
    capture.observe(
        active,
        [token(call, p) for p in positions],
        [logprob(call, p) for p in positions],
        finish_reason=finish,
    )


def inventory(checkpoint_id: str, calls: Iterable[int], rollout: str = "r0") -> GenerationCutInventory:
    prefixes = [
        GenerationCutPrefix(
            ticket_id=f"t-{rollout}-{call}",
            rollout_id=rollout,
            attempt_index=0,
            model_call_id=model_call_id(call),
            admitted_at=1.0,
        )
        for call in calls
    ]
    return GenerationCutInventory.build(checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=prefixes)


@dataclass(frozen=True)
class Final:
    """What a call's final record holds: compared between a continued and an uninterrupted run."""

    token_ids: tuple[int, ...]
    mask: tuple[float, ...]
    logprobs: tuple[float, ...]
    chain_hash: str
    cumulative_hash: str


def final_of(store: Store, coords: CommitCoords) -> Final:
    assert coords.disposition == "staged" and coords.staging_key is not None, coords
    (record,) = store.fetch([coords.staging_key])
    return Final(
        tuple(int(t) for t in record.token_ids_delta),
        tuple(float(m) for m in record.token_mask_delta),
        tuple(float(lp) for lp in record.generation_log_probs_delta),
        record.chain_hash,
        record.cumulative_hash,
    )


def uninterrupted(store: Store, calls: Iterable[int], rollout: str = "r0") -> dict[int, Final]:
    """Every call decoded to its end on ``store`` with no cut: the reference."""
    capture = capture_on(store)
    root = stage_root(capture, rollout)
    finals = {}
    for call in calls:
        active = admit(capture, root, call)
        decode(capture, active, call, 0, TOTAL)
        finals[call] = final_of(store, capture.complete_observed(active))
    capture.close()
    return finals


def serve_until_cut(
    store: Store, calls: Iterable[int], decoded: int, checkpoint_id: str = "checkpoint-1", rollout: str = "r0"
) -> tuple[RolloutTokenCapture, dict[int, ActiveCall], GenerationCutReceipt]:
    """Admit ``calls``, decode ``decoded`` tokens of each, serve a cut naming them all."""
    chosen = list(calls)
    capture = capture_on(store)
    root = stage_root(capture, rollout)
    live = {}
    for call in chosen:
        live[call] = admit(capture, root, call)
        decode(capture, live[call], call, 0, decoded)
    return capture, live, capture.serve_generation_cut(inventory(checkpoint_id, chosen, rollout))


def continue_from(store: Store, call: int, rollout: str = "r0") -> Final:
    """On ``store`` (a replacement worker's), continue ``call`` from its newest durable cut, decode
    the rest and complete it: its final record."""
    capture = capture_on(store)
    try:
        active = capture.continue_latest_cut(rollout, model_call_id(call))
        continuation = active.continuation
        assert continuation is not None
        restored = len(continuation.restored_token_ids)
        decode(capture, active, call, restored, TOTAL)
        return final_of(store, capture.complete_observed(active))
    finally:
        capture.close()


def final_json(final: Final) -> str:
    return json.dumps(dataclasses.asdict(final))


def final_from_json(text: str) -> Final:
    fields = json.loads(text)
    return Final(
        tuple(fields["token_ids"]),
        tuple(fields["mask"]),
        tuple(fields["logprobs"]),
        fields["chain_hash"],
        fields["cumulative_hash"],
    )
