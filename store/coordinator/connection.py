"""One framed, two-way connection: both ends send ``{id, kind, body}`` requests and answer with
``{reply_to, ok, body}`` or ``{reply_to, ok: false, error}`` (wire-contract 8.1).

A reader thread owns the receiving side: replies wake the waiting request, requests go to
the handler.  Kinds listed in ``threaded_kinds`` are handled on a thread of their own, because
their handler sends requests of its own and waits for the replies this reader must deliver.

A peer made with an ``admission`` deadline is on probation until ``admit()`` (the coordinator
admits a connection when it registers): it must be admitted within the deadline or it is
dropped, its frames are held to the small ``admission`` frame limit, and its threaded kinds are
answered on the reader (the handler refuses them at once), so a stranger never gets a thread.
Once admitted, at most ``MAX_IN_FLIGHT`` threaded requests run at a time; up to ``MAX_QUEUED``
more wait their turn, and past that a request is refused with 503 ``checkpoint_busy``.  The
bytes are bounded as well as the count: the frames of one connection's running and waiting
requests hold at most ``Admission.held_bytes`` (32 MiB, or two of its largest frames), and
those of every connection sharing a ``ByteBudget`` (the coordinator's) at most its limit
(128 MiB); a request past either is refused with 503 ``checkpoint_busy`` and its frame dropped.
A waiting request is kept as its frame's bytes and decoded when its turn comes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from store.coordinator import framing
from store.coordinator.errors import CoordinatorError, CoordinatorUnavailableError, FrameError, error_from_wire

Handler = Callable[["Peer", str, Any], Any]
_LOG = logging.getLogger("store.coordinator")
MAX_IN_FLIGHT = 16  # threaded requests one peer runs at once (a worker's claims and control calls)
MAX_QUEUED = 256  # and how many more may wait for a thread
HELD_BYTES = 32 * 1024 * 1024  # frame bytes of one connection's running and waiting requests
HELD_BYTES_TOTAL = 128 * 1024 * 1024  # and of every connection of one coordinator


class ByteBudget:
    """Frame bytes held by requests of several connections, up to ``limit``."""

    def __init__(self, limit: int = HELD_BYTES_TOTAL) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self._lock:
            if self.held + size > self.limit:
                return False
            self.held += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self.held -= size


@dataclass(frozen=True)
class Admission:
    """Probation for a new connection: admitted within ``timeout`` seconds, frames of at most
    ``frame_limit`` bytes until then and ``admitted_frame_limit`` after."""

    timeout: float
    frame_limit: int = framing.REGISTER_FRAME_LIMIT
    admitted_frame_limit: int = framing.WORKER_FRAME_LIMIT
    budget: ByteBudget | None = None  # shared by every connection of one coordinator

    @property
    def held_bytes(self) -> int:
        """What one connection's requests may hold: ``HELD_BYTES``, and two of its largest frames at least."""
        return max(HELD_BYTES, 2 * self.admitted_frame_limit)


class _Waiter:
    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None


class Peer:
    """The two-way message channel over one connected socket."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        on_close: Callable[[Peer], None],
        message_timeout: float,
        admission: Admission | None = None,
        threaded_kinds: Collection[str] = (),
        name: str = "peer",
    ) -> None:
        self.sock = sock
        self.name = name
        self.kernel_pid: int | None = None  # the peer process's pid as the kernel reports it (SO_PEERCRED)
        self._handler = handler
        self._on_close = on_close
        self.message_timeout = message_timeout
        self._admission = admission
        self.admitted = admission is None
        self._threaded = frozenset(threaded_kinds)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Waiter] = {}
        self._in_flight = 0
        self._queued: deque[tuple[Any, bytes]] = deque()  # (id, the frame's payload): decoded in turn
        self._held = 0  # frame bytes of the running and waiting threaded requests
        self.closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)

    def start(self) -> None:
        """Start the reader thread (``RuntimeError`` if the process cannot start one)."""
        self._reader.start()

    def admit(self) -> None:
        """End the probation: no deadline, the admitted frame limit, threaded kinds on threads."""
        self.admitted = True

    # --- sending --------------------------------------------------------------------------------

    def request(self, kind: str, body: Any, *, timeout: float | None = None) -> Any:
        """Send a request and return the reply's body; a failed reply raises its typed error.

        A message that cannot be sent, or is not answered within ``timeout`` (default: the
        message timeout), raises ``CoordinatorUnavailableError``.
        """
        ident = next(self._ids)
        waiter = _Waiter()
        with self._lock:
            if self.closed.is_set():
                raise CoordinatorUnavailableError(f"the connection to the {self.name} is closed")
            self._pending[ident] = waiter
        try:
            self.send({"id": ident, "kind": kind, "body": body})
            if not waiter.done.wait(self.message_timeout if timeout is None else timeout):
                raise CoordinatorUnavailableError(f"the {self.name} did not answer {kind!r} in time")
        finally:
            with self._lock:
                self._pending.pop(ident, None)
        reply = waiter.reply
        if reply is None:
            raise CoordinatorUnavailableError(f"the connection to the {self.name} closed before it answered {kind!r}")
        if reply.get("ok") is True:
            return reply.get("body")
        raise error_from_wire(reply.get("error"))

    def send(self, message: Any) -> None:
        """Send one frame; a message that cannot be framed raises ``FrameError`` (nothing sent),
        a broken connection ``CoordinatorUnavailableError``."""
        frame = framing.encode(message)
        try:
            with self._send_lock:
                framing.send_all(self.sock, frame, self.message_timeout)
        except OSError as exc:
            self.close()
            raise CoordinatorUnavailableError(f"a message to the {self.name} could not be sent: {exc}") from exc

    def close(self) -> None:
        """Shut the socket down; the reader thread then ends and ``on_close`` runs once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    # --- receiving ------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        admission = self._admission
        deadline = None if admission is None else time.monotonic() + admission.timeout
        reader = framing.FrameReader(self.sock, framing.MAX_FRAME if admission is None else admission.frame_limit)
        try:
            while True:
                idle: float | None = None
                body_timeout = self.message_timeout
                if not self.admitted and deadline is not None:
                    idle = deadline - time.monotonic()
                    if idle <= 0:
                        assert admission is not None
                        self._refuse(None, FrameError(f"not registered within {admission.timeout:g} s", status=408))
                        return
                    body_timeout = min(body_timeout, idle)
                try:
                    payload = reader.read_payload(body_timeout=body_timeout, idle_timeout=idle)
                    message = framing.decode(payload)
                except framing.PeerClosed:
                    return
                except FrameError as exc:
                    self._refuse(None, exc)
                    if not exc.in_sync:
                        return  # the stream lost its frame boundaries
                    continue
                except OSError:
                    return
                self._dispatch(message, payload)
                del message, payload  # a waiting request keeps its payload, nothing else
                if self.admitted and admission is not None:
                    reader.max_frame = admission.admitted_frame_limit
        finally:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self.closed.set()
            waiters = list(self._pending.values())
        for waiter in waiters:
            waiter.done.set()  # reply None: the connection closed first
        with contextlib.suppress(OSError):
            self.sock.close()
        self._on_close(self)

    def _dispatch(self, message: Any, payload: bytes = b"") -> None:
        if isinstance(message, dict) and "reply_to" in message and "kind" not in message:
            with self._lock:
                waiter = self._pending.get(message["reply_to"]) if isinstance(message["reply_to"], int) else None
            if waiter is not None:
                waiter.reply = message
                waiter.done.set()
            return  # a late or unknown reply is dropped
        if not (isinstance(message, dict) and isinstance(message.get("kind"), str) and "id" in message):
            self._refuse(
                message.get("id") if isinstance(message, dict) else None,
                FrameError("a request must be a JSON object {id, kind, body}"),
            )
            return
        ident, kind, body = message["id"], message["kind"], message.get("body")
        if kind in self._threaded and self.admitted:
            self._on_a_thread(ident, kind, body, payload)
        else:
            self._answer(ident, kind, body)

    def _on_a_thread(self, ident: Any, kind: str, body: Any, payload: bytes) -> None:
        """Run the request on a thread of its own, or queue it behind the ``MAX_IN_FLIGHT`` running;
        refused when the queue is full or its bytes would pass this connection's or the budget's bound."""
        size = len(payload)
        with self._lock:
            full = self._in_flight >= MAX_IN_FLIGHT
            if full and len(self._queued) >= MAX_QUEUED:
                refusal: str | None = f"{MAX_IN_FLIGHT} requests are running and {MAX_QUEUED} waiting; retry"
            else:
                refusal = self._take(size)
            if refusal is None:
                self._held += size
                if full:
                    self._queued.append((ident, payload))
                    return
                self._in_flight += 1
        if refusal is not None:
            self._refuse(ident, CoordinatorError(refusal, status=503, code="checkpoint_busy"))
            return
        try:
            threading.Thread(
                target=self._serve, args=(ident, kind, body, size), name=f"{self.name}-{kind}", daemon=True
            ).start()
        except RuntimeError as exc:  # the process cannot start a thread now: refuse this one, go on
            with self._lock:
                self._in_flight -= 1
                self._release(size)
            self._refuse(ident, CoordinatorError(f"cannot start a thread: {exc}", status=503, code="checkpoint_busy"))

    def _take(self, size: int) -> str | None:
        """Take ``size`` bytes of this connection's bound and of the shared budget, or say why
        they do not fit (called holding the lock)."""
        admission = self._admission
        if admission is None:
            return None
        if self._held + size > admission.held_bytes:
            return (
                f"this connection's waiting and running requests hold {self._held} bytes; a {size}-byte "
                f"request would pass its {admission.held_bytes}-byte bound; retry"
            )
        if admission.budget is not None and not admission.budget.take(size):
            return f"the coordinator's requests hold their {admission.budget.limit}-byte bound; retry"
        return None

    def _release(self, size: int) -> None:
        """Give back what ``_take`` took (called holding the lock)."""
        self._held -= size
        admission = self._admission
        if admission is not None and admission.budget is not None:
            admission.budget.give(size)

    def _serve(self, ident: Any, kind: str, body: Any, size: int) -> None:
        """Answer a request, then the queued ones, until none is left."""
        while True:
            self._answer(ident, kind, body)
            with self._lock:
                self._release(size)
                if not self._queued:
                    self._in_flight -= 1
                    return
                ident, payload = self._queued.popleft()
            size = len(payload)
            message = framing.decode(payload)  # it decoded once already, when it arrived
            del payload
            kind, body = message["kind"], message.get("body")

    def _answer(self, ident: Any, kind: str, body: Any) -> None:
        try:
            reply: dict[str, Any] = {"reply_to": ident, "ok": True, "body": self._handler(self, kind, body)}
        except CoordinatorError as exc:
            reply = {"reply_to": ident, "ok": False, "error": exc.wire()}
        except Exception as exc:  # an unexpected failure is a 500, never the end of the connection
            _LOG.exception("handling %r from the %s failed", kind, self.name)
            reply = {"reply_to": ident, "ok": False, "error": CoordinatorError(f"{type(exc).__name__}: {exc}").wire()}
        try:
            self.send(reply)
        except FrameError as exc:  # the reply itself cannot be framed
            self._refuse(ident, exc)
        except CoordinatorUnavailableError:
            pass  # the peer is gone; on_close reports it

    def _refuse(self, ident: Any, error: CoordinatorError) -> None:
        with contextlib.suppress(CoordinatorError):
            self.send({"reply_to": ident if _plain_id(ident) else None, "ok": False, "error": error.wire()})


def _plain_id(ident: Any) -> bool:
    return isinstance(ident, (int, str)) and not isinstance(ident, bool)
