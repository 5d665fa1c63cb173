"""Soak: hostile peers against both servers, with their resources measured before and after.

HTTP (a real ``staging-store serve`` process on loopback, the default bounds unless ``--quick``):
waves of silent, half-sent and trickling connections and connection floods past the cap,
trickled bodies, hostile bodies (deep JSON, oversized, too many prefixes, wrong media types),
while an authorised client keeps cutting and reading; then schemathesis against the published
``/openapi.json`` (if installed) with the checks a server promises: no 5xx, documented
statuses, content types and response schemas.  Coordinator (in this process, real Unix
socket): floods of unregistered connections and frames, a registered worker's control flood,
register/close churn and huge numbers, while a worker keeps asking for the status.

Reports per phase what was sent, what came back, the servers' fds, threads and resident
memory before and after, and anything lost; exits 1 on a 5xx, a leak, a hang or a loss.

    pip install schemathesis          # the tool's own dependency, not the [test] extra's
    .venv/bin/python tools/soak_hostile.py [--rounds 3] [--quick] [--examples 300] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402
from hostile_helpers import Resources, closed_by_peer, resources, settle, wait_all_closed  # noqa: E402
from http_helpers import TOKEN, inventory, start_live_calls  # noqa: E402

from store import Coordinator, WorkerClient, open_store, to_json  # noqa: E402
from store.coordinator import framing  # noqa: E402

CUT = "/ng-control/v1/generation-cut"
MANIFEST = "/training-token-capture/control/rollouts/h0/manifest"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _status(answer: bytes) -> str:
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"


class Prober(threading.Thread):
    """An authorised client that keeps reading while the peers misbehave: answers by status."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.answers: Counter[str] = Counter()
        self.slowest = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as http:
            while not self.stop.wait(0.05):
                start = time.monotonic()
                try:
                    self.answers[str(http.get(MANIFEST, headers=AUTH).status_code)] += 1
                except httpx.HTTPError as exc:
                    self.answers[type(exc).__name__] += 1
                self.slowest = max(self.slowest, time.monotonic() - start)


def http_soak(rounds: int, quick: bool, examples: int) -> dict[str, Any]:
    cap, header, body = (32, 1.0, 1.5) if quick else (256, 10.0, 30.0)
    folder = Path(tempfile.mkdtemp(prefix="soak-hostile-"))
    store_path = folder / "store.db"
    with open_store(store_path) as store:
        start_live_calls(store, 4, 8).close()
    token = folder / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    command = [sys.executable, "-c", "import sys; from store.cli import main; sys.exit(main())", "serve"]
    command += [str(store_path), "--token-file", str(token), "--port", "0"]
    command += ["--max-connections", str(cap), "--header-timeout", str(header), "--body-timeout", str(body)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    base = line.rsplit(" ", 1)[1]
    host, port = base.removeprefix("http://").rsplit(":", 1)
    address = (host, int(port))
    result: dict[str, Any] = {"bounds": {"max_connections": cap, "header_timeout": header, "body_timeout": body}}
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.get(MANIFEST, headers=AUTH).status_code == 200
        before = resources(proc.pid)
        prober = Prober(base)
        prober.start()
        phases: dict[str, Counter[str]] = {}
        for _ in range(rounds):
            _merge(phases, "flood past the cap", _flood(address, cap, header))
            _merge(phases, "silent, half-sent and trickled heads", _slow_heads(address, cap // 2, header))
            _merge(phases, "trickled bodies", _slow_bodies(address, 8, body))
            _merge(phases, "hostile bodies", _hostile_bodies(base))
        prober.stop.set()
        prober.join()
        after = settle(proc.pid, before, fds=4, threads=4, timeout=header + body + 5)
        result["phases"] = {name: dict(counts) for name, counts in phases.items()}
        result["authorised reads meanwhile"] = dict(prober.answers)
        result["slowest authorised read s"] = round(prober.slowest, 3)
        result["server before"], result["server after"] = str(before), str(after)
        result["leaked"] = after.fds > before.fds + 4 or after.threads > before.threads + 4
        result["schemathesis"] = _schemathesis(base, examples, folder)
        after_fuzz = resources(proc.pid)
        result["server after schemathesis"] = str(after_fuzz)
        with open_store(store_path, read_only=True) as reopened:
            result["audit after"] = "ok" if reopened.audit().ok else "PROBLEMS"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        result["server tracebacks"] = err.count("Traceback")
        shutil.rmtree(folder, ignore_errors=True)
    server_errors = sum(
        n
        for counts in result["phases"].values()
        for status, n in counts.items()
        if status.isdigit() and status.startswith("5")
    )
    fuzz = result["schemathesis"]
    result["failed"] = bool(
        result["leaked"]
        or result["server tracebacks"]
        or server_errors - result["phases"]["flood past the cap"].get("503", 0)
        or (isinstance(fuzz, dict) and fuzz.get("failures"))
        or result["audit after"] != "ok"
    )
    return result


def _merge(phases: dict[str, Counter[str]], name: str, counts: Counter[str]) -> None:
    """Counts add up over the rounds; a "slowest" figure is the slowest of any round."""
    total = phases.setdefault(name, Counter())
    for key, value in counts.items():
        total[key] = max(total[key], value) if key.startswith("slowest") else total[key] + value


def _flood(address: tuple[str, int], cap: int, header: float) -> Counter[str]:
    """Hold the cap with silent connections, then 3x the cap more: each newcomer sheds the
    oldest silent one (closed without an answer), so the first 3x the cap are closed at once."""
    counts: Counter[str] = Counter()
    held = [socket.create_connection(address) for _ in range(cap)]
    time.sleep(0.3)
    newcomers = [socket.create_connection(address) for _ in range(3 * cap)]
    everyone = held + newcomers
    shed, _ = wait_all_closed(everyone[: 3 * cap], 5)
    counts["silent connections shed by a newcomer"] += shed
    counts["silent connections not shed in 5 s"] += 3 * cap - shed
    closed, _ = wait_all_closed(everyone[3 * cap :], header + 5)
    counts["newest connections closed at the header deadline"] += closed
    counts[f"newest connections still open after {header + 5:g} s"] += cap - closed
    for sock in everyone:
        sock.close()
    return counts


def _slow_heads(address: tuple[str, int], count: int, header: float) -> Counter[str]:
    counts: Counter[str] = Counter()
    socks = [socket.create_connection(address) for _ in range(count)]
    for index, sock in enumerate(socks):
        if index % 3 == 1:
            sock.sendall(b"POST /ng-control/v1/generation-cut HTTP/1.1\r\nHost: x\r\n")
        elif index % 3 == 2:
            sock.sendall(b"GET / HTTP/1.1\r\nX-Slow: ")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5):
            for sock in socks[2::3]:
                with contextlib.suppress(OSError):
                    sock.send(b"x")

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    closed, last = wait_all_closed(socks, header + 5)
    stop.set()
    feeder.join()
    counts["closed at the header deadline"] += closed
    counts["still open"] += len(socks) - closed
    counts["slowest close ms"] = max(counts["slowest close ms"], int(last * 1000))
    for sock in socks:
        sock.close()
    return counts


def _slow_bodies(address: tuple[str, int], count: int, body: float) -> Counter[str]:
    counts: Counter[str] = Counter()
    head = f"POST {CUT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    head += "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
    socks = [socket.create_connection(address) for _ in range(count)]
    for sock in socks:
        sock.sendall(head.encode() + b"{")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5):
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.send(b" ")

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    for sock in socks:
        gone, answer = closed_by_peer(sock, body + 10)
        counts[_status(answer)] += 1
        counts["cut off" if gone else "still open"] += 1
    stop.set()
    feeder.join()
    for sock in socks:
        sock.close()
    return counts


def _hostile_bodies(base: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    bodies = [
        (b"[" * 200_000 + b"]" * 200_000, AUTH),
        (b"{" * 10, AUTH),
        (b"a=1", {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}),
        (b"{}", {"Authorization": AUTH["Authorization"]}),
        (to_json(inventory(4097)), AUTH),
        (b" " * (8 * 1024 * 1024 + 1), AUTH),
        (to_json(inventory(4)), {**AUTH, "Authorization": "Bearer wrong-token-0123456789"}),
        (to_json(inventory(4)), AUTH),  # the real cut, answered from the log
    ]
    with httpx.Client(base_url=base, timeout=60) as http:
        for content, headers in bodies:
            try:
                counts[str(http.post(CUT, content=content, headers=headers).status_code)] += 1
            except httpx.HTTPError as exc:
                counts[type(exc).__name__] += 1
    return counts


def _schemathesis(base: str, examples: int, folder: Path) -> dict[str, Any] | str:
    binary = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    if not Path(binary).exists():
        return "skipped: pip install schemathesis"
    report = folder / "schemathesis.xml"
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    command = [binary, "run", f"{base}/openapi.json", "-H", f"Authorization: Bearer {TOKEN}", "-c", checks]
    command += ["-n", str(examples), "--report-junit-path", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=folder)  # its cache goes there
    summary = [line for line in done.stdout.splitlines() if "generated" in line or "passed" in line]
    text = report.read_text() if report.exists() else ""
    return {
        "exit": done.returncode,
        "summary": summary[-2:],
        "failures": text.count("<failure"),
        "errors": text.count("<error"),
    }


# --- the coordinator -------------------------------------------------------------------------


def coordinator_soak(rounds: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="soak-hostile-coord-"))
    path = str(folder / "policy.sock")
    logging.getLogger("store.coordinator").setLevel(logging.CRITICAL)
    counts: Counter[str] = Counter()
    slowest = 0.0
    with Coordinator(path, expected_workers=2, register_timeout=1.0, message_timeout=5.0).start() as coord:
        worker = WorkerClient.connect(path, message_timeout=10, shutdown_on_loss=False)
        before = _settled_self()
        for _ in range(rounds):
            start = time.monotonic()
            strangers = []
            for _ in range(coord.max_connections * 2):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(path)
                strangers.append(sock)
            for index, sock in enumerate(strangers):
                with contextlib.suppress(OSError):
                    if index % 2:
                        frames = b"".join(
                            framing.encode({"id": n, "kind": "control", "body": {"action": "status"}})
                            for n in range(200)
                        )
                        sock.sendall(frames)
            counts["worker status during the flood"] += worker.control("status")["connected"] >= 1
            closed, _ = wait_all_closed(strangers, 5)
            counts["strangers dropped"] += closed
            counts["strangers still open"] += len(strangers) - closed
            for sock in strangers:
                sock.close()
            flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            flood.connect(path)
            flood.sendall(framing.encode({"id": 0, "kind": "register", "body": {"pid": os.getpid()}}))
            flood.sendall(
                b"".join(
                    framing.encode({"id": n, "kind": "control", "body": {"action": "status"}}) for n in range(2000)
                )
            )
            answers = Counter()
            flood.settimeout(30)
            reader = framing.FrameReader(flood)
            for _ in range(2001):
                reply = reader.read(body_timeout=30, idle_timeout=30)
                answers["ok" if reply.get("ok") else reply["error"]["code"]] += 1
            flood.close()
            counts.update({f"registered flood: {k}": v for k, v in answers.items()})
            for _ in range(500):  # churn
                churn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                churn.connect(path)
                churn.sendall(framing.encode({"id": 0, "kind": "register", "body": {"pid": os.getpid()}}))
                with contextlib.suppress(OSError):
                    churn.recv(4096)
                churn.close()
            for attempt in (3_000_000, 2**80):
                try:
                    worker.control("restore", records=[{"rollout_id": "r", "attempt": attempt, "rows": []}])
                    counts["huge attempt accepted"] += 1
                except Exception as exc:  # counted by type
                    counts[f"huge attempt: {type(exc).__name__}"] += 1
            slowest = max(slowest, time.monotonic() - start)
        after = settle(None, before, fds=4, threads=4, timeout=10)
        counts["connected at the end"] = coord.status()["connected"]
        worker.stop()
    shutil.rmtree(folder, ignore_errors=True)
    leaked = after.fds > before.fds + 4 or after.threads > before.threads + 4
    return {
        "counts": dict(counts),
        "slowest round s": round(slowest, 2),
        "before": str(before),
        "after": str(after),
        "leaked": leaked,
        "failed": leaked or counts["huge attempt accepted"] > 0 or counts["strangers still open"] > 0,
    }


def _settled_self() -> Resources:
    time.sleep(0.2)
    return resources()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small bounds (1 s header, 32 connections)")
    parser.add_argument("--examples", type=int, default=300, help="schemathesis examples per operation")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {"http": http_soak(args.rounds, args.quick, args.examples), "coordinator": coordinator_soak(args.rounds)}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, result in results.items():
            print(f"== {name}")
            for key, value in result.items():
                print(f"  {key}: {value}")
    return 1 if any(result["failed"] for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
