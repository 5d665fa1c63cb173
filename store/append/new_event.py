"""An event to append, with its stored form (body, packed columns, checksum framing) encoded once,
when it is built, so the write lock is taken with the bytes ready."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from store.log.checksum import CHECKSUMMED_COLUMNS, ChecksumParts
from store.log.events import EventKind, encode_body
from store.wire.columns import encode_floats, encode_ids, encode_mask
from store.wire.digest import PackedColumns


@dataclass(frozen=True, init=False)
class NewEvent:
    """An event to append; ``columns`` are stored packed beside the body."""

    kind: EventKind
    rollout_id: str
    model_call_id: str
    body: msgspec.Struct
    staging_key: str | None = None
    columns: PackedColumns | None = None
    # The framework's own cleanup (``Store.retain``) withdraws keys of retired capture keys too.
    past_fence: bool = False
    recorded_at: float | None = None  # None: now; a shipped event keeps its origin's time
    # None: the appending process; a shipped event keeps the (pid, host) of the one that wrote it.
    written_by: tuple[int, str | None] | None = None
    # The stored form (body, ids, mask, log-probs), encoded once when the event is built, so
    # callers build their events before ``EventLog.write`` and the lock is taken with bytes ready.
    stored: tuple[bytes, bytes | None, bytes | None, bytes | None] = field(init=False, repr=False, compare=False)
    size: int = field(init=False, repr=False, compare=False)  # bytes of the stored form (checkpoint pacing)
    # Its checksum's framing, also made here: the append only frames version, pid and time.
    # None while a shipped event's checksum is known (``stored_checksum``): made if it is needed.
    checksum_parts: ChecksumParts | None = field(init=False, repr=False, compare=False)
    # A shipped event's (stream version, checksum) as its source row holds them, verified: an
    # append at that version keeps the checksum (the same columns hash the same) instead of
    # hashing the stored bytes again.
    stored_checksum: tuple[int, bytes] | None = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        kind: EventKind,
        rollout_id: str,
        model_call_id: str,
        body: msgspec.Struct,
        staging_key: str | None = None,
        columns: PackedColumns | None = None,
        past_fence: bool = False,
        recorded_at: float | None = None,
        written_by: tuple[int, str | None] | None = None,
        stored_form: tuple[bytes, bytes | None, bytes | None, bytes | None] | None = None,
        stored_checksum: tuple[int, bytes] | None = None,
    ) -> None:
        # The fields are set as one ``__dict__`` (a frozen dataclass's own ``__init__`` sets
        # each through ``object.__setattr__``; one event is built per staged record).
        # ``stored_form``: the stored bytes already made (a shipped event's, verified against
        # its checksum and its body's encoding), kept as they are instead of encoded again.
        stored: tuple[bytes, bytes | None, bytes | None, bytes | None]
        if stored_form is not None:
            stored = stored_form
            size = sum(len(part) for part in stored_form if part is not None)
        elif columns is None:
            encoded = encode_body(body)
            stored, size = (encoded, None, None, None), len(encoded)
        else:
            encoded = encode_body(body)
            ids, mask = encode_ids(columns.token_ids), encode_mask(columns.token_mask)
            log_probs = encode_floats(columns.log_probs)
            stored, size = (encoded, ids, mask, log_probs), len(encoded) + len(ids) + len(mask) + len(log_probs)
        # ``stored_checksum`` covers the writer's pid and time too: kept only with both given.
        known = None
        if stored_form is not None and written_by is not None and recorded_at is not None:
            known = stored_checksum
        parts = None
        if known is None:
            parts = ChecksumParts(rollout_id, model_call_id, _KIND_VALUES[kind], staging_key, stored)
        _set_attribute(
            self,
            "__dict__",
            {
                "kind": kind,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "body": body,
                "staging_key": staging_key,
                "columns": columns,
                "past_fence": past_fence,
                "recorded_at": recorded_at,
                "written_by": written_by,
                "stored": stored,
                "size": size,
                "checksum_parts": parts,
                "stored_checksum": known,
            },
        )


_set_attribute = object.__setattr__
# Each kind's plain string (``EventKind.value`` is an Enum property: several times a dict lookup).
_KIND_VALUES: dict[EventKind, str] = {kind: kind._value_ for kind in EventKind}


# Every events column but seq: the checksummed ones, the checksum, then the provenance.
EVENT_INSERT_COLUMNS = (*CHECKSUMMED_COLUMNS, "checksum", "writer_host", "store_id")


class Writer(NamedTuple):
    """Who appends (``WriteTransaction``): its pid and host, and the id of the store it writes to."""

    pid: int
    host: str | None
    store_id: str | None


def this_writer(store_id: str | None) -> Writer:
    """This process as the writer of ``store_id``'s events (its host named once per process)."""
    return Writer(os.getpid(), _host(), store_id)


def _host() -> str:
    global _HOST
    if _HOST is None:
        _HOST = socket.gethostname()
    return _HOST


_HOST: str | None = None


def stored_event_row(new: NewEvent, version: int, writer: Writer, recorded_at: float) -> tuple[Any, ...]:
    """The events row of ``new`` at ``version``, in ``EVENT_INSERT_COLUMNS`` order; its checksum
    covers every column that says what the event is (``event_checksum``'s bytes).  A shipped
    event keeps the pid and host it was written by (``written_by``)."""
    body, token_ids, token_mask, log_probs = new.stored
    pid, host = writer.pid, writer.host
    if new.written_by is not None:
        pid, host = new.written_by
    known = new.stored_checksum  # set only with ``written_by`` (the pid above) and ``recorded_at``
    if known is not None and known[0] == version and recorded_at == new.recorded_at:
        checksum = known[1]
    else:
        checksum = _checksum_parts(new).checksum(version, pid, recorded_at)
    return (
        new.rollout_id,
        new.model_call_id,
        version,
        _KIND_VALUES[new.kind],
        new.staging_key,
        pid,
        recorded_at,
        body,
        token_ids,
        token_mask,
        log_probs,
        checksum,
        host,
        writer.store_id,
    )


def _checksum_parts(new: NewEvent) -> ChecksumParts:
    """``new``'s checksum framing, made once (a shipped event's only when it is appended at
    another stream version than its source's)."""
    parts = new.checksum_parts
    if parts is None:
        parts = ChecksumParts(new.rollout_id, new.model_call_id, _KIND_VALUES[new.kind], new.staging_key, new.stored)
        new.__dict__["checksum_parts"] = parts
    return parts
