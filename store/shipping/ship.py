"""``Store.ship``: copy a store's log into another store, idempotently and resumably.

The source is read in sequence order from the target's resume point for it; each batch is
verified, then applied in one write transaction of the target together with the new resume
point and the events' identities (origin store id, origin seq).  A batch is all or
nothing, so a ship killed at any moment resumes where the last committed batch ended,
and an event that reached the target by any path is never appended twice.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from sqlalchemy.engine import Connection, Engine

from store.append.transaction import WriteTransaction
from store.errors import InvalidRecordError
from store.queries.reads import Reader
from store.shipping.receive import (
    LogDiverged,
    Received,
    Refused,
    ResumePoint,
    ResumePointMoved,
    ShipStatements,
    item_names,
    receive,
    resume_point,
)
from store.shipping.report import ShipProblem, ShipReport
from store.shipping.source import (
    Shippable,
    SourceEvent,
    Unshippable,
    batches,
    checksum_at,
    count_between,
    kept,
    last_seq,
    seqs_between,
    unverified,
)

if TYPE_CHECKING:
    from store.shipping.replica import Recent

Progress = Callable[[int, int], object]
T = TypeVar("T")

# Source events per target transaction, and their stored bytes at most: large enough that a
# batch's fixed costs (its lock, lookups, round trips, its commit's WAL flush) spread thin,
# small enough that the next batch is read and verified while this one is written and that
# other writers of the target wait for one batch at most (about 8 MiB of WAL).
BATCH_EVENTS = 1024
BATCH_BYTES = 8 * 1024 * 1024
# Source events verified at a time (read a batch at a time): what the first batch waits for.
CHUNK_EVENTS = 128


class TargetWrite(Protocol):
    """The target store's write path (``Store._write``): staging's transaction and checks."""

    def __call__(self, work: Callable[[WriteTransaction], T], *, durable: bool = ...) -> T: ...


@dataclass(frozen=True)
class ShipTarget:
    """What a ship needs of the store it writes to (``Store.ship`` hands it over)."""

    url: str
    engine: Engine
    known_id: Callable[[], str]
    write: TargetWrite


@dataclass(frozen=True)
class Bounds:
    """How far one ship goes: up to ``limit`` source events, until ``deadline`` (``time.monotonic``),
    or until ``stop`` is set -- each checked between batches, so a batch is never cut short."""

    limit: int | None = None
    deadline: float | None = None
    stop: threading.Event | None = None

    def reached(self, done: int) -> str | None:
        """Why the ship stops before its next batch (None: it goes on)."""
        if self.limit is not None and done >= self.limit:
            return "limit"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        if self.stop is not None and self.stop.is_set():
            return "stopped"
        return None


_STATEMENTS: weakref.WeakKeyDictionary[Engine, ShipStatements] = weakref.WeakKeyDictionary()
_STATEMENTS_LOCK = threading.Lock()


def _statements(engine: Engine) -> ShipStatements:
    """The target's bookkeeping statements, built once per target engine (building them took
    longer than a small ship)."""
    with _STATEMENTS_LOCK:
        found = _STATEMENTS.get(engine)
        if found is None:
            found = _STATEMENTS[engine] = ShipStatements(engine)
        return found


def ship_log(
    source_id: str,
    source: Reader,
    target: ShipTarget,
    progress: Progress | None,
    bounds: Bounds = Bounds(),
    start: int | None = None,
    recent: Recent | None = None,
    *,
    exact: bool = False,
    confirm: bool = False,
) -> ShipReport:
    """Ship the source's events after the target's resume point for it, up to the source's last
    event when the ship began (a source that keeps being written still lets it end), within
    ``bounds``.  A resume point read from the target is checked against the source's log first:
    ``LogDiverged`` (nothing written) when it is past the source's last event or the source's
    event there is not the one the target was sent.

    ``start``: the resume point the shipper knows the target has (its own last ship ended
    there), which saves reading it first.  ``exact`` (the replicator's ships): each batch checks
    in its transaction that the target's resume point is where the one before ended (``start``
    for the first) and raises ``ResumePointMoved`` (nothing written) when it is not; else the
    events up to the target's are skipped.  ``confirm`` (with ``start``): when nothing is left
    to ship, read the target's resume point all the same (``ResumePointMoved`` when it is not
    ``start``), so a caller waiting for the replica hears from it.  ``recent``: the events this
    process committed, as written (the replicator's): a ship of one batch whose every event is
    there, and still in the log, takes them from there instead of reading them back (verified
    all the same)."""
    statements = _statements(target.engine)
    known: ResumePoint | None = None
    if start is None:
        # The target's log refuses a closed store here, before anything of it is read.
        known = target.write(lambda tx: resume_point(tx, statements, source_id), durable=False)
        start = known.seq
    target_id = target.known_id()
    if source_id == target_id:
        raise InvalidRecordError(f"ship() needs another store as its target; {target.url} is this store ({source_id})")
    held = None
    with source.connection("reading the log to ship") as connection:
        head = last_seq(connection)
        if known is not None:
            _check_resume_point(connection, known, head, source_id, target.url)
        # The total is for ``progress`` only: a ship without one (the replicator's) skips the count.
        total = count_between(connection, start, head) if progress is not None else 0
        if recent is not None and start < head and head - start <= _chunk_size(bounds.limit):
            held = recent.rows(start, head)
            # Each of them still in the log (none removed since, by retention in any process).
            if held is not None and seqs_between(connection, start, head) != list(range(start + 1, head + 1)):
                held = None
        connection.rollback()
    if bounds.limit is not None:
        total = min(total, bounds.limit)
    tally = _Tally(last=start, total=total)
    _report(progress, 0, tally.total)
    if confirm and known is None and head <= start:
        # Nothing to ship: the replica is asked where it is (a read of the resume point in its
        # write transaction), not taken at the shipper's memory (restored, failed over).
        there = target.write(lambda tx: resume_point(tx, statements, source_id), durable=False)
        if there.seq != start:
            raise ResumePointMoved(start, there.seq)

    def ours(seq: int, checksum: bytes | None) -> bool:
        """Whether this store's event ``seq`` is the one the target's resume point names (asked
        in the target's transaction: another shipper of this store id moved it)."""
        with source.connection("reading the log to ship") as connection:
            mine, last = checksum_at(connection, seq), last_seq(connection)
            connection.rollback()
        return seq <= last and (checksum is None or mine is None or mine == checksum)

    send = _Sender(
        lambda items, at: _ship_batch(
            target, statements, source_id, target_id, items, at if exact else None, ours if exact else None
        ),
        tally,
        progress,
        # At most one chunk to ship (seqs only grow): its one batch is written by this thread, no
        # writer thread to start and hand it to (a replicated cut's ship, a receipt's).
        inline=head - start <= _chunk_size(bounds.limit),
    )
    # Read and verified in chunks here while the writer thread applies batches to the target
    # (its write path takes callers from any thread): the writer takes everything ready each
    # time it is free, up to a full batch, so the first batch goes out after one chunk and the
    # later ones are as large as the time it writes lets them grow.  A batch is sent only once
    # the one before committed without a problem: a ship still stops at its first problem.
    # The source is read a batch's worth at a time, each read on a connection of its own (a
    # store of one connection stages between), and verified a chunk at a time.
    stopped: str | None = None
    bad: Unshippable | None = None
    read = 0
    with send:
        if send.inline:
            # One batch: read at once and verified in the target's transaction, each event just
            # before it is appended, while the ones before it stream to the server.
            if held is not None:
                events = kept(source, source_id, held)
            else:
                events = unverified(source, source_id, start, head, _read_size(bounds.limit))
            if bounds.limit is not None:
                events = events[: bounds.limit]
            read = len(events)
            if send.offer(events):
                stopped = bounds.reached(read)
        else:
            chunks = batches(source, source_id, start, head, _read_size(bounds.limit), _chunk_size(bounds.limit))
            for chunk in chunks:
                if bounds.limit is not None:
                    chunk = chunk[: bounds.limit - read]
                read += len(chunk)
                verified, bad = _until_unshippable(chunk)
                if not send.offer(verified):
                    bad = None  # stopped at the problem: nothing after it is sent
                    break
                if bad is not None:
                    break  # the events before the damaged one go; shipping stops at it
                stopped = bounds.reached(read)
                if stopped is not None:
                    break
        # What is read and verified goes after the batch in flight; after a deadline or a
        # stop, no batch starts (what was read and not sent is left to the next ship).
        if not send.finish(send_ready=stopped in (None, "limit")):
            bad = None
    if bad is not None:
        tally.problems.append(_corrupt(bad))
    done = tally.appended + tally.present
    if not tally.problems and done != tally.total:
        _report(progress, done, done)
    remaining = 0
    if tally.last < head:  # else nothing is left (the common end: everything up to the head shipped)
        with source.connection("counting the events left to ship") as connection:
            remaining = count_between(connection, tally.last, head)
            connection.rollback()
    return ShipReport(
        ok=not tally.problems,
        source_store_id=source_id,
        target_store_id=target_id,
        read=done,
        appended=tally.appended,
        present=tally.present,
        last_seq=tally.last,
        problems=tuple(tally.problems),
        remaining=remaining,
        stopped=stopped if remaining else None,
    )


def _check_resume_point(connection: Connection, known: ResumePoint, head: int, source_id: str, url: str) -> None:
    """``LogDiverged`` unless the target's resume point for this store is an event of its log."""
    if known.seq == 0:
        return
    cause = (
        "this store lost events it had shipped (a power loss, a restored backup) or another store "
        "with the same id (a copy of one store file) ships there; nothing is shipped: open a fresh "
        "store on this host (what the replica holds stays there)"
    )
    if known.seq > head:
        raise LogDiverged(
            f"this store's log is behind the target {url}: it ends at event {head}, the target holds "
            f"events of store {source_id} up to {known.seq}; {cause}"
        )
    if known.checksum is None:
        return  # written before revision 0012: only the seq is known
    mine = checksum_at(connection, known.seq)
    if mine is not None and mine != known.checksum:
        raise LogDiverged(
            f"this store's event {known.seq} and the one the target {url} holds as event {known.seq} "
            f"of store {source_id} differ; {cause}"
        )


def _read_size(limit: int | None) -> int:
    return BATCH_EVENTS if limit is None else max(1, min(BATCH_EVENTS, limit))


def _chunk_size(limit: int | None) -> int:
    return min(CHUNK_EVENTS, _read_size(limit))


class _Sender:
    """The writer thread's side of a ship: verified events wait in ``ready`` until the writer is
    free, then go as one batch (at most ``BATCH_EVENTS`` events and ``BATCH_BYTES``)."""

    def __init__(
        self,
        ship_batch: Callable[[list[Shippable], int], tuple[Received, ShipProblem | None]],
        tally: _Tally,
        progress: Progress | None,
        *,
        inline: bool = False,
    ) -> None:
        self._ship_batch = ship_batch
        self._tally = tally
        self._progress = progress
        # ``inline``: each batch is written by the caller's thread when sent (a ship of one batch).
        self.inline = inline
        self._writer = None if inline else ThreadPoolExecutor(1)
        self._writing: Future[tuple[Received, ShipProblem | None]] | None = None
        self._ready: list[Shippable] = []
        self._ready_bytes = 0

    def __enter__(self) -> _Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)  # a batch in flight commits or fails before the ship returns

    def offer(self, events: Sequence[Shippable]) -> bool:
        """Add verified events; send a batch if the writer is free (wait for it when a full batch
        is ready).  False once a batch found a problem: shipping stops there."""
        for event in events:
            self._ready.append(event)
            self._ready_bytes += event.size
        writing = self._writing
        if writing is not None and (writing.done() or self._full()):
            self._writing = None
            if not self._tally.settle(writing.result(), self._progress):
                self._ready = []
                return False
        if self._writing is None and self._ready:
            self._send()
        return True

    def finish(self, *, send_ready: bool) -> bool:
        """Settle the batch in flight and (``send_ready``) send what is ready; False if a batch
        found a problem."""
        while True:
            writing, self._writing = self._writing, None
            if writing is not None and not self._tally.settle(writing.result(), self._progress):
                self._ready = []
                return False
            if not send_ready or not self._ready:
                self._ready = []
                return True
            self._send()

    def _full(self) -> bool:
        return len(self._ready) >= BATCH_EVENTS or self._ready_bytes >= BATCH_BYTES

    def _send(self) -> None:
        """Submit the first batch of what is ready: at most ``BATCH_EVENTS`` events and
        ``BATCH_BYTES`` stored bytes, at least one event."""
        count = size = 0
        for event in self._ready[:BATCH_EVENTS]:
            if count and size + event.size > BATCH_BYTES:
                break
            count += 1
            size += event.size
        batch, self._ready = self._ready[:count], self._ready[count:]
        self._ready_bytes -= size
        # Sent once the batch before settled: the target's resume point is where that one ended.
        at = self._tally.last
        if self._writer is not None:
            self._writing = self._writer.submit(self._ship_batch, batch, at)
            return
        written: Future[tuple[Received, ShipProblem | None]] = Future()
        try:
            written.set_result(self._ship_batch(batch, at))
        except Exception as exc:  # raised where the result is read, as a writer thread's would be
            written.set_exception(exc)
        self._writing = written


@dataclass
class _Tally:
    """What the ship did so far."""

    last: int
    total: int
    appended: int = 0
    present: int = 0
    problems: list[ShipProblem] = field(default_factory=list)

    def settle(self, shipped: tuple[Received, ShipProblem | None], progress: Progress | None) -> bool:
        """Count a written batch; False (its problem noted) when shipping stops there."""
        received, problem = shipped
        self.appended += received.appended
        self.present += received.present
        if received.last_seq is not None:
            self.last = max(self.last, received.last_seq)
        if received.shipped_through is not None and problem is None:
            self.last = max(self.last, received.shipped_through)
        if problem is not None:
            self.problems.append(problem)
            return False
        done = self.appended + self.present
        self.total = max(self.total, done)
        _report(progress, done, self.total)
        return True


def _until_unshippable(batch: list[SourceEvent | Unshippable]) -> tuple[list[SourceEvent], Unshippable | None]:
    """The verified events before the first one that failed verification, and that one."""
    verified: list[SourceEvent] = []
    for item in batch:
        if isinstance(item, Unshippable):
            return verified, item
        verified.append(item)
    return verified, None


def _ship_batch(
    target: ShipTarget,
    statements: ShipStatements,
    source_id: str,
    target_id: str,
    items: list[Shippable],
    resume_at: int | None = None,
    ours: Callable[[int, bytes | None], bool] | None = None,
) -> tuple[Received, ShipProblem | None]:
    """Apply ``items`` in one target transaction; a refusal ships the events before it, then
    reports it, as does an unverified item that fails verification (``Received.unshippable``)."""

    def work(chosen: list[Shippable]) -> Callable[[WriteTransaction], Received]:
        return lambda tx: receive(tx, statements, source_id, target_id, chosen, resume_at, ours)

    if not items:
        return Received(), None
    try:
        received = target.write(work(items))
    except Refused as refused:
        before = [item for item in items if item.source_seq < refused.source_seq]
        received = target.write(work(before)) if before else Received()
        code = "conflict" if isinstance(refused.error, InvalidRecordError) else "refused"
        return received, _problem(code, _at(items, refused.source_seq), str(refused.error))
    if received.conflict is not None:
        source_seq, reason = received.conflict
        return received, _problem("conflict", _at(items, source_seq), reason)
    if received.unshippable is not None:
        return received, _corrupt(received.unshippable)
    return received, None


def _at(items: list[Shippable], source_seq: int) -> Shippable:
    return next(item for item in items if item.source_seq == source_seq)


def _problem(code: str, item: Shippable, reason: str) -> ShipProblem:
    # An unverified item refused once verified: its columns as read are its event's.
    _, rollout_id, model_call_id, staging_key = item_names(item)
    return ShipProblem(
        code,
        reason,
        item.source_seq,
        item.origin.store_id,
        item.origin.seq,
        staging_key,
        rollout_id,
        model_call_id,
    )


def _corrupt(item: Unshippable) -> ShipProblem:
    row = item.row
    return ShipProblem(
        "corrupt",
        item.reason,
        item.source_seq,
        item.origin.store_id,
        item.origin.seq,
        row.get("staging_key"),
        row.get("rollout_id"),
        row.get("model_call_id"),
    )


def _report(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)
