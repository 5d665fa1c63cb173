"""Property tests of the digests (wire-contract section 2) and of record codecs (section 3.4)."""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from profiles import examples

from store import (
    EMPTY_EXTRAS_DIGEST,
    DigestMismatchError,
    InvalidRecordError,
    StagedCallRecord,
    StoreError,
    TokenIds,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    from_json,
    from_msgpack,
    hash_token_ids,
    to_json,
    to_msgpack,
)
from store.wire.digest import hash_token_columns

FAST = settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODERATE = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])

U64_MAX = 2**64 - 1
HEX = "0123456789abcdef"


# --- a valid base field set (the same shape make_record builds) ----------------------------------


def _base_fields(*, child: bool) -> dict[str, Any]:
    extras = {"routed_experts": [[1, 2], [3, 4]]}
    prompt, generated, lps = [10, 11, 12], [20, 21], [-0.5, -0.625]
    prefix = [1, 2] if child else []
    ids = [*prompt, *generated]
    parent_chain = "c" * 64 if child else None
    return {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": "parent-1" if child else None,
        "mode": "token_in" if child else "text",
        "prev_len": len(prefix),
        "delta_len": len(ids),
        "cum_len": len(prefix) + len(ids),
        "weight_version": 7,
        "token_ids_delta": ids,
        "token_mask_delta": [0.0] * len(prompt) + [1.0] * len(generated),
        "generation_log_probs_delta": [0.0] * len(prompt) + lps,
        "extras_digest": compute_extras_digest(extras),
        "chain_hash": compute_chain_hash(parent_chain, ids),
        "cumulative_hash": hash_token_ids([*prefix, *ids]),
    }


BASES = {"root": _base_fields(child=False), "child": _base_fields(child=True)}
MUTABLE_FIELDS = (
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "token_ids_delta",
    "token_mask_delta",
    "generation_log_probs_delta",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)

_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.binary(max_size=4),
    st.text(max_size=4),
)
_text_value = st.one_of(st.text(max_size=12), st.sampled_from(["", "text", "token_in", "candidate", "p"]), _junk)
_int_value = st.one_of(
    st.integers(-3, 12),
    st.integers(-(2**65), 2**65),
    st.sampled_from([U64_MAX, 2**64, -1, 0]),
    st.just(True),
    st.just(False),
    st.floats(-10, 10),
    _junk,
)
_hex = st.text(alphabet=HEX, min_size=64, max_size=64)
_hex_value = st.one_of(
    _hex,
    _hex.map(str.upper),
    st.text(alphabet=HEX, min_size=63, max_size=65),
    _hex.map(str.encode),
    _junk,
)
_id_item = st.one_of(st.integers(0, U64_MAX), st.integers(-3, 30), st.sampled_from([2**64, -1, True]), st.floats(0, 9))
_ids_value = st.one_of(st.lists(_id_item, min_size=0, max_size=7), _junk)
_mask_item = st.sampled_from([0.0, 1.0, -0.0, 0.5, 2.0, 0, 1, True, False, math.nan, math.inf])
_mask_value = st.one_of(st.lists(_mask_item, min_size=0, max_size=7), _junk)
_lp_item = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(width=32),
    st.sampled_from([0.0, -0.0, -0.5, 0, -1, True, 1e39, 3.4028235e38]),
)
_lp_value = st.one_of(st.lists(_lp_item, min_size=0, max_size=7), _junk)

MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "rollout_id": _text_value,
    "model_call_id": _text_value,
    "parent_call_id": _text_value,
    "mode": _text_value,
    "prev_len": _int_value,
    "delta_len": _int_value,
    "cum_len": _int_value,
    "weight_version": _int_value,
    "token_ids_delta": _ids_value,
    "token_mask_delta": _mask_value,
    "generation_log_probs_delta": _lp_value,
    "extras_digest": _hex_value,
    "chain_hash": _hex_value,
    "cumulative_hash": _hex_value,
}
assert set(MUTATIONS) == set(MUTABLE_FIELDS) and len(MUTABLE_FIELDS) == 14


def _f32_bits(values: list[Any]) -> bytes | None:
    """The binary32 patterns the digest would hash, or None if the values are not plain finite floats."""
    if not all(type(v) is float and math.isfinite(v) for v in values):
        return None
    with np.errstate(over="ignore"):
        return np.array(values, dtype=np.float64).astype(">f4").tobytes()


def _hashes_the_same(field: str, old: Any, new: Any) -> bool:
    """True when ``new`` is, for the digest, the same input as ``old`` (so no change is expected)."""
    if field in ("token_mask_delta", "generation_log_probs_delta"):
        if not isinstance(new, list) or len(new) != len(old):
            return False
        return _f32_bits(new) is not None and _f32_bits(new) == _f32_bits(old)
    if field == "token_ids_delta":
        return isinstance(new, list) and all(type(v) is int for v in new) and new == old
    return type(new) is type(old) and new == old


@FAST
@given(base_name=st.sampled_from(sorted(BASES)), field=st.sampled_from(MUTABLE_FIELDS), data=st.data())
def test_digest_rejects_or_changes_every_mutable_field(base_name: str, field: str, data: st.DataObject) -> None:
    base = BASES[base_name]
    original = compute_staging_digest(**base)
    new_value = data.draw(MUTATIONS[field], label=field)
    assume(not _hashes_the_same(field, base[field], new_value))
    try:
        mutated = compute_staging_digest(**{**base, field: new_value})
    except (ValueError, TypeError):
        return
    assert mutated != original, f"{field}={new_value!r} was accepted with the same digest"


@pytest.mark.parametrize("field", MUTABLE_FIELDS)
def test_each_field_has_a_valid_mutation_that_changes_the_digest(field: str) -> None:
    """Guards the property above against only ever exercising rejections."""
    base = BASES["child"]
    valid_mutation = {
        "rollout_id": "rollout-2",
        "model_call_id": "call-2",
        "parent_call_id": "parent-2",
        "mode": None,  # mode is pinned by the parent: flip both below
        "prev_len": None,
        "delta_len": None,
        "cum_len": None,
        "weight_version": 8,
        "token_ids_delta": [10, 11, 12, 20, 22],
        "token_mask_delta": [0.0, 0.0, 1.0, 1.0, 1.0],
        "generation_log_probs_delta": [0.0, 0.0, 0.0, -0.5, -0.75],
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": "d" * 64,
        "cumulative_hash": "e" * 64,
    }[field]
    if field == "mode":
        changed = {**base, "mode": "text", "parent_call_id": None, "prev_len": 0, "cum_len": base["delta_len"]}
    elif field in ("prev_len", "cum_len"):
        changed = {**base, "prev_len": 3, "cum_len": 8}
    elif field == "delta_len":
        changed = {
            **base,
            "delta_len": 4,
            "cum_len": 6,
            "token_ids_delta": [10, 11, 12, 20],
            "token_mask_delta": [0.0, 0.0, 0.0, 1.0],
            "generation_log_probs_delta": [0.0, 0.0, 0.0, -0.5],
        }
    else:
        changed = {**base, field: valid_mutation}
    assert compute_staging_digest(**changed) != compute_staging_digest(**base)


def test_digest_errors_stay_in_the_store_error_tree() -> None:
    """errors.py: every error the library raises derives from StoreError (and from Gym's builtin class)."""
    bad_inputs = [
        {"prev_len": None},
        {"prev_len": "2"},
        {"token_ids_delta": None},
        {"token_ids_delta": 5},
        {"token_mask_delta": None},
        {"generation_log_probs_delta": None},
    ]
    outside_the_tree = []
    for overrides in bad_inputs:
        with pytest.raises((ValueError, TypeError)) as info:
            compute_staging_digest(**{**BASES["child"], **overrides})
        if not isinstance(info.value, StoreError):
            outside_the_tree.append(f"{overrides!r} -> {type(info.value).__name__}: {info.value}")
    assert not outside_the_tree, "\n".join(outside_the_tree)


@FAST
@given(base_name=st.sampled_from(sorted(BASES)))
def test_digest_is_deterministic_and_input_container_independent(base_name: str) -> None:
    base = BASES[base_name]
    first = compute_staging_digest(**base)
    assert compute_staging_digest(**base) == first
    as_tuples = {
        **base,
        "token_ids_delta": tuple(base["token_ids_delta"]),
        "token_mask_delta": tuple(base["token_mask_delta"]),
        "generation_log_probs_delta": tuple(base["generation_log_probs_delta"]),
    }
    assert compute_staging_digest(**as_tuples) == first
    as_arrays = {
        **base,
        "token_ids_delta": np.array(base["token_ids_delta"], dtype=np.uint64),
        "token_mask_delta": np.array(base["token_mask_delta"]),
        "generation_log_probs_delta": np.array(base["generation_log_probs_delta"]),
    }
    assert compute_staging_digest(**as_arrays) == first


# --- a spec-level reference for the staged digest ----------------------------------------------


def _u64(x: int) -> bytes:
    return struct.pack(">Q", x)


def _text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return _u64(len(raw)) + raw


def _reference_staging_digest(f: dict[str, Any]) -> str:
    k = len(f["token_ids_delta"])
    ids = _u64(k) + b"".join(_u64(x) for x in f["token_ids_delta"])
    mask = _u64(k) + b"".join(struct.pack(">f", x) for x in f["token_mask_delta"])
    lps = _u64(k) + b"".join(struct.pack(">f", x) for x in f["generation_log_probs_delta"])
    parent = b"\x00" if f["parent_call_id"] is None else b"\x01" + _text(f["parent_call_id"])
    preimage = b"".join(
        [
            b"nemo-gym-staging-call-v2",
            bytes([f["schema_version"], 2, 1]),
            _text(f["rollout_id"]),
            _text(f["model_call_id"]),
            parent,
            _text(f["mode"]),
            _u64(f["prev_len"]),
            _u64(f["delta_len"]),
            _u64(f["cum_len"]),
            _u64(f["weight_version"]),
            _u64(len(ids)) + ids,
            _u64(len(mask)) + mask,
            _u64(len(lps)) + lps,
            bytes.fromhex(f["extras_digest"]),
            b"\x01" + bytes.fromhex(f["chain_hash"]),
            b"\x01" + bytes.fromhex(f["cumulative_hash"]),
        ]
    )
    return hashlib.sha256(preimage).hexdigest()


_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_identifier = st.text(min_size=1, max_size=16)


@st.composite
def staged_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Valid digest inputs: a root or a child, carry-then-generation columns, any u64 values."""
    ids = draw(st.lists(st.integers(0, U64_MAX), min_size=1, max_size=24))
    carry = draw(st.integers(0, len(ids)))
    lps = draw(st.lists(_f32, min_size=len(ids) - carry, max_size=len(ids) - carry))
    child = draw(st.booleans())
    prev_len = draw(st.integers(1, 2**40)) if child else 0
    return {
        "schema_version": draw(st.sampled_from([2, 3])),
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": draw(_identifier),
        "model_call_id": draw(_identifier),
        "parent_call_id": draw(_identifier) if child else None,
        "mode": "token_in" if child else "text",
        "prev_len": prev_len,
        "delta_len": len(ids),
        "cum_len": prev_len + len(ids),
        "weight_version": draw(st.integers(0, U64_MAX)),
        "token_ids_delta": ids,
        "token_mask_delta": [0.0] * carry + [1.0] * (len(ids) - carry),
        "generation_log_probs_delta": [0.0] * carry + lps,
        "extras_digest": draw(_hex),
        "chain_hash": draw(_hex),
        "cumulative_hash": draw(_hex),
    }


@FAST
@given(fields=staged_fields())
def test_staged_digest_matches_the_section_2_6_layout(fields: dict[str, Any]) -> None:
    assert compute_staging_digest(**fields) == _reference_staging_digest(fields)


@FAST
@given(
    prompt=st.lists(st.integers(0, U64_MAX), min_size=1, max_size=12),
    generated=st.lists(st.integers(0, U64_MAX), max_size=12),
    child=st.booleans(),
    data=st.data(),
)
def test_a_live_prefix_digest_is_the_digest_of_the_record_built_from_its_columns(
    prompt: list[int], generated: list[int], child: bool, data: st.DataObject
) -> None:
    """``live_prefix_digest`` hashes a cut's prefix in parts; it must equal the staged digest of
    the record ``build_staging_delta`` makes of the same call (with its chain and cumulative hashes)."""
    from store.wire.columns import FloatColumn
    from store.wire.digest import build_staging_delta, live_prefix_digest

    prev_len = data.draw(st.integers(1, len(prompt))) if child else 0
    assume(len(prompt) - prev_len + len(generated) > 0)
    logprobs = data.draw(st.lists(_f32, min_size=len(generated), max_size=len(generated)))
    parent = data.draw(_hex) if child else None
    identity = {
        "schema_version": data.draw(st.sampled_from([2, 3])),
        "rollout_id": data.draw(_identifier),
        "model_call_id": data.draw(_identifier),
        "parent_call_id": data.draw(_identifier) if child else None,
        "mode": "token_in" if child else "text",
        "prev_len": prev_len,
        "weight_version": data.draw(st.integers(0, U64_MAX)),
    }
    columns = build_staging_delta(prompt, generated, logprobs, prev_len)
    expected = compute_staging_digest(
        **identity,
        digest_version=2,
        extras_digest_version=1,
        delta_len=len(columns.token_ids),
        cum_len=prev_len + len(columns.token_ids),
        token_ids_delta=columns.token_ids,
        token_mask_delta=columns.token_mask,
        generation_log_probs_delta=columns.log_probs,
        extras_digest=EMPTY_EXTRAS_DIGEST,
        chain_hash=compute_chain_hash(parent, columns.token_ids),
        cumulative_hash=hash_token_columns(TokenIds.coerce(prompt), TokenIds.coerce(generated)),
    )
    live = live_prefix_digest(
        **identity,
        parent_chain_hash=parent,
        prompt=TokenIds.coerce(prompt),
        generated=TokenIds.coerce(generated),
        generated_log_probs=FloatColumn.coerce(logprobs, "log-probs"),
    )
    assert live == expected


# --- extras -------------------------------------------------------------------------------------

_extras_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_extras_value = st.recursive(
    _extras_scalar,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
    ),
    max_leaves=20,
)
_extras = st.one_of(st.none(), st.dictionaries(st.text(max_size=6), _extras_value, max_size=5))


def _reorder(value: Any, rng: random.Random) -> Any:
    if type(value) is dict:
        keys = list(value)
        rng.shuffle(keys)
        return {key: _reorder(value[key], rng) for key in keys}
    if type(value) is list:
        return [_reorder(item, rng) for item in value]
    return value


def _reference_enc(value: Any) -> bytes:
    if value is None:
        return b"N"
    if type(value) is bool:
        return b"B" + bytes([value])
    if type(value) is int:
        return b"I" + value.to_bytes(8, "big", signed=True)
    if type(value) is float:
        return b"F" + struct.pack(">d", value)
    if type(value) is str:
        return b"S" + _text(value)
    if type(value) is list:
        return b"L" + _u64(len(value)) + b"".join(_reference_enc(item) for item in value)
    assert type(value) is dict
    items = sorted((key.encode("utf-8"), item) for key, item in value.items())
    return b"D" + _u64(len(items)) + b"".join(_u64(len(k)) + k + _reference_enc(v) for k, v in items)


@FAST
@given(extras=_extras, seed=st.integers(0, 2**32 - 1))
def test_extras_digest_is_independent_of_insertion_order(extras: Any, seed: int) -> None:
    digest = compute_extras_digest(extras)
    assert compute_extras_digest(_reorder(extras, random.Random(seed))) == digest
    assert compute_extras_digest(extras) == digest
    expected = hashlib.sha256(b"nemo-gym-staging-extras-v1\x01" + _reference_enc(extras)).hexdigest()
    assert digest == expected


@FAST
@given(extras=st.dictionaries(st.text(max_size=6), _extras_value, min_size=1, max_size=5), data=st.data())
def test_extras_digest_changes_when_a_value_changes(extras: dict[str, Any], data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(extras)))
    replacement = data.draw(_extras_value)
    assume(_reference_enc(replacement) != _reference_enc(extras[key]))
    assert compute_extras_digest({**extras, key: replacement}) != compute_extras_digest(extras)


# --- chain and cumulative hashes ------------------------------------------------------------------

_ids = st.lists(st.integers(0, U64_MAX), max_size=12)


@FAST
@given(a=_ids, b=_ids, parent=st.one_of(st.none(), _hex))
def test_chain_hash_composes_along_the_lineage(a: list[int], b: list[int], parent: str | None) -> None:
    first = compute_chain_hash(parent, a)
    assert compute_chain_hash(parent, a) == first  # deterministic
    two_step = compute_chain_hash(first, b)
    assert two_step == compute_chain_hash(compute_chain_hash(parent, a), b)
    assert two_step != compute_chain_hash(parent, [*a, *b])
    if parent is None:
        assert compute_chain_hash("0" * 64, a) != first  # the parent marker is hashed
    else:
        assert compute_chain_hash(None, a) != first
    if a != b:
        assert compute_chain_hash(parent, b) != first


@FAST
@given(a=_ids, b=_ids)
def test_cumulative_hash_binds_count_and_concatenation(a: list[int], b: list[int]) -> None:
    whole = hash_token_ids([*a, *b])
    assert hash_token_columns(TokenIds.coerce(a), TokenIds.coerce(b)) == whole
    assert hash_token_ids([*a, *b, 0]) != whole
    expected = hashlib.sha256(
        b"nemo-gym-staging-prefix-v2" + _u64(len(a) + len(b)) + b"".join(_u64(x) for x in [*a, *b])
    ).hexdigest()
    assert whole == expected


# --- records ----------------------------------------------------------------------------------------


@st.composite
def records(draw: st.DrawFn) -> StagedCallRecord:
    ids = draw(st.lists(st.integers(0, U64_MAX), min_size=1, max_size=16))
    carry = draw(st.integers(0, len(ids)))
    lps = draw(st.lists(_f32, min_size=len(ids) - carry, max_size=len(ids) - carry))
    child = draw(st.booleans())
    prefix = draw(st.lists(st.integers(0, U64_MAX), min_size=1, max_size=6)) if child else []
    parent_chain = draw(_hex) if child else None
    return StagedCallRecord.from_components(
        rollout_id=draw(_identifier),
        model_call_id=draw(_identifier),
        parent_call_id=draw(_identifier) if child else None,
        mode="token_in" if child else "text",
        prev_len=len(prefix),
        weight_version=draw(st.integers(0, U64_MAX)),
        token_ids_delta=ids,
        token_mask_delta=[0.0] * carry + [1.0] * (len(ids) - carry),
        generation_log_probs_delta=[0.0] * carry + lps,
        chain_hash=compute_chain_hash(parent_chain, ids),
        cumulative_hash=hash_token_ids([*prefix, *ids]),
        extras=draw(_extras),
        schema_version=draw(st.sampled_from([2, 3])),
    )


def _same_record(decoded: StagedCallRecord, record: StagedCallRecord) -> None:
    assert decoded == record
    assert decoded.digest == record.digest
    assert decoded.extras == record.extras
    assert compute_extras_digest(decoded.extras) == record.extras_digest
    assert compute_staging_digest(**decoded.digest_fields()) == record.digest
    assert decoded.token_ids_delta.tolist() == record.token_ids_delta.tolist()
    lps_bits = [struct.pack(">d", x) for x in decoded.generation_log_probs_delta]
    assert lps_bits == [struct.pack(">d", x) for x in record.generation_log_probs_delta]


@MODERATE
@given(record=records())
def test_records_round_trip_through_json_and_msgpack(record: StagedCallRecord) -> None:
    encoded = to_json(record)
    decoded = from_json(encoded, StagedCallRecord)
    _same_record(decoded, record)
    assert to_json(decoded) == encoded
    packed = to_msgpack(record)
    unpacked = from_msgpack(packed, StagedCallRecord)
    _same_record(unpacked, record)
    assert to_msgpack(unpacked) == packed


@MODERATE
@given(record=records(), what=st.sampled_from(["token", "logprob", "weight_version", "extras"]), data=st.data())
def test_decoding_a_tampered_record_is_refused(record: StagedCallRecord, what: str, data: st.DataObject) -> None:
    payload = json.loads(to_json(record))
    expect: type[InvalidRecordError] = DigestMismatchError
    if what == "token":
        i = data.draw(st.integers(0, len(payload["token_ids_delta"]) - 1))
        payload["token_ids_delta"][i] = (payload["token_ids_delta"][i] + 1) % (U64_MAX + 1)
    elif what == "logprob":
        generated = [i for i, m in enumerate(payload["token_mask_delta"]) if m == 1.0]
        if generated:
            i = data.draw(st.sampled_from(generated))
            old = payload["generation_log_probs_delta"][i]
            new = data.draw(_f32.filter(lambda x: struct.pack(">f", x) != struct.pack(">f", old)))
            payload["generation_log_probs_delta"][i] = new
        else:  # only carried positions: a non-zero carry log-prob breaks a structural rule first
            payload["generation_log_probs_delta"][0] = -1.0
            expect = InvalidRecordError
    elif what == "weight_version":
        payload["weight_version"] = (payload["weight_version"] + 1) % (U64_MAX + 1)
    else:
        payload["extras"] = {"tampered": 1} if payload["extras"] is None else None
    with pytest.raises(expect) as info:
        from_json(json.dumps(payload), StagedCallRecord)
    assert isinstance(info.value, StoreError)
    if expect is InvalidRecordError:
        assert not isinstance(info.value, DigestMismatchError)
