"""Reading the source's log for a ship: batches in sequence order, each event verified.

Relies on the store's sequence-order rule: an event becomes visible only after every
event with a smaller sequence number, so "everything after seq N" never loses an event
that commits late, and a ship can resume after the last source event it shipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.append.new_event import NewEvent
from store.errors import CorruptRecordError
from store.log import schema
from store.log.engine import Statement
from store.log.events import RECORD_KINDS, EventKind, RecordBody, WorkerBody, encode_body
from store.projections.fold import Event
from store.queries.integrity import DECODE_ERRORS, describe, verified_event
from store.queries.reads import Reader, record_fields, stored_columns
from store.shipping.identity import EventOrigin, event_origin
from store.wire.digest import staging_digest_and_columns, stored_record_digest

StoredForm = tuple[bytes, bytes | None, bytes | None, bytes | None]  # body, ids, mask, log-probs


@dataclass(frozen=True)
class SourceEvent:
    """One source event ready to ship: its identity and the event to append."""

    source_seq: int
    origin: EventOrigin
    event: NewEvent
    digest: str | None  # a record's verified digest
    joined: EventOrigin | None = None  # a worker's leave: the identity of its join event

    @property
    def size(self) -> int:
        return self.event.size


@dataclass(frozen=True)
class Unverified:
    """A source event read and not verified yet: the target's write transaction verifies it
    (``verify``) just before it would append it, so a batch's events stream to the target's
    server while the next ones are verified (a ship of one batch: a replicated cut's).  Its
    columns, as read, name it for the batch's lookups; nothing of it is appended unverified,
    and a batch stops at the first that fails (the ones before it commit)."""

    source_seq: int
    origin: EventOrigin
    row: Mapping[str, Any]
    source: Reader
    store_id: str
    size: int  # its stored bytes, as read (a batch's size bound)

    def verify(self) -> SourceEvent | Unshippable:
        """What ``batches`` makes of it: the event to append, or why it cannot ship."""
        return _checked(self.source, self.store_id, self.row, self.origin)


Shippable = SourceEvent | Unverified


@dataclass(frozen=True)
class Unshippable:
    """A source event that failed verification: shipping stops before it."""

    source_seq: int
    origin: EventOrigin
    reason: str
    row: Mapping[str, Any]


class _SourceStatements:
    """A ship's reads of its source, compiled once per dialect and driver for the process (a
    Core statement built and compiled per read took longer than the read: about 0.2 ms each,
    three a ship, and a replicated cut ships twice)."""

    def __init__(self, engine: Engine) -> None:
        events, shipped = schema.events, schema.shipped_events
        self.last_seq = sa.select(sa.func.max(events.c.seq)).compile(dialect=engine.dialect).string
        self.rows = Statement(
            sa.select(*events.c)
            .where(events.c.seq > sa.bindparam("after"), events.c.seq <= sa.bindparam("upto"))
            .order_by(events.c.seq)
            .limit(sa.bindparam("size"))
            .offset(sa.bindparam("skip")),  # (SQLite's LIMIT always renders one)
            engine,
        )
        self.seqs = Statement(
            sa.select(events.c.seq)
            .where(events.c.seq > sa.bindparam("after"), events.c.seq <= sa.bindparam("upto"))
            .order_by(events.c.seq),
            engine,
        )
        self.origins = Statement(
            sa.select(shipped.c.event_seq, shipped.c.origin_store_id, shipped.c.origin_seq).where(
                shipped.c.event_seq > sa.bindparam("after"), shipped.c.event_seq <= sa.bindparam("last")
            ),
            engine,
        )


_SOURCE_STATEMENTS: dict[tuple[str, str, str], _SourceStatements] = {}


def _source_statements(connection: sa.Connection) -> _SourceStatements:
    dialect = connection.dialect
    key = (dialect.name, str(dialect.driver), str(dialect.paramstyle))
    found = _SOURCE_STATEMENTS.get(key)
    if found is None:
        found = _SOURCE_STATEMENTS[key] = _SourceStatements(connection.engine)  # the same text whichever is first
    return found


def last_seq(connection: sa.Connection) -> int:
    """The source's last event now (0: none): a ship goes no further than this."""
    return int(connection.exec_driver_sql(_source_statements(connection).last_seq).scalar() or 0)


def seqs_between(connection: sa.Connection, after: int, upto: int) -> list[int]:
    """The seqs of the events with ``after < seq <= upto`` (no other column is read)."""
    statement = _source_statements(connection).seqs
    return [
        int(seq)
        for (seq,) in connection.exec_driver_sql(statement.sql, statement.params({"after": after, "upto": upto}))
    ]


def count_between(connection: sa.Connection, after: int, upto: int) -> int:
    """Events with ``after < seq <= upto``."""
    events = schema.events
    query = sa.select(sa.func.count()).where(events.c.seq > after, events.c.seq <= upto)
    return int(connection.execute(query).scalar() or 0)


def batches(
    source: Reader, store_id: str, after: int, upto: int, size: int, chunk: int
) -> Iterator[list[SourceEvent | Unshippable]]:
    """Source events with ``after < seq <= upto`` in sequence order, verified: ``size`` rows
    read at a time, each read on a connection of its own (released before they are verified),
    handed on as they are verified, ``chunk`` at a time."""
    while after < upto:
        rows, origins = _read(source, after, upto, size)
        if not rows:
            return
        for begin in range(0, len(rows), chunk):
            batch: list[SourceEvent | Unshippable] = []
            for row in rows[begin : begin + chunk]:
                seq = int(row["seq"])
                batch.append(_checked(source, store_id, row, origins.get(seq) or EventOrigin(store_id, seq)))
            yield batch
        after = int(rows[-1]["seq"])


def unverified(source: Reader, store_id: str, after: int, upto: int, size: int) -> list[Unverified]:
    """The first ``size`` source events with ``after < seq <= upto``, in sequence order, read in
    one go and left for the target's transaction to verify (``Unverified``)."""
    rows, origins = _read(source, after, upto, size)
    found = []
    for row in rows:
        seq = int(row["seq"])
        size = sum(len(row[name]) for name in _STORED if isinstance(row[name], bytes))
        found.append(Unverified(seq, origins.get(seq) or EventOrigin(store_id, seq), row, source, store_id, size))
    return found


def kept(source: Reader, store_id: str, rows: list[tuple[dict[str, Any], int]]) -> list[Unverified]:
    """``unverified`` for rows this process committed, as written (``replica.Recent``): its own
    events (a commit another module wrote in is never kept), verified as any read from the log."""
    return [
        Unverified(int(row["seq"]), EventOrigin(store_id, int(row["seq"])), row, source, store_id, size)
        for row, size in rows
    ]


_NAMES = tuple(column.name for column in schema.events.c)
_STORED = ("body", "token_ids", "token_mask", "log_probs")


def _read(source: Reader, after: int, upto: int, size: int) -> tuple[list[dict[str, Any]], dict[int, EventOrigin]]:
    """Up to ``size`` rows with ``after < seq <= upto``, and the shipped identities among them,
    on a connection of their own (released before anything is verified)."""
    with source.connection("reading the log to ship") as connection:
        statements = _source_statements(connection)
        values = {"after": after, "upto": upto, "size": size, "skip": 0}
        result = connection.exec_driver_sql(statements.rows.sql, statements.rows.params(values))
        rows = [dict(zip(_NAMES, row, strict=True)) for row in result.fetchall()]
        origins: dict[int, EventOrigin] = {}
        if rows:
            last = int(rows[-1]["seq"])
            # The identities of the events just read (written in the transaction that appended them).
            found = connection.exec_driver_sql(
                statements.origins.sql, statements.origins.params({"after": after, "last": last})
            )
            origins = {int(seq): EventOrigin(str(origin), int(origin_seq)) for seq, origin, origin_seq in found}
        connection.rollback()  # no snapshot held between reads
    return rows, origins


def _checked(source: Reader, store_id: str, row: Mapping[str, Any], origin: EventOrigin) -> SourceEvent | Unshippable:
    item = _verified(row, origin)
    if isinstance(item, SourceEvent) and isinstance(item.event.body, WorkerBody):
        item = _with_join(source, store_id, item, item.event.body)
    return item


def _with_join(source: Reader, store_id: str, item: SourceEvent, body: WorkerBody) -> SourceEvent:
    """A worker's leave names its join by this store's seq: ship the join's identity instead."""
    if item.event.kind is EventKind.WORKER_JOINED or body.joined_seq is None:
        return item
    with source.connection("reading the log to ship") as connection:
        joined = event_origin(connection, store_id, body.joined_seq)
        connection.rollback()
    return dataclasses.replace(item, joined=joined)


def _verified(row: Mapping[str, Any], origin: EventOrigin) -> SourceEvent | Unshippable:
    """The event to append for ``row``: checksum, decoding and (for records) digest verified.
    Its stored bytes go to the target as they are (they are what its checksum covers)."""
    seq = int(row["seq"])
    try:
        event = verified_event(row)
        body = bytes(row["body"])
        if encode_body(event.body) != body:
            raise CorruptRecordError(f"event {seq}'s body holds fields this version cannot keep (a newer writer?)")
        digest = None
        if event.kind in RECORD_KINDS:
            digest = _record_digest(event, row)
    except CorruptRecordError as exc:
        return Unshippable(seq, origin, str(exc), row)
    stored = (body, _optional(row["token_ids"]), _optional(row["token_mask"]), _optional(row["log_probs"]))
    return SourceEvent(seq, origin, _new_event(event, row, stored), digest)


def _record_digest(event: Event, row: Mapping[str, Any]) -> str:
    """A record's digest, hashed again from its stored columns; it must be the one it was staged with.

    The common layout is hashed straight from the stored bytes (``stored_record_digest``, the
    audit's path: the same checks, the same bytes); anything else takes the general path,
    which unpacks the columns and names what is wrong."""
    body: RecordBody = event.body
    ids, mask, log_probs = row["token_ids"], row["token_mask"], row["log_probs"]
    fast = None
    if type(ids) is bytes and type(mask) is bytes and type(log_probs) is bytes:
        fast = stored_record_digest(body, ids, mask, log_probs)
    if fast is not None:
        if fast[0] != body.digest:
            raise CorruptRecordError(f"{describe(row)} does not match its staged digest")
        return fast[0]
    try:
        columns = stored_columns(row)
        digest, _ = staging_digest_and_columns(
            **record_fields(body),
            digest_version=2,
            extras_digest_version=1,
            token_ids_delta=columns.token_ids,
            token_mask_delta=columns.token_mask,
            generation_log_probs_delta=columns.log_probs,
        )
    except DECODE_ERRORS as exc:
        raise CorruptRecordError(f"{describe(row)} no longer validates: {exc}") from exc
    if digest != body.digest:
        raise CorruptRecordError(f"{describe(row)} does not match its staged digest")
    return digest


def _optional(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def _new_event(
    event: Event, row: Mapping[str, Any], stored: tuple[bytes, bytes | None, bytes | None, bytes | None]
) -> NewEvent:
    return NewEvent(
        event.kind,
        event.rollout_id,
        event.model_call_id,
        event.body,
        event.staging_key,
        recorded_at=float(row["recorded_at"]),
        # The process and host that first wrote it, kept across every hop (never the shipper's).
        written_by=(int(row["writer_pid"]), row.get("writer_host")),
        stored_form=stored,
        # Verified with the row (``verified_event``): appended at the same version, it holds.
        stored_checksum=(int(row["stream_version"]), bytes(row["checksum"])),
    )


def checksum_at(connection: sa.Connection, seq: int) -> bytes | None:
    """The stored checksum of event ``seq`` (None: no such event, removed by retention or never
    committed)."""
    events = schema.events
    value = connection.execute(sa.select(events.c.checksum).where(events.c.seq == seq)).scalar()
    return None if value is None else bytes(value)
