"""NeMo Gym-compatible staging digests (wire-contract section 2), as pure functions.

Byte-identical with Gym for schema 2 and schema 3: the only difference between them is
the schema byte hashed first, so a record's own ``schema_version`` decides.  Columns are
validated and packed in bulk (numpy), never token by token.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from store.errors import DigestTypeError, DigestValueError
from store.wire.columns import FloatColumn, TokenIds

STAGING_CALL_DOMAIN = b"nemo-gym-staging-call-v2"
EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
CUMULATIVE_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"

SUPPORTED_SCHEMA_VERSIONS = (2, 3)
STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1
CAPTURE_MODES = ("text", "token_in")
# How deeply extras may nest: the extras mapping is level 1, each list or dict inside adds one.
# 255 is the deepest NeMo Gym 0.7.0 can write out (pydantic's JSON serializer refuses deeper),
# so every record Gym writes is storable.  Deeper extras, and extras that contain themselves,
# are refused wherever they enter, so every acknowledged record decodes and re-hashes in a
# bounded stack, well below Python's recursion limit.
EXTRAS_MAX_DEPTH: Final = 255

_U64_MAX = 2**64 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
# Exactly 64 lowercase hex characters (ASCII ranges only); checked for every digest field of
# every record, receipt row and chain link, so the check runs in C.
_HEX_DIGEST = re.compile("[0-9a-f]{64}").fullmatch
_PACK_U64 = struct.Struct(">Q").pack
_PACK_F64 = struct.Struct(">d").pack


# --- primitives (wire-contract section 1) ----------------------------------------------


def u64(value: Any, name: str = "value") -> bytes:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise DigestValueError(f"{name} must be an int in [0, 2**64-1] (a bool is refused), got {value!r}")
    return _PACK_U64(value)


def _text(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise DigestTypeError(f"{name} must be a string, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DigestValueError(f"{name} is not encodable as UTF-8: {exc.reason}") from exc
    return _PACK_U64(len(raw)) + raw


def is_digest_hex(value: Any) -> bool:
    return isinstance(value, str) and _HEX_DIGEST(value) is not None


def hex_digest_bytes(value: Any, name: str) -> bytes:
    """``HEXDIGEST``: 32 raw bytes from exactly 64 lowercase hex characters."""
    if not is_digest_hex(value):
        raise DigestValueError(f"{name} must be 64 lowercase hex characters, got {value!r}")
    return bytes.fromhex(value)


def _present_digest(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise DigestTypeError(f"{name} must be a hex digest string, got {type(value).__name__}")
    return b"\x01" + hex_digest_bytes(value, name)


# --- chain and cumulative hashes (2.2, 2.3) --------------------------------------------


def encode_token_ids(token_ids: Any) -> bytes:
    """IDS(ids): the count, then each id, as big-endian u64 (the bytes the chain and cumulative
    hashes hash; NeMo Gym's function of the same name)."""
    ids = TokenIds.coerce(token_ids, "token ids")
    return _PACK_U64(len(ids)) + bytes(ids.big_endian().data)


def hash_token_ids(token_ids: Any) -> str:
    """Cumulative hash: SHA256(prefix domain || IDS(ids))."""
    return hash_token_columns(TokenIds.coerce(token_ids, "token ids"))


def hash_token_columns(*parts: TokenIds) -> str:
    """The cumulative hash of the concatenation of ``parts``, without concatenating them."""
    hasher = hashlib.sha256(CUMULATIVE_DOMAIN)
    hasher.update(_PACK_U64(sum(len(p) for p in parts)))
    for part in parts:
        hasher.update(part.big_endian().data)
    return hasher.hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Any) -> str:
    """Chain hash: SHA256(chain domain || parent presence || IDS(delta))."""
    delta = TokenIds.coerce(token_ids_delta, "token_ids_delta")
    parent = (
        b"\x00" if parent_chain_hash is None else b"\x01" + hex_digest_bytes(parent_chain_hash, "parent chain hash")
    )
    hasher = hashlib.sha256(CHAIN_DOMAIN)
    hasher.update(parent)
    hasher.update(_PACK_U64(len(delta)))
    hasher.update(delta.big_endian().data)
    return hasher.hexdigest()


# --- extras digest (2.4) ---------------------------------------------------------------


def compute_extras_digest(extras: Any) -> str:
    if extras is None:
        normalized: dict[str, Any] | None = None
    elif isinstance(extras, Mapping):
        normalized = dict(extras)
    else:
        raise DigestTypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    out: list[bytes] = [EXTRAS_DOMAIN, bytes([EXTRAS_DIGEST_VERSION])]
    _encode_extras(normalized, out)
    hasher = hashlib.sha256()
    for chunk in out:
        hasher.update(chunk)
    return hasher.hexdigest()


def _encode_extras(root: Any, out: list[bytes]) -> None:
    """``ENC`` of 2.4 without recursion: an explicit stack of the containers being encoded.

    Python's stack never limits what can be hashed, so what is refused is decided here:
    nesting deeper than ``EXTRAS_MAX_DEPTH``, or a container that contains itself.
    """
    pending: list[Iterator[Any]] = [iter((root,))]
    path: list[int] = []  # ids of the containers on the way down (one per pending level below the root)
    while pending:
        for value in pending[-1]:
            children = _encode_extras_value(value, out)
            if children is not None:
                _descend(value, path)
                pending.append(children)
                break
        else:
            pending.pop()
            if path:
                path.pop()


def _descend(container: Any, path: list[int]) -> None:
    if id(container) in path:
        raise DigestValueError("extras contain themselves (a list or dict nested inside itself)")
    if len(path) >= EXTRAS_MAX_DEPTH:
        raise DigestValueError(f"extras nest deeper than EXTRAS_MAX_DEPTH = {EXTRAS_MAX_DEPTH} levels")
    path.append(id(container))


def check_nesting(value: Any, what: str = "extras") -> None:
    """Refuse a payload nested deeper than ``EXTRAS_MAX_DEPTH`` or containing itself (no recursion).

    ``value`` itself is level 1 when it is a container; lists, tuples and dicts count.
    """
    pending: list[Iterator[Any]] = [iter((value,))]
    path: list[int] = []
    try:
        while pending:
            for item in pending[-1]:
                if type(item) in _CONTAINERS:
                    _descend(item, path)
                    pending.append(iter(item.values() if type(item) is dict else item))
                    break
            else:
                pending.pop()
                if path:
                    path.pop()
    except DigestValueError as exc:
        raise DigestValueError(f"{what}: {exc}") from None


_CONTAINERS = frozenset({list, tuple, dict})


def _encode_extras_value(value: Any, out: list[bytes]) -> Iterator[Any] | None:
    """Encode a scalar, or a container's header; returns the container's items still to encode."""
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"B\x01" if value else b"B\x00")
    elif kind is int:
        if not _I64_MIN <= value <= _I64_MAX:
            raise DigestValueError(f"extras integer {value} is outside the signed 64-bit range")
        out.append(b"I" + value.to_bytes(8, "big", signed=True))
    elif kind is float:
        if not math.isfinite(value):
            raise DigestValueError(f"extras float {value!r} must be finite")
        out.append(b"F" + _PACK_F64(value))
    elif kind is str:
        out.append(b"S" + _text(value, "extras string"))
    elif kind is list:
        out.append(b"L" + _PACK_U64(len(value)))
        if len(value) > 32 and set(map(type, value)) == {int}:
            out.append(_bulk_tagged_ints(value))
            return iter(())  # still a nesting level: the depth limit counts containers, not their contents
        items: list[Any] = value
        return iter(items)
    elif kind is dict:
        for key in value:
            if type(key) is not str:
                raise DigestTypeError(f"extras keys must be exact strings, got {type(key).__name__}")
        encoded = sorted(((_utf8(key), item) for key, item in value.items()), key=_first)
        out.append(b"D" + _PACK_U64(len(encoded)))
        return _dict_values(encoded, out)
    else:
        raise DigestTypeError(f"extras cannot encode a value of type {kind.__name__}")
    return None


def _dict_values(encoded: list[tuple[bytes, Any]], out: list[bytes]) -> Iterator[Any]:
    """A dict's values in key order, each preceded in ``out`` by its encoded key."""
    for key_bytes, item in encoded:
        out.append(_PACK_U64(len(key_bytes)) + key_bytes)
        yield item


def _utf8(key: str) -> bytes:
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DigestValueError(f"extras key is not encodable as UTF-8: {exc.reason}") from exc


def _first(pair: tuple[bytes, Any]) -> bytes:
    return pair[0]


_TAGGED_I64 = np.dtype([("tag", "S1"), ("value", ">i8")])


def _bulk_tagged_ints(values: list[int]) -> bytes:
    try:
        packed = np.array(values, dtype=np.int64)
    except OverflowError as exc:
        raise DigestValueError("an extras integer is outside the signed 64-bit range") from exc
    tagged = np.empty(len(values), dtype=_TAGGED_I64)
    tagged["tag"] = b"I"
    tagged["value"] = packed
    return tagged.tobytes()


EMPTY_EXTRAS_DIGEST = compute_extras_digest(None)
_EMPTY_EXTRAS_RAW = bytes.fromhex(EMPTY_EXTRAS_DIGEST)


# --- staged-call digest (2.6) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PackedColumns:
    """The three validated columns of a staged call."""

    token_ids: TokenIds
    token_mask: FloatColumn
    log_probs: FloatColumn


def compute_staging_digest(**fields: Any) -> str:
    """The staged-call digest of the seventeen fields of wire-contract 2.6 (validated in order)."""
    digest, _ = staging_digest_and_columns(**fields)
    return digest


def staging_digest_and_columns(**fields: Any) -> tuple[str, PackedColumns]:
    """Validate, pack and hash in one pass; the packed columns are returned for reuse.

    Every refusal is a ``DigestValueError`` or ``DigestTypeError`` (also the builtin
    ``ValueError``/``TypeError`` that Gym raises for the same input).
    """
    try:
        return _staging_digest_and_columns(**fields)
    except (DigestValueError, DigestTypeError):
        raise
    except TypeError as exc:  # a missing or unknown field, len() of a non-sequence, ...
        raise DigestTypeError(f"staged-call digest input has a wrong type: {exc}") from exc
    except ValueError as exc:
        raise DigestValueError(f"staged-call digest input is invalid: {exc}") from exc


def _staging_digest_and_columns(
    *,
    schema_version: Any,
    digest_version: Any,
    extras_digest_version: Any,
    rollout_id: Any,
    model_call_id: Any,
    parent_call_id: Any,
    mode: Any,
    prev_len: Any,
    delta_len: Any,
    cum_len: Any,
    weight_version: Any,
    token_ids_delta: Any,
    token_mask_delta: Any,
    generation_log_probs_delta: Any,
    extras_digest: Any,
    chain_hash: Any,
    cumulative_hash: Any,
) -> tuple[str, PackedColumns]:
    _check_versions(schema_version, digest_version, extras_digest_version)
    if not rollout_id or not model_call_id:
        raise DigestValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise DigestValueError("parent_call_id must be None for a root, never the empty string")
    if mode not in CAPTURE_MODES:
        raise DigestValueError(f"mode must be 'text' or 'token_in' for a staged record, got {mode!r}")
    if parent_call_id is None:
        if prev_len != 0 or mode != "text":
            raise DigestValueError("a record without a parent must be text mode with prev_len 0")
    elif prev_len == 0 or mode != "token_in":
        raise DigestValueError("a record with a parent must be token_in mode with prev_len > 0")
    if delta_len == 0:
        raise DigestValueError("delta_len must not be 0: a staged delta holds at least one token")
    if delta_len != len(token_ids_delta):
        raise DigestValueError(f"delta_len {delta_len!r} != len(token_ids_delta) {len(token_ids_delta)}")
    if not len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta):
        raise DigestValueError("token_ids_delta, token_mask_delta and generation_log_probs_delta differ in length")
    columns = PackedColumns(
        TokenIds.coerce(token_ids_delta, "token_ids_delta"),
        FloatColumn.coerce(token_mask_delta, "token_mask_delta"),
        FloatColumn.coerce(generation_log_probs_delta, "generation_log_probs_delta"),
    )
    check_mask_and_carry(columns.token_mask, columns.log_probs)
    if cum_len != prev_len + delta_len:
        raise DigestValueError(f"cum_len {cum_len!r} != prev_len {prev_len!r} + delta_len {delta_len!r}")
    delta_bytes = u64(delta_len, "delta_len")
    cum_bytes = u64(cum_len, "cum_len")
    extras_raw = hex_digest_bytes(extras_digest, "extras_digest")

    count = len(columns.token_ids)
    float_header = _PACK_U64(8 + 4 * count) + _PACK_U64(count)
    # The small fields join into one update each side of the columns (the same bytes).
    hasher = hashlib.sha256(
        _preimage_head(
            (schema_version, digest_version, extras_digest_version),
            rollout_id,
            model_call_id,
            parent_call_id,
            mode,
            prev_len,
            delta_bytes,
            cum_bytes,
            weight_version,
            count,
        )
    )
    tail = extras_raw + _present_digest(chain_hash, "chain_hash") + _present_digest(cumulative_hash, "cumulative_hash")
    hasher.update(columns.token_ids.big_endian().data)
    hasher.update(float_header)
    hasher.update(columns.token_mask.big_endian_f32().data)
    hasher.update(float_header)
    hasher.update(columns.log_probs.big_endian_f32().data)
    hasher.update(tail)
    return hasher.hexdigest(), columns


_F32_ZERO_BE = b"\x00\x00\x00\x00"
_F32_ONE_BE = b"\x3f\x80\x00\x00"


def live_prefix_digest(
    *,
    schema_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    weight_version: int,
    parent_chain_hash: str | None,
    prompt: TokenIds,
    generated: TokenIds,
    generated_log_probs: FloatColumn,
) -> str:
    """The staged-call digest of the prefix record ``build_staging_delta`` makes of a live call
    (the prompt after ``prev_len`` as carry, then the generation; no extras), hashed in parts:
    no column, chain or record is built.  For columns already validated (a cut's own buffers,
    whose chunk records are checked as they are staged); any other input goes through
    ``compute_staging_digest``."""
    carry = len(prompt) - prev_len
    count = carry + len(generated)
    if carry < 0 or count == 0 or len(generated) != len(generated_log_probs):
        raise DigestValueError("a live prefix needs prev_len within the prompt and aligned, non-empty columns")
    prompt_tail = prompt.big_endian()[prev_len:]
    ids_header = _PACK_U64(count)
    chain = hashlib.sha256(CHAIN_DOMAIN)
    chain.update(
        b"\x00" if parent_chain_hash is None else b"\x01" + hex_digest_bytes(parent_chain_hash, "parent chain")
    )
    chain.update(ids_header)
    chain.update(prompt_tail.data)
    chain.update(generated.big_endian().data)
    cumulative = hashlib.sha256(CUMULATIVE_DOMAIN)
    cumulative.update(_PACK_U64(len(prompt) + len(generated)))
    cumulative.update(prompt.big_endian().data)
    cumulative.update(generated.big_endian().data)
    float_header = _PACK_U64(8 + 4 * count) + ids_header
    hasher = hashlib.sha256(
        _preimage_head(
            (schema_version, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION),
            rollout_id,
            model_call_id,
            parent_call_id,
            mode,
            prev_len,
            ids_header,
            u64(prev_len + count, "cum_len"),
            weight_version,
            count,
        )
    )
    hasher.update(prompt_tail.data)
    hasher.update(generated.big_endian().data)
    hasher.update(float_header)
    hasher.update(_F32_ZERO_BE * carry + _F32_ONE_BE * len(generated))
    hasher.update(float_header)
    hasher.update(_F32_ZERO_BE * carry)
    hasher.update(generated_log_probs.big_endian_f32().data)
    hasher.update(_EMPTY_EXTRAS_RAW + b"\x01" + chain.digest() + b"\x01" + cumulative.digest())
    return hasher.hexdigest()


def _preimage_head(
    versions: tuple[int, int, int],
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_bytes: bytes,
    cum_bytes: bytes,
    weight_version: int,
    count: int,
) -> bytes:
    """The staging digest's preimage up to the token ids' bytes (their header included): the
    one layout both the write side and the audit's stored-bytes path hash."""
    return b"".join(
        (
            STAGING_CALL_DOMAIN,
            bytes(versions),
            _text(rollout_id, "rollout_id"),
            _text(model_call_id, "model_call_id"),
            b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id, "parent_call_id"),
            _text(mode, "mode"),
            u64(prev_len, "prev_len"),
            delta_bytes,
            cum_bytes,
            u64(weight_version, "weight_version"),
            _PACK_U64(8 + 8 * count),
            _PACK_U64(count),
        )
    )


# The stored forms the audit's fast path reads (store.wire.columns: encode_ids, encode_mask, encode_floats).
_STORED_IDS: dict[bytes, np.dtype[Any]] = {b"4": np.dtype("<u4"), b"8": np.dtype("<u8")}
_STORED_RUN_MASK = b"R"
_STORED_F32 = b"F"
_U64_BE = np.dtype(">u8")
_U32_BE = np.dtype(">u4")
_ZERO_F32 = b"\x00\x00\x00\x00"
_ONE_F32 = b"\x3f\x80\x00\x00"


def _stored_hex(value: Any) -> bytes:
    """``hex_digest_bytes`` for exact strings (what a decoded body holds), in C: the raw bytes
    of exactly 64 lowercase hex characters; ValueError for anything else."""
    if type(value) is not str or len(value) != 64:
        raise ValueError("not a hex digest")
    raw = bytes.fromhex(value)
    if raw.hex() != value:  # uppercase, or whitespace that fromhex skips
        raise ValueError("not a lowercase hex digest")
    return raw


def stored_record_digest(
    body: Any, token_ids: bytes, token_mask: bytes, log_probs: bytes
) -> tuple[str, TokenIds] | None:
    """A stored record's staging digest hashed from its stored column bytes, and its token ids.

    A read-side fast path for the common layout (u32 or u64 ids, a carry-then-generation
    mask, raw binary32 log-probs): it makes every check ``staging_digest_and_columns`` makes
    and hashes the same bytes, without building float columns.  None when anything is
    unusual or invalid: the caller then runs ``staging_digest_and_columns``, which names it.
    """
    try:
        dtype = _STORED_IDS.get(token_ids[:1])
        if dtype is None or len(token_ids) % dtype.itemsize != 1:
            return None
        ids = np.frombuffer(token_ids, dtype=dtype, offset=1).astype(_U64_BE)
        count = len(ids)
        if len(token_mask) != 17 or token_mask[:1] != _STORED_RUN_MASK:
            return None
        if log_probs[:1] != _STORED_F32 or len(log_probs) != 1 + 4 * count:
            return None
        carry = int.from_bytes(token_mask[1:9], "big")
        if int.from_bytes(token_mask[9:17], "big") != count or carry > count:
            return None
        # A carry position (mask 0.0) must have log-prob 0.0 (-0.0 passes: the sign bit is
        # ignored).  All-zero bytes hold exactly ``carry`` non-overlapping zero words (one
        # nonzero byte leaves fewer); only otherwise are the words read as numbers.
        if (
            carry
            and log_probs.count(_ZERO_F32, 1, 1 + 4 * carry) != carry
            and (np.frombuffer(log_probs, dtype=_U32_BE, count=carry, offset=1) & 0x7FFFFFFF).any()
        ):
            return None
        schema_version, parent_call_id, mode = body.schema_version, body.parent_call_id, body.mode
        prev_len, delta_len, cum_len = body.prev_len, body.delta_len, body.cum_len
        _check_versions(schema_version, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
        if not body.rollout_id or not body.model_call_id or parent_call_id == "" or mode not in CAPTURE_MODES:
            return None
        if (prev_len != 0 or mode != "text") if parent_call_id is None else (prev_len == 0 or mode != "token_in"):
            return None
        if delta_len == 0 or delta_len != count or cum_len != prev_len + delta_len:
            return None
        delta_bytes, cum_bytes = u64(delta_len, "delta_len"), u64(cum_len, "cum_len")
        extras_raw = _stored_hex(body.extras_digest)
        head = _preimage_head(
            (schema_version, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION),
            body.rollout_id,
            body.model_call_id,
            parent_call_id,
            mode,
            prev_len,
            delta_bytes,
            cum_bytes,
            body.weight_version,
            count,
        )
        tail = b"".join(
            (
                extras_raw,
                b"\x01",
                _stored_hex(body.chain_hash),
                b"\x01",
                _stored_hex(body.cumulative_hash),
            )
        )
    except (DigestValueError, DigestTypeError, ValueError, TypeError, OverflowError):
        return None
    float_header = _PACK_U64(8 + 4 * count) + _PACK_U64(count)
    hasher = hashlib.sha256(head)
    hasher.update(ids.data)
    hasher.update(b"".join((float_header, _ZERO_F32 * carry, _ONE_F32 * (count - carry), float_header)))
    hasher.update(memoryview(log_probs)[1:])
    hasher.update(tail)
    return hasher.hexdigest(), TokenIds(ids)


def _check_versions(schema_version: Any, digest_version: Any, extras_digest_version: Any) -> None:
    if type(schema_version) is not int or schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        raise DigestValueError(f"unsupported schema_version {schema_version!r}; supported: 2 and 3")
    if type(digest_version) is not int or digest_version != STAGING_DIGEST_VERSION:
        raise DigestValueError(f"unsupported digest_version {digest_version!r}; must be 2")
    if type(extras_digest_version) is not int or extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise DigestValueError(f"unsupported extras_digest_version {extras_digest_version!r}; must be 1")


def check_mask_and_carry(mask: FloatColumn, log_probs: FloatColumn) -> None:
    """Masks are 0.0 or 1.0; every carry (mask 0.0) position has log-prob 0.0 (-0.0 passes)."""
    carried = mask.given_carry()
    if carried is not None:
        # A carry-then-generation mask (the common shape, found in one pass or known from a
        # stored mask's bytes): the carry positions are its first ``carried``, a slice.
        if carried and log_probs.any_nonzero(slice(0, carried)):
            raise DigestValueError("a carry position (mask 0.0) must have log-prob 0.0")
        return
    carry, generated = mask.zero_one_flags()
    if not (carry | generated).all():
        raise DigestValueError("token_mask_delta values must be exactly 0.0 or 1.0")
    if carry.any() and log_probs.any_nonzero(carry):
        raise DigestValueError("a carry position (mask 0.0) must have log-prob 0.0")


def build_staging_delta(
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    prev_len: int,
) -> PackedColumns:
    """Columns for a call: the prompt tail after ``prev_len`` as carry, then the generation."""
    if type(prev_len) is not int or not 0 <= prev_len <= len(prompt_token_ids):
        raise DigestValueError(f"prev_len {prev_len!r} is outside prompt length {len(prompt_token_ids)}")
    if len(generated_token_ids) != len(generated_logprobs):
        raise DigestValueError("generated token ids and log-probs lengths differ")
    prompt = TokenIds.coerce(prompt_token_ids, "prompt_token_ids")
    generated = TokenIds.coerce(generated_token_ids, "generated_token_ids")
    carry = len(prompt) - prev_len
    if carry + len(generated) == 0:
        raise DigestValueError("the staging delta is empty: no carried prompt and no generated tokens")
    ids = TokenIds.concat([prompt[prev_len:], generated])
    mask = FloatColumn.concat([FloatColumn.filled(0.0, carry), FloatColumn.filled(1.0, len(generated))])
    lps = FloatColumn.concat(
        [FloatColumn.filled(0.0, carry), FloatColumn.coerce(generated_logprobs, "generated_logprobs")]
    )
    return PackedColumns(ids, mask, lps)
