"""Workers by pid in the process log (wire-contract 8.3) and in the store's log.

The lines follow uvicorn's ``Child process [<pid>] died``; the fields the contract asks for
(pid, index, connected, expected, the checkpoint that can no longer commit) are also on
each record as attributes, for handlers that want them without parsing the message.

Join and leave lines are rate-limited (``ChurnLimit``): a process that connects and
disconnects in a loop would otherwise write thousands of lines a second.  Past the limit the
lines are counted, and one WARNING says how many were left out.  A worker lost while a
checkpoint is open is always logged: that line is the one an operator needs.

The store's worker events are bounded too (``EventLimit``), since each is a row that stays:
a process (by the kernel's pid) has at most one join recorded per ``EVENT_WINDOW`` seconds,
and at most ``joins`` joins are recorded per window in all; a join left unrecorded has its
stop or loss left unrecorded as well (the log lines above still say it).  A connect loop then
adds at most two events per window for its process, and at most ``2 * joins`` in all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from store.coordinator.state import Worker

if TYPE_CHECKING:
    from store.store import Store

LOG = logging.getLogger("store.coordinator")
CHURN_LINES = 20  # join/leave lines per window
CHURN_WINDOW = 10.0  # seconds
EVENT_WINDOW = 10.0  # seconds: a process's joins recorded in the store at most once per window


class ChurnLimit:
    """At most ``lines`` join/leave lines per ``window`` seconds; the rest are counted and
    summed up in one WARNING when the window ends (at the next line, or ``flush``)."""

    def __init__(
        self, lines: int = CHURN_LINES, window: float = CHURN_WINDOW, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lines = lines
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._logged = 0
        self._left_out: Counter[str] = Counter()

    def allow(self, what: str) -> bool:
        """Whether a ``what`` line ("joined", "stopped", "lost") may be logged now."""
        with self._lock:
            if self._clock() - self._started >= self.window:
                self._summarize()
            if self._logged < self.lines:
                self._logged += 1
                return True
            self._left_out[what] += 1
            return False

    def flush(self) -> None:
        with self._lock:
            self._summarize()

    def _summarize(self) -> None:
        if self._left_out:
            counts = ", ".join(f"{n} {what}" for what, n in sorted(self._left_out.items()))
            LOG.warning(
                "Policy worker churn: %s not logged in the last %.0f s (status() lists the connected workers)",
                counts,
                self._clock() - self._started,
                extra={"churn_left_out": dict(self._left_out)},
            )
        self._started = self._clock()
        self._logged = 0
        self._left_out.clear()


class EventLimit:
    """Which joins the store records (see the module's docstring): per process at most one per
    ``window``, in all at most ``joins`` per ``window``."""

    def __init__(self, joins: int, window: float = EVENT_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self.joins = joins
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._recorded = 0
        self._last: dict[int, float] = {}  # pid -> when its last join was recorded (this window or the last)

    def allow(self, pid: int) -> bool:
        now = self._clock()
        with self._lock:
            if now - self._started >= self.window:
                self._started, self._recorded = now, 0
                self._last = {p: at for p, at in self._last.items() if now - at < self.window}
            last = self._last.get(pid)
            if (last is not None and now - last < self.window) or self._recorded >= self.joins:
                return False
            self._recorded += 1
            self._last[pid] = now
            return True


def log_join(worker: Worker, connected: int, expected: int) -> None:
    fields = {"worker_pid": worker.pid, "worker_index": worker.index, "connected": connected, "expected": expected}
    LOG.info(
        "Policy worker [%d] joined as worker %d (%d/%d connected)",
        worker.pid,
        worker.index,
        connected,
        expected,
        extra=fields,
    )


def log_claim(pid: int, claimed: int) -> None:
    """A worker whose ``register`` named another pid than the kernel's: logged by the kernel's."""
    LOG.warning(
        "Policy worker [%d] registered claiming pid %d; it is logged by the pid the kernel reports for its socket",
        pid,
        claimed,
        extra={"worker_pid": pid, "claimed_pid": claimed},
    )


def log_leave(worker: Worker, *, said_goodbye: bool, remaining: int, expected: int, blocked: str | None) -> None:
    """A clean stop is an INFO line; a connection dropped without a goodbye is a WARNING."""
    fields = {
        "worker_pid": worker.pid,
        "worker_index": worker.index,
        "connected": remaining,
        "expected": expected,
        "blocked_checkpoint": blocked,
    }
    if said_goodbye:
        consequence = "" if blocked is None else f"; checkpoint {blocked!r} cannot commit until resume"
        LOG.info(
            "Policy worker [%d] stopped (%d/%d connected)%s", worker.pid, remaining, expected, consequence, extra=fields
        )
        return
    consequence = (
        f"open checkpoint {blocked!r} can no longer commit until resume"
        if blocked is not None
        else "no open checkpoint is affected"
    )
    LOG.warning(
        "Policy worker [%d] lost without notice (%d/%d workers remain); %s",
        worker.pid,
        remaining,
        expected,
        consequence,
        extra=fields,
    )


def record(
    store: Store | None, kind: str, worker: Worker, *, connected: int, expected: int, checkpoint: str | None
) -> int | None:
    """Append a worker event to the store's log (its sequence number); a failing store is
    logged and never stops the coordinator."""
    if store is None:
        return None
    try:
        return store.record_worker(
            kind,
            worker.pid,
            index=worker.index,
            joined_seq=worker.joined_seq,
            connected=connected,
            expected=expected,
            checkpoint_id=checkpoint,
        )
    except Exception:
        LOG.exception("could not log %s of policy worker [%d] in the store", kind, worker.pid)
        return None
