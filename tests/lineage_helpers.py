"""Rollouts for the lineage tests: a root and a child, decoded straight through or cut, crashed and
restored as attempt 1 (wire-contract 5), through the worker capture."""

from __future__ import annotations

from collections.abc import Sequence

from capture_helpers import Versions, continuation_from

from store import (
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    Store,
    capture_key,
)

PROMPT = [1, 2, 3]
ROOT_GENERATED = [4, 5]
CARRY = [20, 21]
BEFORE_CUT = [30, 31]
AFTER_CUT = [32, 33]


def logprobs(tokens: Sequence[int]) -> list[float]:
    return [-(token % 7) / 4 for token in tokens]


def child_admission(rollout_id: str, attempt: int, parent_chain_hash: str, **extra: object) -> CaptureAdmission:
    prefix = [*PROMPT, *ROOT_GENERATED]
    return CaptureAdmission(
        rollout_id=capture_key(rollout_id, attempt),
        model_call_id="c1",
        parent_call_id="c0",
        prev_len=len(prefix),
        mode="token_in",
        required_prefix_token_ids=prefix,
        parent_chain_hash=parent_chain_hash,
        **extra,  # type: ignore[arg-type]
    )


def two_call_rollout(
    store: Store, rollout_id: str = "r0", *, interrupted: bool, versions: tuple[int, int] = (7, 7)
) -> list[int]:
    """Root c0 (prompt + 2 generated) and child c1 (carry [20, 21] + 4 generated), all completed.

    ``interrupted``: c1 is cut after two tokens, the worker dies, attempt 1 restores the cut
    (at ``versions[1]``) and finishes.  Returns the whole row's expected token ids.
    """
    policy = Versions(versions[0])
    capture = RolloutTokenCapture(store=store, weight_version_fn=policy)
    root_call = capture.begin_call(CaptureAdmission(rollout_id=rollout_id, model_call_id="c0", mode="text"))
    root = capture.complete_call(
        root_call,
        prompt_token_ids=PROMPT,
        generated_token_ids=ROOT_GENERATED,
        generated_logprobs=logprobs(ROOT_GENERATED),
    )
    assert root.chain_hash is not None
    call = capture.begin_call(child_admission(rollout_id, 0, root.chain_hash))
    engine_prompt = [*PROMPT, *ROOT_GENERATED, *CARRY]
    capture.track(call, prompt_token_ids=engine_prompt, effective_output_limit=16)
    capture.observe(call, BEFORE_CUT, logprobs(BEFORE_CUT))
    if not interrupted:
        capture.observe(call, AFTER_CUT, logprobs(AFTER_CUT))
        generated = [*BEFORE_CUT, *AFTER_CUT]
        coords = capture.complete_call(
            call, prompt_token_ids=engine_prompt, generated_token_ids=generated, generated_logprobs=logprobs(generated)
        )
        capture.close()
        assert coords.disposition == "staged", coords
        return [*engine_prompt, *generated]
    ticket = GenerationCutPrefix(
        ticket_id="t0", rollout_id=rollout_id, attempt_index=0, model_call_id="c1", admitted_at=1.0
    )
    inventory = GenerationCutInventory.build(checkpoint_id="ckpt-1", server_name="policy", active_prefixes=[ticket])
    [ack] = capture.serve_generation_cut(inventory).prefixes
    assert ack.disposition == "durable_prefix", ack
    capture.close()  # the worker dies
    policy.value = versions[1]
    capture = RolloutTokenCapture(store=store, weight_version_fn=policy)
    assert ack.prefix_token_count is not None and ack.prefix_digest is not None
    continuation = continuation_from(ack)
    replacement = capture.begin_call(child_admission(rollout_id, 1, root.chain_hash, generation_cut=continuation))
    resumed = replacement.continuation
    assert resumed is not None
    capture.track(replacement, prompt_token_ids=resumed.engine_prompt_token_ids, effective_output_limit=16)
    capture.observe(replacement, AFTER_CUT, logprobs(AFTER_CUT))
    coords = capture.complete_call(
        replacement,
        prompt_token_ids=resumed.engine_prompt_token_ids,
        generated_token_ids=AFTER_CUT,
        generated_logprobs=logprobs(AFTER_CUT),
    )
    capture.close()
    assert coords.disposition == "staged", coords
    return [*engine_prompt, *BEFORE_CUT, *AFTER_CUT]
