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

from store.append.new_event import NewEvent
from store.errors import CorruptRecordError
from store.log import schema
from store.log.events import RECORD_KINDS, EventKind, WorkerBody, encode_body
from store.projections.fold import Event
from store.queries.integrity import verified_event
from store.queries.reads import snapshot_from_event
from store.shipping.identity import EventOrigin, event_origin, origins_between


@dataclass(frozen=True)
class SourceEvent:
    """One source event ready to ship: its identity and the event to append."""

    source_seq: int
    origin: EventOrigin
    event: NewEvent
    digest: str | None  # a record's verified digest
    joined: EventOrigin | None = None  # a worker's leave: the identity of its join event


@dataclass(frozen=True)
class Unshippable:
    """A source event that failed verification: shipping stops before it."""

    source_seq: int
    origin: EventOrigin
    reason: str
    row: Mapping[str, Any]


def count_after(connection: sa.Connection, after: int) -> int:
    events = schema.events
    return int(connection.execute(sa.select(sa.func.count()).where(events.c.seq > after)).scalar() or 0)


def batches(
    connection: sa.Connection, store_id: str, after: int, size: int
) -> Iterator[list[SourceEvent | Unshippable]]:
    """Source events after ``after`` in sequence order, ``size`` at a time, verified."""
    events = schema.events
    query = sa.select(*events.c).where(events.c.seq > sa.bindparam("after")).order_by(events.c.seq).limit(size)
    while True:
        rows = [dict(row._mapping) for row in connection.execute(query, {"after": after})]
        connection.rollback()  # no snapshot held between batches
        if not rows:
            return
        last = int(rows[-1]["seq"])
        origins = origins_between(connection, after, last)
        connection.rollback()
        batch: list[SourceEvent | Unshippable] = []
        for row in rows:
            seq = int(row["seq"])
            item = _verified(row, origins.get(seq) or EventOrigin(store_id, seq))
            if isinstance(item, SourceEvent) and isinstance(item.event.body, WorkerBody):
                item = _with_join(connection, store_id, item, item.event.body)
            batch.append(item)
        yield batch
        after = last


def _with_join(connection: sa.Connection, store_id: str, item: SourceEvent, body: WorkerBody) -> SourceEvent:
    """A worker's leave names its join by this store's seq: ship the join's identity instead."""
    if item.event.kind is EventKind.WORKER_JOINED or body.joined_seq is None:
        return item
    joined = event_origin(connection, store_id, body.joined_seq)
    connection.rollback()
    return dataclasses.replace(item, joined=joined)


def _verified(row: Mapping[str, Any], origin: EventOrigin) -> SourceEvent | Unshippable:
    """The event to append for ``row``: checksum, decoding and (for records) digest verified."""
    seq = int(row["seq"])
    try:
        event = verified_event(row)
        if encode_body(event.body) != bytes(row["body"]):
            raise CorruptRecordError(f"event {seq}'s body holds fields this version cannot keep (a newer writer?)")
        digest = columns = None
        if event.kind in RECORD_KINDS:
            snapshot, _ = snapshot_from_event(event, row)
            digest, columns = snapshot.digest, snapshot.columns
    except CorruptRecordError as exc:
        return Unshippable(seq, origin, str(exc), row)
    return SourceEvent(seq, origin, _new_event(event, row, columns), digest)


def _new_event(event: Event, row: Mapping[str, Any], columns: Any) -> NewEvent:
    return NewEvent(
        event.kind,
        event.rollout_id,
        event.model_call_id,
        event.body,
        event.staging_key,
        columns,
        recorded_at=float(row["recorded_at"]),
        # The process and host that first wrote it, kept across every hop (never the shipper's).
        written_by=(int(row["writer_pid"]), row.get("writer_host")),
    )
