"""Benchmark: the policy checkpoint coordinator with 64 worker processes connected.

* report round trip: every worker sends ``report`` messages (a body of 8 delivered and 4
  undelivered calls) and times each until its reply, one worker at a time (the others idle,
  connected) and all 64 at once.  Baseline, measured in the same run in alternating blocks:
  the same frame bytes echoed by a plain Unix-socket server thread in the coordinator's
  process (the floor of one framed round trip between the two processes).  Reported as
  median and p99 of the samples, and the ratio report / echo per round (median/min/max).
* SIGKILL -> WARNING: a worker is SIGKILLed and the time until the coordinator's handler sees
  the ``lost without notice`` WARNING naming its pid is measured (CLOCK_MONOTONIC, one clock
  for every process).  Target (issue 9): <= 100 ms, on the slowest kill.

    .venv/bin/python tools/bench_coordinator.py [--quick] [--json] [--workers N] [--rounds R]
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import statistics
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, parser, temp_dir

from store.coordinator import Coordinator, WorkerClient
from store.coordinator.framing import encode, read_frame

KILL_TARGET_MS = 100.0


def report_body() -> dict[str, Any]:
    rows = [{"capture_key": "r-a1", "model_call_id": f"c{i}", "staging_key": f"r-a1/c{i}"} for i in range(8)]
    undelivered = [["r-a1", f"u{i}"] for i in range(4)]
    return {"checkpoint_id": None, "served": 12, "rows": rows, "undelivered": undelivered, "streaming": []}


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# --- the worker process -------------------------------------------------------------------------


def worker(conn: Connection, socket_path: str, echo_path: str) -> None:
    client = WorkerClient.connect(socket_path)
    echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    echo.connect(echo_path)
    body = report_body()
    frame = encode({"id": 1, "kind": "report", "body": body})
    conn.send("ready")
    while True:
        try:
            command, count = conn.recv()
        except EOFError:  # the benchmark is over
            return
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            if command == "report":
                client.report()
            else:  # the baseline: the same bytes, echoed back
                echo.sendall(frame)
                read_frame(echo, body_timeout=30)
            samples.append(time.perf_counter() - started)
        conn.send(samples)


# --- the coordinator's process ------------------------------------------------------------------


def echo_server(listener: socket.socket) -> None:
    """Echo each frame back to its sender, one thread per connection."""

    def serve(sock: socket.socket) -> None:
        while True:
            try:
                header = sock.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    return
                payload = sock.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL)
                sock.sendall(header + payload)
            except OSError:
                return

    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(sock,), daemon=True).start()


class WarningClock(logging.Handler):
    """When the WARNING naming each pid was emitted (CLOCK_MONOTONIC)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[int, float] = {}
        self.arrived = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        stamp = time.perf_counter()
        pid = getattr(record, "worker_pid", None)
        if pid is not None and "lost without notice" in record.getMessage():
            with self.arrived:
                self.seen[pid] = stamp
                self.arrived.notify_all()

    def wait(self, pid: int, timeout: float = 10.0) -> float:
        with self.arrived:
            self.arrived.wait_for(lambda: pid in self.seen, timeout)
            return self.seen[pid]


def run_blocks(pipes: list[Connection], command: str, count: int, together: bool) -> list[float]:
    samples: list[float] = []
    if together:
        for pipe in pipes:
            pipe.send((command, count))
        for pipe in pipes:
            samples += pipe.recv()
    else:
        for pipe in pipes:
            pipe.send((command, count))
            samples += pipe.recv()
    return samples


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rounds, per_block, kills = (2, 5, 4) if args.quick else (args.rounds, 20, 16)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["store", "store.coordinator"])
    clock = WarningClock()
    log = logging.getLogger("store.coordinator")
    log.addHandler(clock)
    log.setLevel(logging.INFO)
    log.propagate = False  # the workers' join lines would flood the report
    report = Report("bench_coordinator", {"workers": args.workers, "rounds": rounds, "per_block": per_block})
    with temp_dir(args.dir) as folder:
        socket_path, echo_path = os.path.join(folder, "policy.sock"), os.path.join(folder, "echo.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(echo_path)
        listener.listen(256)
        threading.Thread(target=echo_server, args=(listener,), daemon=True).start()
        with Coordinator(socket_path, expected_workers=args.workers) as coordinator:
            processes, pipes = [], []
            for _ in range(args.workers):
                mine, theirs = context.Pipe()
                process = context.Process(target=worker, args=(theirs, socket_path, echo_path), daemon=True)
                process.start()
                processes.append(process)
                pipes.append(mine)
            for pipe in pipes:
                assert pipe.recv() == "ready"
            assert coordinator.status()["connected"] == args.workers
            results: dict[str, dict[str, list[float]]] = {"one at a time": {}, "all at once": {}}
            ratios: dict[str, list[float]] = {"one at a time": [], "all at once": []}
            for _ in range(rounds):
                for mode, together in (("one at a time", False), ("all at once", True)):
                    echo = run_blocks(pipes, "echo", per_block, together)
                    rep = run_blocks(pipes, "report", per_block, together)
                    results[mode].setdefault("echo", []).extend(echo)
                    results[mode].setdefault("report", []).extend(rep)
                    ratios[mode].append(statistics.median(rep) / statistics.median(echo))
            rows = []
            for mode, series in results.items():
                for name, samples in series.items():
                    rows.append(
                        [
                            mode,
                            name,
                            len(samples),
                            f"{statistics.median(samples) * 1e6:.0f}",
                            f"{p99(samples) * 1e6:.0f}",
                        ]
                    )
                    report.results[f"{mode} {name}"] = {
                        "median_us": statistics.median(samples) * 1e6,
                        "p99_us": p99(samples) * 1e6,
                    }
                r = ratios[mode]
                report.results[f"{mode} ratio"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
            report.table(
                f"report round trip, {args.workers} workers connected (microseconds)",
                ["mode", "message", "samples", "median", "p99"],
                rows,
            )
            report.table(
                "report / echo per round",
                ["mode", "median", "min", "max"],
                [[m, f"{statistics.median(r):.2f}", f"{min(r):.2f}", f"{max(r):.2f}"] for m, r in ratios.items()],
            )
            latencies = []
            for process in processes[:kills]:
                assert process.pid is not None
                started = time.perf_counter()
                os.kill(process.pid, signal.SIGKILL)
                latencies.append((clock.wait(process.pid) - started) * 1000)
                process.join()
            report.table(
                "SIGKILL -> WARNING (milliseconds)",
                ["kills", "median", "p99", "max"],
                [[kills, f"{statistics.median(latencies):.2f}", f"{p99(latencies):.2f}", f"{max(latencies):.2f}"]],
            )
            report.results["kill_to_warning_ms"] = {
                "median": statistics.median(latencies),
                "max": max(latencies),
                "samples": latencies,
            }
            report.targets.append(
                Target("SIGKILL -> WARNING (slowest kill)", max(latencies), "<=", KILL_TARGET_MS, unit=" ms")
            )
            for pipe in pipes:
                pipe.close()
            for process in processes:
                process.kill()
                process.join()
        listener.close()
    report.emit(args.json)


if __name__ == "__main__":
    main()
