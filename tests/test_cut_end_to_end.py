"""A generation cut survives the death of the worker that served it (wire-contract 5.1 - 5.6).

A child process stages a rollout's root call, starts its second call, serves a cut and is
killed with SIGKILL while still decoding.  A fresh process then reopens the store, admits
the replacement call (attempt 1) with the continuation from the acknowledgement, resolves
the durable prefix from the log, completes the call, and verifies every record of the
rollout from its own fields.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cut_worker
import pytest
from capture_helpers import continuation_from
from factories import plain_digest_fields

from store import (
    CaptureAdmission,
    GenerationCutReceipt,
    RolloutTokenCapture,
    capture_key,
    compute_chain_hash,
    compute_staging_digest,
    from_json,
    hash_token_ids,
    open_store,
    to_json,
)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "cut_worker.py"


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_worker_until_killed(url: str) -> tuple[str, int]:
    """Start the worker, wait for its receipt and for it to keep decoding, then SIGKILL it."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), url],
        cwd=REPO,
        env=_worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    receipt_line: str | None = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("the cut worker produced no receipt in time")
            if line is None:
                proc.wait(timeout=30)
                assert proc.stderr is not None
                pytest.fail(f"the cut worker exited early ({proc.returncode}):\n{proc.stderr.read()}")
            if line.startswith("RECEIPT "):
                receipt_line = line[len("RECEIPT ") :]
            elif line == "DECODING":
                break
        assert receipt_line is not None, "the worker reported decoding before its receipt"
        assert proc.poll() is None, "the worker must still be running when it is killed"
        os.kill(proc.pid, signal.SIGKILL)
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return receipt_line, returncode


def test_cut_survives_process_kill_and_continues(store_url: str) -> None:
    receipt_json, returncode = _run_worker_until_killed(store_url)
    assert returncode == -signal.SIGKILL
    inventory = cut_worker.cut_inventory()
    receipt = from_json(receipt_json, GenerationCutReceipt)
    receipt.validate_for(inventory)
    (ack,) = receipt.prefixes
    assert ack.disposition == "durable_prefix" and ack.cut_kind == "active_prefix"
    assert ack.prefix_token_count == len(cut_worker.FLUSHED) + len(cut_worker.CUT)
    assert ack.effective_output_limit == cut_worker.OUTPUT_LIMIT
    assert ack.staging_keys == (
        "__generation_cut__/periodic-000000000001/r0/c1/0",
        "__generation_cut__/checkpoint-1/r0/c1/1",
    )

    # A new process: this one, on a new connection to the same database.
    with open_store(store_url) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: cut_worker.POLICY_VERSION + 1)
        # The restarted worker answers the same inventory with the identical receipt.
        assert to_json(capture.serve_generation_cut(inventory)) == receipt_json.encode()

        # Gym builds the replacement admission (attempt 1) from the parent row and the acknowledgement.
        (parent,) = store.fetch(["r0/c0"])
        prefix = list(parent.token_ids_delta)  # a root's delta is all of its tokens
        assert ack.prefix_digest is not None and ack.prefix_token_count is not None
        assert ack.effective_output_limit is not None
        continuation = continuation_from(ack)
        admission = CaptureAdmission(
            rollout_id=capture_key(cut_worker.ROLLOUT_ID, 1),
            model_call_id="c1",
            parent_call_id=parent.model_call_id,
            prev_len=parent.cum_len,
            mode="token_in",
            required_prefix_token_ids=prefix,
            parent_chain_hash=parent.chain_hash,
            generation_cut=continuation,
        )
        assert admission.rollout_id == "r0-a1"
        call = capture.begin_call(admission)  # resolves the durable prefix from the log
        resumed = call.continuation
        assert resumed is not None
        restored = [*cut_worker.FLUSHED, *cut_worker.CUT]
        assert list(resumed.engine_prompt_token_ids) == [*prefix, *cut_worker.CARRY, *restored]
        assert list(resumed.restored_token_ids) == restored
        assert resumed.remaining_limits() == (cut_worker.OUTPUT_LIMIT - len(restored), 0)
        assert not resumed.is_terminal

        tail, tail_logprobs = [33, 34], [-0.5, -1.0]
        coords = capture.complete_call(
            call,
            prompt_token_ids=resumed.engine_prompt_token_ids,
            generated_token_ids=tail,
            generated_logprobs=tail_logprobs,
        )
        assert coords.disposition == "staged"
        assert coords.staging_key == "r0-a1/c1"

        # Verify every record of the rollout from its own fields, and the chain that links them.
        keys = [parent.staging_key, *ack.staging_keys, coords.staging_key]
        records = store.fetch(keys)
        for record in records:
            assert compute_staging_digest(**plain_digest_fields(record)) == record.digest, record.staging_key
        root, first_chunk, second_chunk, final = records
        assert root.parent_call_id is None and root.prev_len == 0
        assert root.chain_hash == compute_chain_hash(None, list(root.token_ids_delta))
        assert root.cumulative_hash == hash_token_ids(list(root.token_ids_delta))
        assert (final.parent_call_id, final.prev_len) == (root.model_call_id, root.cum_len)
        assert compute_chain_hash(root.chain_hash, list(final.token_ids_delta)) == final.chain_hash
        all_tokens = [*root.token_ids_delta, *final.token_ids_delta]
        assert all_tokens == [*cut_worker.ROOT_PROMPT, *cut_worker.ROOT_GENERATED, *cut_worker.CARRY, *restored, *tail]
        assert final.cumulative_hash == hash_token_ids(all_tokens)
        assert final.cum_len == len(all_tokens)
        assert list(final.token_mask_delta) == [0.0] * len(cut_worker.CARRY) + [1.0] * (len(restored) + len(tail))
        assert list(final.generation_log_probs_delta) == [
            *([0.0] * len(cut_worker.CARRY)),
            *cut_worker.FLUSHED_LOGPROBS,
            *cut_worker.CUT_LOGPROBS,
            *tail_logprobs,
        ]
        assert not set(cut_worker.LOST) & set(final.token_ids_delta)  # decoded after the cut: regenerated
        assert final.weight_version == cut_worker.POLICY_VERSION  # the oldest contributing version
        assert (final.rollout_id, final.model_call_id) == ("r0-a1", "c1")
        assert (coords.digest, coords.chain_hash, coords.cumulative_hash) == (
            final.digest,
            final.chain_hash,
            final.cumulative_hash,
        )
        assert (coords.prev_len, coords.delta_len, coords.cum_len) == (final.prev_len, final.delta_len, final.cum_len)

        # The cut's chunks: a cumulative first chunk that extends the root, then a generation-only delta.
        assert compute_chain_hash(root.chain_hash, list(first_chunk.token_ids_delta)) == first_chunk.chain_hash
        assert list(first_chunk.token_ids_delta) == [*cut_worker.CARRY, *cut_worker.FLUSHED]
        assert list(second_chunk.token_ids_delta) == cut_worker.CUT
        assert list(second_chunk.token_mask_delta) == [1.0]
        assert list(final.token_ids_delta)[: len(cut_worker.CARRY) + len(restored)] == [
            *first_chunk.token_ids_delta,
            *second_chunk.token_ids_delta,
        ]

        info = store.call("r0-a1", "c1")
        assert info is not None
        assert (info.state, info.continues, info.cum_len) == ("completed", ("r0", "c1"), len(all_tokens))
        assert (info.oldest_version, info.newest_version) == (cut_worker.POLICY_VERSION, cut_worker.POLICY_VERSION + 1)
        assert store.replay().ok
