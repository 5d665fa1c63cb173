"""A store's durability domain: ``open_store(..., replica=..., domain="replicated")``.

In the ``replicated`` domain an acknowledgement (a cut's ``durable_prefix``; with
``replicate_terminal`` a terminal stage) waits until the records it names are in the replica,
for at most ``replica_wait`` seconds.  Shipping (``Store.ship``) stays the mechanism: one
background thread per store ships everything committed up to the highest sequence number a
caller waits for, in sequence order, a batch per target transaction, idempotent and verified,
each event keeping its identity.  The thread keeps the replica's *watermark*: the source seq
up to which every event is in the replica (a ship is sequence ordered and a batch is all or
nothing, so the ship's last seq is one).  A caller whose wait runs out gets False and says so
(``durable_failure``, ``ReplicaUnavailableError``); the thread keeps trying, with a short
back-off, until the replica answers again, so acknowledgements resume by themselves.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from store.append.new_event import EVENT_INSERT_COLUMNS
from store.append.statements import held_keys_binds, held_keys_statement
from store.errors import ConfigurationError, StoreClosedError, StoreError
from store.queries.reads import Reader
from store.shipping.receive import LogDiverged, ResumePointMoved
from store.shipping.source import last_seq

if TYPE_CHECKING:
    from store.shipping.report import ShipReport
    from store.shipping.ship import Bounds

log = logging.getLogger("store.replica")

LOCAL = "local"
REPLICATED = "replicated"
DOMAINS = (LOCAL, REPLICATED)

DEFAULT_REPLICA_WAIT = 5.0
MAX_REPLICA_WAIT = 600.0
# After a failed ship the thread waits this long before the next try (doubling up to the
# most), so a replica that is down is not hammered and one that is back is found quickly.
# With nobody waiting, the thread ships what is new this often.
FOLLOW_INTERVAL = 0.5
RETRY_FIRST = 0.05
RETRY_MOST = 1.0
# The events this process committed and the replica may not hold yet, kept as written (a ship
# of them reads nothing back): at most this many, and this many stored bytes.
RECENT_EVENTS = 4096
RECENT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class DomainOptions:
    """The checked durability options of one store."""

    domain: str
    replica: str | None
    replicate_terminal: bool
    replica_wait: float


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def domain_options(
    replica: Any, domain: Any, replicate_terminal: Any, replica_wait: Any, *, read_only: bool
) -> DomainOptions:
    """``open_store``'s durability arguments, each checked (``ConfigurationError`` names the one)."""
    if domain not in DOMAINS or not isinstance(domain, str):
        raise ConfigurationError(f"domain must be one of {list(DOMAINS)}, got {_shown(domain)}")
    if replica is not None and not isinstance(replica, (str, os.PathLike)):
        raise ConfigurationError(
            f"replica must be the URL or path of another store (a str or os.PathLike), got {_shown(replica)}"
        )
    location = None if replica is None else os.fspath(replica)
    if isinstance(location, bytes):
        raise ConfigurationError(f"replica must be a str or str path, got {_shown(replica)}")
    if location is not None and not location.strip():
        raise ConfigurationError("replica must name a store: got an empty string")
    if type(replicate_terminal) is not bool:
        raise ConfigurationError(f"replicate_terminal must be True or False, got {_shown(replicate_terminal)}")
    if replica_wait is None:
        wait = DEFAULT_REPLICA_WAIT
    elif (
        isinstance(replica_wait, bool)
        or not isinstance(replica_wait, (int, float))
        or not 0 < replica_wait <= MAX_REPLICA_WAIT
    ):
        raise ConfigurationError(
            f"replica_wait must be a number of seconds above 0 and at most {MAX_REPLICA_WAIT:g}, "
            f"got {_shown(replica_wait)}"
        )
    else:
        wait = float(replica_wait)
    if domain == REPLICATED:
        if location is None:
            raise ConfigurationError('domain="replicated" needs replica= (the URL or path of the replica store)')
        if read_only:
            raise ConfigurationError(
                'a store opened read_only=True acknowledges nothing: domain="replicated" needs writes'
            )
    else:
        if location is not None:
            raise ConfigurationError('replica= is given but domain="local": pass domain="replicated" to use it')
        if replicate_terminal:
            raise ConfigurationError('replicate_terminal=True needs domain="replicated" (and replica=)')
        if replica_wait is not None:
            raise ConfigurationError(
                'replica_wait is the bound of a replicated acknowledgement: it needs domain="replicated"'
            )
    return DomainOptions(domain, location, replicate_terminal, wait)


class Replicator:
    """The background shipper of one store in the replicated domain, and its watermark.

    ``open_replica`` opens the replica store (lazily, again after a failure: a replica that is
    down when the worker starts is found once it is up); ``ship(replica, bounds, start, recent,
    confirm)`` ships the source's log into it.  ``reach(seq, deadline)`` waits until the
    watermark is at least ``seq`` or ``deadline`` (``time.monotonic``) passes.

    Every answer comes from the replica, never from memory alone: a caller takes a ticket
    (``ask``) and is answered by a round that began after it and heard from the replica (a batch
    written, whose transaction checks the replica's resume point is where the last one ended,
    or, with nothing to ship, a read of that resume point).  A replica restored from a backup
    or failed over to a lagging standby is found by that check, and shipped again from its own
    resume point, before anything it lacks is acknowledged.  A store whose log is behind the
    replica's resume point for its id, or holds other events there (``LogDiverged``), is never
    acknowledged: every wait answers False at once while it is so (``last_error`` says why).
    """

    def __init__(
        self,
        open_replica: Callable[[], ReplicaStore],
        ship: Callable[[Any, Bounds, int | None, Recent | None, bool], ShipReport],
        source_id: Callable[[], str],
    ) -> None:
        self._open_replica = open_replica
        self._ship = ship
        self._source_id = source_id
        self._replica: ReplicaStore | None = None
        self._lock = threading.Condition()
        self._wanted = 0  # the highest source seq a caller waits for
        self._through = 0  # every source event up to here is in the replica
        self._known = False  # whether _through was read from the replica yet
        self._asked = 0  # tickets handed out (``ask``)
        self._answered = 0  # every ticket up to here was answered by a round that heard from the replica
        self._diverged: str | None = None  # this store's log is not the one the replica holds (why)
        self._failures = 0
        self.last_error: str | None = None  # the newest failure, for a caller to show
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recent = Recent()

    @property
    def through(self) -> int:
        """Every source event with a seq up to this is in the replica (as last learnt)."""
        with self._lock:
            return self._through

    @property
    def replica(self) -> ReplicaStore | None:
        return self._replica

    def ask(self) -> int:
        """A ticket: the rounds that answer it begin after this call (and a round starts now)."""
        with self._lock:
            if self._stop.is_set():
                raise StoreClosedError("this store was closed")
            self._asked += 1
            self._start_thread()
            self._lock.notify_all()
            return self._asked

    def wait(self, ticket: int, seq: int, deadline: float) -> int:
        """The watermark as a round that began after ``ticket`` heard it from the replica, once it
        is at least ``seq`` or ``deadline`` passes (-1: no such round yet, or this store's log
        is not the replica's)."""
        with self._lock:
            self._wanted = max(self._wanted, seq)
            self._lock.notify_all()
            while True:
                answered = self._diverged is None and self._known and self._answered >= ticket
                if answered and self._through >= seq:
                    return self._through
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set() or self._diverged is not None:
                    return self._through if answered else -1
                self._lock.wait(left)

    def reach(self, seq: int, deadline: float) -> bool:
        """Wait until the replica says every source event up to ``seq`` is in it; False once
        ``deadline`` passes first (the thread keeps shipping: a later call finds it there)."""
        return self.wait(self.ask(), seq, deadline) >= seq

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="staging-store-replica", daemon=True)
            self._thread.start()

    def _idle(self) -> bool:
        return (
            self._known and self._through >= self._wanted and self._answered >= self._asked and self._diverged is None
        )

    def _run(self) -> None:
        from store.shipping.ship import Bounds

        while not self._stop.is_set():
            with self._lock:
                while not self._stop.is_set() and self._idle():
                    # Nobody waits: look for new events now and then all the same, so the replica
                    # keeps up between acknowledgements (a cut then ships little more than its own).
                    if not self._lock.wait(FOLLOW_INTERVAL):
                        break
                if self._stop.is_set():
                    return
                ticket = self._asked  # every ticket up to here is answered by this round
                confirm = ticket > self._answered
                # Its own last ship ended here: the next one starts there without asking (each
                # batch checks it in its transaction).
                start = self._through if self._known else None
            try:
                if self._replica is None:
                    self._replica = self._open_replica()
                report = self._ship(self._replica, Bounds(stop=self._stop), start, self._recent, confirm)
            except ResumePointMoved as moved:  # the replica lost events (restored, a standby), or another shipper
                log.warning("the replica's resume point moved (%s); shipping from its own resume point", moved)
                with self._lock:
                    self._known = False
                    self._through = 0
                continue
            except LogDiverged as diverged:
                with self._lock:
                    first = self._diverged is None
                    self._diverged = self.last_error = str(diverged)
                    self._known = False
                    self._through = 0
                    self._lock.notify_all()
                if first:
                    log.error("refusing to replicate: %s", diverged)
                self._failed(str(diverged), logged=True)
                continue
            except StoreClosedError:
                if self._stop.is_set():
                    return
                self._failed("the replica store was closed")
                continue
            except StoreError as exc:
                self._failed(f"{type(exc).__name__}: {exc}")
                continue
            except Exception as exc:  # the thread never dies of one ship
                log.exception("shipping to the replica failed")
                self._failed(f"{type(exc).__name__}: {exc}")
                continue
            # It heard from the replica: the resume point was read (no start), a confirm read or
            # a batch's transaction checked it.  (A ship that stopped at a problem before its
            # first batch did not.)
            heard = start is None or (report.ok and report.stopped is None) or report.last_seq > start
            with self._lock:
                self._through = max(self._through, report.last_seq)
                self._known = True
                self._diverged = None
                if heard:
                    self._answered = max(self._answered, ticket)
                self._lock.notify_all()
            self._recent.shipped(report.last_seq)
            if not report.ok:
                problem = report.problems[0] if report.problems else None
                self._failed(f"the ship stopped at a problem: {problem}")
            else:
                self._failures = 0
                self.last_error = None

    def _failed(self, reason: str, *, logged: bool = False) -> None:
        self.last_error = reason
        self._failures += 1
        if self._failures == 1 and not logged:
            log.warning("replicating to the replica failed (%s); retrying until it answers", reason)
        self._stop.wait(min(RETRY_MOST, RETRY_FIRST * 2 ** min(self._failures - 1, 10)))

    def after_fork_in_child(self) -> None:
        """In a forked child: the parent's thread is not here, and its lock may have been held
        by it; the child starts afresh (its first wait starts a thread of its own)."""
        self._lock = threading.Condition()
        self._thread = None
        self._known = False
        self._diverged = None
        self._recent = Recent()

    def close(self) -> None:
        """Stop the thread (a batch in flight commits whole) and close the replica store."""
        with self._lock:
            self._stop.set()
            self._lock.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._recent.remember(None)
        replica, self._replica = self._replica, None
        if replica is not None:
            replica.close()

    def remember(self, rows: list[tuple[int, tuple[Any, ...]]] | None) -> None:
        """The write path's ``on_commit``: events this process just committed, as written."""
        self._recent.remember(rows)


class Recent:
    """Events this process committed, (seq, row) as written (``WriteTransaction.kept``), until
    a ship covers them: a ship of them takes its rows from here, not from the log, and still
    verifies each (``source.Unverified``).  None from a commit (another module wrote in it: a
    ship into this store, retention's deletes) forgets everything."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: collections.OrderedDict[int, tuple[tuple[Any, ...], int]] = collections.OrderedDict()
        self._bytes = 0

    def remember(self, rows: list[tuple[int, tuple[Any, ...]]] | None) -> None:
        with self._lock:
            if rows is None:
                self._rows.clear()
                self._bytes = 0
                return
            for seq, row in rows:
                size = 0
                for index in _STORED:
                    value = row[index]
                    if value is not None:
                        if type(value) is not bytes:  # as the log gives it back
                            row = (*row[:index], bytes(value), *row[index + 1 :])
                        size += len(value)
                self._rows[seq] = ((seq, *row), size)
                self._bytes += size
            while self._rows and (len(self._rows) > RECENT_EVENTS or self._bytes > RECENT_BYTES):
                self._bytes -= self._rows.popitem(last=False)[1][1]

    def rows(self, after: int, upto: int) -> list[tuple[dict[str, Any], int]] | None:
        """The rows of every seq in (after, upto] (by column, as the log gives them), with their
        stored bytes; None if any is not here."""
        with self._lock:
            found = []
            for seq in range(after + 1, upto + 1):
                row = self._rows.get(seq)
                if row is None:
                    return None
                found.append(row)
        return [(dict(zip(_ROW_NAMES, values, strict=True)), size) for values, size in found]

    def shipped(self, through: int) -> None:
        """Forget what the replica holds now (every seq up to ``through``)."""
        with self._lock:
            while self._rows and next(iter(self._rows)) <= through:
                self._bytes -= self._rows.popitem(last=False)[1][1]


_ROW_NAMES = ("seq", *EVENT_INSERT_COLUMNS)
# Where the stored bytes are in a written row (``EVENT_INSERT_COLUMNS``'s order).
_STORED = tuple(
    EVENT_INSERT_COLUMNS.index(name) for name in ("body", "token_ids", "token_mask", "log_probs", "checksum")
)


class ReplicaStore(Protocol):
    """What the replicator needs of the replica (a ``Store``)."""

    @property
    def store_id(self) -> str: ...

    @property
    def url(self) -> str: ...

    def close(self) -> None: ...

    def _writes_only(self) -> None: ...


class SourceStore(Protocol):
    """What the replicator needs of the store it ships from (a ``Store``)."""

    def _known_id(self) -> str: ...

    def _ship_round(
        self,
        to: Any,
        bounds: Bounds,
        start: int | None = None,
        recent: Recent | None = None,
        *,
        exact: bool = False,
        confirm: bool = False,
    ) -> ShipReport: ...

    def _keep_committed(self, on_commit: Callable[[list[tuple[int, tuple[Any, ...]]] | None], None]) -> None: ...

    def _on_close(self, stop: Callable[[], None]) -> Callable[[], None]: ...


def start(store: SourceStore, options: DomainOptions, open_store: Callable[[str], ReplicaStore]) -> Replicator:
    """The replicator of ``store`` (opened in the replicated domain): its thread starts now and
    catches the replica up (``open_store(location)`` opens it); the store's ``close()`` stops it
    first and closes the replica."""
    location = options.replica
    assert location is not None

    def open_replica() -> ReplicaStore:
        replica = open_store(location)
        try:
            if replica.store_id == store._known_id():
                raise ConfigurationError(f"the replica {replica.url} is this store itself; name another store")
        except BaseException:
            replica.close()
            raise
        # Only the shipping thread's writes use it from now on (its id is known): the writer
        # keeps its connection between ships instead of taking it from the pool for each.
        replica._writes_only()
        return replica

    def ship(to: Any, bounds: Bounds, start: int | None, recent: Recent | None, confirm: bool) -> ShipReport:
        return store._ship_round(to, bounds, start, recent, exact=True, confirm=confirm)

    replicator = Replicator(open_replica, ship, store._known_id)
    remove = store._on_close(replicator.close)
    store._keep_committed(replicator.remember)
    try:
        with replicator._lock:
            replicator._start_thread()
    except BaseException:
        remove()
        raise
    return replicator


def key_seqs(reader: Reader, keys: Sequence[str]) -> dict[str, int]:
    """The source seq of each live key's event (a key that holds nothing is left out)."""
    found: dict[str, int] = {}
    if not keys:
        return found
    with reader.connection("reading the seqs of staged keys") as connection:
        for size, values, _ in held_keys_binds(keys):
            statement = held_keys_statement(reader.engine, size)
            rows = connection.exec_driver_sql(statement.sql, statement.params(values))
            found.update((str(key), int(seq)) for key, seq in rows)
        connection.rollback()
    return found


def head(reader: Reader) -> int:
    """The source's last event now (0: none)."""
    with reader.connection("reading the last event") as connection:
        seq = last_seq(connection)
        connection.rollback()
    return seq


def in_replica(replicator: Replicator, seqs: dict[str, int], deadline: float, ticket: int | None = None) -> set[str]:
    """The keys (of ``seqs``: key -> its event's source seq) whose events the replica says it
    holds by ``deadline`` (a round after ``ticket``, or after this call, heard it): every one
    when the watermark reaches the highest, else those at or below it."""
    if not seqs:
        return set()
    through = replicator.wait(replicator.ask() if ticket is None else ticket, max(seqs.values()), deadline)
    return {key for key, seq in seqs.items() if seq <= through}
