"""Telling a key the store never held from one whose row damage has hidden.

``staged_keys`` is a B-tree keyed by the staging key.  A damaged byte in a row's key, or in
the page that holds it, makes a lookup of that key miss while its record is still in the log:
an acknowledged key would read as unknown.  Before ``fetch`` says ``UnknownKeyError`` it
looks the key up again and checks where the key would be, all in one read snapshot (so a
write committing meanwhile never looks like damage):

* the rows next to its place in key order (a row whose key was damaged is still there): each
  must name an event that is the record of that row's own key;
* on SQLite, ``PRAGMA quick_check(staged_keys)`` (the table's pages only, not the log's):
  a page whose cells can no longer be found.

Either finding is ``CorruptRecordError``.  The checks run only on a miss, which is an error
path; they read a few rows, and on SQLite the key table (~100 bytes per key: ~0.3 s for a
million keys), never the log's token columns.
"""

from __future__ import annotations

import sqlalchemy as sa

from store.errors import CorruptRecordError
from store.log import schema

NEIGHBOURS = 4  # rows on each side of a missing key's place
MAX_CHECKED = 8  # missing keys looked at one by one; past that the table check speaks for them all


_STAGED = schema.staged_keys
_ROWS = sa.select(_STAGED.c.staging_key, _STAGED.c.event_seq)
_AFTER = _ROWS.where(_STAGED.c.staging_key >= sa.bindparam("key")).order_by(_STAGED.c.staging_key).limit(NEIGHBOURS)
_BEFORE = (
    _ROWS.where(_STAGED.c.staging_key < sa.bindparam("key")).order_by(_STAGED.c.staging_key.desc()).limit(NEIGHBOURS)
)
_EVENT_KEYS = sa.select(schema.events.c.seq, schema.events.c.staging_key).where(
    schema.events.c.seq.in_(sa.bindparam("seqs", expanding=True))
)


def check_absent(connection: sa.Connection, missing: list[str]) -> None:
    """Raise ``CorruptRecordError`` if the ``staged_keys`` rows around ``missing`` are damaged;
    return quietly when the keys are simply not there."""
    try:
        _check(connection, missing)
    except sa.exc.DatabaseError as exc:  # SQLite: "database disk image is malformed" while looking
        if "malformed" not in str(exc):
            raise
        raise CorruptRecordError(f"the key table is damaged where {missing[0]!r} would be: {exc.orig}") from exc


def _check(connection: sa.Connection, missing: list[str]) -> None:
    for key in missing[:MAX_CHECKED]:
        neighbours = [*connection.execute(_BEFORE, {"key": key}), *connection.execute(_AFTER, {"key": key})]
        seqs = sorted({int(seq) for _, seq in neighbours if isinstance(seq, int)})
        owners = {seq: owner for seq, owner in connection.execute(_EVENT_KEYS, {"seqs": seqs})} if seqs else {}
        for row_key, seq in neighbours:
            owner = owners.get(seq)
            if owner == key:  # the lookup in this snapshot missed it: its row or its place is damaged
                raise CorruptRecordError(
                    f"staged key {key!r} is damaged in the key table (its row now reads {row_key!r}); "
                    f"its record is event {seq} (`staging-store replay --repair` rebuilds the table)"
                )
            if owner != row_key:
                raise CorruptRecordError(
                    f"the key table is damaged next to {key!r}: the row of {row_key!r} names event {seq!r}, "
                    f"which is {'not in the log' if owner is None else f'the record of {owner!r}'}; "
                    f"{key!r} may be hidden (`staging-store audit` finds the damage)"
                )
    if connection.dialect.name == "sqlite":
        lines = [str(row[0]) for row in connection.exec_driver_sql("PRAGMA quick_check(staged_keys)")]
        if lines != ["ok"]:
            raise CorruptRecordError(
                f"the key table's pages are damaged ({lines[0]}); {missing[0]!r} may be hidden "
                "(`staging-store replay --repair` rebuilds the table)"
            )
