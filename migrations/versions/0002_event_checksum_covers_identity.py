"""Event checksums cover every column that says what an event is.

Layout 1 hashed only the body and the token columns, so damage to an event's kind, staging
key, stream or version went unnoticed.  Layout 2 (``store.columns.event_checksum``) hashes
every stored column but ``seq``.  This migration rewrites the checksum of each event whose
layout-1 checksum still verifies; an event that already failed it keeps failing.

Both layouts are frozen here, so this migration means the same thing whatever later code does.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
import xxhash
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_BATCH = 500
_COLUMNS = (
    "rollout_id",
    "model_call_id",
    "stream_version",
    "kind",
    "staging_key",
    "writer_pid",
    "recorded_at",
    "body",
    "token_ids",
    "token_mask",
    "log_probs",
)
_TOKEN_COLUMNS = ("token_ids", "token_mask", "log_probs")
Checksum = Callable[[Mapping[Any, Any]], "bytes | None"]


def layout_1(row: Mapping[Any, Any]) -> bytes | None:
    """Body, then the three token columns when the event has them; None for a damaged row."""
    columns = [row[name] for name in _TOKEN_COLUMNS]
    if all(value is None for value in columns):
        parts = [row["body"]]
    elif any(value is None for value in columns):
        return None
    else:
        parts = [row["body"], *columns]
    if not all(isinstance(part, (bytes, memoryview)) for part in parts):
        return None
    hasher = xxhash.xxh3_128()
    for part in parts:
        data = bytes(part)
        hasher.update(len(data).to_bytes(8, "big"))
        hasher.update(data)
    return hasher.digest()


def layout_2(row: Mapping[Any, Any]) -> bytes | None:
    """Every stored column but ``seq``, each framed with its type and length."""
    hasher = xxhash.xxh3_128(b"event-checksum-2")
    for name in _COLUMNS:
        value = row[name]
        if value is None:
            hasher.update(b"n")
        elif isinstance(value, (bytes, memoryview, str)):
            is_text = isinstance(value, str)
            data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
            hasher.update((b"s" if is_text else b"b") + len(data).to_bytes(8, "big") + data)
        elif isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
            hasher.update(b"i" + value.to_bytes(8, "big", signed=True))
        elif isinstance(value, float):
            hasher.update(b"f" + struct.pack(">d", value))
        else:
            return None
    return hasher.digest()


def _rechecksum(verify: Checksum, rewrite: Checksum) -> None:
    """Give every event whose checksum verifies under ``verify`` its ``rewrite`` checksum."""
    connection = op.get_bind()
    events = sa.table("events", sa.column("seq"), sa.column("checksum"), *(sa.column(name) for name in _COLUMNS))
    select = (
        sa.select(events.c.seq, events.c.checksum, *(events.c[name] for name in _COLUMNS))
        .where(events.c.seq > sa.bindparam("after"))
        .order_by(events.c.seq)
        .limit(_BATCH)
    )
    update = (
        sa.update(events)
        .where(events.c.seq == sa.bindparam("b_seq"))
        .values(checksum=sa.bindparam("b_checksum", type_=sa.LargeBinary))
    )
    after = -(2**63)
    while True:
        rows = [row._mapping for row in connection.execute(select, {"after": after})]
        if not rows:
            return
        changed = []
        for row in rows:
            stored = row["checksum"]
            if isinstance(stored, (bytes, memoryview)) and verify(row) == bytes(stored):
                new = rewrite(row)
                if new is not None:
                    changed.append({"b_seq": row["seq"], "b_checksum": new})
        if changed:
            connection.execute(update, changed)
        after = rows[-1]["seq"]


def upgrade() -> None:
    _rechecksum(layout_1, layout_2)


def downgrade() -> None:
    _rechecksum(layout_2, layout_1)
