"""``Store``: the staging sink and source over the event log, and ``open_store``."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

from store.engine import SQLITE, create_store_engine, migrate, resolve_url, wal_path
from store.errors import InvalidRecordError, StagingRefusedError, StoreClosedError
from store.events import (
    RECORD_KINDS,
    AdmissionBody,
    Completion,
    CutReceiptBody,
    EventKind,
    FailureBody,
    KeysClearedBody,
    Span,
    record_body,
)
from store.log import EventLog, NewEvent, WriteTransaction
from store.projections import RECEIPT_STREAM, generated_spans
from store.queries import CallInfo, Reader, StoredCompletion, VersionSpan
from store.records import StagedCallRecord, StagedCallSnapshot, StageResult
from store.replay import ReplayReport, replay

P = ParamSpec("P")
R = TypeVar("R")


def _operation(method: Callable[Concatenate[Store, P], R]) -> Callable[Concatenate[Store, P], R]:
    """A public call: refused once the store is closed; ``close()`` and a fork wait for it to end."""

    @functools.wraps(method)
    def run(self: Store, /, *args: P.args, **kwargs: P.kwargs) -> R:
        entered = [False]  # set with the count of calls in flight, so an interrupt leaves both agreeing
        try:
            self._enter(entered)
            return method(self, *args, **kwargs)
        finally:
            # Repeated if an interrupt lands in it (even on entry): a call never counted out
            # would keep close() and a fork waiting for good.
            interrupt: BaseException | None = None
            while entered[0]:
                try:
                    self._leave(entered)
                except Exception:
                    raise
                except BaseException as exc:  # KeyboardInterrupt, SystemExit
                    interrupt = interrupt or exc
            if interrupt is not None:
                raise interrupt

    return run


@dataclass(frozen=True)
class StageEntry:
    """One record to stage: under ``staging_key`` (default key if None), as ``kind``, with its version spans."""

    record: StagedCallRecord
    staging_key: str | None = None
    kind: EventKind = EventKind.CALL_COMPLETED
    spans: Sequence[Span] | None = None
    completion: Completion | None = None


class Store:
    """A durable token staging store (use ``open_store``).  Thread-safe; one per process."""

    def __init__(self, url_or_path: str | os.PathLike[str], *, durability: str = "full") -> None:
        self._url = resolve_url(url_or_path)
        self._durability = durability
        # Guards the lifecycle fields below.  Code takes ``with self._gate_lock``, never ``with
        # self._gate``: Condition.__enter__ is Python, and an interrupt after it locked would keep the
        # lock.  An RLock, so a release after an interrupted wait fails instead of freeing another's hold.
        self._gate_lock = threading.RLock()
        self._gate = threading.Condition(self._gate_lock)
        self._active = 0  # public calls in flight
        self._forking = False  # a fork waits for the calls in flight; new ones wait for it
        self._closed = False  # no new call starts
        self._shut = False  # close() finished: nothing commits any more, no connection is open
        self._engine, self._backend = create_store_engine(self._url, self._durability)
        self._log = EventLog(
            self._engine, self._backend, durable=self._durability == "full", wal_path=wal_path(self._url)
        )
        self._reader = Reader(self._engine)
        self._pid = os.getpid()
        migrate(self._engine, self._backend)
        _track_for_fork(self)

    def _enter(self, entered: list[bool]) -> None:
        with self._gate_lock:
            while self._forking:
                self._gate.wait()
            if self._closed:
                raise StoreClosedError("this store was closed")
            if self._pid != os.getpid():  # forked where os.register_at_fork did not run (fork() from C)
                self._forget_parent_connections()
            self._active += 1
            entered[0] = True

    def _leave(self, entered: list[bool]) -> None:
        with self._gate_lock:
            if entered[0]:
                if self._active == 1:
                    self._gate.notify_all()  # first: a repeat after an interrupt notifies again
                self._active -= 1
                entered[0] = False

    # --- fork: the child reconnects; no SQLite connection is open across the fork -------------

    def _before_fork(self) -> None:
        """Hold the store still: wait for calls in flight, keep new ones out until after the fork.

        SQLite keeps lock bookkeeping per process, shared by every connection to a file, and
        a child inherits the parent's copy: a connection the child opens would trust locks
        only the parent holds.  So the parent's SQLite connections are closed here (they
        reopen on next use); PostgreSQL connections stay open and the child leaves them alone.
        """
        self._gate.acquire()
        self._forking = True
        while self._active:
            self._gate.wait()
        if not self._closed:
            with contextlib.suppress(Exception):  # a broken connection is reopened after the fork anyway
                self._log.release_writer()
            if self._backend is SQLITE:
                with contextlib.suppress(Exception):
                    self._engine.dispose()

    def _after_fork_in_parent(self) -> None:
        self._forking = False
        self._gate.notify_all()
        self._gate.release()

    def _after_fork_in_child(self) -> None:
        self._gate_lock = threading.RLock()
        self._gate = threading.Condition(self._gate_lock)
        self._active = 0
        self._forking = False
        self._shut = self._closed
        self._forget_parent_connections()

    def _forget_parent_connections(self) -> None:
        """In a forked child: drop the parent's connections without using or closing them."""
        self._engine.dispose(close=False)
        self._log.after_fork_in_child()
        self._pid = os.getpid()

    @property
    def url(self) -> str:
        """The database URL (password hidden)."""
        return self._url.render_as_string(hide_password=True)

    @property
    def backend(self) -> str:
        return self._backend.name

    # --- the staging sink and source -------------------------------------------------------

    @_operation
    def stage(
        self,
        record: StagedCallRecord,
        *,
        staging_key: str | None = None,
        kind: EventKind = EventKind.CALL_COMPLETED,
        spans: Sequence[Span] | None = None,
        completion: Completion | None = None,
    ) -> StageResult:
        """Stage ``record`` durably; returns only after the commit.

        Re-staging an identical record under its key succeeds and writes nothing; a
        different record under a used key is refused (``ok=False``) and writes nothing.
        ``kind`` and ``spans`` let the capture mark cut prefixes and chunks; the default
        is a call's terminal record, its generated tokens produced by its weight version.
        """
        event = self._record_event(StageEntry(record, staging_key, kind, spans, completion))
        return self._log.write(lambda tx: _stage(tx, event, record.digest))

    @_operation
    def stage_all(
        self, entries: Sequence[StageEntry], *, cut_receipt: tuple[str, str, bytes] | None = None
    ) -> list[StageResult]:
        """Stage several records, and optionally a cut receipt, in one transaction: all or nothing.

        Raises ``StagingRefusedError`` (nothing written) if any key holds a different record.
        Used by generation cuts, whose acknowledgements must all hold before any is sealed.
        """
        events = [self._record_event(entry) for entry in entries]
        receipt_event = None
        if cut_receipt is not None:
            checkpoint_id, inventory_digest, receipt = cut_receipt
            receipt_body = CutReceiptBody(
                checkpoint_id=checkpoint_id, inventory_digest=inventory_digest, receipt=receipt
            )
            receipt_event = NewEvent(EventKind.CUT_RECEIPT, RECEIPT_STREAM, checkpoint_id, receipt_body)

        def work(tx: WriteTransaction) -> list[StageResult]:
            results = []
            for event, entry in zip(events, entries, strict=True):
                result = _stage(tx, event, entry.record.digest)
                if not result.ok:
                    raise StagingRefusedError(result.error or "refused")
                results.append(result)
            if receipt_event is not None:
                body = receipt_event.body
                assert isinstance(body, CutReceiptBody)
                if tx.receipt_seq(body.checkpoint_id, body.inventory_digest) is None:
                    tx.append(receipt_event)
            return results

        return self._log.write(work)

    def _record_event(self, entry: StageEntry) -> NewEvent:
        record = entry.record
        if not isinstance(record, StagedCallRecord):
            raise InvalidRecordError(f"stage() takes a StagedCallRecord, got {type(record).__name__}")
        key = record.staging_key if entry.staging_key is None else entry.staging_key
        if not isinstance(key, str) or not key:
            raise InvalidRecordError(f"staging_key must be a non-empty string, got {key!r}")
        if entry.kind not in RECORD_KINDS:
            kinds = sorted(k.value for k in RECORD_KINDS)
            raise InvalidRecordError(f"stage() kind must be one of {kinds}, got {entry.kind!r}")
        columns = record.columns
        default_spans = entry.spans is None  # a terminal record: its generated tokens, at its version
        spans = generated_spans(columns.token_mask, record.weight_version) if default_spans else list(entry.spans or ())
        body = record_body(record, spans, entry.completion)
        return NewEvent(entry.kind, record.rollout_id, record.model_call_id, body, key, columns)

    @_operation
    def fetch(self, keys: Sequence[str]) -> list[StagedCallSnapshot]:
        """One verified snapshot per key, in the order asked; ``UnknownKeyError`` if any is absent."""
        if isinstance(keys, str):
            raise InvalidRecordError("fetch() takes a list of staging keys, not a single string")
        return self._reader.fetch(list(keys))

    @_operation
    def fetch_chunks(self, keys: Sequence[str]) -> list[tuple[StagedCallSnapshot, list[Span]]]:
        """Like ``fetch``, with each record's version spans; checksums verified, digests not re-hashed.

        Only for callers that verify one digest over the concatenation, as restoring a
        generation cut does (the rebuilt prefix must match the continuation's digest).
        """
        return self._reader.fetch_with_spans(list(keys), verify_digests=False)

    # --- projections ------------------------------------------------------------------------

    @_operation
    def call(self, rollout_id: str, model_call_id: str) -> CallInfo | None:
        """The calls projection for one call (lineage, state, policy versions), or None."""
        return self._reader.call(rollout_id, model_call_id)

    @_operation
    def calls(self, rollout_id: str | None = None) -> list[CallInfo]:
        """Every call (of one rollout, when given), in the order they were last written."""
        return self._reader.calls(rollout_id)

    def version_spans(self, rollout_id: str, model_call_id: str) -> tuple[VersionSpan, ...]:
        """Which delta positions of the call each policy version generated."""
        info = self.call(rollout_id, model_call_id)
        return () if info is None else info.version_spans

    @_operation
    def replay(self, *, repair: bool = False) -> ReplayReport:
        """Rebuild every projection from the log and compare; ``repair`` replaces differing rows."""
        return replay(self._engine, self._backend, repair=repair)

    # --- events the worker capture appends ----------------------------------------------------

    @_operation
    def record_admission(self, rollout_id: str, model_call_id: str, body: AdmissionBody) -> None:
        event = NewEvent(EventKind.CALL_ADMITTED, rollout_id, model_call_id, body)
        self._log.write(lambda tx: tx.append(event), durable=False)  # holds no tokens

    @_operation
    def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        body = FailureBody(reason=reason)
        event = NewEvent(EventKind.CALL_FAILED, rollout_id, model_call_id, body)
        self._log.write(lambda tx: tx.append(event), durable=False)

    @_operation
    def clear_keys(self, rollout_id: str, model_call_id: str, keys: Sequence[str], reason: str) -> None:
        """Withdraw staged keys of one call (a rolled-back cut, or chunks made obsolete).

        Keys that hold nothing are skipped; if none is live, nothing is written.
        """
        wanted = list(dict.fromkeys(keys))

        def work(tx: WriteTransaction) -> None:
            live = [key for key in wanted if tx.key(key) is not None]
            if live:
                body = KeysClearedBody(staging_keys=live, reason=reason)
                tx.append(NewEvent(EventKind.KEYS_CLEARED, rollout_id, model_call_id, body))

        if wanted:
            self._log.write(work, durable=False)  # a key that reappears after power loss is harmless

    @_operation
    def completion(self, rollout_id: str, model_call_id: str) -> StoredCompletion | None:
        """The call's latest terminal record: its key, digest, generated count and how it finished."""
        return self._reader.completion(rollout_id, model_call_id)

    @_operation
    def cut_receipt(self, checkpoint_id: str, inventory_digest: str) -> bytes | None:
        """The receipt (JSON) already returned for this inventory, if any."""
        return self._reader.cut_receipt(checkpoint_id, inventory_digest)

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the store.  Calls in flight finish first; a write queued behind the batch being
        committed raises ``StoreClosedError``.  Once ``close()`` returns nothing more commits
        and no connection stays open; every later call raises ``StoreClosedError``."""
        with self._gate_lock:
            if self._closed:
                while not self._shut:  # another thread is closing it
                    self._gate.wait()
                return
            self._closed = True
            try:
                self._log.close()
                while self._active:
                    self._gate.wait()
                self._engine.dispose()
            finally:
                self._shut = True
                self._gate.notify_all()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, durability={self._durability!r})"


def _stage(tx: WriteTransaction, event: NewEvent, digest: str) -> StageResult:
    assert event.staging_key is not None
    existing = tx.key(event.staging_key)
    if existing is not None:
        same_call = (existing.rollout_id, existing.model_call_id) == (event.rollout_id, event.model_call_id)
        if same_call and existing.digest == digest:
            return StageResult(ok=True, staging_key=event.staging_key)
        return StageResult(
            ok=False,
            error=(
                f"staging key {event.staging_key!r} already holds a different record "
                f"({existing.rollout_id}/{existing.model_call_id}, digest {existing.digest[:16]}...)"
            ),
        )
    tx.append(event)
    return StageResult(ok=True, staging_key=event.staging_key)


_LIVE_STORES: weakref.WeakSet[Store] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()
_FORKING: list[Store] = []  # the stores held still by the fork in progress


def _track_for_fork(store: Store) -> None:
    with _REGISTRY_LOCK:
        _LIVE_STORES.add(store)


def _before_fork() -> None:
    with _REGISTRY_LOCK:
        _FORKING[:] = list(_LIVE_STORES)
    for store in _FORKING:
        store._before_fork()


def _after_fork_in_parent() -> None:
    for store in _FORKING:
        store._after_fork_in_parent()
    _FORKING.clear()


def _after_fork_in_child() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for store in _FORKING:
        store._after_fork_in_child()
    _FORKING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def open_store(url_or_path: str | os.PathLike[str], *, durability: str = "full") -> Store:
    """Open (creating and migrating if needed) a store.

    A plain path is a SQLite file in WAL mode; ``postgresql://...`` uses PostgreSQL.
    ``durability="full"`` (default) makes every acknowledged stage survive power loss;
    ``"normal"`` may lose the last commits on power loss (never on a process crash).
    """
    return Store(url_or_path, durability=durability)
