"""The worker capture (wire-contract section 4): admission, builders, completion, failure.

The named tests of ``test_token_capture_staging_worker.py`` (wire-contract section 9) that
apply to this library, plus one test per admission and completion rule of 4.3 - 4.11.
Generation cuts (section 5) live in ``test_generation_cuts.py``.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from capture_helpers import Versions, event_count, writes_nothing
from factories import plain_digest_fields
from vectors import vectors_by_id

import store as lib
from store import (
    EMPTY_EXTRAS_DIGEST,
    ActiveCall,
    AdmissionTypeError,
    CaptureAdmission,
    CaptureDataError,
    CaptureError,
    CommitCoords,
    GenerationCutContinuation,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    StagedCallRecord,
    StageResult,
    Store,
    StreamingUnsupportedError,
    UnknownKeyError,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from store.log.events import AdmissionBody
from store.wire import digest as digest_module

# --- helpers ----------------------------------------------------------------------------------


VECTORS = vectors_by_id()


def vector(case_id: str) -> dict[str, Any]:
    assert case_id in VECTORS, f"conformance vector {case_id} is missing from the vector file"
    return VECTORS[case_id]


def make_capture(store: Store, version: Any = 7, **kwargs: Any) -> tuple[RolloutTokenCapture, Versions]:
    versions = Versions(version)
    return RolloutTokenCapture(store=store, weight_version_fn=versions, **kwargs), versions


def root_admission(rollout_id: str = "r0", model_call_id: str = "c0") -> CaptureAdmission:
    return CaptureAdmission(rollout_id=rollout_id, model_call_id=model_call_id, mode="text")


def child_admission(
    parent: CommitCoords,
    prefix: Sequence[int],
    model_call_id: str = "c1",
    *,
    inline: bool = True,
    staging_chain: Sequence[str] = (),
    rollout_id: str | None = None,
    **kwargs: Any,
) -> CaptureAdmission:
    assert parent.chain_hash is not None
    return CaptureAdmission(
        rollout_id=rollout_id or parent.rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent.model_call_id,
        prev_len=len(prefix),
        mode="token_in",
        required_prefix_token_ids=list(prefix) if inline else [],
        staging_chain=tuple(staging_chain),
        parent_chain_hash=parent.chain_hash,
        **kwargs,
    )


def stage_root(
    capture: RolloutTokenCapture,
    rollout_id: str = "r0",
    model_call_id: str = "c0",
    prompt: Sequence[int] = (1, 2, 3),
    generated: Sequence[int] = (4, 5),
    logprobs: Sequence[float] = (-0.5, -0.25),
) -> tuple[CommitCoords, list[int]]:
    """A completed root call; returns its coords and its cumulative tokens (the child's prefix)."""
    call = capture.begin_call(root_admission(rollout_id, model_call_id))
    coords = capture.complete_call(
        call, prompt_token_ids=list(prompt), generated_token_ids=list(generated), generated_logprobs=list(logprobs)
    )
    assert coords.disposition == "staged"
    return coords, [*prompt, *generated]


def assert_failed_coords(coords: CommitCoords, call: ActiveCall) -> None:
    admission = call.admission
    assert coords.disposition == "capture_failed"
    assert (coords.rollout_id, coords.model_call_id, coords.parent_call_id) == (
        admission.rollout_id,
        admission.model_call_id,
        admission.parent_call_id,
    )
    assert (coords.prev_len, coords.delta_len, coords.cum_len) == (admission.prev_len, 0, admission.prev_len)
    assert coords.weight_version == call.weight_version
    assert coords.digest is None
    assert coords.extras_digest is None
    assert coords.staging_key is None
    assert coords.chain_hash is None
    assert coords.cumulative_hash is None


def assert_nothing_staged(store: Store, key: str) -> None:
    with pytest.raises(UnknownKeyError):
        store.fetch([key])


def assert_record_equals_normal_construction(record: StagedCallRecord) -> None:
    """``from_components`` must be byte-identical to constructing the record with its digest."""
    rebuilt = StagedCallRecord(**plain_digest_fields(record), digest=record.digest, extras=record.extras)
    assert lib.to_json(rebuilt) == lib.to_json(record)
    assert compute_staging_digest(**plain_digest_fields(record)) == record.digest


@contextmanager
def counting_digests(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Count ``staging_digest_and_columns`` calls made through ``store.digest`` inside the block."""
    original = digest_module.staging_digest_and_columns
    calls: list[dict[str, Any]] = []

    def counting(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(digest_module, "staging_digest_and_columns", counting)
    try:
        yield calls
    finally:
        monkeypatch.setattr(digest_module, "staging_digest_and_columns", original)


def cut_and_restore(
    store: Store, *, limit: int = 10, version: int = 7
) -> tuple[RolloutTokenCapture, ActiveCall, CommitCoords, list[int]]:
    """Attempt 0 of r0/c1 is cut after two tokens; returns the replacement call (attempt 1)."""
    capture, _ = make_capture(store, version)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    capture.track(call, prompt_token_ids=[*prefix, 20, 21], effective_output_limit=limit)
    capture.observe(call, [30, 31], [-0.5, -0.75])
    ticket = GenerationCutPrefix(ticket_id="t1", rollout_id="r0", attempt_index=0, model_call_id="c1", admitted_at=1.0)
    inventory = GenerationCutInventory.build(
        checkpoint_id="checkpoint-1", server_name="policy", active_prefixes=[ticket]
    )
    ack = capture.serve_generation_cut(inventory).prefixes[0]
    assert ack.disposition == "durable_prefix"
    assert ack.prefix_digest is not None and ack.prefix_token_count is not None
    assert ack.effective_output_limit is not None
    continuation = GenerationCutContinuation(
        source_capture_key="r0",
        source_model_call_id="c1",
        staging_keys=ack.staging_keys,
        generation_token_count=ack.prefix_token_count,
        digest=ack.prefix_digest,
        effective_output_limit=ack.effective_output_limit,
    )
    replacement = capture.begin_call(child_admission(root, prefix, rollout_id="r0-a1", generation_cut=continuation))
    return capture, replacement, root, prefix


# --- 4.3: typed admission, streaming, weight versions -------------------------------------------


def test_begin_call_requires_typed_admission_and_rejects_streaming(store: Store) -> None:
    capture, _ = make_capture(store)
    as_dict = {"rollout_id": "r0", "model_call_id": "c0", "mode": "text"}
    with writes_nothing(store, ("r0", "c0")):
        with pytest.raises(TypeError) as refused:
            capture.begin_call(as_dict)  # type: ignore[arg-type]
        assert isinstance(refused.value, CaptureError)
        assert isinstance(refused.value, AdmissionTypeError)
        with pytest.raises(StreamingUnsupportedError) as streaming:
            capture.begin_call(root_admission(), stream=True)
        assert isinstance(streaming.value, CaptureError)
        # Streaming is refused before the prefix is looked at (4.3 steps 2 then 3).
        with pytest.raises(StreamingUnsupportedError):
            capture.begin_call(root_admission(), prefix_token_ids=[1, 2], stream=True)
    # The same admission, typed and not streaming, is accepted and logged.
    call = capture.begin_call(root_admission())
    assert call.admission == root_admission()
    info = store.call("r0", "c0")
    assert info is not None and info.state == "admitted"


def test_accepted_admission_is_appended_to_the_log(store: Store) -> None:
    capture, _ = make_capture(store, 5)
    root, prefix = stage_root(capture)
    before = event_count(store)
    call = capture.begin_call(child_admission(root, prefix))
    assert event_count(store) == before + 1
    info = store.call("r0", "c1")
    assert info is not None
    assert (info.state, info.parent_call_id, info.mode, info.prev_len) == ("admitted", "c0", "token_in", 5)
    assert info.admitted_version == 5 == call.weight_version
    assert info.continues is None
    assert call.prefix_token_ids == prefix
    assert call.generation_cut is None
    assert call.continuation is None
    assert not call.completed


def test_weight_version_is_stamped_at_admission(store: Store) -> None:
    capture, versions = make_capture(store, 3)
    call = capture.begin_call(root_admission())
    assert call.weight_version == 3
    versions.value = 5  # the trainer publishes new weights while the call decodes
    coords = capture.complete_call(call, prompt_token_ids=[1, 2], generated_token_ids=[3], generated_logprobs=[-0.5])
    assert coords.disposition == "staged"
    assert coords.weight_version == 3
    assert coords.staging_key is not None
    assert store.fetch([coords.staging_key])[0].weight_version == 3
    info = store.call("r0", "c0")
    assert info is not None and (info.admitted_version, info.oldest_version, info.newest_version) == (3, 3, 3)
    later = capture.begin_call(root_admission(model_call_id="c9"))
    assert later.weight_version == 5


def test_explicit_worker_weight_version_overrides_provider(store: Store) -> None:
    def unavailable() -> int:
        raise AssertionError("the provider must not be consulted when the worker passes a version")

    capture = RolloutTokenCapture(store=store, weight_version_fn=unavailable)
    call = capture.begin_call(root_admission(), weight_version=11)
    assert call.weight_version == 11
    coords = capture.complete_call(call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5])
    assert coords.weight_version == 11
    info = store.call("r0", "c0")
    assert info is not None and info.admitted_version == 11
    # Explicit 0 is a version, not "absent".
    provider_capture, versions = make_capture(store, 4)
    zero = provider_capture.begin_call(root_admission(model_call_id="c2"), weight_version=0)
    assert zero.weight_version == 0
    assert versions.calls == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, False, None, "3", 2**64])
def test_weight_version_must_be_a_non_negative_int(store: Store, bad: Any) -> None:
    capture, _ = make_capture(store, bad)
    with writes_nothing(store, ("r0", "c0")):
        with pytest.raises(CaptureError) as from_provider:
            capture.begin_call(root_admission())
        if bad != 2**64:
            assert "non-negative int" in str(from_provider.value)
        if bad is not None:
            good_capture, _ = make_capture(store, 7)
            with pytest.raises(CaptureError):
                good_capture.begin_call(root_admission(), weight_version=bad)


def test_largest_u64_weight_version_is_accepted(store: Store) -> None:
    capture, _ = make_capture(store, 2**64 - 1)
    call = capture.begin_call(root_admission())
    coords = capture.complete_call(call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5])
    assert coords.weight_version == 2**64 - 1
    info = store.call("r0", "c0")
    assert info is not None and info.oldest_version == 2**64 - 1


def test_capture_requires_a_store_and_a_callable_provider(store: Store) -> None:
    with pytest.raises(CaptureError):
        RolloutTokenCapture(store=object(), weight_version_fn=lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(CaptureError):
        RolloutTokenCapture(store=store, weight_version_fn=7)  # type: ignore[arg-type]


# --- 4.4: prefix resolution -----------------------------------------------------------------------


def test_begin_call_rejects_prefixes_that_violate_the_admission(store: Store) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    inline = child_admission(root, prefix)
    cases: list[tuple[CaptureAdmission, Any, str]] = [
        (root_admission(model_call_id="c1"), [1, 2], "accepts no prefix_token_ids"),
        (inline, prefix[:-1], "does not equal prev_len"),
        (inline, [*prefix[:-1], 99], "conflict with the admission's inline prefix"),
        (child_admission(root, prefix, inline=False, staging_chain=["r0/c0"]), [1, 2, -3, 4, 5], "non-negative ints"),
        (child_admission(root, prefix, inline=False, staging_chain=["r0/c0"]), [1, 2, True, 4, 5], "non-negative ints"),
    ]
    for admission, given, fragment in cases:
        with writes_nothing(store, ("r0", "c1")), pytest.raises(CaptureError, match=fragment):
            capture.begin_call(admission, prefix_token_ids=given)


@pytest.mark.parametrize("empty", [None, [], ()])
def test_text_admission_accepts_an_absent_or_empty_prefix(store: Store, empty: Any) -> None:
    capture, _ = make_capture(store)
    call = capture.begin_call(root_admission(), prefix_token_ids=empty)
    assert list(call.prefix_token_ids) == []


def test_inline_admission_accepts_a_matching_explicit_prefix(store: Store) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix), prefix_token_ids=list(prefix))
    assert call.prefix_token_ids == prefix
    coords = capture.complete_call(
        call, prompt_token_ids=[*prefix, 6], generated_token_ids=[7], generated_logprobs=[-0.5]
    )
    assert coords.disposition == "staged"
    assert (coords.prev_len, coords.delta_len, coords.cum_len) == (5, 2, 7)


def test_staging_chain_admission_requires_the_resolved_prefix(store: Store) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    admission = child_admission(root, prefix, inline=False, staging_chain=["r0/c0"])
    with writes_nothing(store, ("r0", "c1")), pytest.raises(CaptureError, match="resolved prefix_token_ids"):
        capture.begin_call(admission)
    # An empty list is "given" and fails the length rule instead; either way nothing is admitted.
    with writes_nothing(store, ("r0", "c1")), pytest.raises(CaptureError, match="does not equal prev_len"):
        capture.begin_call(admission, prefix_token_ids=[])
    call = capture.begin_call(admission, prefix_token_ids=prefix)
    assert call.prefix_token_ids == prefix


def test_staging_chain_admission_with_resolved_prefix_matches_inline_coordinates(store: Store) -> None:
    capture, _ = make_capture(store)
    root, root_tokens = stage_root(capture, prompt=[1, 2], generated=[3], logprobs=[-0.5])
    child = capture.complete_call(
        capture.begin_call(child_admission(root, root_tokens, "c1")),
        prompt_token_ids=[1, 2, 3, 4],
        generated_token_ids=[5],
        generated_logprobs=[-0.25],
    )
    assert child.staging_key is not None and root.staging_key is not None
    chain = [root.staging_key, child.staging_key]
    # The framework fetches the chain and concatenates its deltas.
    resolved = [token for snapshot in store.fetch(chain) for token in snapshot.token_ids_delta]
    assert resolved == [1, 2, 3, 4, 5]

    inline_call = capture.begin_call(child_admission(child, resolved, "c2"))
    chain_call = capture.begin_call(
        child_admission(child, resolved, "c2", inline=False, staging_chain=chain), prefix_token_ids=resolved
    )
    completion = {"prompt_token_ids": [*resolved, 6], "generated_token_ids": [7, 8], "generated_logprobs": [-1.0, -2.0]}
    inline_record = capture.build_prefix_record(inline_call, **completion)
    chain_coords = capture.complete_call(chain_call, **completion)
    inline_coords = capture.complete_call(inline_call, **completion)  # re-stages the identical record: ok
    assert chain_coords == inline_coords
    assert chain_coords.disposition == "staged"
    assert (chain_coords.prev_len, chain_coords.delta_len, chain_coords.cum_len) == (5, 3, 8)
    assert chain_coords.digest == inline_record.digest
    assert chain_coords.chain_hash == compute_chain_hash(child.chain_hash, [6, 7, 8])
    assert chain_coords.cumulative_hash == hash_token_ids([1, 2, 3, 4, 5, 6, 7, 8])


def test_resolved_prefix_still_rejects_a_generation_prompt_that_differs(store: Store) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(
        child_admission(root, prefix, inline=False, staging_chain=["r0/c0"]), prefix_token_ids=prefix
    )
    with pytest.raises(CaptureDataError):
        capture.build_prefix_record(
            call, prompt_token_ids=[9, *prefix[1:], 6], generated_token_ids=[7], generated_logprobs=[-0.5]
        )
    before = event_count(store)
    coords = capture.complete_call(
        call, prompt_token_ids=[9, *prefix[1:], 6], generated_token_ids=[7], generated_logprobs=[-0.5]
    )
    assert_failed_coords(coords, call)
    assert_nothing_staged(store, "r0/c1")
    assert event_count(store) == before + 1  # only the failure event
    info = store.call("r0", "c1")
    assert info is not None and info.state == "failed"


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param([1, 2, 3, 4, 6, 20], id="last-parent-token-differs"),
        pytest.param([0, 1, 2, 3, 4, 5], id="shifted"),
        pytest.param([1, 2, 3], id="shorter-than-prev-len"),
        pytest.param([], id="empty"),
    ],
)
def test_child_rejects_a_generation_prompt_with_the_wrong_parent_prefix(store: Store, prompt: list[int]) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    coords = capture.complete_call(call, prompt_token_ids=prompt, generated_token_ids=[7], generated_logprobs=[-0.5])
    assert_failed_coords(coords, call)
    assert_nothing_staged(store, "r0/c1")
    with pytest.raises(CaptureError, match="already completed"):
        capture.fail_call(call, reason="late")


# --- 4.7 - 4.9: builders and completion ------------------------------------------------------------


def test_root_stages_exact_full_delta_before_returning_coords(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    case = vector("staging.root_text.v2")
    capture, _ = make_capture(store, 7)
    staged: list[tuple[StagedCallRecord, StageResult]] = []
    real_stage = store.stage

    def recording_stage(record: StagedCallRecord, **kwargs: Any) -> StageResult:
        result = real_stage(record, **kwargs)
        # The record is durable (fetchable) before complete_call returns its coords.
        assert store.fetch([record.staging_key])[0].digest == record.digest
        staged.append((record, result))
        return result

    monkeypatch.setattr(store, "stage", recording_stage)
    call = capture.begin_call(root_admission("rollout-1", "call-1"))
    coords = capture.complete_call(
        call, prompt_token_ids=[10, 11], generated_token_ids=[12], generated_logprobs=[-0.25]
    )
    assert len(staged) == 1
    record, result = staged[0]
    assert list(record.token_ids_delta) == [10, 11, 12]
    assert list(record.token_mask_delta) == [0.0, 0.0, 1.0]
    assert list(record.generation_log_probs_delta) == [0.0, 0.0, -0.25]
    assert record.extras is None and record.extras_digest == EMPTY_EXTRAS_DIGEST
    assert coords.disposition == "staged"
    assert (coords.parent_call_id, coords.prev_len, coords.delta_len, coords.cum_len) == (None, 0, 3, 3)
    assert coords.staging_key == result.staging_key == "rollout-1/call-1"
    assert coords.digest == record.digest == case["expected"]["digest"]
    assert coords.chain_hash == case["inputs"]["chain_hash"] == compute_chain_hash(None, [10, 11, 12])
    assert coords.cumulative_hash == case["inputs"]["cumulative_hash"] == hash_token_ids([10, 11, 12])
    assert coords.extras_digest == EMPTY_EXTRAS_DIGEST
    assert coords.weight_version == 7
    fetched = store.fetch(["rollout-1/call-1"])[0]
    assert fetched.digest == coords.digest
    assert list(fetched.token_ids_delta) == [10, 11, 12]
    assert call.completed
    info = store.call("rollout-1", "call-1")
    assert info is not None and info.state == "completed" and info.cum_len == 3


def test_child_stages_only_tokens_after_verified_parent_prefix(store: Store) -> None:
    case = vector("staging.child_token_in.v2")
    capture, _ = make_capture(store, 7)
    root, prefix = stage_root(capture, "rollout-1", "c1", prompt=[10, 11], generated=[12], logprobs=[-0.25])
    assert prefix == [10, 11, 12]
    call = capture.begin_call(child_admission(root, prefix, "c2"))
    coords = capture.complete_call(
        call, prompt_token_ids=[10, 11, 12, 20, 21], generated_token_ids=[22, 23], generated_logprobs=[-0.3, -0.4]
    )
    assert coords.disposition == "staged"
    assert (coords.prev_len, coords.delta_len, coords.cum_len) == (3, 4, 7)
    assert coords.parent_call_id == "c1"
    assert coords.chain_hash == compute_chain_hash(root.chain_hash, [20, 21, 22, 23]) == case["inputs"]["chain_hash"]
    assert coords.cumulative_hash == hash_token_ids([10, 11, 12, 20, 21, 22, 23]) == case["inputs"]["cumulative_hash"]
    assert coords.digest == case["expected"]["digest"]
    assert coords.staging_key is not None
    record = store.fetch([coords.staging_key])[0]
    assert list(record.token_ids_delta) == [20, 21, 22, 23]  # the parent's tokens are not staged again
    assert list(record.token_mask_delta) == [0.0, 0.0, 1.0, 1.0]
    assert record.mode == "token_in"


def test_generation_chunk_record_matches_conformance_vector(store: Store) -> None:
    case = vector("staging.generation_chunk_record")
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture, "r0", "c0", prompt=[10, 11], generated=[12], logprobs=[-0.25])
    call = capture.begin_call(child_admission(root, prefix, "c1"), weight_version=5)
    record = capture.build_generation_chunk_record(
        call, generated_token_ids=[32, 33], generated_logprobs=[-0.125, -0.25]
    )
    assert record.digest == case["expected"]["digest"]
    assert (record.prev_len, record.delta_len, record.cum_len, record.weight_version) == (3, 2, 5, 5)
    assert list(record.token_mask_delta) == [1.0, 1.0]
    assert record.extras_digest == EMPTY_EXTRAS_DIGEST
    assert record.chain_hash == compute_chain_hash(root.chain_hash, [32, 33])
    assert record.cumulative_hash == hash_token_ids([10, 11, 12, 32, 33])
    assert not call.completed
    assert_nothing_staged(store, "r0/c1")


@pytest.mark.parametrize(
    ("ids", "logprobs"),
    [([], []), ([1, 2], [-0.5]), ([-1], [-0.5]), ([1], [math.nan]), ([True], [-0.5])],
)
def test_generation_chunk_record_rejects_bad_chunks(store: Store, ids: list[Any], logprobs: list[Any]) -> None:
    capture, _ = make_capture(store)
    call = capture.begin_call(root_admission())
    with pytest.raises(ValueError):
        capture.build_generation_chunk_record(call, generated_token_ids=ids, generated_logprobs=logprobs)
    assert not call.completed


def test_build_prefix_record_snapshots_a_live_call_without_completing_it(store: Store) -> None:
    capture, _ = make_capture(store, 6)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    before = event_count(store)
    record = capture.build_prefix_record(
        call, prompt_token_ids=[*prefix, 20], generated_token_ids=[30], generated_logprobs=[-0.5], extras={"k": [1]}
    )
    assert event_count(store) == before
    assert not call.completed
    assert (record.rollout_id, record.model_call_id, record.parent_call_id, record.mode) == (
        "r0",
        "c1",
        "c0",
        "token_in",
    )
    assert list(record.token_ids_delta) == [20, 30]
    assert record.extras == {"k": [1]}
    assert record.extras_digest == compute_extras_digest({"k": [1]})
    assert record.weight_version == 6
    assert_record_equals_normal_construction(record)
    coords = capture.complete_call(
        call, prompt_token_ids=[*prefix, 20], generated_token_ids=[30], generated_logprobs=[-0.5], extras={"k": [1]}
    )
    assert coords.digest == record.digest  # complete_call builds exactly this record


def test_complete_call_from_response_uses_the_adapter(store: Store) -> None:
    class Adapter:
        def enter_prefix(self, request: Any, prefix_ids: list[int]) -> Any:
            return request

        def extract_prompt_ids(self, payload: Any) -> Sequence[int]:
            return payload["prompt"]

        def extract_generation(self, payload: Any) -> tuple[Sequence[int], Sequence[float]]:
            return payload["ids"], payload["logprobs"]

        def extract_extras(self, payload: Any) -> dict[str, Any] | None:
            return payload.get("extras")

    capture, _ = make_capture(store, adapter=Adapter())
    call = capture.begin_call(root_admission())
    payload = {"prompt": [1, 2], "ids": [3, 4], "logprobs": [-0.5, -0.25], "extras": {"route": [0, 1]}}
    coords = capture.complete_call_from_response(call, payload)
    assert coords.disposition == "staged"
    assert coords.extras_digest == compute_extras_digest({"route": [0, 1]})
    assert coords.staging_key is not None
    assert store.fetch([coords.staging_key])[0].extras == {"route": [0, 1]}

    broken = capture.begin_call(root_admission(model_call_id="c1"))
    failed = capture.complete_call_from_response(broken, {"prompt": [1]})  # extract_generation raises KeyError
    assert_failed_coords(failed, broken)
    assert broken.completed
    assert_nothing_staged(store, "r0/c1")

    no_adapter, _ = make_capture(store)
    with pytest.raises(CaptureError, match="CaptureAdapter"):
        no_adapter.complete_call_from_response(no_adapter.begin_call(root_admission(model_call_id="c2")), payload)


# --- from_components: each locally built record is hashed once ----------------------------------


@pytest.mark.parametrize("kind", ["root", "child", "continued"])
def test_generation_chunk_record_computes_staging_digest_once(
    store: Store, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "continued":
        capture, call, _, _ = cut_and_restore(store)
    else:
        capture, _ = make_capture(store)
        if kind == "root":
            call = capture.begin_call(root_admission())
        else:
            root, prefix = stage_root(capture)
            call = capture.begin_call(child_admission(root, prefix))
    with counting_digests(monkeypatch) as calls:
        record = capture.build_generation_chunk_record(
            call, generated_token_ids=[40, 41], generated_logprobs=[-0.5, -1.0]
        )
    assert len(calls) == 1
    assert calls[0]["rollout_id"] == call.capture_key
    assert_record_equals_normal_construction(record)
    assert list(record.token_mask_delta) == [1.0, 1.0]
    assert record.weight_version == call.weight_version


@pytest.mark.parametrize("kind", ["root", "child", "continued"])
def test_prefix_record_computes_staging_digest_once(store: Store, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "continued":
        capture, call, _, _ = cut_and_restore(store)
        continuation = call.continuation
        assert continuation is not None
        prompt = list(continuation.engine_prompt_token_ids)
    else:
        capture, _ = make_capture(store)
        if kind == "root":
            call, prompt = capture.begin_call(root_admission()), [1, 2]
        else:
            root, prefix = stage_root(capture)
            call, prompt = capture.begin_call(child_admission(root, prefix)), [*prefix, 20]
    with counting_digests(monkeypatch) as calls:
        record = capture.build_prefix_record(
            call, prompt_token_ids=prompt, generated_token_ids=[40], generated_logprobs=[-0.5], extras={"x": 1}
        )
    assert len(calls) == 1
    assert_record_equals_normal_construction(record)


@pytest.mark.parametrize("kind", ["root", "child", "continued"])
def test_complete_call_computes_staging_digest_once(store: Store, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "continued":
        capture, call, _, _ = cut_and_restore(store)
        continuation = call.continuation
        assert continuation is not None
        prompt = list(continuation.engine_prompt_token_ids)
    else:
        capture, _ = make_capture(store)
        if kind == "root":
            call, prompt = capture.begin_call(root_admission()), [1, 2]
        else:
            root, prefix = stage_root(capture)
            call, prompt = capture.begin_call(child_admission(root, prefix)), [*prefix, 20]
    with counting_digests(monkeypatch) as calls:
        coords = capture.complete_call(
            call, prompt_token_ids=prompt, generated_token_ids=[40], generated_logprobs=[-0.5]
        )
    assert coords.disposition == "staged"
    assert len(calls) == 1, f"complete_call hashed the record {len(calls)} times"
    assert coords.staging_key is not None
    fetched = store.fetch([coords.staging_key])[0]
    assert fetched.digest == coords.digest == compute_staging_digest(**plain_digest_fields(fetched))


# --- 4.9 - 4.11: failures never raise to the serving path ------------------------------------------


@pytest.mark.parametrize("mode", ["reject", "raise", "not-a-result"])
def test_sink_failure_poisons_capture_without_failing_completion(
    store: Store, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    attempts: list[StagedCallRecord] = []

    def failing_stage(record: StagedCallRecord, **kwargs: Any) -> Any:
        attempts.append(record)
        if mode == "reject":
            return StageResult(ok=False, error="the sink is full")
        if mode == "raise":
            raise RuntimeError("the sink is down")
        return None

    monkeypatch.setattr(store, "stage", failing_stage)
    coords = capture.complete_call(
        call, prompt_token_ids=[*prefix, 20], generated_token_ids=[30], generated_logprobs=[-0.5]
    )
    assert len(attempts) == 1
    assert_failed_coords(coords, call)
    monkeypatch.undo()
    assert_nothing_staged(store, "r0/c1")
    info = store.call("r0", "c1")
    assert info is not None and info.state == "failed"
    with pytest.raises(CaptureError, match="already completed"):
        capture.complete_call(call, prompt_token_ids=[*prefix, 20], generated_token_ids=[30], generated_logprobs=[-0.5])


@pytest.mark.parametrize(
    "completion",
    [
        pytest.param({"generated_token_ids": [30, 31], "generated_logprobs": [-0.5]}, id="unaligned"),
        pytest.param({"generated_token_ids": [-30], "generated_logprobs": [-0.5]}, id="negative-id"),
        pytest.param({"generated_token_ids": [2**64], "generated_logprobs": [-0.5]}, id="id-over-u64"),
        pytest.param({"generated_token_ids": [True], "generated_logprobs": [-0.5]}, id="bool-id"),
        pytest.param({"generated_token_ids": [30], "generated_logprobs": [math.nan]}, id="nan-logprob"),
        pytest.param({"generated_token_ids": [30], "generated_logprobs": [-math.inf]}, id="inf-logprob"),
        pytest.param({"generated_token_ids": [30], "generated_logprobs": [-1e300]}, id="logprob-over-f32"),
        pytest.param({"generated_token_ids": None, "generated_logprobs": None}, id="missing"),
        pytest.param({"generated_token_ids": [30], "generated_logprobs": [-0.5], "extras": [1]}, id="extras-list"),
        pytest.param(
            {"generated_token_ids": [30], "generated_logprobs": [-0.5], "extras": {"x": math.nan}}, id="nan-extra"
        ),
        pytest.param({"generated_token_ids": [30], "generated_logprobs": [-0.5], "extras": {1: "x"}}, id="int-key"),
        pytest.param(
            {"prompt_token_ids": [1, 2, 3, 4, 5], "generated_token_ids": [], "generated_logprobs": []}, id="empty"
        ),
    ],
)
def test_bad_delta_poisons_capture_without_staging(store: Store, completion: dict[str, Any]) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    before = event_count(store)
    arguments = {"prompt_token_ids": [*prefix, 20], **completion}
    coords = capture.complete_call(call, **arguments)
    assert_failed_coords(coords, call)
    assert_nothing_staged(store, "r0/c1")
    assert event_count(store) == before + 1  # the failure only
    assert call.completed
    info = store.call("r0", "c1")
    assert info is not None and info.state == "failed"


def test_fail_call_returns_failed_coords_and_consumes_the_call(store: Store) -> None:
    capture, _ = make_capture(store, 9)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    coords = capture.fail_call(call, reason="client_disconnected")
    assert_failed_coords(coords, call)
    assert coords.weight_version == 9
    CommitCoords(**{f: getattr(coords, f) for f in coords.__struct_fields__})  # a valid wire record
    info = store.call("r0", "c1")
    assert info is not None and info.state == "failed"


def test_duplicate_completion_and_failure_are_rejected(store: Store) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    completion = {"prompt_token_ids": [*prefix, 20], "generated_token_ids": [30], "generated_logprobs": [-0.5]}

    completed = capture.begin_call(child_admission(root, prefix, "c1"))
    first = capture.complete_call(completed, **completion)
    assert first.disposition == "staged"
    before = event_count(store)
    with pytest.raises(CaptureError, match="already completed"):
        capture.complete_call(completed, **completion)
    with pytest.raises(CaptureError, match="already completed"):  # different tokens: built, then refused
        capture.complete_call(
            completed, prompt_token_ids=[*prefix, 20], generated_token_ids=[31], generated_logprobs=[-1.0]
        )
    with pytest.raises(CaptureError, match="already completed"):  # a bad record after completion is refused too
        capture.complete_call(completed, prompt_token_ids=[9], generated_token_ids=[31], generated_logprobs=[-1.0])
    with pytest.raises(CaptureError, match="already completed"):
        capture.fail_call(completed, reason="late abort")
    assert event_count(store) == before
    assert first.staging_key is not None
    assert store.fetch([first.staging_key])[0].digest == first.digest

    failed = capture.begin_call(child_admission(root, prefix, "c2"))
    capture.fail_call(failed, reason="abort")
    before = event_count(store)
    with pytest.raises(CaptureError, match="already completed"):
        capture.fail_call(failed, reason="abort again")
    with pytest.raises(CaptureError, match="already completed"):
        capture.complete_call(failed, **completion)
    assert event_count(store) == before
    assert_nothing_staged(store, "r0/c2")


@pytest.mark.parametrize("finish", ["completed", "failed"])
def test_a_finished_call_cannot_be_admitted_again(store: Store, finish: str) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix, "c1"))
    if finish == "completed":
        capture.complete_call(call, prompt_token_ids=[*prefix, 20], generated_token_ids=[30], generated_logprobs=[-0.5])
    else:
        capture.fail_call(call, reason="abort")
    finished = store.call("r0", "c1")
    assert finished is not None and finished.state == finish
    # Also from another capture (a restarted worker): the log knows the call is finished.
    for admitting in (capture, make_capture(store)[0]):
        with writes_nothing(store), pytest.raises(CaptureError, match=f"already {finish}"):
            admitting.begin_call(child_admission(root, prefix, "c1"))
    assert store.call("r0", "c1") == finished


def test_an_admission_event_on_a_finished_call_does_not_regress_its_projection(store: Store) -> None:
    capture, _ = make_capture(store)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix, "c1"))
    coords = capture.complete_call(
        call, prompt_token_ids=[*prefix, 20], generated_token_ids=[30, 31], generated_logprobs=[-0.5, -0.25]
    )
    finished = store.call("r0", "c1")
    assert finished is not None and finished.state == "completed" and finished.generated_tokens == 2
    # An admission that reached the log anyway (a racing worker): it moves only the stream position.
    late = AdmissionBody(
        schema_version=2,
        parent_call_id="c0",
        mode="token_in",
        prev_len=len(prefix),
        parent_chain_hash=root.chain_hash,
        weight_version=8,
    )
    store.record_admission("r0", "c1", late)
    assert store.call("r0", "c1") == finished
    assert coords.staging_key is not None and store.fetch([coords.staging_key])[0].digest == coords.digest
    assert store.replay().ok, "replay must fold the late admission the same way"


def test_concurrent_completions_claim_the_call_once(store: Store) -> None:
    capture, _ = make_capture(store)
    call = capture.begin_call(root_admission())
    barrier = threading.Barrier(8)
    outcomes: list[str] = []
    lock = threading.Lock()

    def complete(index: int) -> None:
        barrier.wait()
        try:
            capture.complete_call(call, prompt_token_ids=[1], generated_token_ids=[index], generated_logprobs=[-0.5])
            outcome = "staged"
        except CaptureError:
            outcome = "refused"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["refused"] * 7 + ["staged"]


def test_completed_record_spans_use_the_stamped_version(store: Store) -> None:
    capture, versions = make_capture(store, 2)
    call = capture.begin_call(root_admission())
    versions.value = 3
    capture.complete_call(call, prompt_token_ids=[1, 2], generated_token_ids=[3, 4, 5], generated_logprobs=[-0.5] * 3)
    spans = store.version_spans("r0", "c0")
    assert [(s.start, s.end, s.weight_version) for s in spans] == [(2, 5, 2)]
    assert store.version_spans("r0", "missing") == ()


def test_coords_ride_the_response_without_tokens(store: Store) -> None:
    capture, _ = make_capture(store)
    call = capture.begin_call(root_admission())
    coords = capture.complete_call(
        call, prompt_token_ids=[1, 2], generated_token_ids=[3, 4], generated_logprobs=[-0.5, -0.25]
    )
    wire = json.loads(lib.to_json(coords))
    assert set(wire) == {
        "schema_version",
        "digest_version",
        "extras_digest_version",
        "rollout_id",
        "model_call_id",
        "parent_call_id",
        "prev_len",
        "delta_len",
        "cum_len",
        "weight_version",
        "disposition",
        "digest",
        "extras_digest",
        "staging_key",
        "chain_hash",
        "cumulative_hash",
    }
    assert lib.from_json(lib.to_json(coords), CommitCoords) == coords


def test_slow_sink_write_does_not_serialize_other_completions(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    capture, _ = make_capture(store)
    slow = capture.begin_call(root_admission(model_call_id="slow"))
    fast = capture.begin_call(root_admission(model_call_id="fast"))
    real_stage = store.stage
    slow_entered, release = threading.Event(), threading.Event()

    def stage(record: StagedCallRecord, **kwargs: Any) -> StageResult:
        if record.model_call_id == "slow":
            slow_entered.set()
            assert release.wait(timeout=30), "the slow write was never released"
        return real_stage(record, **kwargs)

    monkeypatch.setattr(store, "stage", stage)
    results: list[CommitCoords] = []
    writer = threading.Thread(
        target=lambda: results.append(
            capture.complete_call(slow, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5])
        )
    )
    writer.start()
    try:
        assert slow_entered.wait(timeout=30)
        # While the slow write blocks, another call completes (and its duplicate is refused).
        coords = capture.complete_call(fast, prompt_token_ids=[1], generated_token_ids=[3], generated_logprobs=[-0.5])
        assert coords.disposition == "staged"
        assert writer.is_alive()
        with pytest.raises(CaptureError, match="already completed"):
            capture.complete_call(slow, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5])
    finally:
        release.set()
        writer.join(timeout=30)
    assert [c.disposition for c in results] == ["staged"]
