"""Generation cuts on the worker (wire-contract 4.5, 4.6 and section 5).

Serving cut requests, periodic chunk flushes, restoring a cut on a replacement call (from a
snapshot passed directly, or resolved from the log), continuing it, and the policy versions
the store projects for continued calls.  Named after the NeMo RL worker tests of section 9.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from capture_helpers import Versions, continuation_from, damage_token_ids, event_count, writes_nothing
from factories import make_record, plain_digest_fields
from vectors import vectors_by_id

import store as lib
from store import (
    EMPTY_EXTRAS_DIGEST,
    ActiveCall,
    CaptureAdmission,
    CaptureError,
    CommitCoords,
    CorruptRecordError,
    GenerationCutContinuation,
    GenerationCutError,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    RolloutTokenCapture,
    StorageError,
    Store,
    UnknownKeyError,
    capture_key,
    compute_chain_hash,
    compute_staging_digest,
    hash_token_ids,
    open_store,
)

# --- helpers ----------------------------------------------------------------------------------


VECTORS = vectors_by_id()


def ticket(
    model_call_id: str = "c1",
    *,
    attempt: int = 0,
    ticket_id: str | None = None,
    rollout_id: str = "r0",
    admitted_at: float = 1.0,
) -> GenerationCutPrefix:
    return GenerationCutPrefix(
        ticket_id=ticket_id or f"t-{attempt}-{model_call_id}",
        rollout_id=rollout_id,
        attempt_index=attempt,
        model_call_id=model_call_id,
        admitted_at=admitted_at,
    )


def inventory(checkpoint_id: str, *prefixes: GenerationCutPrefix) -> GenerationCutInventory:
    return GenerationCutInventory.build(
        checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=prefixes or [ticket()]
    )


def chunk_key(checkpoint_id: str, capture: str, model_call_id: str, sequence: int) -> str:
    return f"__generation_cut__/{checkpoint_id}/{capture}/{model_call_id}/{sequence}"


def periodic(n: int) -> str:
    return f"periodic-{n:012d}"


@dataclass
class Rollout:
    """Rollout r0: root c0 (prompt [1,2,3] + generated [4,5]) staged; children continue it."""

    store: Store
    capture: RolloutTokenCapture
    versions: Versions
    root: CommitCoords
    prefix: list[int]
    captures: list[RolloutTokenCapture] = field(default_factory=list)

    def admission(
        self,
        model_call_id: str = "c1",
        *,
        attempt: int = 0,
        continuation: GenerationCutContinuation | None = None,
        prefix: Sequence[int] | None = None,
        parent_chain_hash: str | None = None,
        parent_call_id: str = "c0",
    ) -> CaptureAdmission:
        tokens = list(self.prefix if prefix is None else prefix)
        return CaptureAdmission(
            rollout_id=capture_key("r0", attempt),
            model_call_id=model_call_id,
            parent_call_id=parent_call_id,
            prev_len=len(tokens),
            mode="token_in",
            required_prefix_token_ids=tokens,
            parent_chain_hash=parent_chain_hash or self.root.chain_hash,
            generation_cut=continuation,
        )

    def live_call(
        self, model_call_id: str = "c1", *, carry: Sequence[int] = (20, 21), limit: int | None = 10
    ) -> ActiveCall:
        """Admit and track attempt 0 of a child call whose engine prompt carries ``carry``."""
        call = self.capture.begin_call(self.admission(model_call_id))
        self.capture.track(call, prompt_token_ids=[*self.prefix, *carry], effective_output_limit=limit)
        return call

    def restore(self, ack: GenerationCutPrefixAck, *, attempt: int, track: bool = True, **overrides: Any) -> ActiveCall:
        """A replacement call continuing ``ack``; begin_call resolves the prefix from the log."""
        call = self.capture.begin_call(
            self.admission(ack.model_call_id, attempt=attempt, continuation=continuation_from(ack, **overrides))
        )
        if track:
            continuation = call.continuation
            assert continuation is not None
            self.capture.track(
                call,
                prompt_token_ids=continuation.engine_prompt_token_ids,
                effective_output_limit=continuation.effective_output_limit,
            )
        return call

    def new_capture(self, **kwargs: Any) -> RolloutTokenCapture:
        capture = RolloutTokenCapture(store=self.store, weight_version_fn=self.versions, **kwargs)
        self.captures.append(capture)
        return capture


@pytest.fixture
def rollout(store: Store) -> Iterator[Rollout]:
    versions = Versions(7)
    capture = RolloutTokenCapture(store=store, weight_version_fn=versions)
    root_call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text"))
    root = capture.complete_call(
        root_call, prompt_token_ids=[1, 2, 3], generated_token_ids=[4, 5], generated_logprobs=[-0.5, -0.25]
    )
    made = Rollout(store, capture, versions, root, [1, 2, 3, 4, 5], [capture])
    yield made
    for opened in made.captures:
        opened.close()


def flushing(rollout: Rollout, threshold: int = 3) -> Rollout:
    """Switch the rollout to a capture with periodic flush (passes run only via ``flush_due``)."""
    rollout.capture = rollout.new_capture(flush_threshold_tokens=threshold, flush_interval=3600.0)
    return rollout


def only_ack(receipt: GenerationCutReceipt) -> GenerationCutPrefixAck:
    assert len(receipt.prefixes) == 1
    return receipt.prefixes[0]


def fetch_one(store: Store, key: str) -> lib.StagedCallSnapshot:
    return store.fetch([key])[0]


def assert_unknown(store: Store, *keys: str) -> None:
    for key in keys:
        with pytest.raises(UnknownKeyError):
            store.fetch([key])


def spans(store: Store, rollout_id: str, model_call_id: str) -> list[tuple[int, int, int]]:
    return [(s.start, s.end, s.weight_version) for s in store.version_spans(rollout_id, model_call_id)]


# --- serving a cut (5.5) ----------------------------------------------------------------------------


def test_generation_cut_stages_latest_prefix_without_completing_live_call(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    first_inventory = inventory("checkpoint-1")
    receipt = capture.serve_generation_cut(first_inventory)
    receipt.validate_for(first_inventory)
    assert receipt.cut_id == f"worker-{first_inventory.inventory_digest}"
    assert receipt.backend_snapshot_id == f"tq-{first_inventory.inventory_digest}"
    ack = only_ack(receipt)
    key0 = chunk_key("checkpoint-1", "r0", "c1", 0)
    assert key0 == "__generation_cut__/checkpoint-1/r0/c1/0"
    assert ack.disposition == "durable_prefix"
    assert ack.cut_kind == "active_prefix"
    assert ack.frozen_buffer_id == "active/checkpoint-1/0"
    assert ack.staging_keys == (key0,)
    assert ack.prefix_token_count == 2
    assert ack.effective_output_limit == 10
    assert ack.terminal_finish_reason is None and ack.terminal_stop_reason is None

    # The first chunk is cumulative: the carried prompt plus everything generated so far.
    chunk = fetch_one(store, key0)
    assert list(chunk.token_ids_delta) == [20, 21, 30, 31]
    assert list(chunk.token_mask_delta) == [0.0, 0.0, 1.0, 1.0]
    assert list(chunk.generation_log_probs_delta) == [0.0, 0.0, -0.5, -0.75]
    expected = capture.build_prefix_record(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[30, 31], generated_logprobs=[-0.5, -0.75]
    )
    assert chunk.digest == ack.prefix_digest == expected.digest

    # The call is still live: not completed, no terminal row.
    assert not call.completed
    assert_unknown(store, "r0/c1")
    info = store.call("r0", "c1")
    assert info is not None and info.state == "staging"

    # Replaying the same inventory returns the identical receipt and writes nothing.
    before = event_count(store)
    replayed = capture.serve_generation_cut(first_inventory)
    assert replayed == receipt
    assert lib.to_json(replayed) == lib.to_json(receipt)
    assert event_count(store) == before

    # A later cut stages only the new tokens, as chunk /1, and acknowledges the latest prefix.
    capture.observe(call, [32], [-0.125])
    ack2 = only_ack(capture.serve_generation_cut(inventory("checkpoint-2")))
    key1 = chunk_key("checkpoint-2", "r0", "c1", 1)
    assert ack2.staging_keys == (key0, key1)
    assert ack2.prefix_token_count == 3
    assert ack2.frozen_buffer_id == "active/checkpoint-2/1"
    later = fetch_one(store, key1)
    assert list(later.token_ids_delta) == [32]
    assert list(later.token_mask_delta) == [1.0]
    assert ack2.prefix_digest == (
        capture.build_prefix_record(
            call,
            prompt_token_ids=[*rollout.prefix, 20, 21],
            generated_token_ids=[30, 31, 32],
            generated_logprobs=[-0.5, -0.75, -0.125],
        ).digest
    )

    # A cut with nothing new acknowledges the same prefix under the same keys, staging nothing.
    before = event_count(store)
    ack3 = only_ack(capture.serve_generation_cut(inventory("checkpoint-3")))
    assert (ack3.staging_keys, ack3.prefix_token_count, ack3.prefix_digest) == (
        ack2.staging_keys,
        3,
        ack2.prefix_digest,
    )
    assert event_count(store) == before + 1  # the receipt only

    # The live call still completes normally, and its acknowledged chunks stay durable.
    coords = capture.complete_call(
        call,
        prompt_token_ids=[*rollout.prefix, 20, 21],
        generated_token_ids=[30, 31, 32, 33],
        generated_logprobs=[-0.5, -0.75, -0.125, -0.25],
    )
    assert coords.disposition == "staged" and coords.staging_key == "r0/c1"
    assert [s.digest for s in store.fetch([key0, key1])] == [chunk.digest, later.digest]


def test_generation_cut_receipt_is_identical_after_a_restart(store_url: str) -> None:
    with open_store(store_url) as first:
        capture = RolloutTokenCapture(store=first, weight_version_fn=lambda: 3)
        call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=[10, 11], effective_output_limit=8)
        capture.observe(call, [12, 13], [-0.5, -0.25])
        sent = inventory("checkpoint-1", ticket("c0"))
        receipt = capture.serve_generation_cut(sent)
        assert only_ack(receipt).disposition == "durable_prefix"
        capture.close()
    with open_store(store_url) as second:
        fresh = RolloutTokenCapture(store=second, weight_version_fn=lambda: 3)
        before = event_count(second)
        replayed = fresh.serve_generation_cut(sent)
        assert lib.to_json(replayed) == lib.to_json(receipt)
        assert event_count(second) == before
        # The fresh worker does not know the call: a new inventory gets a durable failure.
        other = only_ack(fresh.serve_generation_cut(inventory("checkpoint-2", ticket("c0"))))
        assert other.disposition == "durable_failure"
        assert other.staging_keys == ()
        fresh.close()


def test_generation_cut_marks_completed_race_as_terminal_completion(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call(limit=16)
    capture.observe(call, [30], [-0.5])
    capture.observe(call, [31], [-0.75], finish_reason="stop", stop_reason="</s>")
    coords = capture.complete_call(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[30, 31], generated_logprobs=[-0.5, -0.75]
    )
    assert coords.disposition == "staged"
    before = event_count(store)
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert event_count(store) == before + 1  # the receipt; nothing is staged for a finished call
    assert ack.disposition == "durable_prefix"
    assert ack.cut_kind == "terminal_completion"
    assert ack.frozen_buffer_id == "terminal/checkpoint-1"
    assert ack.staging_keys == ("r0/c1",)
    assert ack.prefix_token_count == 2
    assert ack.prefix_digest == coords.digest
    assert ack.effective_output_limit == 16
    assert (ack.terminal_finish_reason, ack.terminal_stop_reason) == ("stop", "</s>")

    # The replacement returns the finished answer without generating anything.
    replacement = rollout.restore(ack, attempt=1)
    continuation = replacement.continuation
    assert continuation is not None
    assert continuation.is_terminal
    assert continuation.finish_reason == "stop"
    assert continuation.terminal_stop_reason == "</s>"
    assert list(continuation.restored_token_ids) == [30, 31]
    final = capture.finish_restored_call(replacement)
    assert final.disposition == "staged" and final.staging_key == "r0-a1/c1"
    original, restored = store.fetch(["r0/c1", "r0-a1/c1"])
    assert list(restored.token_ids_delta) == list(original.token_ids_delta) == [20, 21, 30, 31]
    assert restored.chain_hash == original.chain_hash
    assert restored.cumulative_hash == original.cumulative_hash
    assert compute_staging_digest(**{**plain_digest_fields(original), "rollout_id": "r0-a1"}) == restored.digest


def test_generation_cut_of_a_finished_call_without_evidence_is_a_durable_failure(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    completion = {
        "prompt_token_ids": [*rollout.prefix, 20, 21],
        "generated_token_ids": [30],
        "generated_logprobs": [-0.5],
    }
    # No finish reason was observed.
    no_finish = rollout.live_call("c1")
    capture.observe(no_finish, [30], [-0.5])
    capture.complete_call(no_finish, **completion)
    # The effective output limit was never known.
    no_limit = rollout.live_call("c2", limit=None)
    capture.observe(no_limit, [30], [-0.5], finish_reason="length")
    capture.complete_call(no_limit, **completion)
    # The capture failed.
    failed = rollout.live_call("c3")
    capture.observe(failed, [30], [-0.5], finish_reason="stop")
    capture.fail_call(failed, reason="aborted")
    # Never tracked here at all.
    untracked = capture.begin_call(rollout.admission("c4"))
    capture.complete_call(untracked, **completion)
    # Not even admitted.
    receipt = capture.serve_generation_cut(
        inventory("checkpoint-1", *(ticket(c) for c in ("c1", "c2", "c3", "c4", "c5")))
    )
    assert [ack.disposition for ack in receipt.prefixes] == ["durable_failure"] * 5
    assert all(ack.staging_keys == () and ack.prefix_digest is None for ack in receipt.prefixes)
    assert store.cut_receipt("checkpoint-1", receipt.inventory_digest) is not None


@pytest.mark.parametrize("evidence", ["in-memory", "from-the-log"])
def test_a_call_completed_with_extras_is_not_promised_as_a_restorable_prefix(rollout: Rollout, evidence: str) -> None:
    """A restore rebuilds the prefix with extras null (5.6), so a terminal record with extras
    can never match its own digest: such a call is a durable failure, not a terminal completion."""
    capture = rollout.capture
    completion: dict[str, Any] = {
        "prompt_token_ids": [*rollout.prefix, 20, 21],
        "generated_token_ids": [30, 31],
        "generated_logprobs": [-0.5, -0.75],
    }
    plain, with_extras = rollout.live_call("c1", limit=16), rollout.live_call("c2", limit=16)
    for call in (plain, with_extras):
        capture.observe(call, [30, 31], [-0.5, -0.75], finish_reason="stop")
    assert capture.complete_call(plain, **completion).disposition == "staged"
    coords = capture.complete_call(with_extras, **completion, extras={"routed_experts": [[[1, 2]], [[3, 4]]]})
    assert coords.disposition == "staged" and coords.extras_digest != EMPTY_EXTRAS_DIGEST
    serving = capture if evidence == "in-memory" else rollout.new_capture()
    receipt = serving.serve_generation_cut(inventory("checkpoint-1", ticket("c1"), ticket("c2")))
    acks = {ack.model_call_id: ack for ack in receipt.prefixes}
    assert acks["c1"].cut_kind == "terminal_completion"
    assert acks["c2"].disposition == "durable_failure" and acks["c2"].staging_keys == ()
    # Every prefix the receipt promises restores on a replacement.
    rollout.capture = serving
    for ack in receipt.prefixes:
        if ack.disposition == "durable_prefix":
            replacement = rollout.restore(ack, attempt=1, track=False)
            assert replacement.continuation is not None and replacement.continuation.is_terminal


def test_completed_capture_evidence_expires_by_age(rollout: Rollout) -> None:
    capture = rollout.new_capture(completion_evidence_ttl=0.05)
    rollout.capture = capture
    call = rollout.live_call()
    capture.observe(call, [30], [-0.5], finish_reason="stop")
    capture.complete_call(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[30], generated_logprobs=[-0.5]
    )
    fresh = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert fresh.cut_kind == "terminal_completion"
    time.sleep(0.2)
    expired = only_ack(capture.serve_generation_cut(inventory("checkpoint-2")))
    assert expired.disposition == "durable_failure"


def test_generation_cut_of_an_empty_prefix_is_a_durable_failure(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    before = event_count(store)
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert ack.disposition == "durable_failure"
    assert ack.cut_kind is None and ack.staging_keys == () and ack.prefix_token_count is None
    assert event_count(store) == before + 1  # the receipt only
    # The call stays live, and the failed cut did not use up a chunk number.
    capture.observe(call, [30], [-0.5])
    ack2 = only_ack(capture.serve_generation_cut(inventory("checkpoint-2")))
    assert ack2.staging_keys == (chunk_key("checkpoint-2", "r0", "c1", 0),)
    assert list(fetch_one(store, ack2.staging_keys[0]).token_ids_delta) == [20, 21, 30]


def test_the_receipt_a_cut_returns_is_the_one_in_the_log(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 4)
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c1", mode="text"))
    capture.track(call, prompt_token_ids=[10, 11], effective_output_limit=32)
    capture.observe(call, [12, 13], [-0.5, -0.25])
    sent = inventory("checkpoint-1", ticket("c1"))
    receipt = capture.serve_generation_cut(sent)
    assert store.cut_receipt(sent.checkpoint_id, sent.inventory_digest) == lib.to_json(receipt)


def test_a_receipt_recorded_first_by_another_serve_stands(
    store: Store, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process on the same store records its receipt of this inventory while this serve
    is staging: the receipt in the log is the answer, not the one this serve built."""
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 4)
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c1", mode="text"))
    capture.track(call, prompt_token_ids=[10, 11], effective_output_limit=32)
    capture.observe(call, [12, 13], [-0.5, -0.25])
    sent = inventory("checkpoint-1", ticket("c1"))
    theirs = GenerationCutReceipt(
        checkpoint_id=sent.checkpoint_id,
        cut_id=f"worker-{sent.inventory_digest}",
        inventory_digest=sent.inventory_digest,
        inventory=sent,
        backend_snapshot_id=f"tq-{sent.inventory_digest}",
        prefixes=(
            GenerationCutPrefixAck(
                ticket_id="t-0-c1",
                rollout_id="r0",
                attempt_index=0,
                model_call_id="c1",
                admitted_at=1.0,
                disposition="durable_failure",
            ),
        ),
    )
    real_stage_all = store.stage_all

    def raced_stage_all(*args: Any, **kwargs: Any) -> Any:
        other = open_store(store_url)
        try:
            other.stage_all([], cut_receipt=(sent.checkpoint_id, sent.inventory_digest, lib.to_json(theirs)))
        finally:
            other.close()
        return real_stage_all(*args, **kwargs)

    monkeypatch.setattr(store, "stage_all", raced_stage_all)
    before = event_count(store)
    answer = capture.serve_generation_cut(sent)
    assert lib.to_json(answer) == lib.to_json(theirs)
    assert store.cut_receipt(sent.checkpoint_id, sent.inventory_digest) == lib.to_json(theirs)
    assert event_count(store) == before + 1  # theirs: this serve's chunk, acknowledged by no receipt, is not written
    monkeypatch.undo()
    coords = capture.complete_observed(call)  # its tokens stayed buffered
    assert coords.disposition == "staged" and coords.delta_len == 4  # prompt [10, 11] and [12, 13]


def test_serving_an_inventory_again_returns_its_receipt_and_leaves_new_tokens_buffered(rollout: Rollout) -> None:
    """The replay is found inside the cut's own transaction: the tokens observed since the first
    serve are neither staged nor lost, and the next cut acknowledges them all."""
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    first = capture.serve_generation_cut(inventory("checkpoint-1"))
    capture.observe(call, [32], [-0.125])
    with writes_nothing(store):
        assert capture.serve_generation_cut(inventory("checkpoint-1")) == first
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-2")))
    assert ack.prefix_token_count == 3
    assert ack.frozen_buffer_id == "active/checkpoint-2/1"  # the replay's frozen buffer was given back
    assert list(fetch_one(store, ack.staging_keys[-1]).token_ids_delta) == [32]


def test_an_inventory_served_before_returns_its_receipt_even_when_the_call_now_fails_a_cut(
    rollout: Rollout,
) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30], [-0.5])
    first = capture.serve_generation_cut(inventory("checkpoint-1"))
    capture.observe(call, [31, 32], [-0.5])  # unaligned: every later cut of the call is refused
    with writes_nothing(store):
        assert capture.serve_generation_cut(inventory("checkpoint-1")) == first
        with pytest.raises(GenerationCutError, match="unaligned"):
            capture.serve_generation_cut(inventory("checkpoint-2"))


def test_generation_cut_swaps_buffer_before_blocking_prefix_write(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 4)
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c1", mode="text"))
    capture.track(call, prompt_token_ids=[10, 11], effective_output_limit=32)
    capture.observe(call, [12, 13], [-0.5, -0.25])
    real_stage_all = store.stage_all
    decoded_during_write: list[bool] = []

    def blocking_stage_all(*args: Any, **kwargs: Any) -> Any:
        if not decoded_during_write:
            # The engine keeps decoding while the prefix write blocks; observing must not wait for it.
            decoder = threading.Thread(target=capture.observe, args=(call, [14, 15], [-0.125, -1.0]))
            decoder.start()
            decoder.join(timeout=10)
            decoded_during_write.append(not decoder.is_alive())
        return real_stage_all(*args, **kwargs)

    monkeypatch.setattr(store, "stage_all", blocking_stage_all)
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1", ticket("c1"))))
    assert decoded_during_write == [True]
    key0 = chunk_key("checkpoint-1", "r0", "c1", 0)
    assert ack.staging_keys == (key0,)
    assert ack.prefix_token_count == 2  # the tokens decoded during the write are not in this cut
    assert list(fetch_one(store, key0).token_ids_delta) == [10, 11, 12, 13]

    ack2 = only_ack(capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1"))))
    key1 = chunk_key("checkpoint-2", "r0", "c1", 1)
    assert ack2.staging_keys == (key0, key1)
    assert ack2.prefix_token_count == 4
    assert list(fetch_one(store, key1).token_ids_delta) == [14, 15]

    # Restoring concatenates the chunks (a root cut is admitted as text).
    replacement = capture.begin_call(
        CaptureAdmission(rollout_id="r0-a1", model_call_id="c1", mode="text", generation_cut=continuation_from(ack2))
    )
    cut = replacement.generation_cut
    assert cut is not None
    assert list(cut.token_ids_delta) == [10, 11, 12, 13, 14, 15]
    assert list(cut.token_mask_delta) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert list(cut.generation_log_probs_delta) == [0.0, 0.0, -0.5, -0.25, -0.125, -1.0]
    assert cut.chain_hash == compute_chain_hash(None, [10, 11, 12, 13, 14, 15])
    continuation = replacement.continuation
    assert continuation is not None
    assert list(continuation.engine_prompt_token_ids) == [10, 11, 12, 13, 14, 15]
    assert list(continuation.restored_token_ids) == [12, 13, 14, 15]
    assert list(continuation.restored_logprobs) == [-0.5, -0.25, -0.125, -1.0]
    assert continuation.generation_token_count == 4


def test_generation_cut_rolls_frozen_buffer_back_after_staging_failure(
    rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])

    def failing_stage_all(*args: Any, **kwargs: Any) -> Any:
        capture.observe(call, [32], [-0.125])  # decoded while the failing write was in flight
        raise StorageError("the database went away")

    failed_inventory = inventory("checkpoint-1")
    monkeypatch.setattr(store, "stage_all", failing_stage_all)
    before = event_count(store)
    with pytest.raises(GenerationCutError):
        capture.serve_generation_cut(failed_inventory)
    monkeypatch.undo()
    assert event_count(store) == before
    assert store.cut_receipt("checkpoint-1", failed_inventory.inventory_digest) is None
    assert_unknown(store, chunk_key("checkpoint-1", "r0", "c1", 0))
    assert not call.completed

    # Nothing was lost or reordered: the next cut stages every token, in order.
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-2")))
    assert ack.staging_keys == (chunk_key("checkpoint-2", "r0", "c1", 0),)
    assert ack.prefix_token_count == 3
    record = fetch_one(store, ack.staging_keys[0])
    assert list(record.token_ids_delta) == [20, 21, 30, 31, 32]
    assert list(record.generation_log_probs_delta) == [0.0, 0.0, -0.5, -0.75, -0.125]


def test_generation_cut_validates_ack_before_sealing_state(rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])

    def refuse(self: GenerationCutReceipt, sent: GenerationCutInventory) -> None:
        raise lib.InvalidRecordError("GenerationCutReceipt: refused for the test")

    monkeypatch.setattr(GenerationCutReceipt, "validate_for", refuse)
    before = event_count(store)
    with pytest.raises(GenerationCutError):
        capture.serve_generation_cut(inventory("checkpoint-1"))
    monkeypatch.undo()
    assert event_count(store) == before
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-2")))
    assert ack.staging_keys == (chunk_key("checkpoint-2", "r0", "c1", 0),)  # nothing was sealed
    assert ack.prefix_token_count == 2


def test_generation_cut_retry_after_later_call_failure_uses_new_chunk_key(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    good = rollout.live_call("c1")
    capture.observe(good, [30, 31], [-0.5, -0.75])
    broken = rollout.live_call("c2", limit=None)  # its output limit is unknown: its cut fails
    capture.observe(broken, [40], [-0.5])
    failed = inventory("checkpoint-1", ticket("c1"), ticket("c2"))
    before = event_count(store)
    with pytest.raises(GenerationCutError, match="effective output limit"):
        capture.serve_generation_cut(failed)
    assert event_count(store) == before  # c1's prefix, staged first, was not kept
    failed_key = chunk_key("checkpoint-1", "r0", "c1", 0)
    assert_unknown(store, failed_key)

    capture.observe(good, [32], [-0.125])
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1"))))
    assert ack.staging_keys == (chunk_key("checkpoint-2", "r0", "c1", 0),)
    assert failed_key not in ack.staging_keys
    assert ack.prefix_token_count == 3
    assert list(fetch_one(store, ack.staging_keys[0]).token_ids_delta) == [20, 21, 30, 31, 32]


def test_generation_cut_refuses_malformed_requests(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30], [-0.5])
    with writes_nothing(store):
        with pytest.raises(GenerationCutError, match="more than once"):
            capture.serve_generation_cut(
                inventory("checkpoint-1", ticket("c1", ticket_id="a"), ticket("c1", ticket_id="b"))
            )
        with pytest.raises(CaptureError):
            capture.serve_generation_cut({"checkpoint_id": "checkpoint-1"})  # type: ignore[arg-type]
    # The inventory's attempt decides the capture key: attempt 1 of r0 is not this call.
    other_attempt = only_ack(capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1", attempt=1))))
    assert other_attempt.disposition == "durable_failure"
    assert only_ack(capture.serve_generation_cut(inventory("checkpoint-3"))).prefix_token_count == 1


def test_track_refuses_bad_limits_and_completed_calls(rollout: Rollout) -> None:
    capture = rollout.capture
    call = capture.begin_call(rollout.admission())
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(CaptureError):
            capture.track(call, prompt_token_ids=[*rollout.prefix, 20], effective_output_limit=bad)  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match="not tracked"):
        capture.observe(call, [30], [-0.5])
    capture.fail_call(call, reason="aborted")
    with pytest.raises(CaptureError, match="already completed"):
        capture.track(call, prompt_token_ids=[*rollout.prefix, 20], effective_output_limit=8)


@pytest.mark.parametrize(
    "observations",
    [
        pytest.param([([30, 31], [-0.5], None)], id="unaligned"),
        pytest.param([([30], [-0.5], "abort")], id="unsupported-finish"),
        pytest.param([([30], [-0.5], "stop"), ([31], [-0.5], "length")], id="conflicting-finish"),
        pytest.param([([-30], [-0.5], None)], id="negative-id"),
        # One token, the decode loop's shape: a bad log-prob, or an id past u64 after a good
        # log-prob, leaves no half-appended token behind.
        pytest.param([([30], [None], None)], id="unreadable-logprob"),
        pytest.param([([2**64], [-0.5], None)], id="id-past-u64"),
        pytest.param([([30], [-0.5], None)] * 10, id="past-the-limit"),
    ],
)
def test_capture_observer_rejects_unaligned_delta_output(
    rollout: Rollout, observations: list[tuple[list[int], list[float], str | None]]
) -> None:
    flushing(rollout, threshold=1)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [29], [-0.25])
    for ids, logprobs, finish in observations:
        capture.observe(call, ids, logprobs, finish_reason=finish)
    live = capture.cuts.live(call)
    assert live is not None and live.observation_error is not None
    observed_ids, observed_logprobs = live.observed()
    assert len(observed_ids) == len(observed_logprobs) <= 10  # aligned, and never past the limit
    with writes_nothing(store):
        assert capture.flush_due() == 0  # a call with an observation error is never flushed
        with pytest.raises(GenerationCutError):
            capture.serve_generation_cut(inventory("checkpoint-1"))
    # The terminal path is unaffected: the engine's final output is still captured.
    coords = capture.complete_call(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[29], generated_logprobs=[-0.25]
    )
    assert coords.disposition == "staged"


# --- restoring a cut: admission checks (4.5, 4.6) --------------------------------------------------


@dataclass
class Cut:
    rollout: Rollout
    ack: GenerationCutPrefixAck
    snapshot: lib.StagedCallSnapshot
    continuation: GenerationCutContinuation


@pytest.fixture
def cut(rollout: Rollout) -> Cut:
    """Attempt 0 of r0/c1 at version 7 is cut after generating [30, 31]."""
    call = rollout.live_call()
    rollout.capture.observe(call, [30, 31], [-0.5, -0.75])
    ack = only_ack(rollout.capture.serve_generation_cut(inventory("checkpoint-1")))
    (snapshot,) = rollout.store.fetch(list(ack.staging_keys))
    return Cut(rollout, ack, snapshot, continuation_from(ack))


def test_generation_cut_snapshot_passed_directly_is_accepted(cut: Cut) -> None:
    rollout = cut.rollout
    call = rollout.capture.begin_call(
        rollout.admission(attempt=1, continuation=cut.continuation),
        generation_cut=cut.snapshot,
        generation_cut_staging_keys=list(cut.ack.staging_keys),
    )
    assert call.generation_cut is cut.snapshot
    resolved = rollout.capture.begin_call(rollout.admission("c1", attempt=1, continuation=cut.continuation))
    assert resolved.generation_cut is not None
    assert plain_digest_fields(resolved.generation_cut) == plain_digest_fields(cut.snapshot)
    assert resolved.generation_cut.digest == cut.snapshot.digest == cut.continuation.digest
    info = rollout.store.call("r0-a1", "c1")
    assert info is not None and info.continues == ("r0", "c1")


def _continuation(cut: Cut, **fields: Any) -> GenerationCutContinuation:
    current = {name: getattr(cut.continuation, name) for name in cut.continuation.__struct_fields__}
    return GenerationCutContinuation(**{**current, **fields})


@pytest.mark.parametrize(
    "case",
    [
        "not-authorized",
        "keys-absent",
        "keys-differ",
        "keys-reordered",
        "source-capture-key",
        "source-model-call",
        "digest",
        "parent-call",
        "count",
        "newer-version",
        "not-a-snapshot",
    ],
)
def test_generation_cut_admission_refuses_each_failed_check(cut: Cut, case: str) -> None:
    rollout = cut.rollout
    keys: list[str] | None = list(cut.ack.staging_keys)
    snapshot: Any = cut.snapshot
    continuation = cut.continuation
    admission_kwargs: dict[str, Any] = {}
    version: int | None = None
    fragment = {
        "not-authorized": "not authorized",
        "keys-absent": "staging_keys",
        "keys-differ": "staging_keys",
        "keys-reordered": "staging_keys",
        "source-capture-key": "source_capture_key",
        "source-model-call": "source_model_call_id",
        "digest": "digest",
        "parent-call": "lineage",
        "count": "generated tokens",
        "newer-version": "newer",
        "not-a-snapshot": "StagedCallBaseSnapshot",
    }[case]
    if case == "not-authorized":
        continuation = None  # type: ignore[assignment]
    elif case == "keys-absent":
        keys = None
    elif case == "keys-differ":
        keys = ["__generation_cut__/checkpoint-9/r0/c1/0"]
    elif case == "keys-reordered":
        # A two-chunk continuation whose keys are passed in another order.
        continuation = _continuation(cut, staging_keys=(*cut.ack.staging_keys, "k2"))
        keys = ["k2", *cut.ack.staging_keys]
    elif case == "source-capture-key":
        continuation = _continuation(cut, source_capture_key="r9")
    elif case == "source-model-call":
        continuation = _continuation(cut, source_model_call_id="c9")
    elif case == "digest":
        continuation = _continuation(cut, digest="0" * 64)
    elif case == "parent-call":
        admission_kwargs["parent_call_id"] = "c8"
    elif case == "count":
        continuation = _continuation(cut, generation_token_count=3)
    elif case == "newer-version":
        version = 6  # the cut was generated at 7
    elif case == "not-a-snapshot":
        snapshot = lib.to_json(cut.snapshot)
    admission = rollout.admission(attempt=1, continuation=continuation, **admission_kwargs)
    with writes_nothing(rollout.store, ("r0-a1", "c1")), pytest.raises(CaptureError, match=fragment):
        rollout.capture.begin_call(
            admission, generation_cut=snapshot, generation_cut_staging_keys=keys, weight_version=version
        )


@pytest.mark.parametrize("version", [7, 8, 2**40])
def test_generation_cut_from_an_older_or_equal_policy_version_is_accepted(cut: Cut, version: int) -> None:
    rollout = cut.rollout
    call = rollout.capture.begin_call(
        rollout.admission(attempt=1, continuation=cut.continuation),
        generation_cut=cut.snapshot,
        generation_cut_staging_keys=cut.ack.staging_keys,
        weight_version=version,
    )
    assert call.weight_version == version
    assert call.oldest_weight_version == 7


def test_generation_cut_resume_rejects_a_prefix_built_on_other_parent_tokens(cut: Cut) -> None:
    rollout = cut.rollout
    capture, store = rollout.capture, rollout.store
    keys = list(cut.ack.staging_keys)
    # Another history of the same rollout: root c0 generated [4, 6] instead of [4, 5].
    other_prefix = [1, 2, 3, 4, 6]
    other_root_chain = compute_chain_hash(None, other_prefix)
    assert other_root_chain != rollout.root.chain_hash

    def forged(parent_chain_hash: str, prefix: list[int]) -> lib.StagedCallRecord:
        """A valid cut record of r0/c1 (same parent id, same prev_len) built on ``prefix``."""
        return make_record(
            rollout_id="r0",
            model_call_id="c1",
            parent_call_id="c0",
            parent_chain_hash=parent_chain_hash,
            prefix=prefix,
            prompt=[20, 21],
            generated=[30, 31],
            logprobs=[-0.5, -0.75],
            weight_version=7,
        )

    for snapshot, fragment in [
        (forged(other_root_chain, other_prefix), "chain hash"),  # other parent tokens, other chain
        (forged(rollout.root.chain_hash, other_prefix), "cumulative hash"),  # right chain, other tokens
        (forged(other_root_chain, rollout.prefix), "chain hash"),  # right tokens, other chain
    ]:
        assert snapshot.digest != cut.snapshot.digest
        # The snapshot's own digest authenticates it, and it passes every check of 4.5 ...
        continuation = _continuation(cut, digest=snapshot.digest)
        admission = rollout.admission(attempt=1, continuation=continuation)
        assert (snapshot.parent_call_id, snapshot.prev_len, snapshot.mode) == ("c0", 5, "token_in")
        # ... but it does not extend the replacement's parent tokens (4.6).
        with writes_nothing(store, ("r0-a1", "c1")), pytest.raises(CaptureError, match=fragment):
            capture.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=keys)

    # The honest snapshot, built on the replacement's parent, is accepted.
    accepted = capture.begin_call(
        rollout.admission(attempt=1, continuation=cut.continuation),
        generation_cut=forged(rollout.root.chain_hash, rollout.prefix),
        generation_cut_staging_keys=keys,
    )
    assert accepted.generation_cut is not None and accepted.generation_cut.digest == cut.snapshot.digest

    # Resolved from the log: a replacement on other parent tokens (same parent id and length) is refused.
    for prefix, chain in [(other_prefix, other_root_chain), (other_prefix, rollout.root.chain_hash)]:
        replacement = rollout.admission(
            "c1", attempt=2, continuation=cut.continuation, prefix=prefix, parent_chain_hash=chain
        )
        with writes_nothing(store, ("r0-a2", "c1")), pytest.raises(CaptureError):
            capture.begin_call(replacement)
    # A replacement whose parent chain hash differs but whose prefix matches is refused too.
    with writes_nothing(store, ("r0-a2", "c1")), pytest.raises(CaptureError):
        capture.begin_call(
            rollout.admission("c1", attempt=2, continuation=cut.continuation, parent_chain_hash=other_root_chain)
        )


@pytest.mark.parametrize(
    "case",
    ["unknown-key", "keys-passed-differ", "digest", "count", "newer-version", "source-model-call", "other-parent-id"],
)
def test_generation_cut_resolved_from_the_log_refuses_each_failed_check(cut: Cut, case: str) -> None:
    rollout = cut.rollout
    continuation = cut.continuation
    kwargs: dict[str, Any] = {}
    admission_kwargs: dict[str, Any] = {}
    if case == "unknown-key":
        continuation = _continuation(cut, staging_keys=("__generation_cut__/checkpoint-9/r0/c1/0",))
    elif case == "keys-passed-differ":
        kwargs["generation_cut_staging_keys"] = ["__generation_cut__/checkpoint-9/r0/c1/0"]
    elif case == "digest":
        continuation = _continuation(cut, digest="f" * 64)
    elif case == "count":
        continuation = _continuation(cut, generation_token_count=1)
    elif case == "newer-version":
        kwargs["weight_version"] = 6
    elif case == "source-model-call":
        continuation = _continuation(cut, source_model_call_id="c9")
    elif case == "other-parent-id":
        admission_kwargs["parent_call_id"] = "c8"
    admission = rollout.admission(attempt=1, continuation=continuation, **admission_kwargs)
    with writes_nothing(rollout.store, ("r0-a1", "c1")), pytest.raises(CaptureError):
        rollout.capture.begin_call(admission, **kwargs)


@pytest.mark.parametrize("fault", ["damaged-chunk", "storage-error"])
def test_generation_cut_that_cannot_be_read_is_refused_as_a_capture_error(
    cut: Cut, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker falls back to regenerating on ``CaptureError``: a damaged chunk or a failing
    store is a refused continuation (the cause chained), not another error class."""
    rollout = cut.rollout
    cause: type[Exception]
    if fault == "damaged-chunk":
        damage_token_ids(rollout.store, cut.ack.staging_keys[0])
        cause = CorruptRecordError
    else:

        def failing_fetch_chunks(*args: Any, **kwargs: Any) -> Any:
            raise StorageError("fetching staged records failed: disk I/O error")

        monkeypatch.setattr(rollout.store, "fetch_chunks", failing_fetch_chunks)
        cause = StorageError
    damaged = fault == "damaged-chunk"
    with writes_nothing(rollout.store, ("r0-a1", "c1"), damaged=damaged), pytest.raises(GenerationCutError) as refused:
        rollout.restore(cut.ack, attempt=1, track=False)
    assert isinstance(refused.value.__cause__, cause)


def rebuilt_continuation(
    store: Store,
    keys: Sequence[str],
    *,
    source: tuple[str, str],
    admission: CaptureAdmission,
    prefix: Sequence[int],
    finish: str | None = None,
) -> GenerationCutContinuation:
    """A continuation naming ``keys`` whose count and digest are recomputed exactly as a restore
    rebuilds them from those chunks (5.6): only the chunks' identity can show it is forged."""
    chunks = store.fetch(list(keys))
    ids = [token for chunk in chunks for token in chunk.token_ids_delta]
    mask = [flag for chunk in chunks for flag in chunk.token_mask_delta]
    logprobs = [lp for chunk in chunks for lp in chunk.generation_log_probs_delta]
    digest = compute_staging_digest(
        schema_version=admission.schema_version,
        digest_version=2,
        extras_digest_version=1,
        rollout_id=source[0],
        model_call_id=source[1],
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        delta_len=len(ids),
        cum_len=admission.prev_len + len(ids),
        weight_version=chunks[0].weight_version,
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=logprobs,
        extras_digest=EMPTY_EXTRAS_DIGEST,
        chain_hash=compute_chain_hash(admission.parent_chain_hash, ids),
        cumulative_hash=hash_token_ids([*prefix, *ids]),
    )
    return GenerationCutContinuation(
        source_capture_key=source[0],
        source_model_call_id=source[1],
        staging_keys=tuple(keys),
        generation_token_count=int(sum(mask)),
        digest=digest,
        effective_output_limit=16,
        terminal_finish_reason=finish,
    )


@pytest.mark.parametrize(("rollout_id", "model_call_id"), [("r9", "c1"), ("r0", "c2")], ids=["rollout", "call"])
def test_generation_cut_refuses_a_chunk_of_another_call(cut: Cut, rollout_id: str, model_call_id: str) -> None:
    rollout = cut.rollout
    store = rollout.store
    # The very tokens of r0/c1's cut, staged as the cut prefix of another rollout's (or call's) c1.
    record = make_record(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id="c0",
        parent_chain_hash=rollout.root.chain_hash,
        prefix=rollout.prefix,
        prompt=[20, 21],
        generated=[30, 31],
        logprobs=[-0.5, -0.75],
        weight_version=7,
    )
    key = chunk_key("checkpoint-1", rollout_id, model_call_id, 0)
    assert store.stage(record, staging_key=key, kind=lib.EventKind.PREFIX_STAGED).ok
    # The rebuilt digest covers the tokens, not whose they are: it is the honest cut's digest.
    forged = _continuation(cut, staging_keys=(key,))
    assert (
        forged.digest
        == rebuilt_continuation(
            store, [key], source=("r0", "c1"), admission=rollout.admission(attempt=1), prefix=rollout.prefix
        ).digest
    )
    with writes_nothing(store, ("r0-a1", "c1")), pytest.raises(GenerationCutError, match="not of the cut call"):
        rollout.capture.begin_call(rollout.admission(attempt=1, continuation=forged))


def test_generation_cut_refuses_a_terminal_record_named_as_an_unfinished_prefix(rollout: Rollout) -> None:
    store = rollout.store
    admission = CaptureAdmission(rollout_id="r0-a1", model_call_id="c0", mode="text")

    def replacement(finish: str | None) -> CaptureAdmission:
        """Attempt 1 of the root c0, continuing a cut that names c0's terminal record."""
        continuation = rebuilt_continuation(
            store, ["r0/c0"], source=("r0", "c0"), admission=admission, prefix=[], finish=finish
        )
        assert continuation.digest == rollout.root.digest
        return CaptureAdmission(rollout_id="r0-a1", model_call_id="c0", mode="text", generation_cut=continuation)

    # Not finished, says the continuation: but the record is the call's finished answer.
    with writes_nothing(store, ("r0-a1", "c0")), pytest.raises(GenerationCutError, match="call_completed record"):
        rollout.capture.begin_call(replacement(None))
    # As a terminal completion (it finished, with a reason) the same record restores.
    call = rollout.capture.begin_call(replacement("stop"))
    assert call.continuation is not None and call.continuation.is_terminal


def flushed_then_cut(rollout: Rollout) -> GenerationCutPrefixAck:
    """The live call decodes [30, 31] (flushed as chunk 0), then [32], then checkpoint-1 cuts it."""
    flushing(rollout, threshold=2)
    call = rollout.live_call()
    rollout.capture.observe(call, [30, 31], [-0.5, -0.75])
    assert rollout.capture.flush_due() == 1
    rollout.capture.observe(call, [32], [-0.125])
    return only_ack(rollout.capture.serve_generation_cut(inventory("checkpoint-1")))


def test_generation_cut_refuses_later_chunks_without_their_cumulative_prefix(rollout: Rollout) -> None:
    capture, store = rollout.capture, rollout.store
    ack = flushed_then_cut(rollout)
    first, second = ack.staging_keys
    admission = rollout.admission(attempt=1)
    honest = rebuilt_continuation(
        store, [first, second], source=("r0", "c1"), admission=admission, prefix=rollout.prefix
    )
    assert honest.digest == ack.prefix_digest
    # The generation-only chunk alone: no carry, a consistent count and digest, but not a prefix.
    forged = rebuilt_continuation(store, [second], source=("r0", "c1"), admission=admission, prefix=rollout.prefix)
    with writes_nothing(store, ("r0-a1", "c1")), pytest.raises(GenerationCutError, match="chunk_staged record"):
        capture.begin_call(rollout.admission(attempt=1, continuation=forged))
    assert capture.begin_call(rollout.admission(attempt=1, continuation=honest)).generation_cut is not None


def test_generation_cut_chunks_must_be_ordered_with_the_carry_first(rollout: Rollout) -> None:
    store = rollout.store
    ack = flushed_then_cut(rollout)
    first, second = ack.staging_keys
    assert (first, second) == (chunk_key(periodic(1), "r0", "c1", 0), chunk_key("checkpoint-1", "r0", "c1", 1))
    # In chunk order the restore works; reversed, the carry would sit in a later chunk.
    restored = rollout.restore(ack, attempt=1, track=False)
    assert restored.generation_cut is not None
    assert list(restored.generation_cut.token_ids_delta) == [20, 21, 30, 31, 32]
    with writes_nothing(store, ("r0-a2", "c1")), pytest.raises(CaptureError):
        rollout.restore(ack, attempt=2, track=False, staging_keys=(second, first))


# --- continuing a restored cut (5.6, 5.8) -------------------------------------------------------


def test_continued_call_record_matches_uninterrupted_call(store: Store) -> None:
    versions = Versions(4)
    capture = RolloutTokenCapture(store=store, weight_version_fn=versions)

    def root(rollout_id: str) -> CommitCoords:
        call = capture.begin_call(CaptureAdmission(rollout_id=rollout_id, model_call_id="c0", mode="text"))
        return capture.complete_call(
            call, prompt_token_ids=[10, 11], generated_token_ids=[12], generated_logprobs=[-0.25]
        )

    def child(rollout_id: str, parent: CommitCoords, cont: GenerationCutContinuation | None = None) -> CaptureAdmission:
        return CaptureAdmission(
            rollout_id=rollout_id,
            model_call_id="c1",
            parent_call_id="c0",
            prev_len=3,
            mode="token_in",
            required_prefix_token_ids=[10, 11, 12],
            parent_chain_hash=parent.chain_hash,
            generation_cut=cont,
        )

    # Interrupted: attempt 0 is cut after [30, 31]; attempt 1 continues with [32, 33] at a newer version.
    r0 = root("r0")
    live = capture.begin_call(child("r0", r0))
    capture.track(live, prompt_token_ids=[10, 11, 12, 20, 21], effective_output_limit=16)
    capture.observe(live, [30, 31], [-0.5, -0.75])
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    versions.value = 5
    continued = capture.begin_call(child("r0-a1", r0, continuation_from(ack)))
    continuation = continued.continuation
    assert continuation is not None
    assert list(continuation.engine_prompt_token_ids) == [10, 11, 12, 20, 21, 30, 31]
    assert continuation.remaining_limits() == (14, 0)
    interrupted = capture.complete_call(
        continued,
        prompt_token_ids=continuation.engine_prompt_token_ids,
        generated_token_ids=[32, 33],
        generated_logprobs=[-0.125, -0.25],
    )

    # Uninterrupted: the same tokens in one call.
    versions.value = 4
    u0 = root("u0")
    assert u0.chain_hash == r0.chain_hash
    whole = capture.complete_call(
        capture.begin_call(child("u0", u0)),
        prompt_token_ids=[10, 11, 12, 20, 21],
        generated_token_ids=[30, 31, 32, 33],
        generated_logprobs=[-0.5, -0.75, -0.125, -0.25],
    )
    assert interrupted.staging_key is not None and whole.staging_key is not None
    a, b = store.fetch([interrupted.staging_key, whole.staging_key])
    assert list(a.token_ids_delta) == list(b.token_ids_delta) == [20, 21, 30, 31, 32, 33]
    assert list(a.token_mask_delta) == list(b.token_mask_delta)
    assert list(a.generation_log_probs_delta) == list(b.generation_log_probs_delta)
    assert (a.chain_hash, a.cumulative_hash) == (b.chain_hash, b.cumulative_hash)
    assert (a.parent_call_id, a.mode, a.prev_len, a.delta_len, a.cum_len) == ("c0", "token_in", 3, 6, 9)
    assert (a.parent_call_id, a.mode, a.prev_len, a.delta_len, a.cum_len) == (
        b.parent_call_id,
        b.mode,
        b.prev_len,
        b.delta_len,
        b.cum_len,
    )
    assert a.extras_digest == b.extras_digest == EMPTY_EXTRAS_DIGEST
    # Only identity and the version stamp may differ: with them swapped in, the digests agree.
    assert a.weight_version == 4  # the oldest contributing version, not the replacement's 5
    assert interrupted.weight_version == 4
    assert (
        compute_staging_digest(**{**plain_digest_fields(b), "rollout_id": a.rollout_id, "weight_version": 4})
        == a.digest
    )
    assert (interrupted.prev_len, interrupted.delta_len, interrupted.cum_len) == (3, 6, 9)

    # The durable cut prefix itself reproduces the conformance vector (the parent is the
    # root [10, 11, 12] of vector chain.root).
    vector = VECTORS["staging.generation_cut_prefix"]
    assert r0.chain_hash == VECTORS["chain.root"]["expected"]["digest"]
    chunk = fetch_one(store, ack.staging_keys[0])
    assert ack.prefix_digest == chunk.digest == vector["expected"]["digest"]
    assert chunk.chain_hash == vector["inputs"]["chain_hash"]
    assert chunk.cumulative_hash == vector["inputs"]["cumulative_hash"]


def test_restored_prefix_reduces_remaining_output_limits(cut: Cut) -> None:
    rollout = cut.rollout
    replacement = rollout.restore(cut.ack, attempt=1, track=False)
    continuation = replacement.continuation
    assert continuation is not None
    assert (continuation.effective_output_limit, continuation.generation_token_count) == (10, 2)
    assert continuation.remaining_output_limit == 8
    assert continuation.remaining_limits() == (8, 0)
    assert continuation.remaining_limits(5) == (8, 3)
    assert not continuation.is_terminal
    assert continuation.finish_reason is None
    with pytest.raises(CaptureError):
        rollout.capture.finish_restored_call(replacement)  # not terminal: the engine must continue
    assert not replacement.completed
    # A call that continues nothing has no continuation.
    assert rollout.capture.begin_call(rollout.admission("c5")).continuation is None


@pytest.mark.parametrize(("limit", "min_tokens", "count", "expected"), [(10, 6, 3, (7, 3)), (10, 2, 3, (7, 0))])
def test_restored_generation_prefix_reduces_independent_output_limits(
    rollout: Rollout, limit: int, min_tokens: int, count: int, expected: tuple[int, int]
) -> None:
    call = rollout.live_call(limit=limit)
    rollout.capture.observe(call, list(range(30, 30 + count)), [-0.5] * count)
    ack = only_ack(rollout.capture.serve_generation_cut(inventory("checkpoint-1")))
    assert ack.prefix_token_count == count
    continuation = rollout.restore(ack, attempt=1, track=False).continuation
    assert continuation is not None
    assert continuation.remaining_limits(min_tokens) == expected


def test_restored_prefix_at_output_limit_is_terminal(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call(limit=2)
    capture.observe(call, [30, 31], [-0.5, -0.75])  # the budget is spent but the engine has not said so
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert (ack.prefix_token_count, ack.effective_output_limit, ack.terminal_finish_reason) == (2, 2, None)
    replacement = rollout.restore(ack, attempt=1, track=False)
    continuation = replacement.continuation
    assert continuation is not None
    assert continuation.is_terminal
    assert continuation.finish_reason == "length"
    assert continuation.remaining_limits(1) == (0, 0)
    coords = capture.finish_restored_call(replacement)
    assert coords.disposition == "staged" and coords.staging_key == "r0-a1/c1"
    record = fetch_one(store, coords.staging_key)
    assert list(record.token_ids_delta) == [20, 21, 30, 31]
    assert list(record.token_mask_delta) == [0.0, 0.0, 1.0, 1.0]
    assert record.cumulative_hash == hash_token_ids([*rollout.prefix, 20, 21, 30, 31])
    assert record.chain_hash == compute_chain_hash(rollout.root.chain_hash, [20, 21, 30, 31])
    with pytest.raises(CaptureError, match="already completed"):
        capture.finish_restored_call(replacement)


def test_a_restored_terminal_completion_cut_again_before_it_finishes_still_restores(rollout: Rollout) -> None:
    """A replacement restored from a terminal record, cut before it returns its answer: its cut
    names that terminal record and must carry its finish, so the next attempt can restore it."""
    capture = rollout.capture
    call = rollout.live_call(limit=16)
    capture.observe(call, [30, 31], [-0.5, -0.75], finish_reason="stop", stop_reason="</s>")
    capture.complete_call(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[30, 31], generated_logprobs=[-0.5, -0.75]
    )
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert ack.cut_kind == "terminal_completion"
    replacement = rollout.restore(ack, attempt=1)  # tracked, not yet finished
    again = only_ack(capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1", attempt=1))))
    assert again.disposition == "durable_prefix" and again.staging_keys == ("r0/c1",)
    assert (again.terminal_finish_reason, again.terminal_stop_reason) == ("stop", "</s>")
    restored = rollout.restore(again, attempt=2, track=False)
    assert restored.continuation is not None and restored.continuation.is_terminal
    assert capture.finish_restored_call(restored).disposition == "staged"
    assert capture.finish_restored_call(replacement).disposition == "staged"


@pytest.mark.parametrize(
    ("prompt_tail", "generated"),
    [([20], [30, 31, 32]), ([20, 21, 30], [32]), ([20, 21], [31, 30, 32])],
    ids=["carry-cut-short", "half-the-cut", "restored-tokens-differ"],
)
def test_continued_call_rejects_a_prompt_that_is_neither_shape(
    cut: Cut, prompt_tail: list[int], generated: list[int]
) -> None:
    """Neither prefix + cut tokens (the engine's prompt) nor prefix + carry with the restored
    tokens first (the natural shape): the data does not fit the call."""
    rollout = cut.rollout
    replacement = rollout.restore(cut.ack, attempt=1, track=False)
    coords = rollout.capture.complete_call(
        replacement,
        prompt_token_ids=[*rollout.prefix, *prompt_tail],
        generated_token_ids=generated,
        generated_logprobs=[-0.5, -0.75, -0.125][: len(generated)],
    )
    assert coords.disposition == "capture_failed"
    assert_unknown(rollout.store, "r0-a1/c1")


def test_generation_cut_restore_accepts_monotonic_mixed_policy_versions(rollout: Rollout) -> None:
    store, capture, versions = rollout.store, rollout.capture, rollout.versions
    # Attempt 0 at version 7 is cut after [30, 31].
    call0 = rollout.live_call()
    capture.observe(call0, [30, 31], [-0.5, -0.75])
    ack0 = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    key0 = chunk_key("checkpoint-1", "r0", "c1", 0)
    assert ack0.staging_keys == (key0,)

    # Attempt 1 restores it at version 9, decodes [32, 33] and is cut again.
    versions.value = 9
    call1 = rollout.restore(ack0, attempt=1)
    assert call1.generation_cut is not None and call1.generation_cut.weight_version == 7
    assert (call1.weight_version, call1.oldest_weight_version) == (9, 7)
    capture.observe(call1, [32, 33], [-0.125, -0.25])
    ack1 = only_ack(capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1", attempt=1))))
    key1 = chunk_key("checkpoint-2", "r0-a1", "c1", 0)
    assert ack1.staging_keys == (key0, key1)
    assert ack1.prefix_token_count == 4
    chunk_digests = [s.digest for s in store.fetch([key0, key1])]
    assert [s.weight_version for s in store.fetch([key0, key1])] == [7, 9]
    assert list(fetch_one(store, key1).token_ids_delta) == [32, 33]

    # A replacement whose current version is 8 cannot continue tokens generated at 9.
    versions.value = 8
    with writes_nothing(store, ("r0-a2", "c1")), pytest.raises(CaptureError, match="newer"):
        rollout.restore(ack1, attempt=2)

    # At 10, attempt 2 restores at the oldest version, 7.
    versions.value = 10
    call2 = rollout.restore(ack1, attempt=2)
    restored = call2.generation_cut
    assert restored is not None
    assert restored.weight_version == 7
    assert restored.rollout_id == "r0-a1"
    assert list(restored.token_ids_delta) == [20, 21, 30, 31, 32, 33]
    assert call2.oldest_weight_version == 7
    continuation = call2.continuation
    assert continuation is not None
    coords = capture.complete_call(
        call2,
        prompt_token_ids=continuation.engine_prompt_token_ids,
        generated_token_ids=[34],
        generated_logprobs=[-1.0],
    )
    assert coords.disposition == "staged"
    assert coords.weight_version == 7
    final = fetch_one(store, "r0-a2/c1")
    assert final.weight_version == 7
    assert list(final.token_ids_delta) == [20, 21, 30, 31, 32, 33, 34]
    assert list(final.generation_log_probs_delta) == [0.0, 0.0, -0.5, -0.75, -0.125, -0.25, -1.0]

    # Policy versions: per-token spans across chunks and continuations.
    assert spans(store, "r0-a2", "c1") == [(2, 4, 7), (4, 6, 9), (6, 7, 10)]
    info = store.call("r0-a2", "c1")
    assert info is not None
    assert (info.state, info.oldest_version, info.newest_version, info.admitted_version) == ("completed", 7, 10, 10)
    assert info.generated_tokens == 5
    assert info.continues == ("r0-a1", "c1")
    source = store.call("r0-a1", "c1")
    assert source is not None and source.state == "staging"
    assert spans(store, "r0-a1", "c1") == [(2, 4, 7), (4, 6, 9)]
    assert (source.oldest_version, source.newest_version) == (7, 9)
    assert spans(store, "r0", "c1") == [(2, 4, 7)]
    # The older attempts' chunks stay durable after the replacement completes.
    assert [s.digest for s in store.fetch([key0, key1])] == chunk_digests
    assert store.replay().ok


def test_policy_versions_of_a_call_flushed_across_version_changes(rollout: Rollout) -> None:
    flushing(rollout, threshold=2)
    store, capture, versions = rollout.store, rollout.capture, rollout.versions
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    versions.value = 8  # new weights are published while the call decodes
    assert capture.flush_due() == 1
    capture.observe(call, [32, 33], [-0.5, -0.75])
    assert capture.flush_due() == 1
    # The call was admitted at 7: every token it generates is stamped 7.
    assert spans(store, "r0", "c1") == [(2, 6, 7)]
    info = store.call("r0", "c1")
    assert info is not None and (info.oldest_version, info.newest_version, info.cum_len) == (7, 7, 11)


# --- periodic flush (5.7) -------------------------------------------------------------------------


def test_periodic_flush_stages_once_the_unstaged_segment_passes_the_bound(rollout: Rollout) -> None:
    flushing(rollout, threshold=3)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    with writes_nothing(store):
        assert capture.flush_due() == 0  # 2 unstaged tokens, the bound is 3
    capture.observe(call, [32], [-0.125])
    assert capture.flush_due() == 1
    key = chunk_key(periodic(1), "r0", "c1", 0)
    chunk = fetch_one(store, key)
    # The first chunk is cumulative: carried prompt plus everything generated so far.
    assert list(chunk.token_ids_delta) == [20, 21, 30, 31, 32]
    assert list(chunk.token_mask_delta) == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert chunk.digest == (
        capture.build_prefix_record(
            call,
            prompt_token_ids=[*rollout.prefix, 20, 21],
            generated_token_ids=[30, 31, 32],
            generated_logprobs=[-0.5, -0.75, -0.125],
        ).digest
    )
    with writes_nothing(store):
        assert capture.flush_due() == 0  # nothing unstaged any more
    assert not call.completed
    info = store.call("r0", "c1")
    assert info is not None and info.state == "staging"


def test_periodic_flush_stages_only_the_new_delta_after_the_first_chunk(rollout: Rollout) -> None:
    flushing(rollout, threshold=2)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    assert capture.flush_due() == 1
    capture.observe(call, [32, 33, 34], [-0.125, -0.25, -1.0])
    assert capture.flush_due() == 1
    first, second = chunk_key(periodic(1), "r0", "c1", 0), chunk_key(periodic(2), "r0", "c1", 1)
    delta = fetch_one(store, second)
    assert list(delta.token_ids_delta) == [32, 33, 34]
    assert list(delta.token_mask_delta) == [1.0, 1.0, 1.0]
    assert delta.weight_version == 7
    assert (delta.prev_len, delta.delta_len, delta.cum_len) == (5, 3, 8)
    assert delta.chain_hash == compute_chain_hash(rollout.root.chain_hash, [32, 33, 34])
    assert delta.cumulative_hash == hash_token_ids([*rollout.prefix, 32, 33, 34])

    # Cuts share the chunk numbering and key list with flushes.
    capture.observe(call, [35], [-0.5])
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    third = chunk_key("checkpoint-1", "r0", "c1", 2)
    assert ack.staging_keys == (first, second, third)
    assert ack.prefix_token_count == 6
    restored = rollout.restore(ack, attempt=1, track=False)
    assert restored.generation_cut is not None
    assert list(restored.generation_cut.token_ids_delta) == [20, 21, 30, 31, 32, 33, 34, 35]
    info = store.call("r0", "c1")
    assert info is not None and info.cum_len == 13 and info.generated_tokens == 6


def test_terminal_completion_clears_periodic_chunk_rows(rollout: Rollout) -> None:
    flushing(rollout, threshold=2)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    assert capture.flush_due() == 1
    capture.observe(call, [32, 33], [-0.125, -0.25])
    assert capture.flush_due() == 1
    keys = [chunk_key(periodic(1), "r0", "c1", 0), chunk_key(periodic(2), "r0", "c1", 1)]
    assert len(store.fetch(keys)) == 2
    coords = capture.complete_call(
        call,
        prompt_token_ids=[*rollout.prefix, 20, 21],
        generated_token_ids=[30, 31, 32, 33, 34],
        generated_logprobs=[-0.5, -0.75, -0.125, -0.25, -1.0],
    )
    assert coords.disposition == "staged"
    assert_unknown(store, *keys)
    assert list(fetch_one(store, "r0/c1").token_ids_delta) == [20, 21, 30, 31, 32, 33, 34]
    assert capture.flush_due() == 0  # the completed call is no longer flushed
    assert store.replay().ok


def test_chunks_a_cut_receipt_acknowledged_survive_terminal_completion(rollout: Rollout) -> None:
    flushing(rollout, threshold=2)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    assert capture.flush_due() == 1
    capture.observe(call, [32], [-0.125])
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    capture.observe(call, [33, 34], [-0.25, -1.0])
    assert capture.flush_due() == 1
    late = chunk_key(periodic(2), "r0", "c1", 2)
    assert fetch_one(store, late).delta_len == 2
    capture.complete_call(
        call,
        prompt_token_ids=[*rollout.prefix, 20, 21],
        generated_token_ids=[30, 31, 32, 33, 34],
        generated_logprobs=[-0.5, -0.75, -0.125, -0.25, -1.0],
    )
    assert len(store.fetch(list(ack.staging_keys))) == 2  # acknowledged: a restore may still need them
    assert_unknown(store, late)
    # ... and the acknowledged cut still restores after the original call completed.
    restored = rollout.restore(ack, attempt=1, track=False)
    assert restored.generation_cut is not None and restored.generation_cut.delta_len == 5


def test_terminal_prefix_cleanup_failure_preserves_completion(
    rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushing(rollout, threshold=1)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30], [-0.5])
    assert capture.flush_due() == 1

    def failing_clear(*args: Any, **kwargs: Any) -> None:
        raise StorageError("cannot clear")

    monkeypatch.setattr(store, "clear_keys", failing_clear)
    coords = capture.complete_call(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[30], generated_logprobs=[-0.5]
    )
    assert coords.disposition == "staged"
    assert fetch_one(store, "r0/c1").digest == coords.digest


def test_restored_attempts_chunks_are_not_cleared_by_the_replacement(cut: Cut) -> None:
    rollout = cut.rollout
    flushing(rollout, threshold=1)
    store, capture = rollout.store, rollout.capture
    replacement = rollout.restore(cut.ack, attempt=1)
    capture.observe(replacement, [32], [-0.125])
    assert capture.flush_due() == 1
    own = chunk_key(periodic(1), "r0-a1", "c1", 0)
    assert list(fetch_one(store, own).token_ids_delta) == [32]  # a continued call's chunks are deltas
    continuation = replacement.continuation
    assert continuation is not None
    capture.complete_call(
        replacement,
        prompt_token_ids=continuation.engine_prompt_token_ids,
        generated_token_ids=[32],
        generated_logprobs=[-0.125],
    )
    assert_unknown(store, own)
    assert fetch_one(store, cut.ack.staging_keys[0]).digest == cut.snapshot.digest


def test_periodic_flush_rolls_back_and_clears_when_staging_fails(
    rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushing(rollout, threshold=2)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])

    def failing_stage_all(*args: Any, **kwargs: Any) -> Any:
        raise StorageError("the database went away")

    monkeypatch.setattr(store, "stage_all", failing_stage_all)
    assert capture.flush_due() == 0
    monkeypatch.undo()
    assert_unknown(store, chunk_key(periodic(1), "r0", "c1", 0))
    capture.observe(call, [32], [-0.125])
    assert capture.flush_due() == 1
    chunk = fetch_one(store, chunk_key(periodic(2), "r0", "c1", 0))
    assert list(chunk.token_ids_delta) == [20, 21, 30, 31, 32]


def test_periodic_flush_skips_a_call_a_checkpoint_cut_already_froze(
    rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushing(rollout, threshold=1)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    real_stage_all = store.stage_all
    flushed_during_cut: list[int] = []

    def stage_all_with_a_flush_pass(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cut_receipt") is not None and not flushed_during_cut:
            capture.observe(call, [32], [-0.125])
            result: list[int] = []
            flusher = threading.Thread(target=lambda: result.append(capture.flush_due()))
            flusher.start()
            flusher.join(timeout=10)
            flushed_during_cut.extend(result)
        return real_stage_all(*args, **kwargs)

    monkeypatch.setattr(store, "stage_all", stage_all_with_a_flush_pass)
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert flushed_during_cut == [0]
    assert ack.staging_keys == (chunk_key("checkpoint-1", "r0", "c1", 0),)
    monkeypatch.undo()
    assert capture.flush_due() == 1  # the token decoded during the cut is flushed afterwards
    assert list(fetch_one(store, chunk_key(periodic(1), "r0", "c1", 1)).token_ids_delta) == [32]


def _flush_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "staging-store-flush" and t.is_alive()}


def test_periodic_flush_thread_flushes_on_its_own(rollout: Rollout) -> None:
    before = _flush_threads()
    capture = rollout.new_capture(flush_threshold_tokens=2, flush_interval=0.02)
    rollout.capture = capture
    assert len(_flush_threads() - before) == 1
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    key = chunk_key(periodic(1), "r0", "c1", 0)
    deadline = time.monotonic() + 10
    while True:
        try:
            chunk = fetch_one(rollout.store, key)
            break
        except UnknownKeyError:
            assert time.monotonic() < deadline, "the flush thread never staged the due call"
            time.sleep(0.02)
    assert list(chunk.token_ids_delta) == [20, 21, 30, 31]
    capture.close()
    assert not (_flush_threads() - before), "close() must stop the flush thread"


def test_abort_waits_for_generation_cut_before_failing_the_call(
    rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    real_stage_all = store.stage_all
    outcome: list[CommitCoords] = []
    aborter = threading.Thread(target=lambda: outcome.append(capture.fail_call(call, reason="client aborted")))

    def stage_all_while_aborting(*args: Any, **kwargs: Any) -> Any:
        aborter.start()
        aborter.join(timeout=0.3)
        assert aborter.is_alive(), "the abort must wait for the cut that owns the call"
        assert not call.completed
        return real_stage_all(*args, **kwargs)

    monkeypatch.setattr(store, "stage_all", stage_all_while_aborting)
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    aborter.join(timeout=30)
    assert ack.disposition == "durable_prefix" and ack.prefix_token_count == 2
    assert [c.disposition for c in outcome] == ["capture_failed"]
    assert call.completed
    info = store.call("r0", "c1")
    assert info is not None and info.state == "failed"
    assert fetch_one(store, ack.staging_keys[0]).digest == ack.prefix_digest


def test_terminal_completion_waits_for_periodic_flush_and_clears_its_row(
    rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushing(rollout, threshold=2)
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75])
    real_stage_all = store.stage_all
    outcome: list[CommitCoords] = []
    completion = {
        "prompt_token_ids": [*rollout.prefix, 20, 21],
        "generated_token_ids": [30, 31, 32],
        "generated_logprobs": [-0.5, -0.75, -0.125],
    }
    finisher = threading.Thread(target=lambda: outcome.append(capture.complete_call(call, **completion)))

    def stage_all_while_finishing(*args: Any, **kwargs: Any) -> Any:
        finisher.start()
        finisher.join(timeout=0.3)
        assert finisher.is_alive(), "the terminal path must wait for the flush that owns the call"
        return real_stage_all(*args, **kwargs)

    monkeypatch.setattr(store, "stage_all", stage_all_while_finishing)
    assert capture.flush_due() == 1
    finisher.join(timeout=30)
    monkeypatch.undo()
    assert [c.disposition for c in outcome] == ["staged"]
    assert_unknown(store, chunk_key(periodic(1), "r0", "c1", 0))
    assert list(fetch_one(store, "r0/c1").token_ids_delta) == [20, 21, 30, 31, 32]
    assert capture.flush_due() == 0  # a stale pass after the terminal path skips the call


def test_periodic_flush_is_inert_when_disabled(rollout: Rollout) -> None:
    before_threads = {t.ident for t in threading.enumerate() if t.name == "staging-store-flush"}
    capture = rollout.new_capture(flush_threshold_tokens=0, flush_interval=0.01)
    rollout.capture = capture
    call = rollout.live_call(limit=100)
    after_threads = {t.ident for t in threading.enumerate() if t.name == "staging-store-flush"}
    assert after_threads <= before_threads  # no flush thread was started
    with writes_nothing(rollout.store):
        capture.observe(call, list(range(30, 130)), [-0.5] * 100)
        time.sleep(0.1)
        assert capture.flush_due() == 0
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    assert ack.staging_keys == (chunk_key("checkpoint-1", "r0", "c1", 0),)  # cuts still work


# --- policy versions of continued calls (calls projection) ------------------------------------------


@pytest.mark.parametrize("staged_by", ["cut", "flush"])
def test_calls_projection_of_a_continued_call_counts_its_restored_prefix(cut: Cut, staged_by: str) -> None:
    rollout = cut.rollout
    if staged_by == "flush":
        flushing(rollout, threshold=2)
    store, capture = rollout.store, rollout.capture
    replacement = rollout.restore(cut.ack, attempt=1)
    capture.observe(replacement, [32, 33], [-0.125, -0.25])
    if staged_by == "flush":
        assert capture.flush_due() == 1
    else:
        capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1", attempt=1)))
    info = store.call("r0-a1", "c1")
    assert info is not None
    # The call's durable tokens are its restored cut (carry [20, 21] + [30, 31]) and the new [32, 33].
    assert [(s.start, s.end, s.weight_version) for s in info.version_spans] == [(2, 6, 7)]
    assert info.generated_tokens == 4
    assert info.cum_len == info.prev_len + 6 == 11, "cum_len must count the restored prefix, as the spans do"


def _terminal_row_of_a_mixed_version_call(rollout: Rollout) -> GenerationCutPrefixAck:
    """Attempt 0 (version 7) is cut after [30, 31]; attempt 1 (version 9) finishes with [32, 33]
    and is then acknowledged as a terminal completion.  Its row is stamped 7 but holds tokens of 9."""
    store, capture, versions = rollout.store, rollout.capture, rollout.versions
    call0 = rollout.live_call(limit=16)
    capture.observe(call0, [30, 31], [-0.5, -0.75])
    ack0 = only_ack(capture.serve_generation_cut(inventory("checkpoint-1")))
    versions.value = 9
    call1 = rollout.restore(ack0, attempt=1)
    capture.observe(call1, [32, 33], [-0.125, -0.25], finish_reason="stop")
    continuation = call1.continuation
    assert continuation is not None
    coords = capture.complete_call(
        call1,
        prompt_token_ids=continuation.engine_prompt_token_ids,
        generated_token_ids=[32, 33],
        generated_logprobs=[-0.125, -0.25],
    )
    assert coords.weight_version == 7
    assert spans(store, "r0-a1", "c1") == [(2, 4, 7), (4, 6, 9)]
    ack = only_ack(capture.serve_generation_cut(inventory("checkpoint-2", ticket("c1", attempt=1))))
    assert ack.cut_kind == "terminal_completion" and ack.staging_keys == ("r0-a1/c1",)
    assert ack.prefix_token_count == 4
    return ack


def test_policy_version_spans_survive_a_restore_from_a_terminal_completion_row(rollout: Rollout) -> None:
    ack = _terminal_row_of_a_mixed_version_call(rollout)
    rollout.versions.value = 10
    call2 = rollout.restore(ack, attempt=2, track=False)
    assert call2.generation_cut is not None and call2.generation_cut.weight_version == 7
    coords = rollout.capture.finish_restored_call(call2)
    assert coords.disposition == "staged" and coords.weight_version == 7
    # [32, 33] were generated at version 9, and the store recorded that for r0-a1/c1.
    assert spans(rollout.store, "r0-a2", "c1") == [(2, 4, 7), (4, 6, 9)]
    info = rollout.store.call("r0-a2", "c1")
    assert info is not None and (info.oldest_version, info.newest_version) == (7, 9)


def test_terminal_row_with_newer_tokens_is_not_restored_at_an_older_version(rollout: Rollout) -> None:
    ack = _terminal_row_of_a_mixed_version_call(rollout)
    # The same tokens restored from their chunks are refused at version 8 (9 is newer) ...
    chunk_keys = (chunk_key("checkpoint-1", "r0", "c1", 0),)
    assert [s.weight_version for s in rollout.store.fetch(list(chunk_keys))] == [7]
    rollout.versions.value = 8
    # ... and so must they be when restored from the terminal row that holds them.
    with writes_nothing(rollout.store, ("r0-a2", "c1")), pytest.raises(CaptureError, match="newer"):
        rollout.restore(ack, attempt=2, track=False)


def test_generation_cut_recovers_terminal_evidence_from_the_log_after_a_restart(rollout: Rollout) -> None:
    store, capture = rollout.store, rollout.capture
    call = rollout.live_call()
    capture.observe(call, [30, 31], [-0.5, -0.75], finish_reason="length")
    coords = capture.complete_call(
        call, prompt_token_ids=[*rollout.prefix, 20, 21], generated_token_ids=[30, 31], generated_logprobs=[-0.5, -0.75]
    )
    # A new capture has no completion evidence in memory: it reads the completed event.
    restarted = rollout.new_capture()
    ack = only_ack(restarted.serve_generation_cut(inventory("checkpoint-1")))
    assert ack.disposition == "durable_prefix" and ack.cut_kind == "terminal_completion"
    assert ack.staging_keys == ("r0/c1",) and ack.prefix_digest == coords.digest
    assert ack.prefix_token_count == 2 and ack.effective_output_limit == 10
    assert ack.terminal_finish_reason == "length"
    rollout.capture = restarted
    replacement = rollout.restore(ack, attempt=1, track=False)
    assert replacement.continuation is not None and replacement.continuation.is_terminal
    final = restarted.finish_restored_call(replacement)
    assert final.disposition == "staged" and final.digest != coords.digest  # the replacement's identity
    # Evidence older than the retention window is not used, from memory or from the log.
    stale = rollout.new_capture(completion_evidence_ttl=0.0)
    expired = only_ack(stale.serve_generation_cut(inventory("checkpoint-2")))
    assert expired.disposition == "durable_failure"
    assert store.replay().ok


def test_periodic_flush_thread_stops_when_the_store_is_closed(store_url: str) -> None:
    store = open_store(store_url)
    capture = RolloutTokenCapture(
        store=store, weight_version_fn=lambda: 1, flush_threshold_tokens=1, flush_interval=0.01
    )
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c1", mode="text"))
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    store.close()
    capture.observe(call, [3], [-0.5])
    flusher = capture.cuts._flusher
    assert flusher is not None
    flusher.join(timeout=5)
    assert not flusher.is_alive(), "the flush thread kept running against a closed store"
    assert call.completed is False
    capture.close()
