"""Frames: a 4-byte big-endian length, then a JSON document of at most 64 MiB (wire-contract 8.1).

JSON here keeps what the checkpoint writer keeps: ±inf and NaN (as ``Infinity``/``NaN``)
and integers of any size, so a worker's message round-trips exactly.

A reader may take less than the contract's 64 MiB: the coordinator reads at most
``REGISTER_FRAME_LIMIT`` from a connection that has not registered (a register frame is
~30 bytes) and ``WORKER_FRAME_LIMIT`` from a worker.  The largest legitimate frame a worker
sends is a report or snapshot: one ~150-byte row per call it delivered since the last
checkpoint (thousands per checkpoint), or a restore's records (a few hundred bytes each);
16 MiB holds ~100,000 rows, far beyond one checkpoint of one worker, and bounds one frame;
what a connection's running and waiting requests hold in all is bounded in bytes by
``store.coordinator.connection`` (32 MiB per connection, 128 MiB per coordinator).
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import time
from typing import Any

from store.coordinator.errors import FrameError

MAX_FRAME = 64 * 1024 * 1024  # the contract's bound: what is ever sent, and what a worker reads
WORKER_FRAME_LIMIT = 16 * 1024 * 1024
REGISTER_FRAME_LIMIT = 64 * 1024
_HEADER = struct.Struct(">I")


class PeerClosed(Exception):
    """The peer closed the connection at a frame boundary (a clean end of stream)."""


def encode(message: Any) -> bytes:
    """One frame holding ``message``; ``FrameError`` if it is not JSON or too large."""
    try:
        payload = json.dumps(message, allow_nan=True, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise FrameError(
            f"the message cannot be framed as JSON: {exc}", status=422, code="invalid_checkpoint_state"
        ) from exc
    if len(payload) > MAX_FRAME:
        raise FrameError(
            f"the message is {len(payload)} bytes, over the {MAX_FRAME}-byte frame limit",
            status=422,
            code="invalid_checkpoint_state",
        )
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> Any:
    """The JSON document of one frame's payload; ``FrameError`` if it is not UTF-8 JSON."""
    try:
        return json.loads(payload.decode("utf-8"), parse_constant=_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"the frame does not hold a JSON document: {exc}") from exc


def _constant(name: str) -> float:
    return {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}[name]


def read_frame(
    sock: socket.socket, *, body_timeout: float, idle_timeout: float | None = None, max_frame: int = MAX_FRAME
) -> Any:
    """Read one frame.  The first byte may take ``idle_timeout`` seconds (None: no limit, an
    idle peer is fine); once a frame has begun, all of it must arrive within ``body_timeout``.

    Raises ``PeerClosed`` at a clean end of stream, ``FrameError`` for a silent, oversized,
    truncated or undecodable frame; ``in_sync`` is false when the stream can no longer be
    trusted to be at a frame boundary.
    """
    try:
        first = _recv_some(sock, 1, idle_timeout)
    except TimeoutError as exc:
        raise _lost(f"the peer sent nothing for {idle_timeout} s", 408) from exc
    if not first:
        raise PeerClosed
    deadline = time.monotonic() + body_timeout
    header = first + _recv_exactly(sock, _HEADER.size - 1, deadline, "header")
    (length,) = _HEADER.unpack(header)
    if length > max_frame:
        raise _lost(f"a frame of {length} bytes is over the {max_frame}-byte limit", 413)
    return decode(_recv_exactly(sock, length, deadline, "body"))


class FrameReader:
    """``read_frame`` for a connection's one reader thread, buffered: one ``recv`` usually
    brings a whole frame (or several), instead of a header and a body read apart."""

    _CHUNK = 1 << 16

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self.max_frame = max_frame  # the reader's own bound (at most the contract's MAX_FRAME)

    def read(self, *, body_timeout: float, idle_timeout: float | None = None) -> Any:
        """As ``read_frame``: the next frame's document, ``PeerClosed`` or ``FrameError``."""
        return decode(self.read_payload(body_timeout=body_timeout, idle_timeout=idle_timeout))

    def read_payload(self, *, body_timeout: float, idle_timeout: float | None = None) -> bytes:
        """The next frame's payload, not yet decoded (``decode`` it)."""
        if not self._buffer:
            try:
                first = self._sock.recv(self._CHUNK) if idle_timeout is None else self._recv(idle_timeout)
            except TimeoutError as exc:
                raise _lost(f"the peer sent nothing for {idle_timeout} s", 408) from exc
            if not first:
                raise PeerClosed
            self._buffer += first
        deadline = time.monotonic() + body_timeout
        self._fill(_HEADER.size, deadline, "header")
        (length,) = _HEADER.unpack_from(self._buffer)
        if length > self.max_frame:
            raise _lost(f"a frame of {length} bytes is over the {self.max_frame}-byte limit", 413)
        end = _HEADER.size + length
        self._fill(end, deadline, "body")
        payload = bytes(self._buffer[_HEADER.size : end])
        del self._buffer[:end]
        return payload

    def _recv(self, timeout: float) -> bytes:
        return _recv_some(self._sock, self._CHUNK, timeout)

    def _fill(self, size: int, deadline: float, part: str) -> None:
        while len(self._buffer) < size:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                chunk = _recv_some(self._sock, max(self._CHUNK, size - len(self._buffer)), left)
            except TimeoutError as exc:
                raise _lost(f"the frame {part} did not arrive in time (truncated frame)", 408) from exc
            if not chunk:
                raise _lost(f"the connection closed inside a frame {part} (truncated frame)", 400)
            self._buffer += chunk


def _recv_some(sock: socket.socket, size: int, timeout: float | None) -> bytes:
    """Up to ``size`` bytes.  The socket stays blocking with no timeout of its own: a reader
    and a sender share it from different threads, so deadlines are kept with ``select``."""
    readable, _, _ = select.select([sock], [], [], timeout)
    if not readable:
        raise TimeoutError
    return sock.recv(size)


def send_all(sock: socket.socket, data: bytes, timeout: float) -> None:
    """Send every byte within ``timeout`` seconds (``TimeoutError`` otherwise), never blocking
    past it even when the peer stops reading."""
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        try:  # most frames fit the socket buffer at once: wait only when it is full
            view = view[sock.send(view, socket.MSG_DONTWAIT) :]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer did not take the frame in time")
        select.select([], [sock], [], left)


def _recv_exactly(sock: socket.socket, size: int, deadline: float, part: str) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _lost(f"the frame {part} did not arrive in time (truncated frame)", 408)
        try:
            chunk = _recv_some(sock, min(remaining, 1 << 20), left)
        except TimeoutError as exc:
            raise _lost(f"the frame {part} did not arrive in time (truncated frame)", 408) from exc
        if not chunk:
            raise _lost(f"the connection closed inside a frame {part} (truncated frame)", 400)
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _lost(detail: str, status: int) -> FrameError:
    """A framing error after which the stream is no longer at a frame boundary."""
    error = FrameError(detail, status=status)
    error.in_sync = False
    return error
