"""Reading events back: nothing read from the log is trusted before it is checked.

Every read path (``fetch``, ``fetch_chunks``, ``completion``, ``cut_receipt``, replay) turns a
stored row into an ``Event`` only through ``verified_event``: the row's checksum covers every
column that says what the event is, and any value that cannot be decoded is corruption.  Both
are reported as ``CorruptRecordError`` naming the event, never as a raw decoding error.
"""

from __future__ import annotations

import hashlib
import operator
import sqlite3
from collections.abc import Mapping
from typing import Any

import msgspec

from store.errors import CorruptRecordError
from store.log.checksum import event_checksum
from store.log.events import (
    RECORD_KINDS,
    TOKEN_KINDS,
    CutReceiptBody,
    EventKind,
    RecordBody,
    TokenPutBody,
    decode_body,
)
from store.projections.fold import RECEIPT_STREAM, Event, filled
from store.projections.tokens import TOKEN_STREAM

# What decoding damaged bytes can raise (msgspec's errors derive from ValueError; listed for clarity).
DECODE_ERRORS = (
    msgspec.DecodeError,
    msgspec.ValidationError,
    ValueError,
    TypeError,
    OverflowError,
    KeyError,
    IndexError,
)


def describe(values: Mapping[Any, Any]) -> str:
    """How an error names a stored event: its sequence number and, if any, its staging key."""
    key = values.get("staging_key")
    return f"event {values.get('seq')!r}" + (f" (key {key!r})" if isinstance(key, str) else "")


def verified_event(values: Mapping[Any, Any]) -> Event:
    """The event a stored row holds, once its checksum and its decoding have held."""
    stored = values.get("checksum")
    try:
        intact = isinstance(stored, (bytes, memoryview)) and event_checksum(values) == bytes(stored)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CorruptRecordError(f"{describe(values)} holds a value its column cannot hold: {exc}") from exc
    if not intact:
        raise CorruptRecordError(f"{describe(values)} failed its xxh3 checksum: the stored bytes are damaged")
    try:
        kind = _KINDS.get(values["kind"]) or EventKind(values["kind"])
        body = decode_body(kind, bytes(values["body"]))
    except DECODE_ERRORS as exc:
        raise CorruptRecordError(f"{describe(values)} cannot be decoded: {type(exc).__name__}: {exc}") from exc
    event = stored_event(values, kind, body)
    problem = _inconsistency(event, values)
    if problem is not None:
        raise CorruptRecordError(f"{describe(values)} is inconsistent: {problem}")
    return event


def stored_event(values: Mapping[Any, Any], kind: EventKind, body: Any) -> Event:
    """The ``Event`` of a stored row, given its decoded kind and body.  Nothing is checked
    here: ``verified_event`` calls it once the row has held (``tools/bench_replay.py``'s floor
    calls it to build events exactly as the store does)."""
    return filled(
        Event,
        {
            "seq": values["seq"],
            "kind": kind,
            "rollout_id": values["rollout_id"],
            "model_call_id": values["model_call_id"],
            "stream_version": values["stream_version"],
            "staging_key": values["staging_key"],
            "body": body,
        },
    )


_KINDS = {kind.value: kind for kind in EventKind}  # a dict lookup: the Enum call is slower, per event
_token_columns = operator.itemgetter("token_ids", "token_mask", "log_probs")


def _inconsistency(event: Event, values: Mapping[Any, Any]) -> str | None:
    """What contradicts itself in an event that passed its checksum (a writer bug or a forgery)."""
    body = event.body
    columns = _token_columns(values)
    if event.kind in RECORD_KINDS:
        assert isinstance(body, RecordBody)
        if not isinstance(event.staging_key, str) or not event.staging_key:
            return f"a {event.kind.value} event without a staging key"
        if None in columns:
            return f"a {event.kind.value} event without its token columns"
        if body.rollout_id != event.rollout_id or body.model_call_id != event.model_call_id:
            return (
                f"its body is the record of {body.rollout_id}/{body.model_call_id}, "
                f"its stream {event.rollout_id}/{event.model_call_id}"
            )
        return None
    if event.staging_key is not None or columns != (None, None, None):
        return f"a {event.kind.value} event with a staging key or token columns"
    if event.kind in TOKEN_KINDS:
        return _token_inconsistency(event)
    if event.kind is EventKind.CUT_RECEIPT:
        assert isinstance(body, CutReceiptBody)
        if (event.rollout_id, event.model_call_id) != (RECEIPT_STREAM, body.checkpoint_id):
            stream = f"{event.rollout_id}/{event.model_call_id}"
            return f"the receipt of checkpoint {body.checkpoint_id!r} on stream {stream}"
    return None


def _token_inconsistency(event: Event) -> str | None:
    """A transport event off its rollout's transport stream, or a put whose payload is not the
    one its digest names (the digest decides idempotency: it must be the payload's)."""
    if event.model_call_id != TOKEN_STREAM:
        return f"a {event.kind.value} event on stream {event.rollout_id}/{event.model_call_id}"
    body = event.body
    if isinstance(body, TokenPutBody) and hashlib.sha256(body.payload).hexdigest() != body.payload_digest:
        return f"the entry of call {body.model_call_id!r} does not match its payload digest"
    return None


def undecodable_text(exc: BaseException) -> bool:
    """SQLite's errors for stored text that is not UTF-8 (only a damaged file holds such text)."""
    cause = getattr(exc, "orig", None) or exc
    if isinstance(cause, UnicodeDecodeError):
        return True
    return isinstance(cause, sqlite3.OperationalError) and "Could not decode to UTF-8" in str(cause)
