"""Argument checks of the ``Store``'s public entry points: each refusal is an ``InvalidRecordError``.

A refused call writes nothing: every check here runs before the write transaction starts.
Also the store's key authority (wire-contract 3.1, 5.4, 7): a record is staged under its
default key ``{rollout_id}/{model_call_id}``, or under a cut key of its own call; a call
withdraws only its own cut keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from store.errors import ConfigurationError, InvalidRecordError
from store.log.engine import DEFAULT_POOL_SIZE
from store.log.events import BODY_TYPES, RECORD_KINDS, Completion, EventKind, Span, decode_body, encode_body
from store.wire.columns import FloatColumn
from store.wire.cut_records import GENERATION_CUT_KEY_PREFIX, is_cut_key_of
from store.wire.digest import compute_extras_digest
from store.wire.field_checks import plain_texts
from store.wire.field_checks import short as _shown

_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
_RESERVED = GENERATION_CUT_KEY_PREFIX + "/"


def text(name: str, value: Any, *, empty: bool = False, free: bool = False) -> str:
    """A string the store can write (UTF-8, so no lone surrogates); non-empty unless ``empty``.
    An id or key (every text but a ``free`` one: a reason, kept in its event's body) holds no NUL
    character: PostgreSQL cannot store one in a text column, so both backends refuse it alike."""
    if not isinstance(value, str) or not (value or empty):
        raise InvalidRecordError(f"{name} must be a {'' if empty else 'non-empty '}string, got {_shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRecordError(f"{name} is not valid Unicode text ({exc.reason} at position {exc.start})") from None
    if not free and "\x00" in value:
        raise nul_refusal(name, value)
    return value


def nul_refusal(name: str, value: str) -> InvalidRecordError:
    return InvalidRecordError(
        f"{name} holds a NUL character at position {value.index(chr(0))}, which no id or key may "
        f"(PostgreSQL cannot store one in text; every backend refuses it); got {_shown(value)}"
    )


def ids(name: str, *values: str | None) -> None:
    """Ids a wire record checked already (non-empty UTF-8 strings, or None): no NUL in any."""
    for value in values:
        if value is not None and "\x00" in value:
            raise nul_refusal(name, value)


def optional_text(name: str, value: Any) -> str | None:
    return None if value is None else text(name, value)


def texts(name: str, values: Any) -> list[str]:
    """A list or tuple of non-empty strings, ids or keys (a single string is refused, not split
    into characters)."""
    if not isinstance(values, (list, tuple)):
        raise InvalidRecordError(f"{name} must be a list of strings, got {type(values).__name__}")
    if plain_texts(values) and not any("\x00" in value for value in values):
        return list(values)
    return [text(f"{name} entry", value) for value in values]


def flag(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise InvalidRecordError(f"{name} must be True or False, got {_shown(value)}")
    return value


def optional_count(name: str, value: Any) -> int | None:
    """None, or an int of at least 1 (``ship(limit=...)``)."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise InvalidRecordError(f"{name} must be an int of at least 1, or None; got {_shown(value)}")
    return value


def optional_seconds(name: str, value: Any) -> float | None:
    """None, or a finite number of seconds above 0 (``ship(deadline=...)``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidRecordError(f"{name} must be a number of seconds above 0, or None; got {_shown(value)}")
    return float(value)


MAX_POOL_SIZE = 1000


def pool_size(value: Any) -> int:
    """``open_store(pool_size=...)``: None (the default, 1) or an int from 1 to ``MAX_POOL_SIZE``."""
    if value is None:
        return DEFAULT_POOL_SIZE
    if type(value) is not int or not 1 <= value <= MAX_POOL_SIZE:
        raise ConfigurationError(f"pool_size must be an int from 1 to {MAX_POOL_SIZE}, got {_shown(value)}")
    return value


def record_kind(kind: Any) -> EventKind:
    """An ``EventKind`` of a staged record; its plain string value is accepted too."""
    found = _RECORD_KINDS_BY_VALUE.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise InvalidRecordError(f"stage() kind must be one of {sorted(_RECORD_KINDS_BY_VALUE)}, got {_shown(kind)}")
    return found


_RECORD_KINDS_BY_VALUE = {kind.value: kind for kind in RECORD_KINDS}


# --- key authority --------------------------------------------------------------------------


def staging_key(rollout_id: str, model_call_id: str, default_key: str, key: Any, kind: EventKind) -> str:
    """The key a record of this call may be staged under, as ``kind``.

    Its terminal record (``call_completed``) goes under its default key; cut prefixes and
    chunks go under a cut key of its own call, never under another call's key.
    """
    if default_key.startswith(_RESERVED):
        raise InvalidRecordError(
            f"rollout id {rollout_id!r} puts the call's default key in the reserved {_RESERVED!r} namespace"
        )
    chosen = default_key if key is None else text("staging_key", key)
    if kind is EventKind.CALL_COMPLETED:
        if chosen != default_key:
            raise InvalidRecordError(
                f"a terminal record ({kind.value}) is staged under its default key {default_key!r}, not {chosen!r}"
            )
    elif not is_cut_key_of(chosen, rollout_id, model_call_id):
        raise InvalidRecordError(
            f"a {kind.value} record of {rollout_id}/{model_call_id} is staged under a cut key of its own call "
            f"({_RESERVED}{{checkpoint_id}}/{rollout_id}/{model_call_id}/{{seq}}), not {chosen!r}"
        )
    return chosen


def clearable_key(rollout_id: str, model_call_id: str, key: str) -> None:
    """A call may withdraw only its own cut and flush keys, never a terminal or another call's key."""
    if not is_cut_key_of(key, rollout_id, model_call_id):
        raise InvalidRecordError(
            f"clear_keys({rollout_id!r}, {model_call_id!r}) may withdraw only that call's cut keys; "
            f"{key!r} is not one (terminal records and other calls' keys are never withdrawn)"
        )


# --- version spans and completion -----------------------------------------------------------


def spans(value: Any, mask: FloatColumn, kind: EventKind) -> list[Span]:
    """Version spans of a record: sorted, non-overlapping ``(start, end, version)`` int triples
    covering exactly its generated (mask 1.0) positions.

    Positions are the call's delta positions: a chunk sits after what its call staged before,
    so its spans are checked once shifted to the chunk's own positions.
    """
    if not isinstance(value, (list, tuple)):
        raise InvalidRecordError(f"spans must be a list of (start, end, version) triples, got {type(value).__name__}")
    triples = [_span(index, item) for index, item in enumerate(value)]
    generated = mask.zero_one_flags()[1]
    count = int(np.count_nonzero(generated))
    offset = 0
    if kind is EventKind.CHUNK_STAGED and triples and count:
        offset = triples[0][0] - int(np.argmax(generated))
        if offset < 0:
            raise InvalidRecordError(f"the chunk's first span {triples[0]} starts before its first generated token")
    covered, previous_end = 0, offset
    for start, end, version in triples:
        if not offset <= start < end <= offset + len(mask):
            raise InvalidRecordError(f"span {(start, end, version)} lies outside the record's {len(mask)} positions")
        if start < previous_end:
            raise InvalidRecordError(f"span {(start, end, version)} overlaps or precedes the span before it")
        if not generated[start - offset : end - offset].all():
            raise InvalidRecordError(f"span {(start, end, version)} covers carried (mask 0.0) positions")
        covered += end - start
        previous_end = end
    if covered != count:
        raise InvalidRecordError(f"spans cover {covered} positions; the record generated {count}")
    return triples


def _span(index: int, item: Any) -> Span:
    if not isinstance(item, (list, tuple)) or len(item) != 3 or any(type(part) is not int for part in item):
        raise InvalidRecordError(f"span {index} must be a (start, end, version) triple of ints, got {_shown(item)}")
    start, end, version = item
    if start < 0 or not 0 <= version <= _U64_MAX:
        raise InvalidRecordError(f"span {index}: start must be >= 0 and version in [0, 2**64-1], got {_shown(item)}")
    return start, end, version


def completion(value: Any) -> Completion | None:
    """How a tracked call finished; stored with its terminal record, so its fields must be writable."""
    if value is None:
        return None
    if not isinstance(value, Completion):
        raise InvalidRecordError(f"completion must be a Completion or None, got {type(value).__name__}")
    limit, stop = value.effective_output_limit, value.stop_reason
    if limit is not None and (type(limit) is not int or not 1 <= limit <= _U64_MAX):
        raise InvalidRecordError(f"completion.effective_output_limit must be a positive int, got {_shown(limit)}")
    optional_text("completion.finish_reason", value.finish_reason)
    if type(stop) is str:
        text("completion.stop_reason", stop, empty=True)
    elif stop is not None and (type(stop) is not int or not _I64_MIN <= stop <= _U64_MAX):
        raise InvalidRecordError(f"completion.stop_reason must be a string or a 64-bit int, got {_shown(stop)}")
    return value


def extras(payload: Any, extras_digest: str) -> None:
    """A record's extras were checked when it was built, but its dict stays mutable: a payload
    changed since (too deep, containing itself, not writable, or just different) would be
    acknowledged and then never verify again, so it is checked against its digest here."""
    if payload is None:
        return
    try:
        computed = compute_extras_digest(payload)
    except (ValueError, TypeError) as exc:
        raise InvalidRecordError(f"the record's extras changed since it was built: {exc}") from exc
    if computed != extras_digest:
        raise InvalidRecordError("the record's extras changed since it was built: they no longer match extras_digest")


def sequence_of(name: str, value: Any, kind: type) -> Sequence[Any]:
    """A list or tuple whose items are all ``kind``."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, kind) for item in value):
        raise InvalidRecordError(f"{name} must be a list of {kind.__name__}, got {_shown(value)}")
    return value


def stream(rollout_id: Any, model_call_id: Any) -> None:
    """A call's identity, as every event of its stream carries it."""
    text("rollout_id", rollout_id)
    text("model_call_id", model_call_id)


def cut_receipt(value: Any) -> tuple[str, str, bytes]:
    if not isinstance(value, tuple) or len(value) != 3 or not isinstance(value[2], bytes):
        raise InvalidRecordError(
            f"cut_receipt must be (checkpoint_id, inventory_digest, receipt bytes), got {_shown(value)}"
        )
    return text("checkpoint_id", value[0]), text("inventory_digest", value[1]), value[2]


def body(kind: EventKind, value: Any) -> None:
    """A bookkeeping body the log can write and read back: its own decoder checks every field's type."""
    expected = BODY_TYPES[kind]
    if not isinstance(value, expected):
        raise InvalidRecordError(f"a {kind.value} event needs a {expected.__name__}, got {type(value).__name__}")
    try:
        decode_body(kind, encode_body(value))
    except (msgspec.MsgspecError, UnicodeEncodeError, OverflowError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidRecordError(f"the {expected.__name__} cannot be stored: {type(exc).__name__}: {exc}") from exc
