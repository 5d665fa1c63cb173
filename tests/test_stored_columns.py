"""Columns read back from storage take faster paths; they must judge exactly like the general ones.

A mask stored in its run form (carry times +0.0, then +1.0) is checked by its known carry;
token ids decode in one widening copy.  Each case compares the stored column's verdict with
the same values given as floats (the general path), refusals included.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples

from store.errors import DigestValueError, RebuildError
from store.log.checksum import event_checksum
from store.rebuild.verify import carry_boundary
from store.wire.columns import (
    FloatColumn,
    TokenIds,
    decode_floats,
    decode_ids,
    decode_mask,
    encode_floats,
    encode_ids,
    encode_mask,
)
from store.wire.digest import check_mask_and_carry

FAST = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stored(mask: list[float], log_probs: list[float]) -> tuple[FloatColumn, FloatColumn]:
    return (
        decode_mask(encode_mask(FloatColumn.coerce(mask, "mask")), len(mask)),
        decode_floats(encode_floats(FloatColumn.coerce(log_probs, "log_probs"))),
    )


def _verdict(check: Any, *args: Any) -> tuple[str, str]:
    try:
        return "ok", repr(check(*args))
    except (DigestValueError, RebuildError) as exc:
        return type(exc).__name__, str(exc)


masks = st.tuples(st.integers(0, 6), st.integers(0, 6)).map(lambda ct: [0.0] * ct[0] + [1.0] * ct[1])
carry_log_probs = st.sampled_from([0.0, -0.0, 0.5, -1e-30])


@FAST
@given(masks, st.lists(carry_log_probs, min_size=12, max_size=12))
def test_a_stored_run_mask_is_checked_like_the_same_floats(mask: list[float], values: list[float]) -> None:
    log_probs = [values[i] if flag == 0.0 else -0.25 for i, flag in enumerate(mask)]
    stored_mask, _ = _stored(mask, log_probs)
    assert stored_mask.stored_carry() == mask.count(0.0)  # the run form: the fast path is taken
    general = FloatColumn.coerce(mask, "mask"), FloatColumn.coerce(log_probs, "log_probs")
    assert general[0].stored_carry() is None  # float values: always the general path
    assert _verdict(check_mask_and_carry, *_stored(mask, log_probs)) == _verdict(check_mask_and_carry, *general)
    assert _verdict(carry_boundary, "call", stored_mask) == _verdict(carry_boundary, "call", general[0])


def test_a_carry_position_with_a_log_prob_is_refused_from_storage_too() -> None:
    mask, log_probs = _stored([0.0, 0.0, 1.0], [0.0, 0.5, -1.0])
    with pytest.raises(DigestValueError, match="carry position"):
        check_mask_and_carry(mask, log_probs)
    check_mask_and_carry(*_stored([0.0, 0.0, 1.0], [-0.0, 0.0, -1.0]))  # -0.0 passes, as 6.1 says


def test_a_stored_mask_without_generation_is_empty_generation() -> None:
    mask, _ = _stored([0.0, 0.0], [0.0, 0.0])
    with pytest.raises(RebuildError) as caught:
        carry_boundary("call", mask)
    assert caught.value.code == "empty_generation"


def test_a_raw_stored_mask_takes_the_general_path() -> None:
    """A mask that is not carry-then-generation is stored raw; it is judged value by value."""
    mask = decode_mask(encode_mask(FloatColumn.coerce([1.0, 0.0, 1.0], "mask")), 3)
    assert mask.stored_carry() is None
    with pytest.raises(RebuildError) as caught:
        carry_boundary("call", mask)
    assert caught.value.code == "invalid_mask_order"


@pytest.mark.parametrize("high", [2**32 - 1, 2**64 - 1])
def test_token_ids_decode_to_the_big_endian_ids_they_encoded(high: int) -> None:
    ids = TokenIds.coerce([0, 1, 150_000, high, 7], "ids")
    decoded = decode_ids(encode_ids(ids))
    assert decoded.tolist() == [0, 1, 150_000, high, 7]
    assert decoded.big_endian().tobytes() == b"".join(v.to_bytes(8, "big") for v in decoded.tolist())
    assert not decoded.array.flags.writeable


def test_a_token_id_column_of_a_broken_length_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        decode_ids(b"4" + b"\x01\x02\x03")  # three bytes: no whole u32
    assert len(decode_ids(b"4")) == 0
    assert np.array_equal(decode_ids(b"8" + (5).to_bytes(8, "little")).array, [5])


def test_a_record_built_from_components_carries_its_stored_form() -> None:
    """from_components encodes the columns for storage once, when the record is built."""
    from factories import make_record

    from store.wire.columns import encode_floats, encode_ids, encode_mask

    columns = make_record(rollout_id="stored-form").columns
    assert columns.token_ids._stored is not None
    assert columns.token_mask._stored_mask is not None
    assert columns.log_probs._stored_floats is not None
    # Later encodings hand back the very bytes computed at build time.
    assert encode_ids(columns.token_ids) is columns.token_ids._stored
    assert encode_mask(columns.token_mask) is columns.token_mask._stored_mask
    assert encode_floats(columns.log_probs) is columns.log_probs._stored_floats


@pytest.mark.parametrize("carry, total", [(0, 3), (2, 5), (5, 5), (3, 70_000)])
def test_run_masks_of_one_shape_decode_alike_and_cannot_be_changed(carry: int, total: int) -> None:
    """Every decode of a run mask gives exactly the column that was encoded, read-only
    (a shared or cached pattern could never be changed through one of its columns)."""
    stored = encode_mask(FloatColumn.coerce([0.0] * carry + [1.0] * (total - carry), "mask"))
    first, second = decode_mask(stored, total), decode_mask(stored, total)
    for column in (first, second):
        assert column.stored_carry() == carry
        assert column.big_endian_f32().tobytes() == b"\x00" * 4 * carry + b"\x3f\x80\x00\x00" * (total - carry)
        assert not column.big_endian_f32().flags.writeable
        with pytest.raises(ValueError):
            column.big_endian_f32()[0] = 1.0
    assert first == second


@pytest.mark.parametrize(
    "carry, total, length",
    [(0, 2**40, 7), (2**62, 2**62, 3), (5, 3, 3), (0, 4, 3)],
)
def test_a_damaged_run_mask_is_refused_before_anything_is_allocated(carry: int, total: int, length: int) -> None:
    """Counts that do not fit the record's ids (or a carry beyond the total) are damage: a
    ValueError (the read paths' CorruptRecordError), never a huge allocation."""
    stored = b"R" + carry.to_bytes(8, "big") + total.to_bytes(8, "big")
    with pytest.raises(ValueError, match="does not fit"):
        decode_mask(stored, length)


def test_stored_log_probs_and_raw_masks_decode_to_their_binary32_values() -> None:
    """Stored log-probs and raw masks decode to exactly the binary32 values encoded, read-only."""
    values = [0.0, -0.5, -1e-30, -3.25]
    assert decode_floats(encode_floats(FloatColumn.coerce(values, "lp"))).tolist() == [
        float(np.float32(v)) for v in values
    ]
    raw = decode_mask(encode_mask(FloatColumn.coerce([1.0, 0.0, 1.0], "mask")), 3)
    assert raw.tolist() == [1.0, 0.0, 1.0]
    assert not raw.big_endian_f32().flags.writeable


def _load_reference() -> Any:
    """Revision 0002's migration, whose ``layout_2`` computes the checksum apart from the store."""
    path = Path(__file__).resolve().parents[1] / "migrations" / "versions" / "0002_event_checksum_covers_identity.py"
    spec = importlib.util.spec_from_file_location("migration_0002_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_REFERENCE = _load_reference().layout_2
_TEXT = st.text(max_size=40)  # surrogates included: the checksum never fails on a text the database refuses
_INTEGER = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]))
_COLUMN = st.one_of(st.none(), st.binary(max_size=40), st.binary(min_size=1000, max_size=1100))


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {
            "rollout_id": _TEXT,
            "model_call_id": _TEXT,
            "stream_version": _INTEGER,
            "kind": _TEXT,
            "staging_key": st.one_of(st.none(), _TEXT),
            "writer_pid": _INTEGER,
            "recorded_at": st.floats(allow_nan=False),
            "body": st.one_of(st.binary(max_size=40), st.binary(min_size=1000, max_size=1100)),
            "token_ids": _COLUMN,
            "token_mask": _COLUMN,
            "log_probs": _COLUMN,
        }
    )
)
def test_the_event_checksum_frames_every_shape_as_its_layout_says(values: dict[str, Any]) -> None:
    # Stored rows take a packed fast path; any other shape the general loop: both must hash the
    # bytes layout 2 defines, whatever the lengths (around the inline threshold too).
    assert event_checksum(values) == _REFERENCE(values)


@pytest.mark.parametrize(
    ("column", "value", "error"),
    [
        ("stream_version", 2**63, OverflowError),
        ("writer_pid", True, TypeError),
        ("recorded_at", 1, None),  # an integer where a float is stored: framed as an integer
        ("token_ids", 3.5, None),  # framed as a float, as layout 2 frames it
        ("token_ids", [1], TypeError),
        ("rollout_id", 7, None),
    ],
)
def test_a_value_its_column_cannot_hold_takes_the_general_path(column: str, value: Any, error: Any) -> None:
    values: dict[str, Any] = {
        "rollout_id": "r",
        "model_call_id": "c",
        "stream_version": 1,
        "kind": "call_completed",
        "staging_key": "r/c",
        "writer_pid": 1,
        "recorded_at": 0.5,
        "body": b"body",
        "token_ids": b"4" * 2000,
        "token_mask": b"R" * 17,
        "log_probs": b"F" * 2000,
        column: value,
    }
    if error is None:
        assert event_checksum(values) == _REFERENCE(values)
    else:
        with pytest.raises(error):
            event_checksum(values)
