"""Real policy worker processes for the coordinator tests, and waiting for log records."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import coordinator_worker
import pytest

REPLY_SECONDS = 15.0
# Worker processes come from a forkserver that imported the store once: each is a fresh
# process (not a fork of the test) and starts in milliseconds instead of half a second.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["store", "store.coordinator", "coordinator_worker"])


class WorkerProcess:
    """One worker process (``coordinator_worker.serve``): send it commands, read its replies."""

    def __init__(self, socket_path: str, store_url: str | None = None) -> None:
        self._conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=coordinator_worker.serve, args=(child, socket_path, store_url))
        self.process.start()
        child.close()
        assert self.process.pid is not None
        self.pid: int = self.process.pid
        self.index: int | None = None

    def wait_ready(self) -> WorkerProcess:
        ready = self._reply()
        assert ready.get("ready") == self.pid, ready
        self.index = ready["index"]
        return self

    def _reply(self) -> dict[str, Any]:
        if not self._conn.poll(REPLY_SECONDS):
            self.process.kill()
            raise AssertionError(f"worker {self.pid} gave no reply")
        reply: dict[str, Any] = self._conn.recv()
        return reply

    def send(self, op: str, **fields: Any) -> dict[str, Any]:
        """The reply ``{"ok": ..., "result"|"error": ...}`` to one command."""
        self._conn.send({"op": op, **fields})
        return self._reply()

    def ok(self, op: str, **fields: Any) -> Any:
        reply = self.send(op, **fields)
        assert reply["ok"], reply
        return reply["result"]

    def error(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = self.send(op, **fields)
        assert not reply["ok"], reply
        error: dict[str, Any] = reply["error"]
        return error

    def kill(self) -> None:
        """SIGKILL: the worker vanishes without a goodbye."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def exit_code(self, timeout: float = 10.0) -> int | None:
        self.process.join(timeout=timeout)
        return self.process.exitcode

    def stop(self) -> None:
        """The clean goodbye, then the process exits."""
        self.ok("stop")
        assert self.exit_code() == 0

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self._conn.close()


@contextmanager
def workers(socket_path: str, count: int, store_url: str | None = None) -> Iterator[list[WorkerProcess]]:
    """``count`` worker processes, started together and registered in start order."""
    started: list[WorkerProcess] = []
    try:
        for _ in range(count):
            started.append(WorkerProcess(socket_path, store_url))
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.close()


def join_in_order(socket_path: str, count: int, store_url: str | None = None) -> list[WorkerProcess]:
    """Start ``count`` workers one after another (each registered before the next starts)."""
    return [WorkerProcess(socket_path, store_url).wait_ready() for _ in range(count)]


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.005)


def coordinator_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "store.coordinator"]


def records_about(
    caplog: pytest.LogCaptureFixture, pid: int, levels: Sequence[int] | None = None
) -> list[logging.LogRecord]:
    return [
        r
        for r in coordinator_records(caplog)
        if getattr(r, "worker_pid", None) == pid and (levels is None or r.levelno in levels)
    ]
