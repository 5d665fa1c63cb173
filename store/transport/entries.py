"""A complete record as the transport stores it: Gym's ``TokenEntry`` (or its JSON mapping)
checked and encoded once, before the write lock, as canonical JSON (sorted keys).

An identical re-put is recognised by the SHA-256 of those bytes, as Gym's file store does
("the identical serialized entry, byte for byte, timestamps included").  The entry's own token
digest (Gym's ``compute_digest``: SHA-256 of ``nemo-gym-tokens`` then a version byte, the count
and every id as big-endian u64) is verified against its tokens when it claims one.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from store import arguments
from store.errors import DigestMismatchError, InvalidRecordError
from store.log.events import TokenPutBody

TOKEN_DIGEST_DOMAIN = b"nemo-gym-tokens"
TOKEN_DIGEST_VERSION = 1
ENTRY_SCHEMA_VERSION = 1  # the TokenEntry record schema this transport reads and writes
_EMPTY_TOKEN_DIGEST = hashlib.sha256(TOKEN_DIGEST_DOMAIN).hexdigest()
_U64 = 2**64
_HEX64 = re.compile(r"[0-9a-f]{64}")


def token_digest(token_ids: Any) -> str:
    """Gym's ``TokenEntry`` digest of an exact token sequence (``records.compute_digest``):
    the empty sequence hashes the domain alone.  An id outside u64 raises ``OverflowError``."""
    return _u64_digest(array("Q", token_ids))


def _u64_digest(ids: array[int]) -> str:
    """``token_digest`` of ids already held as u64 (byte-swapped here, in place, to big-endian)."""
    if not ids:
        return _EMPTY_TOKEN_DIGEST
    header = TOKEN_DIGEST_VERSION.to_bytes(1, "big") + len(ids).to_bytes(8, "big")
    if sys.byteorder == "little":
        ids.byteswap()
    return hashlib.sha256(TOKEN_DIGEST_DOMAIN + header + ids.tobytes()).hexdigest()


class _EntryFields(msgspec.Struct, kw_only=True):
    """Every field of Gym 0.7.0's ``TokenEntry``, typed as its model types it, so an entry put
    always reads back as Gym's ``TokenEntry`` (a NaN that JSON writes as null is refused here,
    not at the freeze); other fields (Gym's model allows extras) are kept as they came."""

    schema_version: int = ENTRY_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any = None
    output_items: list[dict[str, Any]] = []
    token_item_index: int | None = None
    response_id: str | None = None
    created_at: float = 0.0
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: Literal["root", "resolved", "unresolved"] | None = None
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    parent_resolution_reason: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False


_FIELDS_DECODER = msgspec.json.Decoder(_EntryFields)
_ENCODER = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True)
class EncodedEntry:
    """An entry ready to append: its identity and its event body (payload and digests)."""

    rollout_id: str
    model_call_id: str
    body: TokenPutBody


def entry_mapping(entry: Any) -> Mapping[str, Any]:
    """The JSON mapping of a Gym ``TokenEntry`` (``model_dump(mode="json")``, duck-typed: the
    store never imports Gym for it) or of a plain mapping already in that form."""
    dump = getattr(entry, "model_dump", None)
    data = dump(mode="json") if callable(dump) and not isinstance(entry, Mapping) else entry
    if not isinstance(data, Mapping):
        raise InvalidRecordError(f"put() takes a TokenEntry or its JSON mapping, got {type(entry).__name__}")
    return data


def encode_entry(entry: Any) -> EncodedEntry:
    """Check ``entry`` and encode it; anything it cannot store is an ``InvalidRecordError`` (a
    token digest that does not match its tokens a ``DigestMismatchError``) naming the field."""
    data = entry_mapping(entry)
    try:
        payload = _ENCODER.encode(data)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.MsgspecError) as exc:
        raise InvalidRecordError(f"the entry cannot be stored as JSON: {type(exc).__name__}: {exc}") from None
    try:
        fields = _FIELDS_DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise InvalidRecordError(f"the entry is not a TokenEntry the transport can hold: {exc}") from None
    _check(fields)
    arguments.stream(fields.rollout_id, fields.model_call_id)
    body = TokenPutBody(
        model_call_id=fields.model_call_id,
        payload=payload,
        payload_digest=hashlib.sha256(payload).hexdigest(),
        token_digest=fields.digest,
        cum_len=fields.cum_len,
        parent_call_id=fields.parent_call_id,
        prompt_is_delta=fields.prompt_is_delta,
        fingerprint=fields.continuation_fingerprint,
        fingerprint_version=fields.fingerprint_version,
        context_len=fields.continuation_context_len,
        context_digest=fields.continuation_context_digest,
    )
    return EncodedEntry(fields.rollout_id, fields.model_call_id, body)


def _check(fields: _EntryFields) -> None:
    """The rules Gym's model and its digest hold an entry to, and the u64 range of every id."""
    call = f"entry {fields.rollout_id!r}/{fields.model_call_id!r}"
    if fields.schema_version != ENTRY_SCHEMA_VERSION:
        raise InvalidRecordError(f"{call} is TokenEntry schema_version {fields.schema_version}; this store holds 1")
    cumulative_ids = array("Q")
    for name in ("prompt_token_ids", "generation_token_ids"):
        try:  # held as u64 once: the range check and, below, the digest
            cumulative_ids.extend(array("Q", getattr(fields, name)))
        except OverflowError:
            raise InvalidRecordError(f"{call}: {name} must be u64 token ids") from None
    if len(fields.generation_token_ids) != len(fields.generation_log_probs):
        raise InvalidRecordError(
            f"{call}: generation_token_ids and generation_log_probs differ in length "
            f"({len(fields.generation_token_ids)} and {len(fields.generation_log_probs)})"
        )
    for name in ("cum_len", "continuation_context_len", "fingerprint_version"):
        value = getattr(fields, name)
        if value is not None and not 0 <= value < _U64:
            raise InvalidRecordError(f"{call}: {name} must be a u64, got {value}")
    if fields.token_item_index is not None and not 0 <= fields.token_item_index < len(fields.output_items):
        raise InvalidRecordError(f"{call}: token_item_index {fields.token_item_index} is not an index of output_items")
    resolution = fields.parent_resolution
    if resolution == "resolved" and not fields.parent_call_id:
        raise InvalidRecordError(f"{call}: a resolved parent needs its parent_call_id")
    if resolution in ("root", "unresolved") and fields.parent_call_id is not None:
        raise InvalidRecordError(f"{call}: a {resolution} entry cannot name a parent_call_id")
    if fields.prompt_is_delta and (fields.parent_call_id is None or resolution != "resolved"):
        raise InvalidRecordError(f"{call}: a delta prompt needs a resolved parent_call_id")
    if fields.digest is not None and not _HEX64.fullmatch(fields.digest):
        raise InvalidRecordError(f"{call}: digest must be 64 lowercase hex digits, got {fields.digest!r}")
    if fields.prompt_is_delta:
        return  # its digest covers the parent chain's tokens: verified where the chain is read (resolve)
    if fields.cum_len is not None and fields.cum_len != len(cumulative_ids):
        raise InvalidRecordError(f"{call}: cum_len {fields.cum_len} is not its {len(cumulative_ids)} tokens")
    if fields.digest is not None and fields.digest != _u64_digest(cumulative_ids):
        raise DigestMismatchError(f"{call}: its digest is not the token digest of its prompt and generation")
