"""SQLite's page walk for the audit (``PRAGMA quick_check``), overlapped with the audit's pass.

The walk runs on a second connection in a thread (SQLite releases the GIL while it walks) and
reads the audit's own snapshot: both read transactions begin while a third connection holds
the write lock for an instant.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.log.engine import BUSY_TIMEOUT_MS, Backend, driver_errors

PIN_WAIT_MS = 1000  # how long the audit waits for the write lock to pin its page walk's snapshot


class PageWalk(threading.Thread):
    """SQLite's page walk (``PRAGMA quick_check``) on its own connection, in a thread.

    SQLite releases the GIL while it walks, so the walk overlaps the audit's pass over the
    log instead of adding to it.  Its connection reads the audit's snapshot (``page_walk``).
    """

    def __init__(self, connection: sa.Connection) -> None:
        super().__init__(name="store-audit-page-walk", daemon=True)
        self.connection = connection
        self.lines: list[str] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.lines = quick_check(self.connection)
        except BaseException as exc:  # handed to the audit's thread by ``result``
            self.failure = exc

    def result(self) -> list[str]:
        self.join()
        if self.failure is not None:
            raise self.failure
        return self.lines


@contextmanager
def page_walk(
    engine: Engine, connection: sa.Connection, backend: Backend, read_only: bool
) -> Iterator[PageWalk | None]:
    """Begin the audit's read transaction on ``connection`` and, on SQLite, start the page walk
    on a second connection that reads the same snapshot.

    The guarantee: both read transactions begin while a third connection holds the write lock
    (``BEGIN IMMEDIATE``), so no commit can land between them and, in WAL mode, both read the
    same snapshot.  A read-only store's connections cannot take that lock (SQLite accepts the
    BEGIN but locks nothing), nor can a store whose lock stays busy past the busy timeout:
    there the audit walks the pages on its own connection before the pass (the same snapshot,
    no overlap).  None on PostgreSQL, and when the walk runs on the audit's own connection.
    """
    if connection.dialect.name != "sqlite" or read_only:
        connection.exec_driver_sql(backend.begin_snapshot_sql)  # a consistent read, no write lock
        yield None
        return
    with engine.connect() as walker:
        if not begin_together(engine, backend, connection, walker):
            yield None
            return
        walk = PageWalk(walker)
        walk.start()
        try:
            yield walk
        finally:
            walk.join()  # the walk's connection goes back to the pool only once it is done
            walker.rollback()


def begin_together(engine: Engine, backend: Backend, *connections: sa.Connection) -> bool:
    """Begin a read transaction on each connection at one snapshot (False: the first alone)."""
    with engine.connect() as lock:
        # A writer holds the lock for one transaction; an audit waits a little, not the full
        # busy timeout, then walks on its own connection instead.
        lock.exec_driver_sql(f"PRAGMA busy_timeout = {PIN_WAIT_MS}")
        try:
            lock.exec_driver_sql(backend.begin_write_sql)  # no commit can land until it rolls back
        except driver_errors(engine):
            connections[0].exec_driver_sql(backend.begin_snapshot_sql)
            return False
        else:
            try:
                for connection in connections:
                    connection.exec_driver_sql(backend.begin_snapshot_sql)
                    connection.exec_driver_sql("PRAGMA schema_version")  # WAL: the first read takes the snapshot
            finally:
                lock.rollback()
        finally:
            lock.exec_driver_sql(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return True


def quick_check(connection: sa.Connection) -> list[str]:
    try:
        return [str(row[0]) for row in connection.exec_driver_sql("PRAGMA quick_check")]
    except driver_errors(connection.engine) as exc:
        return [f"{type(exc).__name__}: {exc}"]
