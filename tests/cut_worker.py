"""A child-process inference worker for ``test_cut_end_to_end.py`` (not a test module).

    python tests/cut_worker.py URL

Opens the store at URL and plays attempt 0 of rollout ``r0`` at policy version 4:

* stages the root call ``r0/c0`` (prompt [10, 11], generated [12]);
* admits the child ``r0/c1``, tracks it, and decodes [30, 31]; a periodic flush stages them;
* decodes [32], then serves the cut inventory ``cut_inventory()`` and prints
  ``RECEIPT <receipt JSON>`` (flushed);
* decodes [98, 99], which are never staged, prints ``DECODING`` and sleeps until killed.
"""

from __future__ import annotations

import sys
import time

from store import (
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    open_store,
    to_json,
)

ROLLOUT_ID = "r0"
POLICY_VERSION = 4
ROOT_PROMPT = [10, 11]
ROOT_GENERATED = [12]
ROOT_LOGPROBS = [-0.25]
CARRY = [20, 21]
FLUSHED = [30, 31]
FLUSHED_LOGPROBS = [-0.5, -0.75]
CUT = [32]
CUT_LOGPROBS = [-0.125]
LOST = [98, 99]
OUTPUT_LIMIT = 16


def cut_inventory() -> GenerationCutInventory:
    """The inventory the policy model sends for checkpoint-1 (deterministic, so both sides build it)."""
    prefix = GenerationCutPrefix(
        ticket_id="ticket-1", rollout_id=ROLLOUT_ID, attempt_index=0, model_call_id="c1", admitted_at=1234.5
    )
    return GenerationCutInventory.build(checkpoint_id="checkpoint-1", server_name="policy", active_prefixes=[prefix])


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(url: str) -> int:
    store = open_store(url)
    capture = RolloutTokenCapture(
        store=store,
        weight_version_fn=lambda: POLICY_VERSION,
        flush_threshold_tokens=len(FLUSHED),
        flush_interval=3600.0,  # passes run only when called below
    )
    root_call = capture.begin_call(CaptureAdmission(rollout_id=ROLLOUT_ID, model_call_id="c0", mode="text"))
    root = capture.complete_call(
        root_call,
        prompt_token_ids=ROOT_PROMPT,
        generated_token_ids=ROOT_GENERATED,
        generated_logprobs=ROOT_LOGPROBS,
    )
    assert root.disposition == "staged", root
    prefix = [*ROOT_PROMPT, *ROOT_GENERATED]
    call = capture.begin_call(
        CaptureAdmission(
            rollout_id=ROLLOUT_ID,
            model_call_id="c1",
            parent_call_id="c0",
            prev_len=len(prefix),
            mode="token_in",
            required_prefix_token_ids=prefix,
            parent_chain_hash=root.chain_hash,
        )
    )
    capture.track(call, prompt_token_ids=[*prefix, *CARRY], effective_output_limit=OUTPUT_LIMIT)
    capture.observe(call, FLUSHED, FLUSHED_LOGPROBS)
    flushed = capture.flush_due()
    assert flushed == 1, flushed
    capture.observe(call, CUT, CUT_LOGPROBS)
    receipt = capture.serve_generation_cut(cut_inventory())
    emit("RECEIPT " + to_json(receipt).decode())
    capture.observe(call, LOST, [-1.0] * len(LOST))  # decoded after the cut: lost with the process
    emit("DECODING")
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
