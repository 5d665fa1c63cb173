"""Hostile input (fault test 4): every wire decoder fuzzed, every public entry point given wrong types.

What must hold: only errors from the store's tree come out (``StoreError``), nothing hangs,
a record that decodes re-encodes and decodes to itself (a staged record's digest verified
again), and a refused call writes nothing.  ``INPUTS`` counts what was tried (``-s`` prints it).
"""

from __future__ import annotations

import collections
import faulthandler
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from capture_helpers import Versions
from factories import make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples
from rollouts import manifest_row
from test_records import admission, call_row, child_record, coords, cut, failed_coords, receipt

import store as lib
from store import (
    CaptureAdmission,
    CaptureLedgerCommit,
    EventKind,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    InvalidRecordError,
    ManifestFailure,
    RolloutManifest,
    RolloutRemoval,
    RolloutTokenCapture,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageEntry,
    StageResult,
    Store,
    StoreError,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)
from store.log.events import AdmissionBody, Completion, FailureBody
from store.wire import cut_records, records

INPUTS: collections.Counter[str] = collections.Counter()
FUZZ = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
HANG_SECONDS = 300  # far beyond this file's few seconds: only a hang ever reaches it


@pytest.fixture(autouse=True, scope="module")
def no_hang_and_totals() -> Iterator[None]:
    """A hang dumps every thread's stack and ends the run instead of blocking it forever."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    print(f"\nhostile inputs tried: {sum(INPUTS.values())} ({dict(sorted(INPUTS.items()))})")


# --- one valid example of every wire record ----------------------------------------------------


def _cut_records() -> list[msgspec.Struct]:
    prefix = GenerationCutPrefix(ticket_id="t-1", rollout_id="r0", attempt_index=1, model_call_id="c1", admitted_at=1.5)
    inventory = GenerationCutInventory.build(checkpoint_id="ckpt-1", server_name="w0", active_prefixes=[prefix])
    ack = GenerationCutPrefixAck(
        ticket_id="t-1",
        rollout_id="r0",
        attempt_index=1,
        model_call_id="c1",
        admitted_at=1.5,
        disposition="durable_prefix",
        cut_kind="active_prefix",
        frozen_buffer_id="active/ckpt-1/0",
        staging_keys=(lib.chunk_staging_key("ckpt-1", "r0-a1", "c1", 0),),
        prefix_token_count=3,
        prefix_digest="4" * 64,
        effective_output_limit=16,
        terminal_finish_reason="stop",
        terminal_stop_reason=7,
    )
    receipt_record = GenerationCutReceipt(
        checkpoint_id="ckpt-1",
        cut_id=f"worker-{inventory.inventory_digest}",
        inventory_digest=inventory.inventory_digest,
        inventory=inventory,
        backend_snapshot_id=f"tq-{inventory.inventory_digest}",
        prefixes=(ack,),
    )
    return [prefix, inventory, ack, receipt_record]


def _examples() -> list[msgspec.Struct]:
    staged = child_record()
    snapshot_fields = {name: getattr(staged, name) for name in StagedCallBaseSnapshot.__struct_fields__}
    return [
        admission(generation_cut=cut(terminal_finish_reason="length", terminal_stop_reason="</s>")),
        cut(),
        StagedCallBaseSnapshot(**snapshot_fields),
        staged,
        StagedCallSnapshot(**{**snapshot_fields, "extras": staged.extras}),
        StageResult(ok=False, error="refused"),
        coords(),
        failed_coords(),
        call_row("a", admitted_at=1.25),
        CaptureLedgerCommit(
            rollout_id="rollout-1",
            record=call_row("b", "a", prev_len=2),
            staging_chain=("rollout-1/a",),
            request_items=[{"role": "user", "content": [{"text": "hi"}]}],
            parent_manifest=(call_row("a"),),
        ),
        ManifestFailure(model_call_id="a", reason="worker_capture_failed"),
        RolloutManifest(rollout_id="rollout-1", records=[call_row("a")], failures=[]),
        RolloutRemoval(removed=["rollout-1"], absent=["rollout-2"]),
        receipt(),
        *_cut_records(),
    ]


EXAMPLES = _examples()
EXAMPLE_IDS = [f"{type(record).__name__}-{index}" for index, record in enumerate(EXAMPLES)]
WIRE_TYPES = {type(record) for record in EXAMPLES}


def test_every_wire_record_type_is_fuzzed() -> None:
    declared = {
        value
        for module in (records, cut_records)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == module.__name__
    }
    bases = {records._Wire, records._DigestWire, cut_records._CutWire}
    assert declared - bases == WIRE_TYPES


# --- codecs -----------------------------------------------------------------------------------

Codec = tuple[Callable[[Any], bytes], Callable[[Any, Any], Any], Callable[[Any], bytes]]
CODECS: dict[str, Codec] = {
    # (store encoder, store decoder, raw encoder of plain values)
    "json": (to_json, from_json, msgspec.json.encode),
    "msgpack": (to_msgpack, from_msgpack, msgspec.msgpack.encode),
}


def at_depth(frames: int, work: Callable[[], Any]) -> Any:
    """Run ``work`` with ``frames`` more Python frames on the stack."""
    return work() if frames <= 0 else at_depth(frames - 1, work)


def stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


SPARE_FRAMES = 150  # the stack a decoded record may need to be encoded and decoded again


def decodes_or_refuses(codec: str, data: Any, record_type: type[Any], what: str) -> Any:
    """Decode hostile input: a ``StoreError``, or a record that re-encodes to the same record,
    also from a deep stack (what was accepted can be served by any caller)."""
    encode, decode, _ = CODECS[codec]
    INPUTS[what] += 1
    try:
        record = decode(data, record_type)
    except StoreError:
        return None
    assert isinstance(record, record_type)
    frames = sys.getrecursionlimit() - stack_depth() - SPARE_FRAMES
    again = at_depth(frames, lambda: decode(encode(record), record_type))  # validated (digests verified) again
    assert again == record
    assert encode(again) == encode(record)
    return record


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("example", EXAMPLES, ids=EXAMPLE_IDS)
def test_valid_examples_round_trip(example: msgspec.Struct, codec: str) -> None:
    encode = CODECS[codec][0]
    assert decodes_or_refuses(codec, encode(example), type(example), "valid") == example


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("example", EXAMPLES, ids=EXAMPLE_IDS)
@FUZZ
@given(data=st.data())
def test_damaged_encodings(example: msgspec.Struct, codec: str, data: st.DataObject) -> None:
    """Byte flips and truncations of a valid encoding."""
    encoded = bytearray(CODECS[codec][0](example))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(encoded) - 1), st.integers(1, 255)), max_size=4))
    for position, mask in flips:
        encoded[position] ^= mask
    cut_at = data.draw(st.one_of(st.none(), st.integers(0, len(encoded))))
    damaged = bytes(encoded if cut_at is None else encoded[:cut_at])
    decodes_or_refuses(codec, damaged, type(example), "flipped or truncated")


# Hostile values put in place of one field, as raw JSON text and as raw msgpack bytes
# (raw, so that NaN, invalid UTF-8 and lone surrogates reach the decoder exactly as sent).
def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = {"k": value}
    return value


def _hostile_values() -> dict[str, tuple[bytes | None, bytes | None]]:
    mp = msgspec.msgpack.encode
    values: dict[str, tuple[bytes | None, bytes | None]] = {
        "u64 max": (b"18446744073709551615", mp(2**64 - 1)),
        "u64 max + 1": (b"18446744073709551616", None),
        "a 40-digit int": (b"1" + b"0" * 40, None),
        "i64 min": (b"-9223372036854775808", mp(-(2**63))),
        "minus one": (b"-1", mp(-1)),
        "zero": (b"0", mp(0)),
        "NaN": (b"NaN", mp(math.nan)),
        "infinity": (b"1e999", mp(math.inf)),
        "minus infinity": (b"-1e999", mp(-math.inf)),
        "a float": (b"1.5", mp(1.5)),
        "minus zero": (b"-0.0", mp(-0.0)),
        "lists 5000 deep": (b"[" * 5000 + b"]" * 5000, b"\x91" * 5000 + b"\xc0"),
        "dicts 40 deep": (msgspec.json.encode(_nested(40)), mp(_nested(40))),
        "a dict holding lists 950 deep": (
            b'{"a":' + b"[" * 949 + b"]" * 949 + b"}",
            b"\x81\xa1a" + b"\x91" * 949 + b"\xc0",
        ),
        "a dict holding lists 5000 deep": (
            b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}",
            b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0",
        ),
        "[a dict holding lists 950 deep]": (
            b'[{"a":' + b"[" * 949 + b"]" * 949 + b"}]",
            b"\x91\x81\xa1a" + b"\x91" * 949 + b"\xc0",
        ),
        "invalid UTF-8": (b'"\xff\xfe"', b"\xa2\xff\xfe"),
        "a lone surrogate": (b'"\\ud800"', b"\xa3\xed\xa0\x80"),
        "a reversed surrogate pair": (b'"\\udc00\\ud800"', b"\xa6\xed\xb0\x80\xed\xa0\x80"),
        "true": (b"true", mp(True)),
        "null": (b"null", mp(None)),
        "empty string": (b'""', mp("")),
        "a string": (b'"x"', mp("x")),
        "a digest-shaped string": (b'"' + b"a" * 64 + b'"', mp("a" * 64)),
        "empty list": (b"[]", mp([])),
        "a list of ints": (b"[1,2]", mp([1, 2])),
        "a list of lists": (b"[[0,1,2]]", mp([[0, 1, 2]])),
        "empty dict": (b"{}", mp({})),
        "a dict": (b'{"k":1}', mp({"k": 1})),
        "bytes": (None, mp(b"\x00\x01")),
    }
    return values


HOSTILE = _hostile_values()
PLACEHOLDER = "\x00hostile\x00"


def with_hostile_field(example: msgspec.Struct, codec: str, field: str, value: bytes) -> bytes:
    """The example encoded with one field (possibly a new, unknown one) replaced by raw ``value`` bytes."""
    payload = msgspec.to_builtins(example, enc_hook=lambda v: v.tolist())
    payload[field] = PLACEHOLDER
    raw_encode = CODECS[codec][2]
    encoded = raw_encode(payload)
    marker = raw_encode(PLACEHOLDER)
    assert encoded.count(marker) == 1
    return encoded.replace(marker, value)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("example", EXAMPLES, ids=EXAMPLE_IDS)
def test_hostile_field_values(example: msgspec.Struct, codec: str) -> None:
    """Every field (and an unknown one) in turn given every hostile value: huge and negative ints,
    NaN and infinity, deep nesting, invalid UTF-8, surrogates, wrong types."""
    for field in [*example.__struct_fields__, "unknown_field"]:
        for name, raw in HOSTILE.items():
            value = raw[0] if codec == "json" else raw[1]
            if value is None:
                continue  # not expressible in this codec
            decoded = decodes_or_refuses(codec, with_hostile_field(example, codec, field, value), type(example), name)
            if field == "unknown_field":
                assert decoded is None, "an unknown field must be refused"


@pytest.mark.parametrize("example", EXAMPLES, ids=EXAMPLE_IDS)
def test_wrong_input_types_and_surrogates_in_text_input(example: msgspec.Struct) -> None:
    record_type = type(example)
    text = to_json(example).decode()
    for hostile in (text.replace('"', '"\ud800', 1), "\udcff" + text, text[:-1] + "\ud83d}"):
        INPUTS["lone surrogates in str input"] += 1
        with pytest.raises(InvalidRecordError, match="Unicode"):
            from_json(hostile, record_type)
    for wrong in (None, 1, 1.5, [text], {"a": 1}, object()):
        INPUTS["wrong input types"] += 2
        with pytest.raises(InvalidRecordError):
            from_json(wrong, record_type)  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            from_msgpack(wrong, record_type)  # type: ignore[arg-type]
    with pytest.raises(InvalidRecordError):
        from_msgpack(text, record_type)  # type: ignore[arg-type]  # msgpack is bytes, never text
    for wrong_type in (int, "StageResult", None, dict, [StageResult]):
        with pytest.raises(InvalidRecordError, match="record_type"):
            from_json(to_json(example), wrong_type)  # type: ignore[arg-type]


# --- defect 6: extras nesting --------------------------------------------------------------------


def deep_extras(depth: int) -> dict[str, Any]:
    """Extras nesting exactly ``depth`` levels (the mapping itself is level 1)."""
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return {"deep": value}


def self_containing() -> dict[str, Any]:
    inner: list[Any] = [1]
    inner.append(inner)
    return {"loop": inner}


def test_extras_nesting_limit_at_construction() -> None:
    limit = lib.EXTRAS_MAX_DEPTH
    assert make_record(extras=deep_extras(limit)).extras == deep_extras(limit)
    for extras in (deep_extras(limit + 1), deep_extras(5000), self_containing()):
        with pytest.raises(InvalidRecordError, match=r"EXTRAS_MAX_DEPTH|contain themselves"):
            make_record(extras=extras)
        with pytest.raises(lib.DigestValueError):
            lib.compute_extras_digest(extras)
    record = make_record(extras=deep_extras(limit))
    native = {name: getattr(record, name) for name in StagedCallRecord.__struct_fields__}
    with pytest.raises(InvalidRecordError, match="EXTRAS_MAX_DEPTH"):
        StagedCallRecord(**{**native, "extras": deep_extras(limit + 1)})


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_extras_nesting_limit_when_decoding(codec: str) -> None:
    encode, decode, raw_encode = CODECS[codec]
    record = make_record(extras=deep_extras(lib.EXTRAS_MAX_DEPTH))
    assert decode(encode(record), StagedCallRecord) == record
    payload = msgspec.to_builtins(record, enc_hook=lambda v: v.tolist())
    for depth in (lib.EXTRAS_MAX_DEPTH + 1, 950):
        with pytest.raises(InvalidRecordError, match="EXTRAS_MAX_DEPTH"):
            decode(raw_encode({**payload, "extras": deep_extras(depth)}), StagedCallRecord)
    # Deeper than msgspec itself can go: its RecursionError is refused as an InvalidRecordError.
    if codec == "json":
        deep_lists, deep_dicts = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"a":' * 5000 + b"1" + b"}" * 5000
    else:
        deep_lists, deep_dicts = b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0", b"\x81\xa1a" * 5000 + b"\x01"
    for deepest in (deep_lists, deep_dicts):
        with pytest.raises(InvalidRecordError, match="too deeply"):
            decode(with_hostile_field(record, codec, "extras", deepest), StagedCallRecord)


def test_stage_refuses_extras_made_too_deep_after_construction(store: Store) -> None:
    record = make_record(extras={"deep": [1]})
    assert record.extras is not None
    record.extras["deep"] = deep_extras(lib.EXTRAS_MAX_DEPTH + 1)["deep"]  # the payload dict is still mutable
    with pytest.raises(InvalidRecordError, match="EXTRAS_MAX_DEPTH"):
        store.stage(record)
    record.extras["deep"] = self_containing()["loop"]
    with pytest.raises(InvalidRecordError, match="contain themselves"):
        store.stage(record)
    with pytest.raises(InvalidRecordError):
        store.stage_all([StageEntry(record)])
    for unwritable in ("\ud800", 2**64, {1, 2}, b"bytes", 2, math.nan):
        record.extras["deep"] = [unwritable]  # [2] is writable, but no longer the record's extras
        with pytest.raises(InvalidRecordError, match="changed since it was built"):
            store.stage(record)
    assert store.replay().events == 0


def test_a_record_at_the_nesting_limit_is_served_from_a_deep_stack(store: Store) -> None:
    """Acknowledged means servable: fetch and replay need a small, bounded stack, whatever the extras."""
    record = make_record(extras=deep_extras(lib.EXTRAS_MAX_DEPTH))
    assert store.stage(record).ok
    assert store.fetch([record.staging_key])[0].extras == record.extras  # warm the connection pool
    # Frames left for fetch/replay: decoding extras takes about one per level, and the rest
    # about a quarter of the 150 beside it.
    spare = lib.EXTRAS_MAX_DEPTH + 150
    frames = sys.getrecursionlimit() - stack_depth() - spare
    [snapshot] = at_depth(frames, lambda: store.fetch([record.staging_key]))
    assert snapshot.digest == record.digest and snapshot.extras == record.extras
    assert at_depth(frames, lambda: store.replay()).ok


def test_complete_call_gives_failed_coords_for_extras_too_deep_or_containing_themselves(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=Versions(7))
    for index, extras in enumerate((deep_extras(5000), deep_extras(lib.EXTRAS_MAX_DEPTH + 1), self_containing())):
        call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id=f"c{index}", mode="text"))
        coords_ = capture.complete_call(
            call, prompt_token_ids=[1, 2], generated_token_ids=[3], generated_logprobs=[-0.5], extras=extras
        )
        assert coords_.disposition == "capture_failed"
        assert coords_.staging_key is None
        info = store.call("r0", f"c{index}")
        assert info is not None and info.state == "failed"
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="ok", mode="text"))
    coords_ = capture.complete_call(
        call,
        prompt_token_ids=[1, 2],
        generated_token_ids=[3],
        generated_logprobs=[-0.5],
        extras=deep_extras(lib.EXTRAS_MAX_DEPTH),
    )
    assert coords_.disposition == "staged" and coords_.staging_key is not None
    assert store.fetch([coords_.staging_key])[0].extras == deep_extras(lib.EXTRAS_MAX_DEPTH)


# --- defect 7: version spans and kinds -------------------------------------------------------------


def test_stage_validates_spans(store: Store) -> None:
    record = make_record(prompt=(1,), generated=(2, 3, 4, 5), weight_version=12)  # generated positions 1..4
    refused = [
        [(1, 5, 12), (5, 1_000_000, 12)],  # beyond the record
        [(1, 3, -1), (3, 5, 12)],  # a negative version
        [(1, 3, 2**64), (3, 5, 12)],  # a version beyond u64
        [(0, 5, 12)],  # covers the carried prompt token
        [(1, 4, 10), (3, 5, 12)],  # overlapping
        [(3, 5, 12), (1, 3, 10)],  # unsorted
        [(1, 3, 10)],  # leaves generated positions without a version
        [(3, 1, 12)],  # empty / reversed
        [(-1, 5, 12)],
        [],
        [(1, 5)],
        [(1, 5, 12, 0)],
        [(1.0, 5, 12)],
        [(1, 5, True)],
        [(1, 5, "12")],
        ["1,5,12"],
        [None],
        "(1, 5, 12)",
        (1, 5, 12),
        {1: (1, 5, 12)},
        5,
        [[1, 5, 12], 7],
    ]
    for spans in refused:
        INPUTS["spans"] += 1
        with pytest.raises(InvalidRecordError):
            store.stage(record, spans=spans)  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            store.stage_all([StageEntry(record, spans=spans)])  # type: ignore[arg-type]
    assert store.replay().events == 0
    assert store.stage(record, spans=[[1, 3, 10], (3, 5, 12)]).ok  # lists are triples too
    info = store.call("rollout-1", "call-1")
    assert info is not None and info.generated_tokens == 4 and info.newest_version == 12


def test_chunk_spans_are_in_call_positions(store: Store) -> None:
    prefix = make_record(model_call_id="live", generated=(1, 2, 3), weight_version=4)
    chunk = make_record(model_call_id="live", prompt=(), generated=(4, 5), weight_version=5)
    keys = [lib.chunk_staging_key("k", "rollout-1", "live", n) for n in range(3)]
    assert store.stage(prefix, staging_key=keys[0], kind=EventKind.PREFIX_STAGED, spans=[(3, 6, 4)]).ok
    for spans in ([(6, 9, 5)], [(6, 7, 5)], [(6, 7, 5), (6, 8, 5)]):
        with pytest.raises(InvalidRecordError):
            store.stage(chunk, staging_key=keys[1], kind=EventKind.CHUNK_STAGED, spans=spans)
    assert store.stage(chunk, staging_key=keys[1], kind=EventKind.CHUNK_STAGED, spans=[(6, 7, 5), (7, 8, 6)]).ok
    info = store.call("rollout-1", "live")
    assert info is not None and info.generated_tokens == 5 and info.newest_version == 6


def test_kind_as_a_plain_string(store_url: str, store: Store) -> None:
    record = make_record()
    key = lib.chunk_staging_key("k", "rollout-1", "call-1", 0)
    assert store.stage(record, staging_key=key, kind="prefix_staged").ok  # type: ignore[arg-type]
    for kind in (
        EventKind.CALL_FAILED,
        "call_failed",
        "keys_cleared",
        "bogus",
        "",
        "CALL_COMPLETED",
        1,
        None,
        ["call_completed"],
        {},
    ):
        INPUTS["kinds"] += 1
        with pytest.raises(InvalidRecordError, match="kind"):
            store.stage(record, kind=kind)  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError, match="kind"):
            store.stage_all([StageEntry(record, kind=kind)])  # type: ignore[arg-type]
    assert store.stage(record, kind="call_completed").ok  # type: ignore[arg-type]
    assert store.call("rollout-1", "call-1").state == "completed"  # type: ignore[union-attr]
    assert store.replay().ok


# --- defect 12: edges ---------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_an_int_is_refused_where_a_float_is_declared(codec: str) -> None:
    _, decode, raw_encode = CODECS[codec]
    float_fields = {
        GenerationCutPrefix: "admitted_at",
        GenerationCutPrefixAck: "admitted_at",
        lib.CallRecord: "admitted_at",
        lib.RolloutReceipt: "reward",
    }
    examples = {type(example): example for example in EXAMPLES}
    for record_type, field in float_fields.items():
        payload = msgspec.to_builtins(examples[record_type])
        assert isinstance(payload[field], float)
        for number in (1, 0, -3, 2**63):
            with pytest.raises(InvalidRecordError, match=field):
                decode(raw_encode({**payload, field: number}), record_type)
        with pytest.raises(InvalidRecordError, match=field):
            record_type(**{**{name: getattr(examples[record_type], name) for name in payload}, field: 1})


def test_lone_surrogates_in_ids_are_invalid_records() -> None:
    for build in (
        lambda: make_record(rollout_id="r\ud800"),
        lambda: make_record(model_call_id="\udfff"),
        lambda: CaptureAdmission(rollout_id="r\ud800", model_call_id="c", mode="text"),
        lambda: admission(staging_chain=("rollout-1/\ud800",), required_prefix_token_ids=[]),
        lambda: StageResult(ok=False, error="\ud800"),
        lambda: cut(staging_keys=("\ud800",)),
        lambda: ManifestFailure(model_call_id="a", reason="\ud800"),
        lambda: receipt(capture_poisoned=True, failure_reason="\ud800", terminal_model_call_id=None),
        lambda: GenerationCutPrefix(
            ticket_id="\ud800", rollout_id="r", attempt_index=0, model_call_id="c", admitted_at=1.0
        ),
    ):
        INPUTS["surrogate ids"] += 1
        with pytest.raises(InvalidRecordError, match=r"Unicode|UTF-8"):
            build()


def test_store_entry_points_refuse_surrogates_and_wrong_types(store_url: str, store: Store) -> None:
    record = make_record()
    assert store.stage(record).ok
    cut_key = lib.chunk_staging_key("k\ud800", "rollout-1", "call-1", 0)
    for attempt in (
        lambda: store.stage(record, staging_key=cut_key, kind=EventKind.PREFIX_STAGED),
        lambda: store.fetch(["rollout-1/\ud800"]),
        lambda: store.fetch(None),  # type: ignore[arg-type]
        lambda: store.fetch("rollout-1/call-1"),
        lambda: store.fetch_chunks(None),  # type: ignore[arg-type]
        lambda: store.call("rollout-1", "\ud800"),
        lambda: store.call(None, "c"),  # type: ignore[arg-type]
        lambda: store.calls("\ud800"),
        lambda: store.version_spans("\ud800", "c"),
        lambda: store.completion("r", "\ud800"),
        lambda: store.cut_receipt("\ud800", "d"),
        lambda: store.clear_keys("rollout-1", "call-1", [cut_key], "r"),
        lambda: store.record_failure("rollout-1", "call-1", "\ud800"),
    ):
        INPUTS["surrogates and wrong types at the store"] += 1
        with pytest.raises(InvalidRecordError):
            attempt()
    assert store.replay().events == 1


# --- open_store ----------------------------------------------------------------------------------------


def test_open_store_refuses_unusable_paths(tmp_path: os.PathLike[str]) -> None:
    folder = os.fspath(tmp_path)
    for location, fragment in (
        (os.path.join(folder, "a\0b.db"), "NUL"),
        ("sqlite:///" + os.path.join(folder, "a\0b.db"), "NUL"),
        (os.path.join(folder, "x.db").encode(), "bytes"),
        (os.path.join(folder, "n" * 300 + ".db"), "too long"),
        (os.path.join(folder, *["d"] * 3000, "x.db"), "too long"),
        (None, "NoneType"),
        (7, "int"),
    ):
        INPUTS["open_store paths"] += 1
        with pytest.raises(lib.ConfigurationError, match=fragment):
            lib.open_store(location)  # type: ignore[arg-type]
    assert os.listdir(folder) == []


def test_open_store_says_a_file_is_not_a_store(tmp_path: os.PathLike[str]) -> None:
    for name, content in (("text.db", b"hello, I am a text file\n" * 20), ("random.db", os.urandom(8192))):
        path = os.path.join(tmp_path, name)
        with open(path, "wb") as handle:
            handle.write(content)
        with pytest.raises(lib.StorageError, match="is not a store database") as caught:
            lib.open_store(path)
        assert "migrating" not in str(caught.value)
        with open(path, "rb") as handle:
            assert handle.read() == content  # left as it was


OPEN_AS_UNPRIVILEGED = """
import sys
from store import StoreError, open_store
for path in sys.argv[1:]:
    try:
        open_store(path).close()
    except StoreError as exc:
        print(type(exc).__name__, exc)
    else:
        print("opened")
"""


def open_without_file_privileges(*paths: str) -> list[str]:
    """Open stores in a process without root's power to ignore file permissions: one answer a path."""
    command = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    result = subprocess.run(
        [*command, sys.executable, "-c", OPEN_AS_UNPRIVILEGED, *paths], capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop")
def test_open_store_says_permission_denied(tmp_path: os.PathLike[str]) -> None:
    # Root ignores file permissions; the child drops that privilege (CAP_DAC_OVERRIDE), as any user lacks it.
    unreadable = os.path.join(tmp_path, "unreadable.db")
    lib.open_store(unreadable).close()
    os.chmod(unreadable, 0o000)
    locked_folder = os.path.join(tmp_path, "locked")
    os.mkdir(locked_folder)
    os.chmod(locked_folder, 0o555)
    try:
        unreadable_answer, locked_answer = open_without_file_privileges(
            unreadable, os.path.join(locked_folder, "new.db")
        )
        assert unreadable_answer.startswith("StorageError permission denied: cannot read")
        assert locked_answer.startswith("StorageError permission denied: cannot create files in")
    finally:
        os.chmod(unreadable, 0o600)
        os.chmod(locked_folder, 0o755)


# --- every public entry point with wrong types --------------------------------------------------------

WRONG: dict[str, Any] = {
    "None": None,
    "zero": 0,
    "minus one": -1,
    "2**64": 2**64,
    "10**40": 10**40,
    "a float": 1.5,
    "NaN": math.nan,
    "True": True,
    "empty string": "",
    "a lone surrogate": "\ud800",
    "bytes": b"rollout-1/call-1",
    "a bytearray": bytearray(b"k"),
    "empty list": [],
    "[None]": [None],
    "[1]": [1],
    "[surrogate]": ["\ud800"],
    "[empty string]": [""],
    "[[key]]": [["rollout-1/call-1"]],
    "empty dict": {},
    "a dict": {"rollout-1/call-1": 1},
    "a triple": (1, 2, 3),
    "an object": object(),
    "a set": {"rollout-1/call-1"},
    "a generator": (key for key in ["rollout-1/call-1"]),
    "a bad Completion": Completion(effective_output_limit="x"),  # type: ignore[arg-type]
    "a huge stop reason": Completion(stop_reason=2**70),
    "a bad AdmissionBody": AdmissionBody(
        schema_version=2, parent_call_id=None, mode=5, prev_len=0, parent_chain_hash=None, weight_version=-1
    ),  # type: ignore[arg-type]
    "an AdmissionBody with a surrogate": AdmissionBody(
        schema_version=2, parent_call_id="\ud800", mode="text", prev_len=0, parent_chain_hash=None, weight_version=1
    ),
    "a FailureBody": FailureBody(reason="r"),
    "a StageEntry of nothing": StageEntry(None),  # type: ignore[arg-type]
    "a record as JSON": to_json(make_record()),
}


BYTES_OF_INTS = "a bytearray"  # a mutable sequence of exact ints: token ids [107], rightly accepted


def wrong_values(*legal: str) -> Iterator[tuple[str, Any]]:
    """Every wrong value but the ``legal`` ones (those the argument rightly accepts)."""
    for label, value in WRONG.items():
        if label not in legal:
            yield label, value


def every_refused(
    entry: str, call: Callable[..., Any], valid: dict[str, Any], legal: dict[str, tuple[str, ...]]
) -> int:
    """Call ``entry`` with each argument in turn replaced by each wrong value: each must raise a StoreError."""
    tried = 0
    for argument in valid:
        for label, value in wrong_values(*legal.get(argument, ())):
            tried += 1
            try:
                call(**{**valid, argument: value})
            except StoreError:
                continue
            except BaseException as exc:  # the point of the test: nothing raw escapes
                pytest.fail(f"{entry}({argument}={label}) raised a raw {type(exc).__name__}: {exc}")
            pytest.fail(f"{entry}({argument}={label}) was accepted")
    INPUTS["wrong types at entry points"] += tried
    return tried


def test_every_store_entry_point_refuses_wrong_types_and_writes_nothing(store_url: str, store: Store) -> None:
    record = make_record()
    assert store.stage(record).ok
    events = store.replay().events
    body = AdmissionBody(
        schema_version=2, parent_call_id=None, mode="text", prev_len=0, parent_chain_hash=None, weight_version=1
    )
    ids = {"rollout_id": "rollout-1", "model_call_id": "call-1"}
    none_ok = ("None",)
    ledger = store.ledger()
    commit = CaptureLedgerCommit(
        rollout_id="rollout-1", record=manifest_row(record), staging_chain=(record.staging_key,)
    )
    table: list[tuple[str, Callable[..., Any], dict[str, Any], dict[str, tuple[str, ...]]]] = [
        (
            "stage",
            store.stage,
            {
                "record": record,
                "staging_key": None,
                "kind": EventKind.CALL_COMPLETED,
                "spans": None,
                "completion": None,
            },
            {"staging_key": none_ok, "spans": none_ok, "completion": none_ok},
        ),
        (
            "stage_all",
            store.stage_all,
            {"entries": [StageEntry(record)], "cut_receipt": None},
            {"entries": ("empty list",), "cut_receipt": none_ok},
        ),
        ("fetch", store.fetch, {"keys": [record.staging_key]}, {"keys": ("empty list",)}),
        ("fetch_chunks", store.fetch_chunks, {"keys": [record.staging_key]}, {"keys": ("empty list",)}),
        ("call", store.call, ids, {}),
        ("calls", store.calls, {"rollout_id": "rollout-1"}, {"rollout_id": none_ok}),
        ("version_spans", store.version_spans, ids, {}),
        ("completion", store.completion, ids, {}),
        ("cut_receipt", store.cut_receipt, {"checkpoint_id": "c", "inventory_digest": "d"}, {}),
        ("replay", store.replay, {"repair": False}, {"repair": ("True",)}),
        ("retire", store.retire, {"capture_keys": ["rollout-9"]}, {}),
        ("forget", store.forget, {"capture_keys": ["rollout-9"]}, {}),
        ("delete", store.delete, {"capture_keys": ["rollout-9"]}, {}),
        (
            "retain",
            store.retain,
            {"keys": [record.staging_key], "capture_keys": None},
            {"keys": ("empty list",), "capture_keys": none_ok},
        ),
        ("ledger.record", ledger.record, {"commit": commit}, {}),
        ("ledger.record_failure", ledger.record_failure, {**ids, "reason": "r"}, {}),
        (
            "ledger.record_lineage",
            ledger.record_lineage,
            {**ids, "request_items": [], "response_items": []},
            {"request_items": ("empty list",), "response_items": ("empty list",)},
        ),
        ("ledger.manifest", ledger.manifest, {"rollout_id": "rollout-1"}, {}),
        ("ledger.has_rows", ledger.has_rows, {"rollout_id": "rollout-1"}, {}),
        ("ledger.admit", ledger.admit, {**ids, "request_items": []}, {"request_items": ("empty list",)}),
        ("ledger.retire", ledger.retire, {"rollout_ids": ["rollout-9"]}, {}),
        ("ledger.delete", ledger.delete, {"rollout_ids": ["rollout-9"]}, {}),
        ("record_admission", store.record_admission, {**ids, "body": body}, {}),
        ("record_failure", store.record_failure, {**ids, "reason": "r"}, {"reason": ("empty string",)}),
        (
            "clear_keys",
            store.clear_keys,
            {**ids, "keys": [lib.chunk_staging_key("k", "rollout-1", "call-1", 0)], "reason": "r"},
            {"keys": ("empty list",), "reason": ("empty string",)},
        ),
    ]
    valid_calls = [lambda entry=entry, call=call, valid=valid: call(**valid) for entry, call, valid, _ in table]
    tried = sum(every_refused(entry, call, valid, legal) for entry, call, valid, legal in table)
    assert tried > 300
    assert store.replay().events == events, "a refused call wrote to the log"
    for call in valid_calls[:-3]:  # the same calls with valid arguments work (the last three write)
        call()
    assert store.replay().ok


def test_every_capture_entry_point_refuses_wrong_types_and_writes_nothing(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=Versions(7))
    admission_ = CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text")
    call = capture.begin_call(admission_)
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    events = store.replay().events
    none_ok = ("None",)
    table: list[tuple[str, Callable[..., Any], dict[str, Any], dict[str, tuple[str, ...]]]] = [
        (
            "RolloutTokenCapture",
            RolloutTokenCapture,
            {
                "store": store,
                "weight_version_fn": Versions(7),
                "adapter": None,
                "flush_threshold_tokens": 0,
                "flush_interval": 0.25,
                "completion_evidence_ttl": 60.0,
            },
            {
                "adapter": tuple(WRONG),
                "flush_threshold_tokens": ("zero", "2**64", "10**40"),
                "flush_interval": ("a float",),
                "completion_evidence_ttl": ("zero", "a float", "2**64", "10**40"),
            },
        ),
        (
            "begin_call",
            capture.begin_call,
            {
                "admission": CaptureAdmission(rollout_id="r0", model_call_id="c9", mode="text"),
                "prefix_token_ids": None,
                "generation_cut": None,
                "generation_cut_staging_keys": None,
                "stream": False,
                "weight_version": None,
            },
            {
                "prefix_token_ids": ("None", "empty list"),
                "generation_cut": none_ok,
                "generation_cut_staging_keys": ("None", "empty list", "[surrogate]", "[empty string]"),  # ignored
                "weight_version": ("None", "zero"),
            },
        ),
        (
            "track",
            capture.track,
            {"call": call, "prompt_token_ids": [1, 2], "effective_output_limit": 8},
            {"prompt_token_ids": ("empty list", "[1]", "a triple", BYTES_OF_INTS), "effective_output_limit": none_ok},
        ),
        (
            "observe",
            capture.observe,
            {"call": call, "token_ids": [3], "logprobs": [-0.5]},
            {"token_ids": tuple(WRONG), "logprobs": tuple(WRONG)},
        ),
        (
            "complete_call",
            capture.complete_call,
            {"call": None, "prompt_token_ids": [1], "generated_token_ids": [2], "generated_logprobs": [-0.5]},
            {
                "prompt_token_ids": tuple(WRONG),
                "generated_token_ids": tuple(WRONG),
                "generated_logprobs": tuple(WRONG),
                "call": (),
            },
        ),
        (
            "complete_call_from_response",
            capture.complete_call_from_response,
            {"call": call, "payload": {}},
            {"payload": tuple(WRONG)},
        ),
        ("finish_restored_call", capture.finish_restored_call, {"call": call}, {}),
        ("fail_call", capture.fail_call, {"call": None, "reason": "r"}, {"reason": tuple(WRONG)}),
        (
            "build_prefix_record",
            capture.build_prefix_record,
            {"call": call, "prompt_token_ids": [1, 2], "generated_token_ids": [3], "generated_logprobs": [-0.5]},
            {
                "prompt_token_ids": ("empty list", "[1]", "a triple", BYTES_OF_INTS),
                "generated_token_ids": ("empty list", "[1]", BYTES_OF_INTS),
            },
        ),
        (
            "build_generation_chunk_record",
            capture.build_generation_chunk_record,
            {"call": call, "generated_token_ids": [3], "generated_logprobs": [-0.5]},
            {"generated_token_ids": ("[1]", BYTES_OF_INTS)},
        ),
        (
            "record_spans",
            capture.record_spans,
            {"call": call, "record": make_record(rollout_id="r0", model_call_id="c0")},
            {},
        ),
        ("serve_generation_cut", capture.serve_generation_cut, {"inventory": EXAMPLES[-3]}, {}),
    ]
    tried = sum(every_refused(entry, entry_call, valid, legal) for entry, entry_call, valid, legal in table)
    assert tried > 250
    assert store.replay().events == events, "a refused call wrote to the log"
    assert not call.completed


def test_complete_call_with_wrong_data_types_gives_failed_coords_and_stages_nothing(store: Store) -> None:
    """Bad engine data is a data problem (4.9): failed coords, never an exception, and no record staged."""
    capture = RolloutTokenCapture(store=store, weight_version_fn=Versions(7))
    legal = {
        *(("extras", label) for label in ("None", "empty dict", "a dict")),
        *(("prompt_token_ids", label) for label in ("empty list", "[1]", "a triple")),
        ("generated_token_ids", "[1]"),
    }
    for argument in ("prompt_token_ids", "generated_token_ids", "generated_logprobs", "extras"):
        for index, (label, value) in enumerate(WRONG.items()):
            if (argument, label) in legal or label == BYTES_OF_INTS:
                continue
            INPUTS["wrong data at completion"] += 1
            call = capture.begin_call(
                CaptureAdmission(rollout_id="r0", model_call_id=f"{argument}-{index}", mode="text")
            )
            data = {"prompt_token_ids": [1], "generated_token_ids": [2], "generated_logprobs": [-0.5], argument: value}
            coords_ = capture.complete_call(call, **data)
            assert coords_.disposition == "capture_failed", f"{argument}={label}"
            assert call.completed
    assert store.replay().ok
    assert {info.state for info in store.calls()} == {"failed"}
    assert sum(info.generated_tokens for info in store.calls()) == 0
