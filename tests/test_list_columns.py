"""Columns built from Python lists take C-speed paths; they must judge exactly like the general ones.

Token ids go through ``array('Q')`` with msgpack encoding as the type check and the 0/1
positions checked for bools; floats are read from their msgpack encoding (nine bytes, tag
0xcb, per exact float); the finite and binary32-range check is a sum of squares.  Each case
compares the list's column, or its refusal, with the same values through numpy or the
element-by-element rules of the wire contract.
"""

from __future__ import annotations

import array
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples

from store.errors import DigestValueError
from store.wire import columns
from store.wire.columns import FloatColumn, TokenIds, encode_ids
from store.wire.digest import compute_staging_digest

FAST = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(np.finfo(np.float32).max)


class IntSubclass(int):
    pass


class FloatSubclass(float):
    pass


# --- token ids ---------------------------------------------------------------------------


@FAST
@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=300))
def test_list_ids_equal_the_numpy_column(values: list[int]) -> None:
    column = TokenIds.coerce(values)
    assert column.tolist() == values
    assert column.big_endian().tobytes() == np.array(values, dtype=">u8").tobytes()
    assert TokenIds.coerce(tuple(values)) == column
    assert encode_ids(column) == encode_ids(TokenIds.coerce(np.array(values, dtype=np.uint64)))


@pytest.mark.parametrize("bad", [True, False])
@pytest.mark.parametrize("where", [0, 17, -1])
def test_a_bool_among_list_ids_is_refused_wherever_it_is(bad: bool, where: int) -> None:
    values: list[Any] = list(range(2, 42))
    values[where] = bad
    with pytest.raises(DigestValueError, match=r"exact ints .*found bool"):
        TokenIds.coerce(values, "ids")


def test_a_bool_is_refused_among_real_zero_and_one_ids() -> None:
    values: list[Any] = [0, 1, 5, 1, 0, 7] * 100 + [True]
    with pytest.raises(DigestValueError, match="found bool"):
        TokenIds.coerce(values, "ids")
    assert TokenIds.coerce([0, 1, 5, 1, 0, 7] * 100).tolist()[:6] == [0, 1, 5, 1, 0, 7]


@pytest.mark.parametrize(
    ("bad", "found"),
    [
        (np.int64(5), "int64"),
        (np.uint32(5), "uint32"),
        (IntSubclass(5), "IntSubclass"),
        (5.0, "float"),
        ("5", "str"),
        (None, "NoneType"),
        ([5], "list"),
    ],
)
def test_a_non_int_among_list_ids_is_refused(bad: Any, found: str) -> None:
    with pytest.raises(DigestValueError, match=rf"exact ints .*found {found}"):
        TokenIds.coerce([3, bad, 4] * 20, "ids")


@pytest.mark.parametrize("bad", [-1, 2**64, -(2**63) - 1, 2**100])
def test_out_of_range_list_ids_are_refused(bad: int) -> None:
    with pytest.raises(DigestValueError, match=r"\[0, 2\*\*64-1\]"):
        TokenIds.coerce([3, bad, 4] * 20, "ids")


def test_a_list_containing_itself_is_refused_not_recursed() -> None:
    values: list[Any] = [1, 2, 3]
    values.append(values)
    with pytest.raises(DigestValueError, match="found list"):
        TokenIds.coerce(values, "ids")


# --- float columns -----------------------------------------------------------------------

finite32 = st.floats(min_value=-F32_MAX, max_value=F32_MAX, allow_nan=False, allow_infinity=False)


@FAST
@given(st.lists(finite32, min_size=1, max_size=300))
def test_list_floats_equal_the_numpy_column(values: list[float]) -> None:
    column = FloatColumn.coerce(values, "values")
    assert column.big_endian_f32().tobytes() == np.array(values, dtype=">f4").tobytes()
    assert column.tolist() == values  # the values as given, not their binary32 rounding
    assert FloatColumn.coerce(tuple(values), "values") == column
    assert FloatColumn.coerce(np.array(values), "values") == column


@pytest.mark.parametrize("count", [1, 15, 16, 65_535, 65_536, 70_000])
def test_every_msgpack_array_header_length_is_read(count: int) -> None:
    values = [(-0.5 - i % 7) for i in range(count)]
    column = FloatColumn.coerce(values, "values")
    assert len(column) == count
    assert column.big_endian_f32().tobytes() == np.array(values, dtype=">f4").tobytes()


@pytest.mark.parametrize(
    ("bad", "found"),
    [
        (1, "int"),
        (0, "int"),
        (True, "bool"),
        (np.float64(0.5), "float64"),
        (FloatSubclass(0.5), "FloatSubclass"),
        (None, "NoneType"),
        ("0.5", "str"),
        (2**70, "int"),  # a nine-byte msgpack int: as long as a float, but another tag
    ],
)
@pytest.mark.parametrize("where", [0, 9, -1])
def test_a_non_float_among_list_floats_is_refused(bad: Any, found: str, where: int) -> None:
    values: list[Any] = [-0.25] * 20
    values[where] = bad
    with pytest.raises(DigestValueError, match=rf"exact floats .*found {found}"):
        FloatColumn.coerce(values, "values")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("form", ["list", "numpy", "array"])
def test_non_finite_floats_are_refused_in_every_form(bad: float, form: str) -> None:
    values = [-0.25] * 20
    values[7] = bad
    given: Any = {"list": values, "numpy": np.array(values), "array": array.array("d", values)}[form]
    with pytest.raises(DigestValueError, match="must be finite"):
        FloatColumn.coerce(given, "values")


@pytest.mark.parametrize("bad", [3.5e38, -3.5e38, 1e100, 1e200, -1e300])
@pytest.mark.parametrize("form", ["list", "numpy"])
def test_floats_beyond_binary32_are_refused(bad: float, form: str) -> None:
    values = [-0.25] * 20
    values[3] = bad
    given: Any = values if form == "list" else np.array(values)
    with pytest.raises(DigestValueError, match="too large for binary32"):
        FloatColumn.coerce(given, "values")


def test_large_values_binary32_holds_pass_the_slow_range_check() -> None:
    # Their squares sum past the bound, so the exact min/max check decides: they fit.
    values = [F32_MAX, -F32_MAX, 1e38, 3.4028235e38] * 8
    column = FloatColumn.coerce(values, "values")
    assert column.big_endian_f32().tobytes() == np.array(values, dtype=">f4").tobytes()


def test_the_largest_value_rounding_to_binary32_max_passes_and_the_next_is_refused() -> None:
    limit = 2.0**128 - 2.0**103  # rounds to infinity in binary32
    below = math.nextafter(limit, 0.0)
    assert np.isfinite(np.array([below]).astype(np.float32))[0]
    assert FloatColumn.coerce([below], "values").big_endian_f32()[0] == np.float32(F32_MAX)
    with pytest.raises(DigestValueError, match="too large for binary32"):
        FloatColumn.coerce([limit], "values")


def test_a_long_exact_binary32_column_keeps_its_values_as_given() -> None:
    given = np.concatenate([np.zeros(1_000), np.ones(20_000)])
    column = FloatColumn.coerce(given, "mask")
    given[:] = 0.5  # the caller's buffer changes: the column does not
    assert column.tolist() == [0.0] * 1_000 + [1.0] * 20_000
    assert column.given_carry() == 1_000
    assert column.stored_carry() is None  # built from values: not judged as a stored column


def test_a_scratch_buffer_still_viewed_is_replaced_not_resized() -> None:
    FloatColumn.coerce([-0.5] * 40, "values")
    scratch = columns._SCRATCH.buffer
    assert isinstance(scratch, bytearray)
    held = np.frombuffer(scratch, dtype=np.uint8)  # say, kept alive by a traceback
    assert FloatColumn.coerce([-0.75] * 400, "values").tolist() == [-0.75] * 400
    assert TokenIds.coerce([9] * 400).tolist() == [9] * 400
    assert held.size == 3 + 9 * 40


def test_a_very_long_columns_scratch_buffer_is_not_kept() -> None:
    FloatColumn.coerce([-0.5] * 200_000, "values")  # 1.8 MB encoded
    assert columns._SCRATCH.buffer is None
    FloatColumn.coerce([-0.5] * 10, "values")
    assert isinstance(columns._SCRATCH.buffer, bytearray)


def test_list_and_buffer_forms_hash_to_the_same_digest() -> None:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 150_000, size=5_000).tolist()
    mask = [0.0] * 500 + [1.0] * 4_500
    log_probs = [0.0] * 500 + (-rng.exponential(0.7, size=4_500)).tolist()
    fields = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "r",
        "model_call_id": "c",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 5_000,
        "cum_len": 5_000,
        "weight_version": 1,
        "extras_digest": "0" * 64,
        "chain_hash": "1" * 64,
        "cumulative_hash": "2" * 64,
    }
    from_lists = compute_staging_digest(
        token_ids_delta=ids, token_mask_delta=mask, generation_log_probs_delta=log_probs, **fields
    )
    from_buffers = compute_staging_digest(
        token_ids_delta=array.array("Q", ids),
        token_mask_delta=np.array(mask),
        generation_log_probs_delta=array.array("d", log_probs),
        **fields,
    )
    assert from_lists == from_buffers


class LyingList(list[Any]):
    def __getitem__(self, index: Any) -> Any:
        return 7 if isinstance(index, int) else super().__getitem__(index)


def test_a_list_subclass_takes_the_element_by_element_path() -> None:
    with pytest.raises(DigestValueError, match="found bool"):
        TokenIds.coerce(LyingList([5, True, 6] * 10), "ids")
    assert TokenIds.coerce(LyingList([5, 0, 6])).tolist() == [5, 0, 6]
    assert FloatColumn.coerce(LyingList([-0.5, 0.0]), "values").tolist() == [-0.5, 0.0]
