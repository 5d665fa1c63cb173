"""A client-side bound on every wait for a PostgreSQL server: past its deadline, a connection is cut.

A server that stops answering -- its processes stopped (SIGSTOP, a frozen VM), or a proxy or
NAT between that keeps the TCP connection but stops forwarding -- leaves a kernel on the
path acknowledging every packet, so neither TCP keepalives nor ``tcp_user_timeout`` ever
fire and a blocked read waits forever.  So the store arms a deadline before each wait for
the server (a write transaction, a read statement, a ping, a commit or rollback) and disarms
it after; one thread per process watches them and, past a deadline, shuts the connection's
socket down.  The blocked read then returns at once and the driver reports the connection
lost; the caller turns that into ``ConnectionLostError`` or ``CommitUncertainError``
(``cut`` tells it the deadline did it).

Arming is a dict insert under a lock (no thread wakes: a new deadline is never earlier than
the ones armed before it, all being of the same few lengths).  A socket is only ever shut
down while its wait is armed, and every caller disarms before its connection can close, so
the watchdog never touches a file descriptor that has been reused.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time


class Watchdog:
    """Deadlines of blocking waits, by token; one thread cuts the connections that outlive theirs."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A fork's child starts with no thread and none of the parent's waits.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._armed: dict[int, tuple[float, int]] = {}  # token -> (deadline, socket fd)
        self._earliest = float("inf")  # the deadline the thread sleeps until (a bound: it may be passed)
        self._cut: set[int] = set()  # tokens whose connection the watchdog shut down
        self._tokens = itertools.count(1)
        self._thread: threading.Thread | None = None

    def arm(self, fileno: int, seconds: float) -> int:
        """Watch the connection on ``fileno`` for ``seconds``; returns the token to ``disarm``."""
        deadline = time.monotonic() + seconds
        with self._lock:
            token = next(self._tokens)
            self._armed[token] = (deadline, fileno)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="store-watchdog", daemon=True)
                self._thread.start()
            if deadline < self._earliest:
                self._earliest = deadline
                self._changed.notify()
        return token

    def disarm(self, token: int) -> bool:
        """Stop watching; True if the deadline passed and the connection was cut."""
        with self._lock:
            self._armed.pop(token, None)
            if token in self._cut:
                self._cut.discard(token)
                return True
            return False

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                expired = [token for token, (deadline, _) in self._armed.items() if deadline <= now]
                for token in expired:
                    _, fileno = self._armed.pop(token)
                    self._cut.add(token)
                    _shut_down(fileno)  # under the lock: its owner cannot disarm and close it meanwhile
                self._earliest = min((deadline for deadline, _ in self._armed.values()), default=float("inf"))
                self._changed.wait(None if self._earliest == float("inf") else max(0.0, self._earliest - now))


def _shut_down(fileno: int) -> None:
    """End the TCP (or Unix) connection on ``fileno`` for both directions; the fd stays its owner's."""
    with contextlib.suppress(OSError):
        duplicate = socket.socket(fileno=os.dup(fileno))
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
        finally:
            duplicate.close()


WATCHDOG = Watchdog()
