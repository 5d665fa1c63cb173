"""The append path: one write transaction per batch, shared by concurrent callers (group commit).

A caller hands ``EventLog.write`` a function of a ``WriteTransaction``.  The first caller to
arrive while no batch is being written becomes the leader: it runs every queued function
in one transaction and commits once, then wakes the others.  Each function runs inside a
savepoint when it shares a batch, so one caller's error never undoes another's events.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Engine

from store import failpoints
from store.append.new_event import this_writer
from store.append.statements import WriteStatements
from store.append.transaction import WriteTransaction
from store.errors import ReadOnlyStoreError, StorageError, StoreClosedError, StoreError
from store.lifecycle import repeat_through_interrupts
from store.log.checkpointer import Checkpointer
from store.log.engine import Backend, driver_errors, storage_error, sync_file
from store.log.failures import COMMIT_SENT_ATTRIBUTE, connection_lost, driver_cause
from store.log.postgres import looks_dead, watchdog_cut
from store.log.write_transaction import DeferredStatementError, lock_wait_ended, raw_write_transaction

T = TypeVar("T")


def _lost_before_commit(exc: BaseException) -> bool:
    """The connection broke (not by the watchdog's deadline) before COMMIT went out."""
    cause = driver_cause(exc)
    return connection_lost(exc) and watchdog_cut(exc) is None and not getattr(cause, COMMIT_SENT_ATTRIBUTE, False)


class _FailedCaller(Exception):
    """A caller's work failed in a batch run without savepoints."""


class _GuessMissed(Exception):
    """A lone stage's guarded new-stream statement wrote nothing (the stream, key or a fence
    exists): its transaction committed nothing, and the work runs again with lookups."""


class _Wake:
    """A waiting caller's wake-up: a lock held while the wake is unset.  ``set`` and ``clear`` are
    called holding the log's lock, ``wait`` only by the caller's own thread.  A ``threading.Event``
    does the same with a Condition, a lock per wait and Python around each step; this is two
    lock operations a wait.  An interrupted ``wait`` leaves it unusable, as its caller leaves."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def clear(self) -> None:
        if self._set:
            self._set = False
            self._lock.acquire()  # free: ``set`` released it and ``wait`` gave it back

    def wait(self) -> None:
        self._lock.acquire()  # until ``set``
        self._lock.release()


class _Pending(Generic[T]):
    __slots__ = ("ahead", "done", "durable", "error", "guess", "result", "wake", "work")

    def __init__(
        self,
        work: Callable[[WriteTransaction], T],
        durable: bool,
        ahead: Sequence[tuple[str, str, str]] = (),
        guess: bool = False,
    ) -> None:
        self.work = work
        self.durable = durable
        self.ahead = ahead
        self.guess = guess
        self.done = False
        # Set (holding the log's lock) when the caller should look again: its batch was written,
        # or the writer role is free and it is first in the queue.  Each waiting caller has its
        # own, so a commit wakes exactly its callers, none of them contending for the log's lock.
        # Made only when the caller first has to wait: a caller that leads at once never needs one.
        self.wake: _Wake | None = None
        self.result: T | None = None
        self.error: BaseException | None = None


# How long a running batch may wait for the callers of the previous batch to queue again: at
# least this, at most the max, else as long as the last commit took.
GATHER_SECONDS = 0.0005
GATHER_MAX_SECONDS = 0.005
RECENT_BATCHES = 8  # a batch waits for as many callers as the largest of the last few had
MAX_BATCH = 1024  # callers a batch takes in at most (a commit must come)
KNOWN_STREAMS = 4096  # streams remembered as existing (a lone stage of one reads before it writes)
PAGE_BYTES = 4096
COMMIT_PAGES = 4  # pages a commit writes beside its events' own bytes (tables' leaves, indexes)


class EventLog:
    """The single write path of a store: group commit over one writer connection.

    The writer role belongs to one pending write at a time (``_leader``); it is taken with a
    single assignment and given back in a ``finally`` that every path out of ``write``
    runs, so an interrupt (``KeyboardInterrupt``, an async exception) never leaves it taken.
    """

    def __init__(
        self,
        engine: Engine,
        backend: Backend,
        *,
        durable: bool = True,
        wal_path: str | None = None,
        read_only: bool = False,
        hold_writer: bool = True,
    ) -> None:
        self._engine = engine
        # Keep the writer connection between batches; False: check it out per batch, so a store
        # of one pooled connection (PostgreSQL's default) shares it with its readers.
        self._hold_writer = hold_writer
        self._read_only = read_only  # every write is refused before it is queued
        self._backend = backend
        self._durable = durable
        self._wal_path = wal_path  # SQLite: the -wal file a durable acknowledgement may have to sync
        self._statements = WriteStatements(engine)
        # The events' writer_pid and writer_host (a forked child sets its own) and store_id.
        self._appender = this_writer(None)
        self._checkpointer = (
            None
            if backend.checkpoint_sql is None or read_only
            else Checkpointer(engine, backend.checkpoint_sql, database=wal_path and wal_path.removesuffix("-wal"))
        )
        self._driver_errors = driver_errors(engine)
        self._closed = False
        self._recent_batches: collections.deque[int] = collections.deque([1], maxlen=RECENT_BATCHES)
        self._expected = 1  # the largest of the recent batches: how many callers a batch waits for
        self._last_commit_seconds = 0.0  # how long the last batch's commit took (bounds the gathering)
        # Streams this writer saw exist, most recent last: a lone stage of one of them does not
        # guess a new stream.  A hint only (another process may write any stream): the guess's
        # own guard decides what is written.
        self._known_streams: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._guessing = False  # the batch being written may guess (``WriteTransaction.guess_new_stream``)
        # SQLite: called after each commit with the events it appended, (seq, row) each as
        # written, or None when another module wrote in it too (``WriteTransaction.kept``).
        self.on_commit: Callable[[list[tuple[int, tuple[Any, ...]]] | None], None] | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        """Fresh locks and an empty queue; no connection (the current one is not closed)."""
        # An RLock: if an interrupt inside Condition.wait leaves it released, the ``with`` that
        # then releases it again fails instead of releasing another thread's hold.
        self._lock = threading.RLock()
        self._finished = threading.Condition(self._lock)  # close() waits for the writer role to be free
        self._arrived = threading.Condition(self._lock)  # a gathering leader waits for callers
        self._queue: list[_Pending[Any]] = []
        self._leader: _Pending[Any] | None = None  # the pending whose thread holds the writer role
        self._batch: list[_Pending[Any]] = []  # what the leader took from the queue
        self._batch_started = False  # the leader began writing its batch
        self._gathering = False
        self._connection: Any = None
        self._fairy: Any = None  # the pool's wrapper of _connection, kept to return it
        self._commit_mode: bool | None = None  # the writer connection's current durability

    def write(
        self,
        work: Callable[[WriteTransaction], T],
        *,
        durable: bool = True,
        ahead: Sequence[tuple[str, str, str]] = (),
        guess: bool = False,
    ) -> T:
        """Run ``work`` in a write transaction and return its result once committed.

        ``durable=False`` is for bookkeeping events that hold no staged tokens: their commit
        does not wait for the disk unless a durable write shares the batch.  ``ahead``: the
        (rollout, call, key) of each record ``work`` stages, read ahead for the whole batch
        in one round trip on PostgreSQL (``WriteTransaction.read_ahead``).  ``guess``: ``work``
        does nothing but one ``stage_event``, so when it runs alone on PostgreSQL it may send its
        record as a new stream's, guarded, and be run again if the guess missed.  Raises
        ``StoreClosedError`` if the log is closed before the write began.
        """
        if self._read_only:
            raise ReadOnlyStoreError("this store was opened read-only; nothing was written")
        pending: _Pending[T] = _Pending(work, durable, ahead, guess)
        try:
            self._take_turn(pending)
            if self._leader is pending:
                try:
                    self._write_batch(self._batch)
                finally:
                    if not self._hold_writer:
                        self._return_writer()
        finally:
            repeat_through_interrupts(self._leave, pending)  # else the writer role stays taken
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]

    def hold_writer(self) -> None:
        """Keep the writer connection between batches from now on (a store only its own writes
        use, as the replicator's replica: no pool checkout and return around each batch)."""
        self._hold_writer = True

    def _take_turn(self, pending: _Pending[Any]) -> None:
        """Queue ``pending``; return once another leader wrote it, or with the writer role and a batch."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("this store was closed")
            self._queue.append(pending)
            if self._gathering:
                self._arrived.notify()
            if self._settled_or_leading(pending):
                return
        while True:
            assert pending.wake is not None  # made by _settled_or_leading before it said wait
            pending.wake.wait()
            if pending.done:  # written (set before its wake, never undone): no need for the lock
                return
            with self._lock:
                if self._settled_or_leading(pending):
                    return

    def _settled_or_leading(self, pending: _Pending[Any]) -> bool:
        """(Holding the lock.)  True once another leader wrote ``pending``, or when it takes the
        free writer role with a batch; else False, its ``wake`` cleared for waiting again."""
        if pending.done:
            return True
        if self._leader is not None:
            # Every set happens under the lock: none is lost before the wait.
            if pending.wake is None:
                pending.wake = _Wake()
            else:
                pending.wake.clear()
            return False
        self._leader = pending  # one assignment: from here on _leave gives the role back
        self._batch_started = False
        self._gather()
        self._batch, self._queue = self._queue, []
        return True

    def _leave(self, pending: _Pending[Any]) -> None:
        """Every path out of ``write``: give back the writer role, and settle a batch left unwritten."""
        if pending.done and self._leader is not pending:
            return  # a follower whose batch was written holds nothing (only its own thread leads it)
        with self._lock:
            self._leave_locked(pending)

    def _leave_locked(self, pending: _Pending[Any]) -> None:
        """``_leave``'s steps; each can be repeated after an interrupt."""
        if not pending.done and pending in self._queue:
            self._queue.remove(pending)  # interrupted while waiting or gathering: its work never runs
        if self._leader is pending:
            for other in self._batch:
                if other is not pending and not other.done and other not in self._queue:
                    self._settle_orphan(other)
            self._recent_batches.append(max(1, len(self._batch)))
            self._expected = max(self._recent_batches)
            for other in self._batch:
                if other.done and other.wake is not None:  # None: it never waited (this leader's own)
                    other.wake.set()
            if self._closed:  # close() waits for the role (before it is given back: a repeat notifies again)
                self._finished.notify_all()
            self._batch = []
            self._leader = None
        if self._leader is None and self._queue:
            first = self._queue[0].wake  # the role is free: the first waiting caller takes it
            if first is not None:  # (None: it queued but has not yet looked, and will under the lock)
                first.set()

    def _settle_orphan(self, pending: _Pending[Any]) -> None:
        """A follower whose leader was interrupted (called holding the lock)."""
        if self._closed:
            pending.error = StoreClosedError("this store was closed before the write began")
        elif not self._batch_started:
            self._queue.insert(0, pending)  # never written: a waiting follower leads it next
            return
        elif pending.error is None:
            pending.error = StorageError(
                "the write was interrupted in another thread; it may or may not have been committed "
                "(re-staging an identical record is a no-op)"
            )
        pending.done = True

    def _gather(self) -> None:
        """Wait briefly (``GATHER_SECONDS``) for as many callers as recent batches had before
        the batch starts (called holding the lock); later ones join it while it runs."""
        expected = self._expected
        if expected <= 1 or len(self._queue) >= expected:
            return
        deadline = time.monotonic() + GATHER_SECONDS
        self._gathering = True
        try:
            while len(self._queue) < expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.wait(remaining)
        finally:
            self._gathering = False

    def _take_arrivals(self, batch: list[_Pending[Any]], durable: bool, began: float) -> bool:
        """Move callers that queued while the batch ran into it (its transaction is still open);
        while it is smaller than recent batches, wait for them up to one commit's time from
        ``began`` (bounded by ``GATHER_SECONDS`` and ``GATHER_MAX_SECONDS``).

        The gathering overlaps the batch's own statements, so a leader starts at once and the
        batch fills while it works.  A durable caller never joins a batch that commits without
        a sync; it leads or joins the next one.
        """
        expected = self._expected
        if expected <= 1 and not self._queue:  # one caller at a time: nothing to wait for
            return False
        # Up to one commit's time: callers released by the last commit are usually back by then.
        deadline = began + min(GATHER_MAX_SECONDS, max(GATHER_SECONDS, self._last_commit_seconds))
        with self._lock:
            self._gathering = True
            try:
                while not self._closed and len(batch) < MAX_BATCH:
                    arrived = [pending for pending in self._queue if durable or not pending.durable]
                    if arrived:
                        self._queue = [pending for pending in self._queue if not (durable or not pending.durable)]
                        for pending in arrived:
                            pending.error = pending.result = None
                        batch.extend(arrived)
                        return True
                    remaining = deadline - time.monotonic()
                    if len(batch) >= expected or remaining <= 0:
                        return False
                    self._arrived.wait(remaining)
                return False
            finally:
                self._gathering = False

    def _write_batch(self, batch: list[_Pending[Any]]) -> None:
        """One transaction for the batch.  Savepoints cost two statements per caller, so
        they are used only when a first pass finds a failing caller: then the batch is
        rolled back and run again with each caller isolated (its work only reads and writes
        the transaction, so running it again is safe)."""
        self._batch_started = True
        durable = False
        if self._durable:
            for pending in batch:
                if pending.durable:
                    durable = True
                    break
        isolate = reconnected = False
        # A lone stage while stages come one at a time (a batch of several reads ahead instead).
        self._guessing = len(batch) == 1 and batch[0].guess and self._expected <= 1 and self._backend.pipelined
        try:
            while True:
                try:
                    self._run_batch(batch, durable, isolate)
                    failpoints.hit("after_commit")
                    return
                except _GuessMissed:
                    self._guessing = False  # nothing was written: run it again, reading first
                except _FailedCaller:
                    if len(batch) == 1 or isolate:
                        return  # the failing caller's error is set; nothing was committed
                    isolate = True
                except DeferredStatementError as exc:
                    if isolate:
                        raise exc.cause from None
                    isolate = True  # a pipelined statement failed: find whose, each caller settled
                except self._driver_errors as exc:
                    if reconnected or not _lost_before_commit(exc):
                        raise
                    # The connection was dead before this batch sent its COMMIT (a server restart
                    # the pool could not see: it pings only connections idle a while): nothing
                    # committed, so the batch runs once more on a new connection.
                    reconnected = True
                    self._discard_writer()
        except BaseException as exc:
            if not isinstance(exc, StoreError):
                self._discard_writer()  # the connection's state is unknown after a driver error
            for pending in batch:
                if pending.error is None:
                    # An interrupt belongs to the leader's thread; the others get a store error.
                    interrupt = not isinstance(exc, Exception)
                    pending.error = exc if interrupt and pending is self._leader else self._translate(exc)
                pending.result = None
        finally:
            for pending in batch:
                pending.done = True

    def _run_batch(self, batch: list[_Pending[Any]], durable: bool, isolate: bool) -> None:
        for pending in batch:
            pending.error = pending.result = None
        connection = self._writer()
        mode_set = self._commit_mode == durable
        self._commit_mode = durable
        began = time.monotonic()
        guess = self._guessing and not isolate
        with raw_write_transaction(connection, self._backend, durable=durable, mode_set=mode_set) as cursor:
            on_commit = self.on_commit
            transaction = WriteTransaction(
                cursor,
                self._statements,
                self._appender,
                guess=guess,
                known_streams=self._known_streams,
                keep_rows=on_commit is not None and not self._backend.pipelined,
            )
            if len(batch) > 1:  # a lone stage reads its lookup in the round trip of its BEGIN
                streams = [stream for pending in batch for stream in pending.ahead]
                transaction.read_ahead(streams, len(streams))
            index = 0
            while True:
                while index < len(batch):
                    if index:
                        failpoints.hit("mid_batch")
                    pending = batch[index]
                    self._run_one(transaction, pending, f"op{index}" if isolate else None)
                    if pending.error is not None and not isolate:
                        raise _FailedCaller  # roll back; run again isolated (or report a lone caller)
                    index += 1
                if isolate or transaction.guessed is not None or not self._take_arrivals(batch, durable, began):
                    # A batch run again isolated keeps exactly its callers; so does a guess, which
                    # may have to run again (the callers it took in would have committed).
                    break
            transaction.flush()  # the inserts still waiting go out before COMMIT
            committing = time.perf_counter()
            unsynced = durable and transaction.appended == 0
            if unsynced and self._backend.force_commit_record_sql is not None:
                cursor.execute(self._backend.force_commit_record_sql)
            failpoints.hit("before_commit")
        if unsynced and self._wal_path is not None:
            sync_file(self._wal_path)
        self._last_commit_seconds = time.perf_counter() - committing
        if on_commit is not None and (transaction.foreign or transaction.kept):
            on_commit(transaction.kept)
        self._after_commit(connection, transaction.appended_bytes)
        if transaction.guessed is not None:
            try:
                row = transaction.guessed.fetchone()  # arrived with the COMMIT's sync
            finally:
                transaction.guessed.close()
            if row is None:
                raise _GuessMissed
            transaction.last_seq = int(row[0])
            transaction.streams.append(transaction.guessed_stream)
        if self._backend.pipelined:  # only a PostgreSQL stage guesses
            self._remember(transaction.streams)

    def written_for(self, store_id: str) -> None:
        """Name the store every event is appended for (``events.store_id``; the audit checks it)."""
        self._appender = self._appender._replace(store_id=store_id)

    def _remember(self, streams: list[tuple[str, str]]) -> None:
        """Note streams seen to exist (most recent last; the oldest forgotten past ``KNOWN_STREAMS``)."""
        known = self._known_streams
        for stream in streams:
            known[stream] = None
            known.move_to_end(stream)
        while len(known) > KNOWN_STREAMS:
            known.popitem(last=False)

    def _after_commit(self, connection: Any, appended_bytes: int) -> None:
        """Pace WAL checkpoints: a background thread's, then the writer's own to finish it (see
        ``store.log.checkpointer``)."""
        checkpointer = self._checkpointer
        if checkpointer is None:
            return
        # Pages the commit wrote, about: the events' stored bytes and a few projection pages.
        checkpointer.committed(appended_bytes + COMMIT_PAGES * PAGE_BYTES)
        if checkpointer.due_in_line() and self._backend.checkpoint_sql is not None:
            # After the commit: a failing checkpoint must not fail callers whose batch committed.
            try:
                cursor = connection.cursor()
                try:
                    if not checkpointer.room_to_finish(cursor):
                        return  # a full disk: the space goes to commits until the checkpoint can finish
                    row = cursor.execute(self._backend.checkpoint_sql).fetchone()
                finally:
                    cursor.close()
            except self._driver_errors:
                return  # the next commit tries again
            # (busy, frames in the -wal, frames copied): the thread still at work, or a reader's
            # snapshot, can leave frames behind; the next commit tries again.
            if row is None or row[2] >= row[1]:
                checkpointer.checkpointed_in_line()

    def _run_one(self, transaction: WriteTransaction, pending: _Pending[Any], savepoint: str | None) -> None:
        if savepoint is not None:
            transaction.savepoint(savepoint)
        appended = transaction.appended
        try:
            pending.result = pending.work(transaction)
            if savepoint is not None:
                transaction.settle()  # its own statements' errors are its own
        except self._driver_errors as exc:
            if lock_wait_ended(exc) or connection_lost(exc):
                raise  # the write lock or the connection, not this caller: the whole batch fails
            pending.error = storage_error("writing to the store", exc)
            pending.error.__cause__ = exc
        except Exception as exc:  # reported to its own caller; the batch's other work stands
            pending.error = exc
        if savepoint is not None:
            if pending.error is None:
                transaction.release(savepoint)
            else:
                transaction.rollback_to(savepoint)
                transaction.release(savepoint)
                transaction.appended = appended  # its events were undone

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, self._driver_errors):
            error = storage_error("committing to the store", exc)
        elif isinstance(exc, Exception):
            return exc
        else:  # an interrupt of the leader's thread, before or after the commit
            error = StorageError(
                f"the write was interrupted in another thread ({type(exc).__name__}); "
                "it may or may not have been committed (re-staging an identical record is a no-op)"
            )
        error.__cause__ = exc
        return error

    def _writer(self) -> Any:
        if self._connection is not None and self._backend.pipelined and looks_dead(self._connection):
            self._discard_writer()  # the server ended it while it waited for the next batch
        if self._connection is None:
            self._fairy = self._engine.raw_connection()
            # The driver's own connection: the write path is hot, the pool's proxy is not needed.
            self._connection = self._fairy.dbapi_connection
            self._commit_mode = None
            self._run_on_writer(self._backend.writer_setup_sql)
        return self._connection

    def _run_on_writer(self, statements: tuple[str, ...]) -> None:
        if statements:
            cursor = self._connection.cursor()
            try:
                for sql in statements:
                    cursor.execute(sql).fetchall()
            finally:
                cursor.close()

    def _discard_writer(self) -> None:
        # Forget it first: even if invalidating is interrupted, the next batch opens a new one.
        fairy, self._fairy, self._connection = self._fairy, None, None
        if fairy is not None:
            with contextlib.suppress(Exception):  # the connection is being thrown away anyway
                fairy.invalidate()

    def _return_writer(self) -> None:
        """The leader gives the writer connection back to the pool after its batch."""
        fairy, self._fairy, self._connection = self._fairy, None, None
        if fairy is not None:
            with contextlib.suppress(*self._driver_errors):  # a broken connection is discarded by the pool
                fairy.close()

    def release_writer(self) -> None:
        """Return the writer connection to the pool (before a fork: no connection is held in use)."""
        with self._lock:
            if self._connection is not None:
                with contextlib.suppress(*self._driver_errors):  # a broken connection is closed anyway
                    self._run_on_writer(self._backend.writer_reset_sql)
            fairy, self._fairy, self._connection = self._fairy, None, None
        if fairy is not None:
            fairy.close()

    def hold_checkpoints_for_fork(self) -> None:
        """Before a fork: no background checkpoint holds a connection across it."""
        if self._checkpointer is not None:
            self._checkpointer.hold_for_fork()

    def release_checkpoints_after_fork(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.release_after_fork()

    def after_fork_in_child(self) -> None:
        """In a forked child: new locks and queue; the parent's connection is neither used nor closed."""
        self._reset_state()
        self._appender = this_writer(self._appender.store_id)
        if self._checkpointer is not None:
            self._checkpointer.after_fork_in_child()

    def close(self) -> None:
        """Refuse new writes, fail the queued ones, let the batch being written commit, close the writer."""
        with self._lock:
            self._closed = True
            for pending in self._queue:
                if pending is not self._leader:
                    pending.error = StoreClosedError("this store was closed before the write began")
                    pending.done = True
                    if pending.wake is not None:
                        pending.wake.set()
            self._queue = [pending for pending in self._queue if pending is self._leader]
            self._finished.notify_all()
            while self._leader is not None:
                self._finished.wait()
        self.release_writer()
        if self._checkpointer is not None:
            self._checkpointer.close()
