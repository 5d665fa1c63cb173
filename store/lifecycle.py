"""A store's lifecycle: its public calls are counted in and out, so ``close()`` and a fork
wait for the calls in flight; and the process-wide fork hooks that hold every live store
still while the process forks.

Every path here is written so that an interrupt (``KeyboardInterrupt``, ``SystemExit``)
landing anywhere leaves the counts and locks consistent: a call never counted out would
keep ``close()`` and a fork waiting for good.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from store.errors import StoreClosedError

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")


class CallGate:
    """Public calls in flight, and whether the store is closing, closed or held for a fork."""

    def __init__(self) -> None:
        self._reset(closed=False)

    def _reset(self, *, closed: bool) -> None:
        # Code takes ``with self._lock``, never ``with self._condition``: Condition.__enter__ is
        # Python, and an interrupt after it locked would keep the lock.  An RLock, so a release
        # after an interrupted wait fails instead of freeing another thread's hold.
        self._lock = threading.RLock()
        self._condition = threading.Condition(self._lock)
        self._active = 0  # public calls in flight
        self._draining = 0  # threads waiting for the calls in flight to end (a fork, close())
        self._forking = False  # a fork waits for the calls in flight; new ones wait for it
        self._closed = closed  # no new call starts
        self._shut = closed  # close() finished: nothing commits any more, no connection is open

    def enter(self, entered: list[bool], check_process: Callable[[], None]) -> None:
        """Count a call in (``entered[0]`` is set with the count); refused once closed.

        ``check_process`` runs under the gate first: a store reached from a forked child
        that the fork hooks did not see drops its parent's connections there.
        """
        with self._lock:
            while self._forking:
                self._condition.wait()
            if self._closed:
                raise StoreClosedError("this store was closed")
            check_process()
            self._active += 1
            entered[0] = True

    def leave(self, entered: list[bool]) -> None:
        with self._lock:
            if entered[0]:
                if self._active == 1 and self._draining:
                    self._condition.notify_all()  # first: a repeat after an interrupt notifies again
                self._active -= 1
                entered[0] = False

    def hold_for_fork(self) -> bool:
        """Wait for the calls in flight and keep new ones out (the gate stays locked until
        ``release_after_fork``); returns whether the store is still open."""
        self._lock.acquire()
        self._forking = True
        self._wait_for_calls()
        return not self._closed

    def _wait_for_calls(self) -> None:
        """(Holding the lock.)  Wait until no call is in flight; ``leave`` notifies only while
        someone waits here."""
        self._draining += 1
        try:
            while self._active:
                self._condition.wait()
        finally:
            self._draining -= 1

    def release_after_fork(self) -> None:
        self._forking = False
        self._condition.notify_all()
        self._lock.release()

    def reset_in_child(self) -> None:
        """In a forked child: fresh locks (the parent's may be held by threads the child lacks)."""
        self._reset(closed=self._closed)

    def close(self, stop_writes: Callable[[], None], release: Callable[[], None]) -> None:
        """Refuse new calls, ``stop_writes``, wait for the calls in flight, then ``release``.

        A second ``close()`` waits for the first to finish.
        """
        with self._lock:
            if self._closed:
                while not self._shut:  # another thread is closing it
                    self._condition.wait()
                return
            self._closed = True
            try:
                stop_writes()
                self._wait_for_calls()
                release()
            finally:
                self._shut = True
                self._condition.notify_all()


class Gated(Protocol):
    """What ``operation`` needs of the object whose method it wraps."""

    _calls: CallGate

    def _check_process(self) -> None: ...


G = TypeVar("G", bound=Gated)


def operation(method: Callable[Concatenate[G, P], R]) -> Callable[Concatenate[G, P], R]:
    """A public call: refused once the store is closed; ``close()`` and a fork wait for it to end."""

    @functools.wraps(method)
    def run(self: G, /, *args: P.args, **kwargs: P.kwargs) -> R:
        entered = [False]  # set with the count of calls in flight, so an interrupt leaves both agreeing
        gate = self._calls
        try:
            gate.enter(entered, self._check_process)
            return method(self, *args, **kwargs)
        finally:
            repeat_through_interrupts(gate.leave, entered)  # leave is idempotent

    return run


def repeat_through_interrupts(step: Callable[[A], None], argument: A) -> None:
    """Run ``step(argument)`` until it completes, even if interrupts (``KeyboardInterrupt``,
    ``SystemExit``) land in it, even on entry; then raise the first interrupt.  ``step`` must be
    safe to repeat.

    For the steps that give back what a call holds: one left undone would keep ``close()``,
    a fork or the writer role waiting for good.  An ordinary exception is raised at once.
    """
    interrupt: BaseException | None = None
    while True:
        try:
            step(argument)
            break
        except Exception:
            raise
        except BaseException as exc:
            interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt


# --- fork: every live store is held still while the process forks ------------------------------


class ForkAware(Protocol):
    def _before_fork(self) -> None: ...
    def _after_fork_in_parent(self) -> None: ...
    def _after_fork_in_child(self) -> None: ...


_LIVE: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()
_FORKING: list[ForkAware] = []  # the objects held still by the fork in progress


def track_for_fork(target: ForkAware) -> None:
    with _REGISTRY_LOCK:
        _LIVE.add(target)


def _before_fork() -> None:
    with _REGISTRY_LOCK:
        _FORKING[:] = list(_LIVE)
    for target in _FORKING:
        target._before_fork()


def _after_fork_in_parent() -> None:
    for target in _FORKING:
        target._after_fork_in_parent()
    _FORKING.clear()


def _after_fork_in_child() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for target in _FORKING:
        target._after_fork_in_child()
    _FORKING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
