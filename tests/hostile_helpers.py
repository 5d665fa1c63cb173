"""A process's resources as ``/proc`` reports them, and sockets that behave badly, for the
hostile-peer tests of both servers (``test_hostile_http.py``, ``test_hostile_coordinator.py``)
and the soak in ``tools/soak_hostile.py``."""

from __future__ import annotations

import os
import select
import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Resources:
    """Open file descriptors, threads and resident memory (KiB) of one process."""

    fds: int
    threads: int
    rss_kib: int

    def __str__(self) -> str:
        return f"{self.fds} fds, {self.threads} threads, {self.rss_kib / 1024:.1f} MiB resident"


def resources(pid: int | None = None) -> Resources:
    """What ``pid`` (default: this process) holds now (Linux ``/proc``)."""
    where = f"/proc/{pid or os.getpid()}"
    fds = len(os.listdir(f"{where}/fd"))
    fields: dict[str, str] = {}
    with open(f"{where}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return Resources(fds, int(fields["Threads"]), int(fields["VmRSS"].split()[0]))


def settle(pid: int | None, target: Resources, *, fds: int = 2, threads: int = 2, timeout: float = 5.0) -> Resources:
    """Wait (up to ``timeout``) until ``pid`` holds no more than ``target`` plus the given slack; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        now = resources(pid)
        if (now.fds <= target.fds + fds and now.threads <= target.threads + threads) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def closed_by_peer(sock: socket.socket, timeout: float) -> tuple[bool, bytes]:
    """Whether the peer closed ``sock`` within ``timeout`` seconds, and what it sent before closing."""
    deadline = time.monotonic() + timeout
    received = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, received
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return False, received
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return True, received
        if not chunk:
            return True, received
        received += chunk


def wait_all_closed(socks: list[socket.socket], timeout: float) -> tuple[int, float]:
    """How many of ``socks`` their peer closed within ``timeout`` seconds, and when the last one went."""
    start = time.monotonic()
    deadline = start + timeout
    pending = set(socks)
    last = 0.0
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select(list(pending), [], [], min(left, 0.2))
        for sock in readable:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if not chunk:
                pending.discard(sock)
                last = time.monotonic() - start
    return len(socks) - len(pending), last
