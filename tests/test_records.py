"""Wire records (wire-contract section 3) and the named record tests of section 9."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from factories import make_record

import store
import store.wire.records
from store import (
    EMPTY_EXTRAS_DIGEST,
    CallRecord,
    CaptureAdmission,
    CaptureLedgerCommit,
    CommitCoords,
    DigestMismatchError,
    GenerationCutContinuation,
    InvalidRecordError,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    StoreError,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    from_json,
    from_msgpack,
    hash_token_ids,
    to_json,
    to_msgpack,
)

H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64


# --- helpers -----------------------------------------------------------------------------------


def refused(build: Callable[[], Any], *fragments: str) -> InvalidRecordError:
    """``build`` must raise an InvalidRecordError (a StoreError and a ValueError) naming ``fragments``."""
    with pytest.raises(InvalidRecordError) as info:
        build()
    error = info.value
    assert isinstance(error, StoreError)
    assert isinstance(error, ValueError)
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in {error}"
    return error


def refused_json(record_type: type[Any], payload: dict[str, Any], *fragments: str) -> InvalidRecordError:
    return refused(lambda: from_json(json.dumps(payload), record_type), *fragments)


def refused_msgpack(record_type: type[Any], payload: dict[str, Any], *fragments: str) -> InvalidRecordError:
    return refused(lambda: from_msgpack(msgspec.msgpack.encode(payload), record_type), *fragments)


def wire(record: msgspec.Struct) -> dict[str, Any]:
    return json.loads(to_json(record))


def round_trips(record: msgspec.Struct) -> None:
    record_type = type(record)
    assert from_json(to_json(record), record_type) == record
    assert from_msgpack(to_msgpack(record), record_type) == record
    assert to_json(from_json(to_json(record), record_type)) == to_json(record)


def call_row(
    model_call_id: str,
    parent_call_id: str | None = None,
    *,
    prev_len: int = 0,
    delta_len: int = 2,
    capture_key: str | None = "rollout-1",
    **overrides: Any,
) -> CallRecord:
    fields: dict[str, Any] = {
        "capture_key": capture_key,
        "model_call_id": model_call_id,
        "parent_call_id": parent_call_id,
        "prev_len": prev_len,
        "delta_len": delta_len,
        "cum_len": prev_len + delta_len,
        "weight_version": 3,
        "digest": H1,
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "staging_key": f"rollout-1/{model_call_id}",
        "mode": "text" if parent_call_id is None else "token_in",
        "chain_hash": H2,
        "cumulative_hash": H3,
        "response_id": f"resp-{model_call_id}",
    }
    fields.update(overrides)
    return CallRecord(**fields)


def admission(**overrides: Any) -> CaptureAdmission:
    fields: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "model_call_id": "call-2",
        "parent_call_id": "call-1",
        "prev_len": 3,
        "mode": "token_in",
        "required_prefix_token_ids": [1, 2, 3],
        "parent_chain_hash": H1,
    }
    fields.update(overrides)
    return CaptureAdmission(**fields)


def cut(**overrides: Any) -> GenerationCutContinuation:
    fields: dict[str, Any] = {
        "source_capture_key": "rollout-1",
        "source_model_call_id": "call-1",
        "staging_keys": ("__generation_cut__/checkpoint-1/rollout-1/call-1/0",),
        "generation_token_count": 4,
        "digest": H1,
        "effective_output_limit": 16,
    }
    fields.update(overrides)
    return GenerationCutContinuation(**fields)


def coords(**overrides: Any) -> CommitCoords:
    fields: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "model_call_id": "call-2",
        "parent_call_id": "call-1",
        "prev_len": 3,
        "delta_len": 2,
        "cum_len": 5,
        "weight_version": 7,
        "digest": H1,
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "staging_key": "rollout-1/call-2",
        "chain_hash": H2,
        "cumulative_hash": H3,
    }
    fields.update(overrides)
    return CommitCoords(**fields)


def failed_coords(**overrides: Any) -> CommitCoords:
    fields: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "model_call_id": "call-2",
        "parent_call_id": "call-1",
        "prev_len": 3,
        "delta_len": 0,
        "cum_len": 3,
        "weight_version": 7,
        "disposition": "capture_failed",
    }
    fields.update(overrides)
    return CommitCoords(**fields)


def receipt(**overrides: Any) -> RolloutReceipt:
    fields: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "reward": 1.0,
        "terminal_model_call_id": "call-2",
        "manifest": [call_row("call-1"), call_row("call-2", "call-1", prev_len=2)],
        "terminal_selection": "declared",
    }
    fields.update(overrides)
    return RolloutReceipt(**fields)


def child_record(**overrides: Any) -> StagedCallRecord:
    fields: dict[str, Any] = {
        "parent_call_id": "call-0",
        "parent_chain_hash": H1,
        "prefix": (1, 2),
        "extras": {"routed_experts": [[1, 2], [3, 4]]},
    }
    fields.update(overrides)
    return make_record(**fields)


# --- CaptureAdmission (3.2) ------------------------------------------------------------------------


def test_admission_uses_canonical_model_call_identity_and_exact_prefix() -> None:
    token_in = admission()
    assert token_in.required_prefix_token_ids == [1, 2, 3]
    round_trips(token_in)
    text = CaptureAdmission(rollout_id="rollout-1", model_call_id="call-1", mode="text")
    assert text.parent_call_id is None and text.prev_len == 0 and list(text.required_prefix_token_ids) == []
    round_trips(text)
    # A staging chain replaces the inline prefix.
    chained = admission(required_prefix_token_ids=[], staging_chain=["rollout-1/call-0", "rollout-1/call-1"])
    assert chained.staging_chain == ("rollout-1/call-0", "rollout-1/call-1")
    round_trips(chained)

    refused(lambda: admission(parent_call_id=None), "requires a parent_call_id and prev_len > 0")
    refused(lambda: admission(prev_len=0, required_prefix_token_ids=[]), "requires a parent_call_id and prev_len > 0")
    refused(lambda: admission(parent_chain_hash=None), "parent_chain_hash")
    refused(lambda: admission(parent_chain_hash=None), "parent's chain hash")
    refused(lambda: admission(required_prefix_token_ids=[1, 2]), "length must equal prev_len")
    refused(lambda: admission(required_prefix_token_ids=[1, 2, 3, 4]), "length must equal prev_len")
    refused(lambda: admission(parent_chain_hash="A" * 64), "parent_chain_hash")

    text_fields: dict[str, Any] = {
        "mode": "text",
        "parent_call_id": None,
        "prev_len": 0,
        "required_prefix_token_ids": [],
        "parent_chain_hash": None,
    }
    for bad in (
        {"parent_call_id": "call-1"},
        {"prev_len": 3},
        {"required_prefix_token_ids": [1]},
        {"staging_chain": ["rollout-1/call-1"]},
        {"parent_chain_hash": H1},
    ):
        refused(lambda bad=bad: admission(**{**text_fields, **bad}), "text admission")
        refused_json(CaptureAdmission, {**wire(admission(**text_fields)), **bad}, "text admission")


@pytest.mark.parametrize("prefix", [[1, -1, 3], [1, 2, 2**64], [1, True, 3], [1, 2.0, 3]])
def test_admission_refuses_bad_prefix_ids(prefix: list[Any]) -> None:
    refused(lambda: admission(required_prefix_token_ids=prefix))
    refused_json(CaptureAdmission, {**wire(admission()), "required_prefix_token_ids": prefix})


def test_admission_refuses_candidate_mode_clearly() -> None:
    fields = {"rollout_id": "r", "model_call_id": "c", "mode": "candidate"}
    refused(lambda: CaptureAdmission(**fields), "candidate")
    refused_json(CaptureAdmission, fields, "candidate")
    refused_json(CaptureAdmission, {**fields, "mode": "bogus"})
    refused(lambda: CaptureAdmission(rollout_id="r", model_call_id="c", mode="bogus"))


def test_admission_identifiers_and_staging_chain_entries() -> None:
    refused(lambda: admission(rollout_id=""), "rollout_id")
    refused(lambda: admission(model_call_id=""), "model_call_id")
    refused(lambda: admission(parent_call_id=""), "parent_call_id")
    refused(lambda: admission(prev_len=-1))
    refused(lambda: admission(prev_len=True, required_prefix_token_ids=[1]))
    refused(lambda: admission(required_prefix_token_ids=[], staging_chain=["rollout-1/call-1", ""]))
    refused_json(CaptureAdmission, {**wire(admission()), "prev_len": True})


def test_admission_carries_a_generation_cut_in_either_mode() -> None:
    root_cut = CaptureAdmission(rollout_id="rollout-1-a1", model_call_id="call-1b", mode="text", generation_cut=cut())
    round_trips(root_cut)
    decoded = from_json(to_json(root_cut), CaptureAdmission)
    assert isinstance(decoded.generation_cut, GenerationCutContinuation)
    round_trips(admission(generation_cut=cut()))
    refused(lambda: admission(generation_cut={"source_capture_key": "x"}), "generation_cut")
    bad_nested = {**wire(root_cut)}
    bad_nested["generation_cut"] = {**bad_nested["generation_cut"], "effective_output_limit": 0}
    refused_json(CaptureAdmission, bad_nested, "effective_output_limit")


# --- GenerationCutContinuation (3.3) -------------------------------------------------------------


def test_generation_cut_continuation_rules() -> None:
    round_trips(cut())
    round_trips(cut(terminal_finish_reason="stop", terminal_stop_reason="</s>"))
    round_trips(cut(terminal_finish_reason="length", terminal_stop_reason=2))
    round_trips(cut(terminal_finish_reason="stop"))
    many = cut(staging_keys=["k/0", "k/1", "k/2"])
    assert many.staging_keys == ("k/0", "k/1", "k/2")
    round_trips(many)
    round_trips(cut(generation_token_count=0))

    refused(lambda: cut(staging_keys=("k/0", "k/1", "k/0")), "staging_keys must be unique")
    refused_json(GenerationCutContinuation, {**wire(cut()), "staging_keys": ["k", "k"]}, "staging_keys must be unique")
    refused(lambda: cut(staging_keys=()), "staging_keys")
    refused_json(GenerationCutContinuation, {**wire(cut()), "staging_keys": []}, "staging_keys")
    refused(lambda: cut(staging_keys=("k/0", "")))
    refused(lambda: cut(terminal_stop_reason="</s>"), "finish")
    refused_json(GenerationCutContinuation, {**wire(cut()), "terminal_stop_reason": 7}, "finish")
    refused(lambda: cut(terminal_finish_reason="eos"))
    refused_json(GenerationCutContinuation, {**wire(cut()), "terminal_finish_reason": "eos"})
    refused(lambda: cut(terminal_finish_reason="stop", terminal_stop_reason=True))
    refused_json(GenerationCutContinuation, {**wire(cut(terminal_finish_reason="stop")), "terminal_stop_reason": 1.5})
    for limit in (0, -1, True, 1.0):
        refused(lambda limit=limit: cut(effective_output_limit=limit), "effective_output_limit")
    refused_json(GenerationCutContinuation, {**wire(cut()), "effective_output_limit": 0}, "effective_output_limit")
    refused(lambda: cut(generation_token_count=-1), "generation_token_count")
    refused(lambda: cut(generation_token_count=True), "generation_token_count")
    refused(lambda: cut(digest="0" * 63), "digest")
    refused(lambda: cut(source_capture_key=""), "source_capture_key")
    refused(lambda: cut(source_model_call_id=""), "source_model_call_id")


# --- StagedCallRecord (3.4) ------------------------------------------------------------------------


def test_staged_record_and_snapshot_round_trip() -> None:
    record = child_record()
    round_trips(record)
    assert record.staging_key == "rollout-1/call-1"
    assert record.generated_token_count == 2
    assert record.columns.token_ids.tolist() == [10, 11, 12, 20, 21]
    snapshot = from_json(to_json(record), StagedCallSnapshot)
    assert isinstance(snapshot, StagedCallSnapshot)
    assert snapshot.digest == record.digest
    assert to_json(snapshot) == to_json(record)
    base_payload = {key: value for key, value in wire(record).items() if key != "extras"}
    base = from_json(json.dumps(base_payload), StagedCallBaseSnapshot)
    assert base.digest == record.digest and base.extras_digest == record.extras_digest
    refused_json(StagedCallBaseSnapshot, wire(record), "extras")  # the base snapshot has no extras field


def test_base_snapshot_does_not_check_an_extras_payload_but_the_record_does() -> None:
    record = child_record()
    base_payload = {key: value for key, value in wire(record).items() if key != "extras"}
    # The base snapshot binds extras_digest through the staged digest only.
    assert from_json(json.dumps(base_payload), StagedCallBaseSnapshot).extras_digest != EMPTY_EXTRAS_DIGEST
    refused_json(StagedCallRecord, {**wire(record), "extras": None}, "extras_digest does not match")
    refused_json(StagedCallRecord, {**wire(record), "extras": {"routed_experts": [[1, 2], [3, 5]]}})
    error = refused_json(StagedCallRecord, {**wire(record), "extras": {"v": [1, 2.0]}})
    assert isinstance(error, DigestMismatchError)


def test_staged_record_validation_order() -> None:
    payload = wire(child_record())
    # 1 before 2: a root with prev_len > 0 and token_in mode names prev_len.
    refused_json(StagedCallRecord, {**payload, "parent_call_id": None}, "prev_len")
    # 2: a child in text mode.
    refused_json(StagedCallRecord, {**payload, "mode": "text"}, "token_in")
    # 3 before 5: delta_len 0 with a bad mask names delta_len.
    refused_json(StagedCallRecord, {**payload, "delta_len": 0, "token_mask_delta": [0.5] * 5}, "delta_len")
    # 4 before 5: a negative id with a bad mask names the ids.
    error = refused_json(
        StagedCallRecord, {**payload, "token_ids_delta": [-1, 11, 12, 20, 21], "token_mask_delta": [0.5] * 5}
    )
    assert "token_ids_delta" in str(error) and "mask" not in str(error)
    # 5 before 6: a bad mask with a bad carry log-prob names the mask.
    refused_json(
        StagedCallRecord,
        {
            **payload,
            "token_mask_delta": [0.5, 0.0, 0.0, 1.0, 1.0],
            "generation_log_probs_delta": [0.0, -1.0, 0.0, -0.5, -0.625],
        },
        "token_mask_delta",
    )
    # 6 before 7: a non-zero carry log-prob with a wrong digest is a structural error, not a mismatch.
    error = refused_json(
        StagedCallRecord,
        {**payload, "generation_log_probs_delta": [-1.0, 0.0, 0.0, -0.5, -0.625], "digest": "0" * 64},
        "carry",
    )
    assert not isinstance(error, DigestMismatchError)
    # 7: the digest.
    error = refused_json(StagedCallRecord, {**payload, "digest": "0" * 64}, "digest does not match")
    assert isinstance(error, DigestMismatchError)
    # Any digest ValueError fails validation too.
    refused_json(StagedCallRecord, {**payload, "cum_len": 8})
    refused_json(StagedCallRecord, {**payload, "delta_len": 4})
    refused_json(StagedCallRecord, {**payload, "chain_hash": "A" * 64}, "chain_hash")
    refused_json(StagedCallRecord, {k: v for k, v in payload.items() if k != "chain_hash"}, "chain_hash")


def test_staged_record_rejects_digest_covered_mutation() -> None:
    payload = wire(child_record())
    for field, value in (
        ("rollout_id", "rollout-2"),
        ("model_call_id", "call-9"),
        ("parent_call_id", "call-x"),
        ("weight_version", 8),
        ("token_ids_delta", [10, 11, 12, 20, 22]),
        ("token_mask_delta", [0.0, 0.0, 1.0, 1.0, 1.0]),
        ("generation_log_probs_delta", [0.0, 0.0, 0.0, -0.5, -0.75]),
        ("chain_hash", H2),
        ("cumulative_hash", H3),
        ("schema_version", 3),
    ):
        error = refused_json(StagedCallRecord, {**payload, field: value}, "does not match")
        assert isinstance(error, DigestMismatchError), field


def test_from_components_is_identical_to_normal_construction() -> None:
    record = child_record()
    fields = {name: getattr(record, name) for name in record.__struct_fields__}
    fields["token_ids_delta"] = record.token_ids_delta.tolist()
    fields["token_mask_delta"] = record.token_mask_delta.tolist()
    fields["generation_log_probs_delta"] = record.generation_log_probs_delta.tolist()
    normal = StagedCallRecord(**fields)
    assert to_json(normal) == to_json(record)
    assert to_msgpack(normal) == to_msgpack(record)
    assert normal == record and normal.digest == record.digest
    assert record.digest == compute_staging_digest(**normal.digest_fields())
    assert record.extras_digest == compute_extras_digest(record.extras)
    # delta_len and cum_len follow from the columns
    assert (record.prev_len, record.delta_len, record.cum_len) == (2, 5, 7)
    # a wrong digest in normal construction is caught
    refused(lambda: StagedCallRecord(**{**fields, "digest": H1}), "digest does not match")


def test_from_components_computes_each_digest_once(monkeypatch: pytest.MonkeyPatch) -> None:
    module = store.wire.records._digest
    calls = {"staging_digest_and_columns": 0, "compute_extras_digest": 0}
    for name in calls:
        original = getattr(module, name)

        def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)

    record = child_record()
    assert calls == {"staging_digest_and_columns": 1, "compute_extras_digest": 1}
    # decoding still verifies the supplied digest and extras (once each)
    for name in calls:
        calls[name] = 0
    from_json(to_json(record), StagedCallRecord)
    assert calls == {"staging_digest_and_columns": 1, "compute_extras_digest": 1}


def test_from_components_refuses_bad_components_as_invalid_records() -> None:
    refused(lambda: make_record(parent_call_id="p", prefix=()))  # child with prev_len 0
    refused(lambda: make_record(logprobs=[math.nan, -0.5]))
    refused(lambda: make_record(extras={"v": (1, 2)}), "tuple")
    refused(lambda: make_record(extras={1: "x"}))  # type: ignore[dict-item]
    refused(lambda: make_record(prompt=(), generated=()))
    refused(lambda: make_record(weight_version=-1))
    refused(lambda: make_record(rollout_id=""))
    with pytest.raises(InvalidRecordError):
        StagedCallRecord.from_components(
            rollout_id="r",
            model_call_id="c",
            parent_call_id=None,
            mode="text",
            prev_len=0,
            weight_version=1,
            token_ids_delta=[1],
            token_mask_delta=[1.0],
            generation_log_probs_delta=[-0.5],
            chain_hash=compute_chain_hash(None, [1]),
            cumulative_hash=None,  # type: ignore[arg-type]
        )


def test_schema_3_records_are_accepted_and_hash_with_schema_byte_3() -> None:
    v2 = make_record(schema_version=2)
    v3 = make_record(schema_version=3)
    assert v3.schema_version == 3
    assert v3.digest != v2.digest
    fields = v3.digest_fields()
    assert fields["schema_version"] == 3
    assert compute_staging_digest(**fields) == v3.digest
    assert compute_staging_digest(**{**fields, "schema_version": 2}) == v2.digest
    round_trips(v3)
    assert wire(v3)["schema_version"] == 3
    for record in (
        CaptureAdmission(schema_version=3, rollout_id="r", model_call_id="c", mode="text"),
        cut(schema_version=3),
        StageResult(schema_version=3, ok=True, staging_key="k"),
        coords(schema_version=3),
        call_row("a", schema_version=3),
        receipt(schema_version=3),
        RolloutManifest(schema_version=3, rollout_id="r"),
    ):
        assert record.schema_version == 3
        round_trips(record)


def _every_wire_record() -> list[msgspec.Struct]:
    return [
        admission(),
        cut(),
        child_record(),
        StageResult(ok=True, staging_key="k"),
        coords(),
        call_row("a"),
        CaptureLedgerCommit(rollout_id="rollout-1", record=call_row("a"), staging_chain=("rollout-1/a",)),
        ManifestFailure(model_call_id="a", reason="worker_capture_failed"),
        RolloutManifest(rollout_id="rollout-1", records=[call_row("a")]),
        RolloutRemoval(removed=["rollout-1"], absent=["rollout-2"]),
        receipt(),
    ]


@pytest.mark.parametrize("record", _every_wire_record(), ids=lambda r: type(r).__name__)
def test_wire_records_reject_old_and_new_versions(record: msgspec.Struct) -> None:
    record_type = type(record)
    payload = wire(record)
    round_trips(record)
    for schema in (1, 4, True, "2"):
        refused_json(record_type, {**payload, "schema_version": schema})
        refused_msgpack(record_type, {**payload, "schema_version": schema})
    if "digest_version" in payload:
        for field, values in (("digest_version", (1, 3, True)), ("extras_digest_version", (0, 2, True))):
            for value in values:
                refused_json(record_type, {**payload, field: value})
                refused_msgpack(record_type, {**payload, field: value})


@pytest.mark.parametrize("record", _every_wire_record(), ids=lambda r: type(r).__name__)
def test_directly_constructed_records_reject_old_and_new_versions(record: msgspec.Struct) -> None:
    record_type = type(record)
    native = {name: getattr(record, name) for name in record.__struct_fields__}
    for schema in (1, 4, True):
        refused(lambda schema=schema: record_type(**{**native, "schema_version": schema}), "schema")
    if "digest_version" in native:
        for field, values in (("digest_version", (1, 3, True)), ("extras_digest_version", (0, 2, True))):
            for value in values:
                refused(lambda field=field, value=value: record_type(**{**native, field: value}), field)


@pytest.mark.parametrize("record", _every_wire_record(), ids=lambda r: type(r).__name__)
def test_wire_records_refuse_unknown_fields(record: msgspec.Struct) -> None:
    payload = {**wire(record), "unexpected_field": 1}
    refused_json(type(record), payload, "unexpected_field")
    refused_msgpack(type(record), payload, "unexpected_field")


def test_wire_records_refuse_bools_for_ints_and_ints_for_floats() -> None:
    record = child_record()
    for field in ("prev_len", "delta_len", "cum_len", "weight_version"):
        refused_json(StagedCallRecord, {**wire(record), field: True})
        refused_json(StagedCallRecord, {**wire(record), field: float(getattr(record, field))})
    refused_json(StagedCallRecord, {**wire(record), "token_ids_delta": [10, 11, 12, 20, True]})
    refused_json(StagedCallRecord, {**wire(record), "generation_log_probs_delta": [0, 0, 0, -1, -1]}, "float")
    refused_json(StagedCallRecord, {**wire(record), "generation_log_probs_delta": [0.0, 0.0, 0, -0.5, -0.625]})
    refused_json(StagedCallRecord, {**wire(record), "token_mask_delta": [0, 0, 0, 1, 1]}, "float")
    refused_msgpack(StagedCallRecord, {**wire(record), "token_mask_delta": [0.0, 0.0, 0.0, 1.0, True]})
    short_root = make_record(prompt=(5,), generated=(6,), logprobs=[-1.0])
    refused_json(StagedCallRecord, {**wire(short_root), "generation_log_probs_delta": [0, -1]}, "float")
    refused(lambda: make_record(logprobs=[0, -1]), "float")

    refused_json(CallRecord, {**wire(call_row("a")), "admitted_at": 1}, "admitted_at")
    refused(lambda: call_row("a", admitted_at=1), "admitted_at")
    refused(lambda: call_row("a", admitted_at=True), "admitted_at")
    assert call_row("a", admitted_at=1.5).admitted_at == 1.5
    round_trips(call_row("a", admitted_at=1700000000.25))
    refused_json(RolloutReceipt, {**wire(receipt()), "reward": 1}, "reward")
    refused(lambda: receipt(reward=1), "reward")
    refused(lambda: receipt(reward=False), "reward")
    round_trips(receipt(reward=None))
    refused_json(CommitCoords, {**wire(coords()), "weight_version": True})
    refused(lambda: coords(weight_version=True))
    refused_json(CallRecord, {**wire(call_row("a")), "fingerprint_version": True})
    refused(lambda: call_row("a", fingerprint_version=True))
    refused_json(StageResult, {"ok": 1, "staging_key": "k"})
    refused(lambda: StageResult(ok=1, staging_key="k"))
    refused(lambda: RolloutReceipt(**{**_receipt_fields(), "capture_poisoned": 1}))


def _receipt_fields() -> dict[str, Any]:
    record = receipt()
    return {name: getattr(record, name) for name in record.__struct_fields__}


def test_wire_records_refuse_nan_and_infinity() -> None:
    record = child_record()
    for bad in (math.nan, math.inf, -math.inf):
        refused_msgpack(StagedCallRecord, {**wire(record), "generation_log_probs_delta": [0.0, 0.0, 0.0, bad, -0.5]})
        refused_msgpack(StagedCallRecord, {**wire(record), "token_mask_delta": [0.0, 0.0, 0.0, bad, 1.0]})
        refused_msgpack(StagedCallRecord, {**wire(record), "extras": {"routed_experts": [[1, 2], [3, bad]]}})
        refused_msgpack(RolloutReceipt, {**wire(receipt()), "reward": bad}, "reward")
        refused_msgpack(CallRecord, {**wire(call_row("a")), "admitted_at": bad}, "admitted_at")
        refused(lambda bad=bad: receipt(reward=bad), "reward")
        refused(lambda bad=bad: call_row("a", admitted_at=bad), "admitted_at")
    text = to_json(receipt()).replace(b'"reward":1.0', b'"reward":NaN')
    assert b"NaN" in text
    refused(lambda: from_json(text, RolloutReceipt))
    refused(lambda: from_json(b"{not json", RolloutReceipt), "malformed")


# --- StageResult (3.5) -------------------------------------------------------------------------------


def test_stage_result_and_receipt_validate_identity() -> None:
    round_trips(StageResult(ok=True, staging_key="rollout-1/call-1"))
    round_trips(StageResult(ok=False, error="sink unavailable"))
    refused(lambda: StageResult(ok=False), "requires an error")
    refused(lambda: StageResult(ok=False, error=""), "requires an error")
    refused_json(StageResult, {"ok": False}, "requires an error")
    refused(lambda: StageResult(ok=True), "staging_key")
    refused_json(StageResult, {"ok": True, "error": None}, "staging_key")
    refused(lambda: StageResult(ok=True, staging_key=""), "staging_key")
    refused(lambda: StageResult(ok=False, error=5))
    refused(lambda: receipt(rollout_id=""), "rollout_id")
    refused(lambda: receipt(terminal_model_call_id=""), "terminal_model_call_id")
    refused(lambda: call_row(""), "model_call_id")
    refused(lambda: ManifestFailure(model_call_id="", reason="x"), "model_call_id")
    refused(lambda: ManifestFailure(model_call_id="a", reason=""), "reason")
    refused(lambda: RolloutManifest(rollout_id=""), "rollout_id")
    refused(lambda: RolloutRemoval(removed=["a", ""]))
    refused_json(RolloutRemoval, {"removed": ["a"], "absent": [""]})


# --- CommitCoords (3.6) -------------------------------------------------------------------------------


def test_coords_enforce_staged_and_failed_shapes() -> None:
    round_trips(coords())
    round_trips(coords(parent_call_id=None, prev_len=0, cum_len=2))
    round_trips(failed_coords())
    round_trips(failed_coords(parent_call_id=None, prev_len=0, cum_len=0))
    assert coords().disposition == "staged"

    for field in ("digest", "extras_digest", "staging_key", "chain_hash", "cumulative_hash"):
        refused(lambda field=field: coords(**{field: None}), field)
        refused_json(CommitCoords, {**wire(coords()), field: None}, field)
        value = "rollout-1/call-2" if field == "staging_key" else H1
        refused(lambda field=field, value=value: failed_coords(**{field: value}), "cannot carry staged payload")
        refused_json(CommitCoords, {**wire(failed_coords()), field: value}, "cannot carry staged payload")
    refused(lambda: coords(delta_len=0, cum_len=3), "delta_len")
    refused(lambda: failed_coords(delta_len=2, cum_len=5), "delta_len")
    refused(lambda: coords(cum_len=6), "cum_len")
    refused(lambda: failed_coords(cum_len=4), "cum_len")
    refused(lambda: coords(parent_call_id=None), "prev_len")
    refused(lambda: coords(prev_len=0, cum_len=2), "prev_len")
    refused(lambda: coords(disposition="bogus"), "disposition")
    refused_json(CommitCoords, {**wire(coords()), "disposition": "bogus"})
    refused(lambda: coords(digest="A" * 64), "digest")
    refused(lambda: coords(staging_key=""), "staging_key")
    refused_json(CommitCoords, {**wire(coords()), "token_ids_delta": [1, 2]}, "token_ids_delta")  # token-free


# --- CallRecord (3.7) --------------------------------------------------------------------------------


def test_call_record_rules() -> None:
    root = call_row("a")
    child = call_row("b", "a", prev_len=2)
    round_trips(root)
    round_trips(child)
    fields = {name: getattr(child, name) for name in child.__struct_fields__ if name != "mode"}
    assert CallRecord(**fields).mode == "token_in"  # the default mode
    # a legacy row without admitted_at (and without capture_key) still validates
    legacy_row = call_row("b", "a", prev_len=2, capture_key=None)
    legacy = {key: value for key, value in wire(legacy_row).items() if key not in ("admitted_at", "capture_key")}
    assert from_json(json.dumps(legacy), CallRecord) == legacy_row

    refused(lambda: call_row("a", mode="token_in"), "text")
    refused(lambda: call_row("b", "a", prev_len=2, mode="text"), "token_in")
    refused(lambda: call_row("b", "a", prev_len=0), "prev_len")
    refused(lambda: call_row("a", prev_len=2, cum_len=4), "prev_len")
    refused(lambda: call_row("a", delta_len=0), "delta_len")
    refused(lambda: call_row("a", cum_len=3), "cum_len")
    refused(lambda: call_row("a", response_id=""), "response_id")
    refused_json(CallRecord, {k: v for k, v in wire(root).items() if k != "response_id"}, "response_id")
    refused_json(CallRecord, {k: v for k, v in wire(root).items() if k != "chain_hash"}, "chain_hash")
    refused(lambda: call_row("a", staging_key=""), "staging_key")
    refused(lambda: call_row("a", capture_key=""), "capture_key")
    refused(lambda: call_row("a", output_fingerprint="xyz"), "output_fingerprint")
    refused(lambda: call_row("a", continuation_fingerprint="A" * 64), "continuation_fingerprint")
    refused(lambda: call_row("a", fingerprint_version=-1), "fingerprint_version")
    refused(lambda: call_row("a", weight_version=-1), "weight_version")
    refused(lambda: call_row("a", extras_digest="a" * 63), "extras_digest")
    round_trips(call_row("a", output_fingerprint=H1, continuation_fingerprint=H2, fingerprint_version=1))


# --- CaptureLedgerCommit (3.8) ------------------------------------------------------------------------


def test_capture_ledger_commit_parent_manifest_rules() -> None:
    a = call_row("a")
    b = call_row("b", "a", prev_len=2)
    c = call_row("c", "b", prev_len=4)

    def commit(record: CallRecord, manifest: tuple[CallRecord, ...]) -> CaptureLedgerCommit:
        return CaptureLedgerCommit(
            rollout_id="rollout-1",
            record=record,
            staging_chain=tuple(row.staging_key for row in (*manifest, record)),
            parent_manifest=manifest,
        )

    round_trips(commit(c, (a, b)))
    round_trips(commit(a, ()))
    round_trips(commit(b, (a,)))
    with_items = CaptureLedgerCommit(
        rollout_id="rollout-1",
        record=a,
        staging_chain=("rollout-1/a",),
        request_items=[{"role": "user", "content": "hi"}],
        response_items=[{"role": "assistant", "content": "hello"}],
    )
    round_trips(with_items)

    refused(lambda: commit(c, (a, call_row("b", "a", prev_len=2, capture_key=None))), "capture_key")
    refused(lambda: commit(c, (a, a)), "duplicate")
    refused(lambda: commit(call_row("b", "a", prev_len=2), (a, call_row("b", "a", prev_len=2))))
    refused(lambda: commit(c, (b,)), "root")
    refused(lambda: commit(c, (a, call_row("b", "x", prev_len=2))), "contiguous")
    refused(lambda: commit(c, (a, call_row("b", "a", prev_len=1, delta_len=3))), "contiguous")
    refused(lambda: commit(call_row("c", "a", prev_len=4), (a, b)), "parent")
    refused(lambda: commit(call_row("c", "b", prev_len=5), (a, b)), "prev_len")
    refused(
        lambda: CaptureLedgerCommit(rollout_id="", record=a, staging_chain=("rollout-1/a",)),
        "rollout_id",
    )
    refused(lambda: CaptureLedgerCommit(rollout_id="rollout-1", record=a, staging_chain=("",)), "staging_chain")
    bad = wire(commit(c, (a, b)))
    bad["parent_manifest"] = list(reversed(bad["parent_manifest"]))
    refused_json(CaptureLedgerCommit, bad)


# --- RolloutReceipt (3.9) ------------------------------------------------------------------------------


def test_rollout_receipt_rejects_inconsistent_attribution_state() -> None:
    round_trips(receipt())
    for selection in ("declared", "response_id", "content", "heuristic"):
        round_trips(receipt(terminal_selection=selection))
    poisoned = receipt(
        capture_poisoned=True, failure_reason="unresolved_parent", terminal_model_call_id=None, terminal_selection=None
    )
    round_trips(poisoned)
    # a poisoned receipt may still name a terminal and a method
    round_trips(receipt(capture_poisoned=True, failure_reason="worker_capture_failed"))

    # rule 1: unique manifest ids; a named terminal is in the manifest
    refused(lambda: receipt(manifest=[call_row("call-1"), call_row("call-1")], terminal_model_call_id="call-1"))
    refused(lambda: receipt(terminal_model_call_id="call-9"), "absent")
    refused(
        lambda: receipt(capture_poisoned=True, failure_reason="x", terminal_model_call_id="call-9"),
        "absent",
    )
    # rule 2: an unpoisoned receipt has no failure_reason and names both the terminal and the method
    refused(lambda: receipt(failure_reason="worker_capture_failed"), "failure_reason")
    refused(lambda: receipt(terminal_model_call_id=None))
    refused(lambda: receipt(terminal_selection=None))
    refused(lambda: receipt(terminal_model_call_id=None, terminal_selection=None, failure_reason=None))
    # rule 3: a null selection needs a null terminal and a failure_reason
    refused(lambda: receipt(capture_poisoned=True, terminal_selection=None, failure_reason="x"))
    refused(lambda: receipt(capture_poisoned=True, terminal_selection=None, terminal_model_call_id=None))
    refused(lambda: receipt(terminal_selection="bogus"), "terminal_selection")
    refused_json(RolloutReceipt, {**wire(receipt()), "terminal_selection": "bogus"})
    refused_json(RolloutReceipt, {**wire(poisoned), "terminal_selection": None, "terminal_model_call_id": "call-2"})


# --- error tree, native construction, dependencies ---------------------------------------------------------


def test_every_record_refusal_is_an_invalid_record_error() -> None:
    assert issubclass(InvalidRecordError, StoreError)
    assert issubclass(InvalidRecordError, ValueError)
    assert issubclass(DigestMismatchError, InvalidRecordError)
    for record in _every_wire_record():
        payload = wire(record)
        for broken in (b"", b"[]", b'{"schema_version": 2', json.dumps({**payload, "schema_version": None}).encode()):
            refused(lambda broken=broken, record=record: from_json(broken, type(record)))
        refused(lambda record=record: from_msgpack(b"\xc1", type(record)))


def test_native_construction_refuses_what_decoding_refuses() -> None:
    """The records' docstring: every record refuses unknown fields and wrong types with InvalidRecordError.

    Decoding does; this checks that direct construction (what a Gym-style caller does) does too.
    """
    manifest_row = call_row("a")
    cases: dict[str, Callable[[], Any]] = {
        "RolloutReceipt(failure_reason=5)": lambda: RolloutReceipt(
            rollout_id="r", capture_poisoned=True, failure_reason=5
        ),
        "RolloutReceipt(manifest=[dict])": lambda: RolloutReceipt(
            rollout_id="r", capture_poisoned=True, failure_reason="x", manifest=[{"model_call_id": "a"}]
        ),
        "RolloutManifest(records=[1, 2])": lambda: RolloutManifest(rollout_id="r", records=[1, 2]),
        "RolloutRemoval(removed=None)": lambda: RolloutRemoval(removed=None),
        "CaptureLedgerCommit(record=dict)": lambda: CaptureLedgerCommit(
            rollout_id="r", record={"model_call_id": "b"}, staging_chain=("k",), parent_manifest=(manifest_row,)
        ),
    }
    # An unknown keyword is refused by Python itself at the call site (msgspec's __init__).
    with pytest.raises(TypeError, match="bogus"):
        StageResult(ok=True, staging_key="k", bogus=1)  # type: ignore[call-arg]
    # Each of these is refused on the wire ...
    refused_json(StageResult, {"ok": True, "staging_key": "k", "bogus": 1})
    refused_json(RolloutReceipt, {"rollout_id": "r", "capture_poisoned": True, "failure_reason": 5})
    refused_json(RolloutManifest, {"rollout_id": "r", "records": [1, 2]})
    refused_json(RolloutRemoval, {"removed": None})
    # ... and must be refused the same way when constructed directly.
    wrong = []
    for label, build in cases.items():
        try:
            build()
        except InvalidRecordError:
            continue
        except Exception as exc:
            wrong.append(f"{label}: raised {type(exc).__name__}: {exc}")
        else:
            wrong.append(f"{label}: accepted")
    assert not wrong, "\n".join(wrong)


def test_staging_namespace_has_no_serving_or_framework_dependencies() -> None:
    forbidden = ["fastapi", "ray", "torch", "transfer_queue", "aiohttp"]
    code = (
        "import json, sys\n"
        "import store, store.wire.records, store.wire.digest, store.wire.columns\n"
        f"print(json.dumps(sorted(m for m in {forbidden!r} if m in sys.modules)))\n"
        "print(json.dumps('store' in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded, imported = result.stdout.strip().splitlines()
    assert json.loads(imported) is True
    assert json.loads(loaded) == []


def test_hash_helpers_used_by_the_factories_agree() -> None:
    record = child_record()
    assert record.chain_hash == compute_chain_hash(H1, [10, 11, 12, 20, 21])
    assert record.cumulative_hash == hash_token_ids([1, 2, 10, 11, 12, 20, 21])


def test_a_list_of_keys_is_checked_in_one_pass_and_a_bad_entry_is_still_named() -> None:
    """``plain_texts`` (the one-pass check of a key list, as a cut's ack and ``stage_all``'s
    ``acknowledged`` make at every cut) passes only what the per-entry checks pass: a lone
    surrogate anywhere (also one half of a pair split across two keys), an empty key, a
    non-str; the per-entry check then names the bad one."""
    from store import arguments
    from store.wire import field_checks as check

    class Key(str):
        pass

    good = ["a/0", "a/1", "é/2"]
    assert check.plain_texts(good) and check.plain_texts([])
    for bad in (["a", "\ud800"], ["a\ud800", "\udc00b"], ["a", ""], ["a", 7], [Key("a")]):
        assert not check.plain_texts(bad), bad
    assert arguments.texts("keys", good) == good
    assert arguments.texts("keys", [Key("x")]) == ["x"]  # a str subclass passes the per-entry check
    with pytest.raises(InvalidRecordError, match="keys entry is not valid Unicode text"):
        arguments.texts("keys", ["a", "b\ud800"])
    with pytest.raises(InvalidRecordError, match="keys entry must be a non-empty string, got ''"):
        arguments.texts("keys", ["a", ""])
    check.unique("Ack", "staging_keys", good)
    with pytest.raises(InvalidRecordError, match="staging_keys entry is not valid Unicode text"):
        check.unique("Ack", "staging_keys", ["a\ud800", "\udc00b"])
    with pytest.raises(InvalidRecordError, match="staging_keys must be unique"):
        check.unique("Ack", "staging_keys", ["a", "a"])
