"""Golden vectors (wire-contract sections 1, 2 and 11) and the named digest tests of section 9."""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import numpy as np
import pytest
from vectors import REPO_COPY, SHARED_COPY, load_vectors

import store
from store import (
    EMPTY_EXTRAS_DIGEST,
    FloatColumn,
    StoreError,
    build_staging_delta,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from store.wire import digest

# --- loading and decoding the vector file ----------------------------------------------------


def _load_cases() -> list[dict[str, Any]]:
    data = load_vectors()
    assert data[0].get("id") == "_meta", "element 0 of the vector file must be the header"
    return list(data[1:])


CASES = _load_cases()
HEADER_EMPTY_EXTRAS = load_vectors()[0]["empty_extras_digest"]

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# Reject cases whose JSON form cannot carry the native value (see each case's input_notes).
_NATIVE_EXTRAS: dict[str, Any] = {
    "reject.extras_int_key": {1: "x"},
    "reject.extras_tuple": {"v": (1, 2)},
    "reject.extras_bytes": {"v": b"\x00"},
}

_FUNCTIONS = {
    "compute_staging_digest": lambda inputs: compute_staging_digest(**inputs),
    "compute_chain_hash": lambda inputs: compute_chain_hash(inputs["parent_chain_hash"], inputs["token_ids_delta"]),
    "hash_token_ids": lambda inputs: hash_token_ids(inputs["token_ids"]),
    "compute_extras_digest": lambda inputs: compute_extras_digest(inputs["extras"]),
}


def _decode(value: Any) -> Any:
    """Turn the file's {"$float": ...} / {"$bytes": ...} markers into native values."""
    if isinstance(value, dict):
        if set(value) == {"$float"}:
            return _NONFINITE[value["$float"]]
        if set(value) == {"$bytes"}:
            return bytes.fromhex(value["$bytes"])
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


def _f64(hex_pattern: str) -> float:
    return float(struct.unpack(">d", bytes.fromhex(hex_pattern))[0])


def _typed(node: list[Any]) -> Any:
    """Rebuild a value from the tagged tree (tags N, B, I, F, S, L, D)."""
    tag = node[0]
    if tag == "N":
        return None
    if tag == "B":
        assert type(node[1]) is bool
        return node[1]
    if tag == "I":
        return int(node[1])
    if tag == "F":
        return _f64(node[1])
    if tag == "S":
        return node[1]
    if tag == "L":
        return [_typed(item) for item in node[1]]
    if tag == "D":
        return {key: _typed(item) for key, item in node[1]}  # dict keeps the listed insertion order
    raise AssertionError(f"unknown extras tag {tag!r}")


def _inputs(case: dict[str, Any]) -> dict[str, Any]:
    inputs = _decode(case["inputs"])
    exact = case.get("exact")
    function = case["function"]
    if exact and function == "compute_staging_digest":
        inputs["token_ids_delta"] = [int(x) for x in exact["token_ids_delta_decimal"]]
        inputs["token_mask_delta"] = [_f64(h) for h in exact["token_mask_delta_f64_hex"]]
        inputs["generation_log_probs_delta"] = [_f64(h) for h in exact["generation_log_probs_delta_f64_hex"]]
        inputs["weight_version"] = int(exact["weight_version_decimal"])
    elif exact and function == "compute_chain_hash":
        inputs["token_ids_delta"] = [int(x) for x in exact["token_ids_delta_decimal"]]
    elif exact and function == "hash_token_ids":
        inputs["token_ids"] = [int(x) for x in exact["token_ids_decimal"]]
    if "extras_typed" in case:
        inputs["extras"] = _typed(case["extras_typed"])
    if case["id"] in _NATIVE_EXTRAS:
        inputs["extras"] = _NATIVE_EXTRAS[case["id"]]
    return inputs


_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


def _run_case(case: dict[str, Any]) -> None:
    """Raise AssertionError when the library disagrees with the case."""
    function = _FUNCTIONS[case["function"]]
    inputs = _inputs(case)
    expected = case["expected"]
    if expected["ok"]:
        assert function(inputs) == expected["digest"], case["id"]
        return
    error_type = _ERROR_TYPES[expected["error_type"]]
    with pytest.raises(error_type) as info:
        function(inputs)
    assert isinstance(info.value, StoreError), f"{case['id']}: {type(info.value).__name__} is not a StoreError"


# --- the vectors ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_golden_vector(case: dict[str, Any]) -> None:
    _run_case(case)


def test_vector_file_has_at_least_60_cases_and_all_pass() -> None:
    assert len(CASES) >= 60
    ids = [case["id"] for case in CASES]
    assert len(set(ids)) == len(ids), "case ids must be unique"
    categories = {case["category"] for case in CASES}
    assert {"staging_digest", "chain_hash", "cumulative_hash", "extras_digest", "reject"} <= categories
    failures = []
    for case in CASES:
        try:
            _run_case(case)
        except BaseException as exc:
            failures.append(f"{case['id']}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


def test_exact_forms_agree_with_the_plain_inputs() -> None:
    """The hex/decimal 'exact' forms describe the same numbers as the JSON inputs."""
    checked = 0
    for case in CASES:
        exact = case.get("exact")
        if not exact or case["function"] != "compute_staging_digest":
            continue
        plain = _decode(case["inputs"])
        rebuilt = _inputs(case)
        assert rebuilt["token_ids_delta"] == plain["token_ids_delta"], case["id"]
        assert rebuilt["weight_version"] == plain["weight_version"], case["id"]
        for column in ("token_mask_delta", "generation_log_probs_delta"):
            assert [struct.pack(">d", x) for x in rebuilt[column]] == [struct.pack(">d", x) for x in plain[column]]
            f32 = [struct.pack(">f", x).hex() for x in rebuilt[column]]
            assert f32 == exact[f"{column}_f32_hex"], case["id"]
        checked += 1
    assert checked >= 10


def test_staging_vectors_bind_their_extras_payload() -> None:
    cases = [case for case in CASES if "extras_payload_typed" in case]
    assert cases
    for case in cases:
        payload = _typed(case["extras_payload_typed"])
        assert compute_extras_digest(payload) == case["inputs"]["extras_digest"]


def test_derived_inputs_are_reproduced() -> None:
    """Where a case says how its hashes were derived, our helpers derive the same values."""
    cases = [case for case in CASES if "derived_inputs" in case]
    assert cases
    for case in cases:
        inputs = _inputs(case)
        derived = case["derived_inputs"]
        if derived.get("chain_hash") == "compute_chain_hash(None, token_ids_delta)":
            assert compute_chain_hash(None, inputs["token_ids_delta"]) == inputs["chain_hash"]
        if derived.get("cumulative_hash") == "hash_token_ids(token_ids_delta)":
            assert hash_token_ids(inputs["token_ids_delta"]) == inputs["cumulative_hash"]
        if derived.get("extras_digest") == "compute_extras_digest(None)":
            assert compute_extras_digest(None) == inputs["extras_digest"]


GYM_SCHEMA2 = "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"
GYM_SCHEMA3 = "cdd62002cf93637646f8501ae816eada76e315885219455f53a09dd5a86580f2"
GYM_EXTRAS = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"


def test_gym_golden_digests_are_among_the_vectors() -> None:
    expected = {case["expected"].get("digest") for case in CASES if case["expected"]["ok"]}
    assert {GYM_SCHEMA2, GYM_SCHEMA3, GYM_EXTRAS} <= expected
    assert compute_extras_digest({"routed_experts": [[[1, 2]], [[3, 4]]]}) == GYM_EXTRAS


def _gym_golden_inputs(schema_version: int) -> dict[str, Any]:
    return {
        "schema_version": schema_version,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": "parent-1",
        "mode": "token_in",
        "prev_len": 3,
        "delta_len": 2,
        "cum_len": 5,
        "weight_version": 7,
        "token_ids_delta": [10, 11],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.25],
        "extras_digest": GYM_EXTRAS,
        "chain_hash": "1" * 64,
        "cumulative_hash": "2" * 64,
    }


def test_digest_golden_vectors() -> None:
    """Gym's named test: golden digests for both schemas, key order, and IDS count binding."""
    assert compute_staging_digest(**_gym_golden_inputs(2)) == GYM_SCHEMA2
    assert compute_staging_digest(**_gym_golden_inputs(3)) == GYM_SCHEMA3
    forward = {"a": 1, "b": [2.5, None], "c": {"x": "y", "w": True}}
    backward = {"c": {"w": True, "x": "y"}, "b": [2.5, None], "a": 1}
    assert compute_extras_digest(forward) == compute_extras_digest(backward)
    assert hash_token_ids([1]) != hash_token_ids([1, 0])
    assert hash_token_ids([]) != hash_token_ids([0])
    assert compute_chain_hash(None, [1]) != compute_chain_hash(None, [1, 0])


def test_empty_extras_digest_value() -> None:
    expected = "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
    assert expected == EMPTY_EXTRAS_DIGEST == HEADER_EMPTY_EXTRAS == store.EMPTY_EXTRAS_DIGEST
    assert compute_extras_digest(None) == EMPTY_EXTRAS_DIGEST
    assert compute_extras_digest({}) != EMPTY_EXTRAS_DIGEST


# --- named digest tests (section 9) -----------------------------------------------------------


def _valid_child(**overrides: Any) -> dict[str, Any]:
    fields = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "rollout-1",
        "model_call_id": "c",
        "parent_call_id": "p",
        "mode": "token_in",
        "prev_len": 2,
        "delta_len": 2,
        "cum_len": 4,
        "weight_version": 7,
        "token_ids_delta": [3, 4],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.5],
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": "a" * 64,
        "cumulative_hash": "b" * 64,
    }
    fields.update(overrides)
    return fields


def test_valid_child_fixture_hashes() -> None:
    assert digest.is_digest_hex(compute_staging_digest(**_valid_child()))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("schema_version", 1),
        ("schema_version", 4),
        ("schema_version", True),
        ("schema_version", 2.0),
        ("digest_version", 1),
        ("digest_version", 3),
        ("digest_version", True),
        ("extras_digest_version", 0),
        ("extras_digest_version", 2),
        ("extras_digest_version", True),
    ],
)
def test_digest_rejects_unknown_versions(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match="unsupported") as info:
        compute_staging_digest(**_valid_child(**{field: value}))
    assert isinstance(info.value, StoreError)


def test_digest_accepts_schema_3_and_hashes_the_schema_byte() -> None:
    assert compute_staging_digest(**_valid_child(schema_version=3)) != compute_staging_digest(**_valid_child())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_digest_rejects_nonfinite_numbers(bad: float) -> None:
    # a generated position
    with pytest.raises(ValueError) as info:
        compute_staging_digest(**_valid_child(generation_log_probs_delta=[0.0, bad]))
    assert isinstance(info.value, StoreError)
    # a carried position
    with pytest.raises(ValueError):
        compute_staging_digest(**_valid_child(generation_log_probs_delta=[bad, -0.5]))
    # the mask
    with pytest.raises(ValueError):
        compute_staging_digest(**_valid_child(token_mask_delta=[0.0, bad]))
    # extras, at the top and nested
    for extras in ({"v": bad}, {"v": [[bad]]}, {"v": {"w": [1, bad]}}):
        with pytest.raises(ValueError) as info:
            compute_extras_digest(extras)
        assert isinstance(info.value, StoreError)


class _DictSub(dict):  # type: ignore[type-arg]
    pass


class _IntSub(int):
    pass


@pytest.mark.parametrize(
    ("extras", "error"),
    [
        ({1: "x"}, TypeError),
        ({"v": {2: "x"}}, TypeError),
        ({"v": (1, 2)}, TypeError),
        ({"v": b"\x00"}, TypeError),
        ({"v": {1, 2}}, TypeError),
        ({"v": np.int64(1)}, TypeError),
        ({"v": _DictSub(a=1)}, TypeError),
        ({"v": _IntSub(1)}, TypeError),
        ({"v": [1] * 40 + [_IntSub(1)]}, TypeError),
        ([1, 2], TypeError),
        ("abc", TypeError),
        ({"v": 2**80}, ValueError),
        ({"v": 2**63}, ValueError),
        ({"v": -(2**63) - 1}, ValueError),
        ({"v": [1] * 40 + [2**63]}, ValueError),
        ({"v": [1] * 40 + [2**80]}, ValueError),
        ({"v": "\ud800"}, ValueError),
    ],
    ids=[
        "int-key",
        "nested-int-key",
        "tuple",
        "bytes",
        "set",
        "numpy-scalar",
        "nested-dict-subclass",
        "int-subclass",
        "int-subclass-in-long-list",
        "top-level-list",
        "top-level-str",
        "2**80",
        "2**63",
        "-2**63-1",
        "2**63-in-long-list",
        "2**80-in-long-list",
        "lone-surrogate",
    ],
)
def test_extras_reject_ambiguous_or_unsupported_types(extras: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        compute_extras_digest(extras)
    assert isinstance(info.value, StoreError)


def _reference_enc(value: Any) -> bytes:
    """Section 2.4's ENC, written directly from the table (exact types only)."""
    if value is None:
        return b"N"
    if type(value) is bool:
        return b"B" + bytes([value])
    if type(value) is int:
        return b"I" + value.to_bytes(8, "big", signed=True)
    if type(value) is float:
        return b"F" + struct.pack(">d", value)
    if type(value) is str:
        raw = value.encode("utf-8")
        return b"S" + struct.pack(">Q", len(raw)) + raw
    if type(value) is list:
        return b"L" + struct.pack(">Q", len(value)) + b"".join(_reference_enc(item) for item in value)
    if type(value) is dict:
        items = sorted((key.encode("utf-8"), item) for key, item in value.items())
        body = b"".join(struct.pack(">Q", len(key)) + key + _reference_enc(item) for key, item in items)
        return b"D" + struct.pack(">Q", len(items)) + body
    raise AssertionError(type(value))


def _reference_extras_digest(extras: Any) -> str:
    return hashlib.sha256(b"nemo-gym-staging-extras-v1\x01" + _reference_enc(extras)).hexdigest()


@pytest.mark.parametrize(
    "extras",
    [
        {"v": [2**63 - 1, -(2**63), 0, -1, 5] * 10},
        {"v": list(range(33))},
        {"v": list(range(32))},
        {"v": [[1] * 40, [True] * 40, [1.0] * 40]},
        {"v": [*range(40), None]},
        {"\uffff": 1, "\U0001f600": 2, "a": 3, "\u00e9": [0.0, -0.0, 5e-324]},
    ],
    ids=["i64-edges-long", "33-ints", "32-ints", "ints-bools-floats", "ints-then-null", "utf8-key-order"],
)
def test_extras_digest_matches_the_tagged_encoding(extras: Any) -> None:
    # Long all-int lists take a bulk path; it must hash exactly like item-by-item encoding.
    assert compute_extras_digest(extras) == _reference_extras_digest(extras)


def test_extras_keys_sort_by_utf8_bytes_and_ints_differ_from_floats() -> None:
    assert compute_extras_digest({"one": 1}) != compute_extras_digest({"one": 1.0})
    assert compute_extras_digest({"z": -0.0}) != compute_extras_digest({"z": 0.0})
    a = {"\uffff": 1, "\U0001f600": 2, "a": 3}
    b = {"\U0001f600": 2, "a": 3, "\uffff": 1}
    assert compute_extras_digest(a) == compute_extras_digest(b)


# --- float32 rules (2.5) -----------------------------------------------------------------------


@pytest.mark.parametrize("mask", [[0, 1.0], [0.0, 1], [0.0, True], [False, 1.0]], ids=["int0", "int1", "True", "False"])
def test_mask_must_be_exact_floats(mask: list[Any]) -> None:
    with pytest.raises(ValueError) as info:
        compute_staging_digest(**_valid_child(token_mask_delta=mask))
    assert isinstance(info.value, StoreError)


@pytest.mark.parametrize("lps", [[0, -0.5], [0.0, -1], [0.0, True]], ids=["int0", "int-1", "bool"])
def test_log_probs_must_be_exact_floats(lps: list[Any]) -> None:
    with pytest.raises(ValueError):
        compute_staging_digest(**_valid_child(generation_log_probs_delta=lps))


def _lp_digest(value: float) -> str:
    return compute_staging_digest(**_valid_child(generation_log_probs_delta=[0.0, value]))


def test_float32_overflow_is_refused_and_flt_max_is_accepted() -> None:
    for too_big in (-1e39, 1e39, 2.0**128 - 2.0**103):  # the last is FLT_MAX + half an ulp: ties to inf
        with pytest.raises(ValueError):
            _lp_digest(too_big)
    flt_max = float(np.finfo(np.float32).max)
    assert _lp_digest(3.4028235e38) == _lp_digest(flt_max)
    assert _lp_digest(flt_max + 2.0**102) == _lp_digest(flt_max)  # just under the tie rounds down
    assert _lp_digest(-3.4028235e38) == _lp_digest(-flt_max)
    assert _lp_digest(-flt_max) != _lp_digest(flt_max)


def test_float32_rounding_underflow_and_subnormals() -> None:
    neg_zero = _lp_digest(-0.0)
    assert _lp_digest(-1e-50) == neg_zero
    assert _lp_digest(-5e-324) == neg_zero
    assert neg_zero != _lp_digest(0.0)
    smallest = -1.401298464324817e-45  # binary32 pattern 0x80000001
    assert _lp_digest(smallest) != neg_zero
    assert _lp_digest(smallest) == _lp_digest(float(np.float32(smallest)))
    assert _lp_digest(-1e-40) != neg_zero  # a binary32 subnormal is kept
    assert _lp_digest(-0.1) == _lp_digest(float(np.float32(-0.1)))
    assert _lp_digest(-0.1) != _lp_digest(-0.10000001)  # one binary32 ulp apart


def test_negative_zero_mask_is_accepted_but_hashes_differently() -> None:
    positive = compute_staging_digest(**_valid_child(token_mask_delta=[0.0, 1.0]))
    negative = compute_staging_digest(**_valid_child(token_mask_delta=[-0.0, 1.0]))
    assert positive != negative
    # -0.0 also counts as a carry log-prob of 0.0
    carry = compute_staging_digest(**_valid_child(generation_log_probs_delta=[-0.0, -0.5]))
    assert carry != positive


def test_float32_bit_patterns_of_a_validated_column() -> None:
    values = [0.0, -0.1, -1e-50, -1.401298464324817e-45, 3.4028235e38, -0.0, -1e-40]
    column = FloatColumn.coerce(values, "log_probs")
    raw = column.big_endian_f32().tobytes()
    patterns = [raw[i : i + 4].hex() for i in range(0, len(raw), 4)]
    assert patterns == ["00000000", "bdcccccd", "80000000", "80000001", "7f7fffff", "80000000", "800116c2"]


# --- build_staging_delta (2.7) -------------------------------------------------------------------


def test_build_staging_delta_layout_and_errors() -> None:
    columns = build_staging_delta([1, 2, 3, 4], [7, 8], [-0.5, -0.25], 1)
    assert columns.token_ids.tolist() == [2, 3, 4, 7, 8]
    assert columns.token_mask.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert columns.log_probs.tolist() == [0.0, 0.0, 0.0, -0.5, -0.25]

    whole = build_staging_delta([1, 2], [9], [-1.5], 0)
    assert whole.token_ids.tolist() == [1, 2, 9]
    generation_only = build_staging_delta([1, 2], [9], [-1.5], 2)
    assert generation_only.token_ids.tolist() == [9]
    assert generation_only.token_mask.tolist() == [1.0]
    carry_only = build_staging_delta([1, 2, 3], [], [], 1)
    assert carry_only.token_ids.tolist() == [2, 3]
    assert carry_only.token_mask.tolist() == [0.0, 0.0]
    assert carry_only.log_probs.tolist() == [0.0, 0.0]

    for prev_len in (-1, 5, True):
        with pytest.raises(ValueError, match="outside prompt length") as info:
            build_staging_delta([1, 2, 3, 4], [7], [-0.5], prev_len)
        assert isinstance(info.value, StoreError)
    with pytest.raises(ValueError, match="lengths differ"):
        build_staging_delta([1, 2], [7, 8], [-0.5], 0)
    with pytest.raises(ValueError, match="lengths differ"):
        build_staging_delta([1, 2], [7], [-0.5, -0.25], 0)
    for prompt, prev_len in (([1, 2], 2), ([], 0)):
        with pytest.raises(ValueError, match="empty") as info:
            build_staging_delta(prompt, [], [], prev_len)
        assert isinstance(info.value, StoreError)
    for bad_lps in ([math.nan], [math.inf], [0], [True]):
        with pytest.raises(ValueError):
            build_staging_delta([1], [2], bad_lps, 0)
    with pytest.raises(ValueError):
        build_staging_delta([1], [-2], [-0.5], 0)
    with pytest.raises(ValueError):
        build_staging_delta([-1], [2], [-0.5], 0)


def test_build_staging_delta_columns_hash_like_the_same_plain_values() -> None:
    """The packed columns must carry big-endian binary32 patterns, like any validated column."""
    columns = build_staging_delta([1, 2, 3, 4], [7, 8], [-0.5, -0.25], 1)
    digest = compute_staging_digest(
        **_valid_child(
            prev_len=1,
            delta_len=5,
            cum_len=6,
            token_ids_delta=columns.token_ids,
            token_mask_delta=columns.token_mask,
            generation_log_probs_delta=columns.log_probs,
        )
    )
    plain = compute_staging_digest(
        **_valid_child(
            prev_len=1,
            delta_len=5,
            cum_len=6,
            token_ids_delta=[2, 3, 4, 7, 8],
            token_mask_delta=[0.0, 0.0, 0.0, 1.0, 1.0],
            generation_log_probs_delta=[0.0, 0.0, 0.0, -0.5, -0.25],
        )
    )
    assert digest == plain
    assert columns.token_mask == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert columns.log_probs == [0.0, 0.0, 0.0, -0.5, -0.25]
    raw = columns.token_mask.big_endian_f32().tobytes()
    assert raw == bytes.fromhex("00000000" * 3 + "3f800000" * 2)


@pytest.mark.skipif(not SHARED_COPY.exists(), reason="no shared/ folder beside the repo")
def test_repo_copy_of_the_vectors_matches_shared() -> None:
    assert REPO_COPY.read_bytes() == SHARED_COPY.read_bytes(), "tests/data/vectors.json is stale; copy it again"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0123456789abcdef" * 4, True),
        ("0123456789ABCDEF" * 4, False),  # upper case
        ("0123456789abcdef" * 4 + "\n", False),  # a trailing newline (a regex ``$`` would take it)
        ("0123456789abcdef" * 4 + "0", False),
        (("0123456789abcdef" * 4)[:-1], False),
        (" " + ("0123456789abcdef" * 4)[1:], False),  # bytes.fromhex would skip the space
        ("\u0660" + ("0123456789abcdef" * 4)[1:], False),  # an Arabic-Indic digit: a digit, not hex
        (("0123456789abcdef" * 4)[:-1] + "g", False),
        (b"ab" * 32, False),
        (None, False),
    ],
)
def test_a_digest_is_exactly_64_lowercase_hex_characters(value: object, expected: bool) -> None:
    assert digest.is_digest_hex(value) is expected
