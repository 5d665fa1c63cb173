"""The log-shipping methods of ``Store``: ``ship``, ``follow``, the store's id and an event's
origin.

A mixin of ``store.store.Store`` (one concern, and ``store.py``'s size); how a ship reads,
verifies and applies events is ``store.shipping.ship`` and ``store.shipping.receive``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from store import arguments
from store.errors import InvalidRecordError
from store.lifecycle import CallGate, operation
from store.queries.reads import Reader
from store.shipping import identity

if TYPE_CHECKING:
    from store.append.log import EventLog
    from store.shipping import EventOrigin, ShipReport
    from store.shipping.replica import Recent
    from store.shipping.ship import Bounds


class LogShipping:
    """``Store``'s shipping methods (see ``Store.ship``)."""

    _reader: Reader
    _engine: Engine
    _store_id: str | None
    _calls: CallGate
    _check_process: Callable[[], None]

    _write: Callable[..., Any]  # Store._write: the target's write path
    _log: EventLog

    @property
    def url(self) -> str:
        raise NotImplementedError  # Store.url overrides it

    @operation
    def ship(
        self,
        to: LogShipping,
        *,
        progress: Callable[[int, int], object] | None = None,
        limit: int | None = None,
        deadline: float | None = None,
    ) -> ShipReport:
        """Copy this store's events not yet in ``to`` into it, verified, keeping their identity.

        Idempotent and resumable; stops at the first conflict or damaged event and reports it.
        Goes up to this store's last event when it began (later ones wait for the next ship),
        at most ``limit`` events, and starts no batch after ``deadline`` seconds: the report's
        ``remaining`` and ``stopped`` say what is left and why.  ``progress(done, total)`` is
        called with source events done as batches commit.
        """
        from store.shipping.ship import Bounds  # loaded when a ship runs

        limit = arguments.optional_count("limit", limit)
        ends = arguments.optional_seconds("deadline", deadline)
        bounds = Bounds(limit=limit, deadline=None if ends is None else time.monotonic() + ends)
        return self._reported(to, lambda: self._ship(to, progress, bounds))

    def follow(
        self,
        to: LogShipping,
        *,
        stop: threading.Event,
        interval: float = 0.5,
        on_round: Callable[[ShipReport], object] | None = None,
    ) -> ShipReport:
        """Ship this store into ``to`` until ``stop`` is set: each round ships everything up to
        this store's last event when the round began, then, caught up, waits ``interval``
        seconds (or until ``stop``) before the next.  An event committed here reaches ``to``
        within ``interval`` plus the time to ship what was ahead of it.  Stops at the first
        problem, or once ``stop`` is set after the batch in flight commits; returns the rounds'
        totals (``stopped="stopped"`` when asked to stop).  ``on_round(report)`` is called after
        each round that shipped something.  Each round is an operation of its own, so a fork or
        ``close()`` happens between rounds (a closed store ends the follow with ``StoreClosedError``)."""
        from store.shipping.follow import follow as follow_log
        from store.shipping.ship import Bounds

        if not isinstance(stop, threading.Event):
            raise InvalidRecordError(f"follow() stop must be a threading.Event, got {type(stop).__name__}")
        wait = arguments.optional_seconds("interval", interval)
        assert wait is not None
        if on_round is not None and not callable(on_round):
            raise InvalidRecordError(f"follow() on_round must be callable, got {type(on_round).__name__}")
        return follow_log(
            lambda: self._reported(to, lambda: self._ship_round(to, Bounds(stop=stop))), stop, wait, on_round
        )

    def _reported(self, to: LogShipping, ship: Callable[[], ShipReport]) -> ShipReport:
        """``ship()``, a ``LogDiverged`` made the report's problem (``diverged``: nothing shipped)."""
        from store.shipping.receive import LogDiverged
        from store.shipping.report import ShipProblem, ShipReport

        try:
            return ship()
        except LogDiverged as diverged:
            source_id = self._known_id()
            target_id = to._known_id() if isinstance(to, LogShipping) else "?"
            problem = ShipProblem("diverged", str(diverged), 0, source_id, 0, None, None, None)
            return ShipReport(False, source_id, target_id, 0, 0, 0, 0, problems=(problem,))

    @operation
    def _ship_round(
        self,
        to: LogShipping,
        bounds: Bounds,
        start: int | None = None,
        recent: Recent | None = None,
        *,
        exact: bool = False,
        confirm: bool = False,
    ) -> ShipReport:
        return self._ship(to, None, bounds, start, recent, exact=exact, confirm=confirm)

    def _writes_only(self) -> None:
        """Only this store's own write path uses it from now on (the replicator's replica, its
        id read): the writer keeps its connection between batches (``EventLog.hold_writer``)."""
        self._known_id()
        self._log.hold_writer()

    def _keep_committed(self, on_commit: Callable[[list[tuple[int, tuple[Any, ...]]] | None], None]) -> None:
        """Hand each commit's appended events to ``on_commit`` (the replicator's ``Recent``)."""
        self._log.on_commit = on_commit

    def _ship(
        self,
        to: LogShipping,
        progress: Callable[[int, int], object] | None,
        bounds: Bounds,
        start: int | None = None,
        recent: Recent | None = None,
        *,
        exact: bool = False,
        confirm: bool = False,
    ) -> ShipReport:
        if not isinstance(to, LogShipping):
            raise InvalidRecordError(f"ship() takes a Store to ship to, got {type(to).__name__}")
        if progress is not None and not callable(progress):
            raise InvalidRecordError(f"ship() progress must be callable, got {type(progress).__name__}")
        from store.shipping.ship import ShipTarget, ship_log

        target = ShipTarget(to.url, to._engine, to._known_id, to._write)
        return ship_log(
            self._known_id(), self._reader, target, progress, bounds, start, recent, exact=exact, confirm=confirm
        )

    @property
    def store_id(self) -> str:
        """This store's id (random, made when it was created): the origin of the events it stages."""
        return self._identity()

    @operation
    def _identity(self) -> str:
        return self._known_id()

    def _known_id(self) -> str:
        """The store id, for code already inside an operation (store.shipping)."""
        if self._store_id is None:
            with self._reader.connection("reading the store id") as connection:
                self._store_id = identity.read_store_id(connection)
        return self._store_id

    @operation
    def event_origin(self, seq: int) -> EventOrigin | None:
        """Event ``seq``'s identity: (store that first staged it, its seq there); None if no such event."""
        if type(seq) is not int or seq < 1:
            raise InvalidRecordError(f"event_origin() takes a sequence number (an int >= 1), got {seq!r}")
        store_id = self._known_id()  # before the connection: a store of one connection has no second
        with self._reader.connection("reading an event's origin") as connection:
            return identity.event_origin(connection, store_id, seq)
