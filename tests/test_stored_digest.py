"""The audit's fast digest path: hashed from the stored bytes, it agrees with the general path.

``stored_record_digest`` either returns exactly what ``staging_digest_and_columns`` computes
from the unpacked columns (digest and token ids) or None (the general path then decides).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from factories import make_record

from store.log.events import record_body
from store.queries.integrity import DECODE_ERRORS
from store.queries.reads import record_fields, stored_columns
from store.wire.columns import FloatColumn, TokenIds, encode_floats, encode_ids, encode_mask
from store.wire.digest import staging_digest_and_columns, stored_record_digest
from store.wire.records import StagedCallRecord


def _stored(record: StagedCallRecord) -> tuple[Any, bytes, bytes, bytes]:
    ids = TokenIds.coerce(record.token_ids_delta)
    mask = FloatColumn.coerce(record.token_mask_delta, "mask")
    lps = FloatColumn.coerce(record.generation_log_probs_delta, "lps")
    return record_body(record, []), encode_ids(ids), encode_mask(mask), encode_floats(lps)


def _general(body: Any, ids: bytes, mask: bytes, lps: bytes) -> tuple[str, TokenIds] | None:
    try:
        columns = stored_columns({"token_ids": ids, "token_mask": mask, "log_probs": lps})
        digest, columns = staging_digest_and_columns(
            **record_fields(body),
            digest_version=2,
            extras_digest_version=1,
            token_ids_delta=columns.token_ids,
            token_mask_delta=columns.token_mask,
            generation_log_probs_delta=columns.log_probs,
        )
    except DECODE_ERRORS:
        return None
    return digest, columns.token_ids


RECORDS = {
    "root": make_record(),
    "root, no carry": make_record(prompt=()),
    "child": make_record(parent_call_id="p", parent_chain_hash="ab" * 32, prefix=(1, 2, 3)),
    "u64 ids": make_record(prompt=(2**40, 3), generated=(2**63 + 5,)),
    "schema 3, extras": make_record(schema_version=3, extras={"a": [1, 2]}),
    "negative zero carry log-prob": make_record(),
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_fast_path_hashes_the_stored_bytes_as_the_general_path(name: str) -> None:
    body, ids, mask, lps = _stored(RECORDS[name])
    if name == "negative zero carry log-prob":
        lps = lps[:1] + b"\x80\x00\x00\x00" + lps[5:]  # -0.0 at a carry position passes
    fast = stored_record_digest(body, ids, mask, lps)
    assert fast is not None  # the common layout takes the fast path
    assert fast == _general(body, ids, mask, lps)
    if name != "negative zero carry log-prob":
        assert fast[0] == RECORDS[name].digest


def test_unusual_layouts_take_the_general_path() -> None:
    record = make_record(prompt=(1, 2), generated=(3,))
    body, ids, _, lps = _stored(record)
    raw_mask = b"F" + FloatColumn.coerce([0.0, 0.0, 1.0], "m").big_endian_f32().tobytes()
    assert stored_record_digest(body, ids, raw_mask, lps) is None
    assert _general(body, ids, raw_mask, lps) == (record.digest, TokenIds.coerce([1, 2, 3]))


@pytest.mark.parametrize(
    "change",
    [
        {"mask": b"R" + (1).to_bytes(8, "big") + (3).to_bytes(8, "big")},  # another carry: another digest
        {"mask": b"R" + (4).to_bytes(8, "big") + (3).to_bytes(8, "big")},  # carry past the end
        {"mask": b"R" + (2).to_bytes(8, "big") + (3).to_bytes(8, "big") + b"x"},
        {"lps": b"F" + b"\x3f\x00\x00\x00" * 3},  # a carry position with a log-prob
        {"lps": b"F" + b"\x00" * 8},  # one value short
        {"ids": b"4" + b"\x01\x00\x00\x00" * 2},  # one id short
        {"ids": b"4\x01\x00"},
        {"ids": b"x" + b"\x01\x00\x00\x00" * 3},
        {"body": {"mode": "token_in"}},
        {"body": {"delta_len": 4, "cum_len": 4}},
        {"body": {"cum_len": 4}},
        {"body": {"schema_version": 4}},
        {"body": {"rollout_id": ""}},
        {"body": {"parent_call_id": ""}},
        {"body": {"prev_len": 1, "cum_len": 4}},
        {"body": {"weight_version": -1}},
        {"body": {"extras_digest": "AB" * 32}},
        {"body": {"chain_hash": "ab"}},
        {"body": {"rollout_id": "\ud800"}},
    ],
)
def test_a_changed_record_gets_the_general_paths_answer(change: dict[str, Any]) -> None:
    """Whatever the fast path returns, the general path returns too (a None defers to it)."""
    record = make_record(prompt=(1, 2), generated=(3,), logprobs=[-0.25])
    body, ids, mask, lps = _stored(record)
    body = msgspec.structs.replace(body, **change.get("body", {}))
    ids, mask, lps = change.get("ids", ids), change.get("mask", mask), change.get("lps", lps)
    fast = stored_record_digest(body, ids, mask, lps)
    general = _general(body, ids, mask, lps)
    if "mask" in change and change["mask"][1:9] == (1).to_bytes(8, "big"):
        # Still a valid record, of other bytes: hashed on the fast path, to another digest.
        assert fast is not None and fast == general
        assert fast[0] != record.digest
    else:
        assert fast is None  # invalid, or not the stored layout: the general path names it
