"""Giving deleted space back to the file system.

SQLite: a store created with ``auto_vacuum=INCREMENTAL`` frees its empty pages with
``PRAGMA incremental_vacuum``; an older store is converted once by a full ``VACUUM``.  The
WAL is then checkpointed and truncated, so the file sizes shrink on disk.  PostgreSQL:
``VACUUM`` the log so its dead rows' space is reusable (rows deleted are already gone from
every query; ``VACUUM FULL`` would hand the space to the OS but locks the table).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from store.log.engine import SQLITE, Backend, driver_errors, storage_error

_INCREMENTAL = 2


@dataclass(frozen=True)
class CompactReport:
    """What ``compact`` did: bytes of the store's files before and after (SQLite; 0 on PostgreSQL),
    and whether an older store was converted to incremental vacuum."""

    bytes_before: int
    bytes_after: int
    converted: bool = False

    @property
    def reclaimed(self) -> int:
        return max(0, self.bytes_before - self.bytes_after)


def store_file_bytes(database: str) -> int:
    """Bytes of a SQLite store on disk: the database file plus its -wal file."""
    total = 0
    for path in (database, f"{database}-wal"):
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(path)
    return total


def compact(engine: Engine, backend: Backend) -> CompactReport:
    """Return free pages to the file system (see the module note).  Takes the write lock
    (SQLite) while it runs; readers carry on."""
    try:
        if backend is SQLITE:
            return _compact_sqlite(engine)
        with engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM events")
        return CompactReport(0, 0)
    except driver_errors(engine) as exc:
        raise storage_error("compacting the store", exc) from exc


def _compact_sqlite(engine: Engine) -> CompactReport:
    database = str(engine.url.database)
    before = store_file_bytes(database)
    with engine.connect() as connection:
        raw = connection.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        try:
            converted = cursor.execute("PRAGMA auto_vacuum").fetchone()[0] != _INCREMENTAL
            if converted:
                cursor.execute("PRAGMA auto_vacuum = INCREMENTAL")
                cursor.execute("VACUUM")  # rewrites the file; takes effect only now
            else:
                # executescript steps the pragma to its end; execute() frees a single page.
                raw.executescript("PRAGMA incremental_vacuum;")
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            cursor.close()
    return CompactReport(before, store_file_bytes(database), converted)
