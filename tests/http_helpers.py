"""Live calls for the control-route tests (in-process and in ``http_worker.py``)."""

from __future__ import annotations

from store import (
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    Store,
)

TOKEN = "s3cret-token-0123456789"
POLICY_VERSION = 3
OUTPUT_LIMIT = 64


def start_live_calls(store: Store, count: int, tokens: int) -> RolloutTokenCapture:
    """A capture with ``count`` root calls (rollouts ``h0``..) each still decoding ``tokens`` tokens."""
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: POLICY_VERSION, flush_interval=3600.0)
    for index in range(count):
        call = capture.begin_call(CaptureAdmission(rollout_id=f"h{index}", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=[1, 2, 3], effective_output_limit=max(OUTPUT_LIMIT, tokens + 1))
        capture.observe(call, [(index + t) % 50_000 for t in range(tokens)], [-0.5] * tokens)
    return capture


def inventory(count: int, checkpoint_id: str = "checkpoint-1") -> GenerationCutInventory:
    prefixes = [
        GenerationCutPrefix(
            ticket_id=f"t{index:05d}", rollout_id=f"h{index}", attempt_index=0, model_call_id="c0", admitted_at=1.5
        )
        for index in range(count)
    ]
    return GenerationCutInventory.build(checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=prefixes)
