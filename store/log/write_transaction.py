"""The write transaction, per backend: the single begin path for writes on a raw DBAPI connection.

SQLite: the commit mode, ``BEGIN IMMEDIATE``, the work, COMMIT.  PostgreSQL: BEGIN, the write
lock, the work and COMMIT in one pipeline (psycopg 3), statements waited for only when read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

from store.log import postgres
from store.log.engine import Backend
from store.log.failures import COMMIT_SENT_ATTRIBUTE
from store.log.postgres import CUT_ATTRIBUTE
from store.log.watchdog import WATCHDOG


def raw_write_transaction(
    dbapi_connection: Any, backend: Backend, *, durable: bool = True, mode_set: bool = False
) -> AbstractContextManager[Any]:
    """One write transaction on a raw DBAPI connection: the single begin path for writes.

    ``durable=False`` commits without waiting for the disk (WAL ``synchronous=NORMAL``);
    a later durable commit makes it durable too.  ``mode_set`` says the connection is
    already in the wanted commit mode.
    """
    if backend.pipelined:
        return _pipelined_write_transaction(dbapi_connection, backend, durable=durable)
    return _WriteTransaction(dbapi_connection, backend, durable, mode_set)


class _WriteTransaction:
    """``raw_write_transaction`` on SQLite: the commit mode, BEGIN, the work, then COMMIT, or a
    rollback if anything raised (BEGIN or COMMIT included); the cursor is closed either way.
    A class, not a generator: one transaction per batch, a generator's frame per batch costs more."""

    __slots__ = ("_backend", "_connection", "_cursor", "_durable", "_mode_set")

    def __init__(self, dbapi_connection: Any, backend: Backend, durable: bool, mode_set: bool) -> None:
        self._connection = dbapi_connection
        self._backend = backend
        self._durable = durable
        self._mode_set = mode_set
        self._cursor: Any = None

    def __enter__(self) -> Any:
        backend = self._backend
        before, inside = backend.commit_mode_sql(self._durable)
        cursor = self._cursor = self._connection.cursor()
        try:
            if before is not None and not self._mode_set:
                cursor.execute(before)
            cursor.execute(backend.begin_write_sql)
            if inside is not None:
                cursor.execute(inside)
        except BaseException:
            self._abandon()
            raise
        return cursor

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self._abandon()
            return
        try:
            self._connection.commit()
        except BaseException:
            self._abandon()
            raise
        self._cursor.close()

    def _abandon(self) -> None:
        try:
            self._connection.rollback()
        finally:
            self._cursor.close()


class DeferredStatementError(Exception):
    """A statement of a pipelined write transaction failed, found only when it committed.

    The transaction was rolled back; which caller's statement failed is unknown, so the
    write path runs the batch again with each caller checked on its own (``settle``).
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@contextmanager
def _pipelined_write_transaction(dbapi_connection: Any, backend: Backend, *, durable: bool) -> Iterator[Any]:
    """``raw_write_transaction`` on PostgreSQL: BEGIN, the schema, the transaction's limits and
    the write lock, the work and COMMIT in one pipeline.  A statement is waited for only when
    its result is read (a fetch) or the caller settles; COMMIT goes out with the pipeline's
    closing sync, which returns once the server has committed.

    psycopg is in autocommit for the transaction so that it sends no BEGIN of its own
    (a round trip of its own); this BEGIN goes out in the pipeline.  The whole transaction
    runs under the watchdog's write deadline; a driver error after COMMIT went out is marked
    (``COMMIT_SENT_ATTRIBUTE``): a lost connection then may have committed.
    """
    assert backend.write_begin_sql is not None and backend.search_path_sql is not None
    begin = backend.write_begin_sql[0 if durable else 1]
    deadline = postgres.WAIT_LIMITS.write
    watch = WATCHDOG.arm(dbapi_connection.fileno(), deadline)
    cut = False
    try:
        dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        commit_sent = committed = False
        pipelined: _PipelinedCursor | None = None
        try:
            pipeline = _Pipeline(dbapi_connection)
            try:
                cursor.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                cursor.execute(backend.search_path_sql)
                cursor.execute(begin)
                pipelined = _PipelinedCursor(cursor, pipeline, backend.next_seq_sql)
                yield pipelined
                pipelined.end_copy()  # (a caller's rows still streaming: its error raised here)
                # Every caller's work is queued.  An earlier statement's error can surface from here
                # on: at the COMMIT's own queuing (the server's answer already arrived) or at the
                # closing sync; either way whose statement failed is unknown.
                commit_sent = True
                cursor.execute("COMMIT")
            except BaseException as exc:
                if pipelined is not None:
                    pipelined.abandon_copy(exc)
                pipeline.leave(exc)
                raise
            pipeline.leave()
            committed = True
        except dbapi_connection.Error as exc:
            cut = WATCHDOG.disarm(watch)
            if cut:
                setattr(exc, CUT_ATTRIBUTE, deadline)
            if commit_sent:
                setattr(exc, COMMIT_SENT_ATTRIBUTE, True)
            # COMMIT never ran when an earlier statement failed: the transaction is still open, in error.
            if commit_sent and dbapi_connection.info.transaction_status == _IN_ERROR and not lock_wait_ended(exc):
                raise DeferredStatementError(exc) from exc
            raise
        finally:
            try:
                if not committed and not dbapi_connection.broken:
                    dbapi_connection.rollback()
            except dbapi_connection.Error:
                if not dbapi_connection.broken:
                    raise
            finally:
                cursor.close()
                if pipelined is not None:
                    pipelined.close()
                if dbapi_connection.info.transaction_status == _IDLE:
                    dbapi_connection.autocommit = False  # the pool's usual mode for its next user
    finally:
        if not cut:
            WATCHDOG.disarm(watch)


class _Pipeline:
    """The connection's pipeline mode for one write transaction, left and entered again around a
    ``COPY`` (which psycopg refuses in pipeline mode); the transaction stays open throughout.
    Entered when made; ``leave`` is a ``with`` block's exit (the closing sync: every result is
    read and the first error raised), or with the error that ends the transaction."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._inside: Any = None  # the ``connection.pipeline()`` context entered, None outside
        self.enter()

    def enter(self) -> None:
        inside = self._connection.pipeline()
        self.pipeline = inside.__enter__()
        self._inside = inside

    def leave(self, exc: BaseException | None = None) -> None:
        inside, self._inside = self._inside, None
        if inside is not None:
            inside.__exit__(None if exc is None else type(exc), exc, None if exc is None else exc.__traceback__)


class _PipelinedCursor:
    """The write transaction's cursor in pipeline mode.

    ``settle`` waits for every statement sent so far and raises the first one's error (a
    caller's own statements).  ``reserve_seqs`` sends ``nextval`` for the next events on a
    side cursor; its result arrives with the next read anyway, so ``take_seq`` rarely waits.
    ``copy_row`` streams rows with ``COPY`` (out of pipeline mode while it is open): each
    row goes to the server as it comes, while the caller works on the next, until anything
    else uses the connection (a statement, a fetch, ``settle``, ``end_copy``), which first
    ends the COPY (its error, if any, raised there).
    """

    def __init__(self, cursor: Any, pipeline: _Pipeline, next_seq_sql: str | None) -> None:
        self._cursor = cursor
        self._pipeline = pipeline
        self.execute = cursor.execute
        self.executemany = cursor.executemany
        self._next_seq_sql = next_seq_sql
        self._seqs: list[int] = []  # taken, not yet used (ascending)
        self._reserving: Any = None  # the side cursor whose nextval rows are on their way
        self._copying: Any = None  # the open ``cursor.copy`` context, None when no COPY is open
        self._copy: Any = None  # its Copy object
        self._copy_statement = ""

    @property
    def takes_seqs(self) -> bool:
        return self._next_seq_sql is not None

    def settle(self) -> None:
        self.end_copy()
        self._pipeline.pipeline.sync()

    def copy_row(self, statement: str, types: Sequence[str], row: Sequence[Any]) -> None:
        """Send ``row`` with ``statement`` (``COPY ... FROM STDIN (FORMAT BINARY)``, columns of
        ``types``), opening the COPY if another (or none) is open: the statements sent before
        it are waited for then (their first error raised here)."""
        if self._copying is None or self._copy_statement != statement:
            self.end_copy()
            try:
                self._pipeline.leave()  # an earlier statement's error is raised here
            except BaseException:
                self._pipeline.enter()  # the caller's error handling goes on in pipeline mode
                raise
            copying = self._cursor.copy(statement)
            try:
                copy = copying.__enter__()
                copy.set_types(types)
            except BaseException as exc:
                with suppress(Exception):
                    copying.__exit__(type(exc), exc, exc.__traceback__)
                self._pipeline.enter()
                raise
            self._copying, self._copy, self._copy_statement = copying, copy, statement
            # Any statement ends the COPY first (the caller's execute is this cursor's own).
            self.execute, self.executemany = self._execute_after_copy, self._executemany_after_copy
        self._copy.write_row(row)

    def copy_rows(self, statement: str, types: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """``copy_row`` for each of ``rows``, then ``end_copy``."""
        for row in rows:
            self.copy_row(statement, types, row)
        self.end_copy()

    def end_copy(self, exc: BaseException | None = None) -> None:
        """End the open COPY, if any, and resume pipeline mode: the server's answer is waited for
        (its error raised here).  ``exc``: abandon it instead (``CopyFail``: the transaction is
        in error until it, or its savepoint, is rolled back)."""
        copying, self._copying, self._copy = self._copying, None, None
        if copying is None:
            return
        self.execute, self.executemany = self._cursor.execute, self._cursor.executemany
        try:
            if exc is None:
                copying.__exit__(None, None, None)
            else:
                copying.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self._pipeline.enter()

    def abandon_copy(self, exc: BaseException) -> None:
        """``end_copy(exc)``, its own failure ignored (the transaction is rolled back anyway)."""
        with suppress(Exception):
            self.end_copy(exc)

    def _execute_after_copy(self, *args: Any, **kwargs: Any) -> Any:
        self.end_copy()
        return self._cursor.execute(*args, **kwargs)

    def _executemany_after_copy(self, *args: Any, **kwargs: Any) -> Any:
        self.end_copy()
        return self._cursor.executemany(*args, **kwargs)

    def side_cursor(self) -> Any:
        """Another cursor of the transaction: its statement's rows stay apart from this one's."""
        self.end_copy()
        return self._cursor.connection.cursor()

    def reserve_seqs(self, count: int) -> None:
        """Send ``nextval`` for ``count`` events (fewer if some are already taken and unused)."""
        wanted = count - len(self._seqs)
        if self._reserving is not None or wanted <= 0 or self._next_seq_sql is None:
            return
        self._reserving = self.side_cursor()
        if wanted == 1:
            self._reserving.execute(self._next_seq_sql)
        else:
            self._reserving.execute(f"{self._next_seq_sql} FROM generate_series(1, {int(wanted)})")

    def needs_seq(self) -> bool:
        """No seq taken and unused, none on its way: the next event's can come with a read."""
        return not self._seqs and self._reserving is None

    def give_seq(self, seq: int) -> None:
        """A seq a read took (``nextval`` in the stage lookup, under the write lock)."""
        self._seqs.append(seq)

    def take_seq(self) -> int:
        """The next event's seq (taken under the write lock, like the identity default)."""
        if not self._seqs:
            self.end_copy()  # the rows of nextval may still be on their way
            self.reserve_seqs(1)
            reserving, self._reserving = self._reserving, None
            try:
                self._seqs = sorted(int(row[0]) for row in reserving.fetchall())
            finally:
                reserving.close()
        return self._seqs.pop(0)

    def close(self) -> None:
        if self._reserving is not None:
            self._reserving.close()


# psycopg.pq.TransactionStatus values (not imported: psycopg is an optional driver).
_IDLE, _IN_ERROR = 0, 3


def lock_wait_ended(exc: BaseException) -> bool:
    """The write lock was not granted in time (``lock_timeout``): running again would wait again."""
    return getattr(exc, "sqlstate", None) == "55P03"
