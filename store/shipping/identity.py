"""A store's identity, and where each of its events came from (itself, or a ship)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from store.errors import CorruptRecordError
from store.log import schema


@dataclass(frozen=True)
class EventOrigin:
    """An event's identity, kept across ships: the store that first staged it and its seq there."""

    store_id: str
    seq: int


def read_store_id(connection: sa.Connection) -> str:
    rows = connection.execute(sa.select(schema.store_identity.c.store_id)).scalars().all()
    if len(rows) != 1:
        raise CorruptRecordError(f"the store_identity table holds {len(rows)} rows; a store has exactly one id")
    return str(rows[0])


def event_origin(connection: sa.Connection, store_id: str, seq: int) -> EventOrigin | None:
    """The origin of event ``seq`` of this store (None when there is no such event)."""
    events, shipped = schema.events, schema.shipped_events
    if connection.execute(sa.select(events.c.seq).where(events.c.seq == seq)).first() is None:
        return None
    row = connection.execute(
        sa.select(shipped.c.origin_store_id, shipped.c.origin_seq).where(shipped.c.event_seq == seq)
    ).first()
    return EventOrigin(store_id, seq) if row is None else EventOrigin(str(row[0]), int(row[1]))
