"""A rollout read for linearizing decodes its records' columns into one ``ColumnBlock``.

Each record decoded into the block must equal the same stored bytes decoded alone (the
values, the binary32 patterns, the known carry), anything unusual must be left to the
ordinary decoders (which name it), and a row joined from block views must equal the row
joined from copies, whether the views are side by side or not.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples

from store.wire.columns import (
    ColumnBlock,
    FloatColumn,
    TokenIds,
    decode_floats,
    decode_ids,
    decode_mask,
    encode_floats,
    encode_ids,
    encode_mask,
    stored_id_count,
)

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stored(ids: list[int], mask: list[float], log_probs: list[float]) -> tuple[bytes, bytes, bytes]:
    return (
        encode_ids(TokenIds.coerce(ids)),
        encode_mask(FloatColumn.coerce(mask, "mask")),
        encode_floats(FloatColumn.coerce(log_probs, "log_probs")),
    )


records = st.integers(1, 9).flatmap(
    lambda n: st.tuples(
        st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)), min_size=n, max_size=n),
        st.one_of(
            st.integers(0, n).map(lambda c: [0.0] * c + [1.0] * (n - c)),  # the run form
            st.lists(st.sampled_from([0.0, -0.0, 1.0]), min_size=n, max_size=n),  # stored raw
        ),
        st.lists(st.sampled_from([0.0, -0.0, -0.5, -1e-40, -3.4028235e38]), min_size=n, max_size=n),
    )
)


@FAST
@given(st.lists(records, min_size=1, max_size=4))
def test_records_decoded_into_a_block_equal_them_decoded_alone(given_records: list[tuple]) -> None:
    stored = [_stored(*record) for record in given_records]
    counts = [stored_id_count(ids) for ids, _, _ in stored]
    assert counts == [len(ids) for ids, _, _ in given_records]
    block = ColumnBlock(sum(counts))
    start, decoded = 0, []
    for (ids, mask, log_probs), count in zip(stored, counts, strict=True):
        columns = block.decode_into(start, ids, mask, log_probs)
        assert columns is not None
        decoded.append(columns)
        start += count
    block.seal()
    for (ids, mask, log_probs), (block_ids, block_mask, block_log_probs) in zip(stored, decoded, strict=True):
        alone_mask = decode_mask(mask, stored_id_count(ids))
        assert block_ids == decode_ids(ids)
        assert block_ids.array.dtype == decode_ids(ids).array.dtype
        assert block_mask.big_endian_f32().tobytes() == alone_mask.big_endian_f32().tobytes()
        assert block_log_probs.big_endian_f32().tobytes() == decode_floats(log_probs).big_endian_f32().tobytes()
        assert block_mask.stored_carry() == alone_mask.stored_carry()
        assert block_mask.tolist() == alone_mask.tolist()
    # Joined side by side (a view) and joined in another order (a copy) equal the copies joined.
    for order in (list(range(len(decoded))), list(reversed(range(len(decoded))))):
        parts = [decoded[i] for i in order]
        alone = [
            (decode_ids(stored[i][0]), decode_mask(stored[i][1], counts[i]), decode_floats(stored[i][2])) for i in order
        ]
        joined_ids = TokenIds.concat([p[0] for p in parts])
        assert joined_ids == TokenIds.concat([a[0] for a in alone])
        for column in (1, 2):
            joined = FloatColumn.concat_binary32([p[column] for p in parts])
            expected = FloatColumn.concat_binary32([a[column] for a in alone])
            assert joined.big_endian_f32().tobytes() == expected.big_endian_f32().tobytes()
            assert joined.stored_carry() == expected.stored_carry()
    with pytest.raises(ValueError):
        block.ids[0] = 1  # sealed: nothing writes the block again


def test_a_row_of_adjacent_views_is_a_view_of_the_block() -> None:
    stored = [_stored([1, 2, 3], [0.0, 1.0, 1.0], [0.0, -0.5, -0.25]), _stored([4, 5], [1.0, 1.0], [-1.0, -2.0])]
    block = ColumnBlock(5)
    first = block.decode_into(0, *stored[0])
    second = block.decode_into(3, *stored[1])
    assert first is not None and second is not None
    row = TokenIds.concat([first[0], second[0]])
    assert np.shares_memory(row.array, block.ids) and row == [1, 2, 3, 4, 5]
    mask = FloatColumn.concat_binary32([first[1], second[1]])
    assert np.shares_memory(mask.big_endian_f32(), block.mask) and mask.stored_carry() == 1
    apart = TokenIds.concat([second[0], first[0]])  # not side by side: a copy
    assert not np.shares_memory(apart.array, block.ids) and apart == [4, 5, 1, 2, 3]


@pytest.mark.parametrize(
    "ids, mask, log_probs",
    [
        (b"4" + b"\x01\x00\x00\x00" * 2, b"R" + (1).to_bytes(8, "big") + (3).to_bytes(8, "big"), b"F" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00\x00" * 2, b"R" + (3).to_bytes(8, "big") + (2).to_bytes(8, "big"), b"F" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00\x00" * 2, b"R" + bytes(8) + (2).to_bytes(8, "big") + b"x", b"F" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00\x00" * 2, b"F" + b"\0" * 4, b"F" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00\x00" * 2, b"Q" + b"\0" * 8, b"F" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00\x00" * 2, b"F" + b"\0" * 8, b"G" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00\x00" * 2, b"F" + b"\0" * 8, b"F" + b"\0" * 12),
        (b"4" + b"\x01\x00\x00\x00" * 2, memoryview(b"F" + b"\0" * 8), b"F" + b"\0" * 8),
        (b"5" + b"\x01\x00\x00\x00" * 2, b"F" + b"\0" * 8, b"F" + b"\0" * 8),
        (b"4" + b"\x01\x00\x00", b"F" + b"\0" * 8, b"F" + b"\0" * 8),
        (b"4", b"F", b"F"),
        (None, None, None),
    ],
)
def test_unusual_stored_columns_are_left_to_the_ordinary_decoders(ids: bytes, mask: bytes, log_probs: bytes) -> None:
    block = ColumnBlock(8)
    assert block.decode_into(0, ids, mask, log_probs) is None


def test_a_record_that_does_not_fit_its_slot_is_left_to_the_ordinary_decoders() -> None:
    stored = _stored([1, 2, 3], [0.0, 1.0, 1.0], [0.0, -0.5, -0.25])
    assert ColumnBlock(2).decode_into(0, *stored) is None
    assert ColumnBlock(5).decode_into(3, *stored) is None
    assert ColumnBlock(6).decode_into(3, *stored) is not None
