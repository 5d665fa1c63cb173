"""uvicorn's HTTP/1.1 protocol with the bounds ``staging-store serve`` promises a hostile peer.

uvicorn on its own bounds a header's size (h11's 16 KiB) and the idle time between two
requests (``timeout_keep_alive``), but not the connections it holds, nor the time a peer may
take to send its headers or its body: a peer that connects and says nothing, or sends a byte
every few seconds, holds a file descriptor forever.  ``GuardedH11Protocol`` adds:

* a connection cap: at ``max_connections`` open connections a newcomer sheds the connection
  that has gone longest without sending a request carrying the server's token (one that never
  sent one first, oldest first; then the one whose last authorised request is oldest), so a
  flood of idle or unauthorised connections cannot keep an authorised client out.  A connection
  with a request in progress is never shed; only when every connection has one is a newcomer
  answered ``503 too_many_connections`` and closed at once (the process never runs out of fds);
* a header deadline: a request's line and headers must all arrive within ``header_timeout``
  seconds of its first byte (or of the connection, for a silent peer), else ``408`` and close;
* a body deadline: the body must arrive within ``body_timeout`` seconds of the headers; the
  route answers ``408 body_timeout`` itself, and a body still trickling in after any answer is
  cut off at the deadline.

* a send deadline: a response the peer does not read (the transport's buffer stays full, so
  writing is paused) for ``send_timeout`` seconds on end is abandoned and the connection
  aborted: a peer that asks and never reads holds neither the connection nor the response's
  memory past it.

The header and body deadlines are absolute: bytes that trickle in do not extend them.

``RateLimitedLog`` keeps uvicorn's own warnings (one per malformed request: "Invalid HTTP
request received.") from letting a stranger write the server's log at the rate it sends.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_SEND_TIMEOUT = 30.0
LINGER = 1.0  # past the route's own body deadline, so its 408 goes out before the connection is cut


class RateLimitedLog(logging.Filter):
    """Lets at most ``lines`` records through per ``window`` seconds; the next one to pass after
    a window says how many were left out."""

    def __init__(self, lines: int = 10, window: float = 10.0) -> None:
        super().__init__()
        self.lines, self.window = lines, window
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._passed = 0
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._started >= self.window:
                if self.left_out:
                    record.msg = f"{record.getMessage()} ({self.left_out} more such lines not logged in the last "
                    record.msg += f"{now - self._started:.0f} s)"
                    record.args = ()
                self._started, self._passed, self.left_out = now, 0, 0
            if self._passed < self.lines:
                self._passed += 1
                return True
            self.left_out += 1
            return False


def refusal_bytes(status: int, reason: str, code: str, detail: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, written before h11 has a request."""
    body = msgspec.json.encode({"code": code, "detail": detail})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` with a connection cap and header and body deadlines (set by ``configure``)."""

    max_connections = DEFAULT_MAX_CONNECTIONS
    header_timeout = DEFAULT_HEADER_TIMEOUT
    body_timeout = 30.0
    send_timeout = DEFAULT_SEND_TIMEOUT
    token: bytes | None = None  # the bearer token: at the cap, who never sent it is shed first
    refused_connections = 0  # counted across the process, for tests and the soak
    shed_connections = 0  # likewise: idle connections closed to let a newcomer in
    abandoned_sends = 0  # likewise: connections aborted at the send deadline

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" or "body" while a deadline is armed
        self._refused = False
        self._send_deadline: asyncio.TimerHandle | None = None
        self._since = time.monotonic()  # connected, or last sent an authorised request
        self._authorised = False
        self._checked: object = None  # the request cycle whose headers were checked last

    @classmethod
    def configure(
        cls,
        *,
        max_connections: int,
        header_timeout: float,
        body_timeout: float,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        token: str | None = None,
    ) -> type[GuardedH11Protocol]:
        """A subclass with these bounds (uvicorn takes a protocol class, not an instance).
        ``token``: the bearer token (None: any whole request counts as authorised)."""
        bounds = {
            "max_connections": max_connections,
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "send_timeout": send_timeout,
            "token": None if token is None else f"Bearer {token}".encode("ascii"),
        }
        return type("GuardedH11Protocol", (cls,), bounds)

    # --- the connection cap -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._open_connections() >= self.max_connections and not self._shed_one():
            self._refused = True
            self.transport = transport
            type(self).refused_connections += 1
            detail = f"the server holds its limit of {self.max_connections} connections; retry shortly"
            transport.write(refusal_bytes(503, "Service Unavailable", "too_many_connections", detail))
            transport.close()
            return
        super().connection_made(transport)
        self._arm("headers", self.header_timeout)

    def _open_connections(self) -> int:
        """Connections that count against the cap: those not already closing (a shed one is)."""
        return sum(1 for other in self.connections if not other.transport.is_closing())

    def _shed_one(self) -> bool:
        """Close the connection that has gone longest without an authorised request, among those
        with no request in progress; False if every connection has one."""
        idle = [
            other
            for other in self.connections
            if isinstance(other, GuardedH11Protocol) and not other.transport.is_closing() and other._idle()
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda other: (other._authorised, other._since))
        type(self).shed_connections += 1
        victim.transport.close()  # it asked for nothing now: no answer is owed
        return True

    def _idle(self) -> bool:
        """No request of this connection is being answered, and none has been read whole."""
        return self.cycle is None or self.cycle.response_complete

    def _note_request(self) -> None:
        """A whole request's headers arrived: it is authorised if it carries the token."""
        cycle = self.cycle
        if cycle is None or cycle is self._checked:
            return
        self._checked = cycle
        if self.token is None or any(
            name == b"authorization" and hmac.compare_digest(value, self.token)
            for name, value in cycle.scope["headers"]
        ):
            self._authorised = True
            self._since = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_send()
        if self._refused:
            return
        super().connection_lost(exc)

    # --- the deadlines ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._note_request()
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._note_request()  # a pipelined request's cycle starts here, not in data_received
        self._follow()

    def _follow(self) -> None:
        """Arm the deadline the request's state calls for; the app has the whole request once the peer is done."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase != "headers" and self.timeout_keep_alive_task is None:
                self._arm("headers", self.header_timeout)  # bytes of a next request: its own header deadline
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self.body_timeout + LINGER)
        else:
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    # --- the send deadline: asyncio pauses writing while the peer leaves the buffer full -----

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None and not self._refused:
            self._send_deadline = self.loop.call_later(self.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()

    def _disarm_send(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
        self._send_deadline = None

    def _send_expired(self) -> None:
        self._send_deadline = None
        if not self.transport.is_closing():
            type(self).abandoned_sends += 1
            self.transport.abort()  # close() would wait for the buffer the peer does not read

    def _expired(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, None
        if self.transport.is_closing():
            return
        if phase == "headers" and self.conn.our_state is h11.IDLE:
            detail = f"the request's headers did not arrive within {self.header_timeout:g} s"
            self.transport.write(refusal_bytes(408, "Request Timeout", "header_timeout", detail))
        self.transport.close()
