"""Hostile peers against the checkpoint coordinator over its real Unix socket (issue 22):
frames with huge numbers, peers that never register, floods of frames and connections, a
process that cannot start threads or has run out of fds, a dead claimer, a squatter on the
socket path, a stale socket after SIGKILL, and register/close churn in the log.  The
coordinator runs in this process, so its threads and fds are this process's (read before
and after each test)."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coordinator_helpers import wait_for, workers
from hostile_helpers import Resources, resources, settle

from store.coordinator import Coordinator, CoordinatorError, CoordinatorUnavailableError, WorkerClient, framing
from store.coordinator import connection as connection_module
from store.coordinator.state import MAX_ATTEMPT, CheckpointState, RestoredCut

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, SO_PEERCRED")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def socket_path(tmp_path: Path) -> str:
    return str(tmp_path / "policy.sock")


@pytest.fixture
def coord(socket_path: str) -> Iterator[Coordinator]:
    with Coordinator(socket_path, expected_workers=2, message_timeout=2, register_timeout=0.5) as started:
        yield started


@pytest.fixture
def held(coord: Coordinator) -> Iterator[Resources]:
    """This process's threads and fds before a test; after it they are back (the coordinator's included)."""
    before = resources()
    yield before
    after = settle(None, before, fds=3, threads=2, timeout=5)
    assert after.fds <= before.fds + 3 and after.threads <= before.threads + 2, f"before {before}, after {after}"


def raw(socket_path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(socket_path)
    return sock


def send(sock: socket.socket, message: Any) -> None:
    payload = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def reply(sock: socket.socket, timeout: float = 5) -> dict[str, Any]:
    message = framing.read_frame(sock, body_timeout=timeout, idle_timeout=timeout)
    assert isinstance(message, dict)
    return message


def registered(socket_path: str) -> socket.socket:
    sock = raw(socket_path)
    send(sock, {"id": 0, "kind": "register", "body": {"pid": os.getpid()}})
    assert reply(sock)["ok"] is True
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = 5) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def client(socket_path: str) -> WorkerClient:
    return WorkerClient.connect(socket_path, message_timeout=2, shutdown_on_loss=False)


# --- numbers in frames (6) ----------------------------------------------------------------------


def test_a_huge_attempt_is_refused_at_once_and_changes_nothing(socket_path: str, coord: Coordinator, held: Any) -> None:
    worker = client(socket_path)
    try:
        start = time.monotonic()
        for attempt in (3_000_000, MAX_ATTEMPT, 2**70, -1, 1.5, True):
            record = {"rollout_id": "r", "attempt": attempt, "rows": []}
            with pytest.raises(CoordinatorError) as refused:
                worker.control("restore", records=[record])
            assert refused.value.status == 400 and "attempt" in str(refused.value)
            with pytest.raises(CoordinatorError, match="attempt"):
                worker.control("retire", rollout_id="r", attempt=attempt if attempt != MAX_ATTEMPT else 10**9)
        assert time.monotonic() - start < 2, "refusals hold the coordinator"
        too_many = [{"rollout_id": f"r{i}", "attempt": MAX_ATTEMPT - 1, "rows": []} for i in range(300)]
        with pytest.raises(CoordinatorError, match="would retire 300000 attempts") as split:
            worker.control("restore", records=too_many)
        assert split.value.status == 413
        status = worker.control("status")
        assert status["retired"] == [] and status["restored"] == {}
        assert worker.control("restore", records=[{"rollout_id": "r", "attempt": MAX_ATTEMPT - 1, "rows": []}])
        assert len(worker.control("status")["retired"]) == MAX_ATTEMPT
        with pytest.raises(CoordinatorError, match="served"):
            worker._request("report", {"checkpoint_id": None, "served": 2**63, "rows": []})
        for pid in (2**31, 0, 10**30):
            with registered_raw(socket_path) as sock:
                send(sock, {"id": 1, "kind": "register", "body": {"pid": pid}})
                assert reply(sock)["error"]["status"] == 400
    finally:
        worker.stop()


class registered_raw:
    """A raw connection, closed on exit."""

    def __init__(self, socket_path: str) -> None:
        self.sock = raw(socket_path)

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# --- peers that never register (7) --------------------------------------------------------------


def test_a_peer_that_sends_frames_but_never_registers_is_dropped_at_the_deadline(
    socket_path: str, coord: Coordinator, held: Any
) -> None:
    peers = [raw(socket_path) for _ in range(10)]
    for sock in peers:  # a valid frame each, then silence: the first frame must not end probation
        send(sock, {"id": 1, "kind": "report", "body": {}})
        assert reply(sock)["error"]["code"] == "invalid_checkpoint_state"
    start = time.monotonic()
    for sock in peers:
        assert closed_by_peer(sock, 3)
        sock.close()
    assert time.monotonic() - start < 2
    assert coord.status()["connected"] == 0


def test_control_frames_before_registering_get_no_thread(
    socket_path: str, coord: Coordinator, held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    real_start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    sock = raw(socket_path)
    frames = b"".join(framing.encode({"id": n, "kind": "control", "body": {"action": "status"}}) for n in range(2000))
    sock.sendall(frames)
    replies = [reply(sock) for _ in range(2000)]
    assert all(r["error"]["code"] == "invalid_checkpoint_state" for r in replies)
    assert started == ["policy worker-reader"]  # the connection's reader, and nothing per frame
    sock.close()


def test_a_registered_flood_of_control_frames_runs_on_a_bounded_number_of_threads(
    socket_path: str, coord: Coordinator, held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = registered(socket_path)
    threads = threading.active_count()
    peak = [threads]
    release = threading.Event()
    real = Coordinator.status

    def slow_status(self: Coordinator) -> dict[str, Any]:
        peak[0] = max(peak[0], threading.active_count())
        release.wait(5)
        return real(self)

    monkeypatch.setattr(Coordinator, "status", slow_status)
    count = connection_module.MAX_IN_FLIGHT + connection_module.MAX_QUEUED + 50
    sock.sendall(
        b"".join(framing.encode({"id": n, "kind": "control", "body": {"action": "status"}}) for n in range(count))
    )
    busy = [reply(sock) for _ in range(50)]  # past the queue: refused at once, while the others wait
    assert all(r["error"]["code"] == "checkpoint_busy" and r["error"]["status"] == 503 for r in busy)
    release.set()
    answered = [reply(sock) for _ in range(count - 50)]
    assert all(r["ok"] for r in answered)
    assert peak[0] <= threads + connection_module.MAX_IN_FLIGHT
    sock.close()


# --- the accept loop lives on (8) ----------------------------------------------------------------


def test_a_thread_that_cannot_start_drops_one_connection_not_the_accept_loop(
    socket_path: str, coord: Coordinator, held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = threading.Thread.start
    failures = [3]

    def failing_start(self: threading.Thread) -> None:
        if self.name == "policy worker-reader" and failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", failing_start)
    for _ in range(3):
        refused = raw(socket_path)
        assert reply(refused)["error"]["code"] == "checkpoint_busy"
        assert closed_by_peer(refused)
        refused.close()
    worker = client(socket_path)  # the next connection is served
    assert worker.control("status")["connected"] == 1
    worker.stop()


def test_the_accept_loop_outlives_running_out_of_file_descriptors(socket_path: str, coord: Coordinator) -> None:
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # made before the limit drops
    waiting.settimeout(10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # less the one the listing itself held
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use, hard))  # no fd left for accept()
        waiting.connect(socket_path)  # queued by the kernel; the coordinator's accept() gets EMFILE
        time.sleep(0.3)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    send(waiting, {"id": 1, "kind": "register", "body": {"pid": os.getpid()}})
    assert reply(waiting)["ok"] is True  # accepted once fds were back
    waiting.close()
    worker = client(socket_path)
    assert worker.control("status")["connected"] == 1
    worker.stop()


# --- restored cuts of a dead claimer (9) ----------------------------------------------------------


def test_a_dead_claimers_cut_is_offered_to_the_workers_still_connected(socket_path: str) -> None:
    record = {"rollout_id": "r", "attempt": 0, "rows": [], "generation_cuts": [{"model_call_id": "c1"}]}
    with Coordinator(socket_path, expected_workers=2).start() as coord, workers(socket_path, 2) as (a, b):
        a.ok(
            "control",
            action="restore",
            records=[{**record, "generation_cuts": [{**record["generation_cuts"][0], "continuation": {"d": 1}}]}],
        )
        assert a.ok("begin", capture_key="r-a1", model_call_id="c1")["continuation"] == {"d": 1}
        assert b.ok("state")["restored_targets"] == []
        a.kill()
        assert wait_for(lambda: b.ok("state")["restored_targets"] == ["r-a1/c1"]), "b was not offered the cut"
        assert b.ok("begin", capture_key="r-a1", model_call_id="c1")["continuation"] == {"d": 1}
        assert coord.status()["connected"] == 1


def test_a_claim_from_a_worker_that_already_left_claims_nothing() -> None:
    state = CheckpointState(2)
    worker = state.join(100)
    state.cuts["r-a1/c1"] = RestoredCut("r-a1", "c1", {"d": 1})
    state.leave(worker.index)
    with pytest.raises(CoordinatorError, match="not registered"):
        state.claim(worker.index, "r-a1", "c1")  # was a KeyError after marking the cut claimed
    assert state.cuts["r-a1/c1"].claimed_by is None
    assert state.adoption()["restored_targets"] == ["r-a1/c1"]


# --- who serves the socket, and a stale one (10) -----------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_a_worker_refuses_a_socket_another_user_serves() -> None:
    folder = Path(tempfile.mkdtemp())  # in the shared temp directory, which the other user can reach
    folder.chmod(0o777)
    path = str(folder / "squat.sock")
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: another user listening at the path the worker will use
        try:
            os.setuid(65534)
            squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            squat.bind(path)
            os.chmod(path, 0o777)
            squat.listen(8)
            os.write(ready_write, b"1")
            squat.settimeout(10)
            peer, _ = squat.accept()
            got = peer.recv(65536)
            os._exit(3 if got else 0)  # 3: the worker told it something
        except BaseException:
            os._exit(1)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"1"
    with pytest.raises(CoordinatorUnavailableError, match="served by uid 65534"):
        WorkerClient.connect(path, message_timeout=2, shutdown_on_loss=False)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(folder, ignore_errors=True)
    assert os.waitstatus_to_exitcode(status) == 0, "the squatter received a frame"


def test_a_stale_socket_left_by_a_killed_coordinator_is_replaced(socket_path: str) -> None:
    code = (
        "import sys, time; from store.coordinator import Coordinator; "
        f"Coordinator({socket_path!r}, expected_workers=1).start(); print('up', flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        with pytest.raises(CoordinatorError, match="another coordinator is listening"):
            Coordinator(socket_path, expected_workers=1).start()  # a live one is never replaced
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert os.path.exists(socket_path)  # SIGKILL left the file behind
    with Coordinator(socket_path, expected_workers=1).start():
        worker = client(socket_path)
        assert worker.control("status")["connected"] == 1
        worker.stop()


def test_a_path_that_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    regular = tmp_path / "not-a-socket"
    regular.write_text("precious")
    with pytest.raises(CoordinatorError, match="not a socket"):
        Coordinator(str(regular), expected_workers=1).start()
    assert regular.read_text() == "precious"
    target = tmp_path / "target"
    target.write_text("precious")
    link = tmp_path / "link.sock"
    link.symlink_to(target)
    with pytest.raises(CoordinatorError, match="not a socket"):
        Coordinator(str(link), expected_workers=1).start()
    assert target.read_text() == "precious" and (target.stat().st_mode & 0o777) != 0o600


# --- umask, chmod, frame and connection caps (11) -----------------------------------------------


def test_starting_changes_no_umask_and_chmods_no_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(f"umask {mask:o}") or 0o022)
    real_chmod = os.chmod
    monkeypatch.setattr(os, "chmod", lambda *a, **k: calls.append(f"chmod {a}") or real_chmod(*a, **k))
    path = str(tmp_path / "p.sock")
    with Coordinator(path, expected_workers=1).start():
        assert os.stat(path).st_mode & 0o777 == 0o600
    assert calls == []


def test_frames_are_capped_before_and_after_registering(socket_path: str, coord: Coordinator, held: Any) -> None:
    stranger = raw(socket_path)
    stranger.sendall(struct.pack(">I", framing.REGISTER_FRAME_LIMIT + 1))
    assert reply(stranger)["error"]["status"] == 413
    assert closed_by_peer(stranger)
    stranger.close()
    worker = registered(socket_path)
    worker.sendall(struct.pack(">I", framing.WORKER_FRAME_LIMIT + 1))
    assert reply(worker)["error"]["status"] == 413
    assert closed_by_peer(worker)
    worker.close()
    assert framing.WORKER_FRAME_LIMIT == 16 * 1024 * 1024 < framing.MAX_FRAME


def test_past_the_connection_cap_a_newcomer_is_refused_and_the_cap_clears(tmp_path: Path) -> None:
    socket_path = str(tmp_path / "capped.sock")
    with Coordinator(socket_path, expected_workers=1, register_timeout=0.5, max_connections=4) as coord:
        assert coord.max_connections == 4
        squatters = [raw(socket_path) for _ in range(4)]
        time.sleep(0.1)
        newcomer = raw(socket_path)
        refused = reply(newcomer)
        assert (refused["error"]["status"], refused["error"]["code"]) == (503, "too_many_connections")
        assert closed_by_peer(newcomer)
        newcomer.close()
        for sock in squatters:  # never registered: dropped at the deadline, freeing the cap
            assert closed_by_peer(sock, 3)
            sock.close()
        worker = client(socket_path)
        assert worker.control("status")["connected"] == 1
        worker.stop()
    assert Coordinator(socket_path, expected_workers=2).max_connections == 2 * 2 + 16


def test_register_close_churn_is_rate_limited_in_the_log(
    socket_path: str, coord: Coordinator, held: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="store.coordinator")
    for _ in range(200):
        sock = registered(socket_path)
        sock.close()
    assert wait_for(lambda: coord.status()["connected"] == 0)
    coord._churn.flush()
    lines = [r for r in caplog.records if r.name == "store.coordinator"]
    assert len(lines) <= 21, f"{len(lines)} lines for 200 joins and 200 losses"
    summary = [r for r in lines if "churn" in r.getMessage()]
    assert len(summary) == 1 and summary[0].levelno == logging.WARNING
    left_out = summary[0].churn_left_out  # type: ignore[attr-defined]
    assert left_out["joined"] + left_out["lost"] == 400 - 20


# --- the pid a worker is logged by is the kernel's (issue 33 item 9) ------------------------------

NO_CHECKPOINT = "no open checkpoint is affected"


def test_a_worker_is_logged_by_the_kernels_pid_not_the_one_it_claims(
    socket_path: str, coord: Coordinator, held: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="store.coordinator")
    sock = raw(socket_path)
    send(sock, {"id": 0, "kind": "register", "body": {"pid": 1}})  # claims to be init
    assert reply(sock)["ok"] is True
    assert list(coord.status()["workers"]) == [os.getpid()]  # this process connected: SO_PEERCRED says so
    lines = [r.getMessage() for r in caplog.records if r.name == "store.coordinator"]
    assert f"Policy worker [{os.getpid()}] joined as worker 0 (1/2 connected)" in lines, lines
    assert not [line for line in lines if "[1]" in line], lines
    [claim] = [r for r in caplog.records if "claiming pid 1" in r.getMessage()]
    assert claim.levelno == logging.WARNING and claim.claimed_pid == 1  # type: ignore[attr-defined]
    sock.close()
    assert wait_for(lambda: coord.status()["connected"] == 0)
    lost = [r.getMessage() for r in caplog.records if "lost without notice" in r.getMessage()]
    assert lost == [f"Policy worker [{os.getpid()}] lost without notice (0/2 workers remain); {NO_CHECKPOINT}"]


# --- the bytes a peer's waiting requests hold are bounded (issue 33 item 8) -----------------------


def _flood_big_requests(sock: socket.socket, count: int, size: int, first_id: int) -> None:
    pad = "x" * size
    for n in range(count):
        sock.sendall(framing.encode({"id": first_id + n, "kind": "control", "body": {"action": "status", "pad": pad}}))


def test_the_bytes_held_by_waiting_requests_are_bounded_per_connection_and_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """256 queued requests of up to 16 MiB each behind 16 busy threads held ~4 GiB; now one
    connection's running and waiting requests hold at most 32 MiB of frames and all connections
    at most the coordinator's budget (set to 40 MiB here); past it a request is refused at once."""
    from store.coordinator import server as server_module

    monkeypatch.setattr(server_module, "HELD_BYTES_TOTAL", 40 * 1024 * 1024)
    socket_path = str(tmp_path / "budget.sock")
    release = threading.Event()
    real = Coordinator.status

    def slow_status(self: Coordinator) -> dict[str, Any]:
        release.wait(20)
        return real(self)

    monkeypatch.setattr(Coordinator, "status", slow_status)
    megabyte = 1024 * 1024
    with Coordinator(socket_path, expected_workers=2, message_timeout=10, register_timeout=2) as coord:
        before = resources()
        budget = coord._admission.budget
        assert budget is not None and budget.limit == 40 * megabyte and coord._admission.held_bytes == 32 * megabyte
        first, second = registered(socket_path), registered(socket_path)
        small = [framing.encode({"id": n, "kind": "control", "body": {"action": "status"}}) for n in range(16)]
        first.sendall(b"".join(small))  # the 16 threads, busy
        _flood_big_requests(first, 48, megabyte, 100)  # 48 MiB for one connection
        busy_first = [reply(first, 20) for _ in range(48 - 31)]  # 31 fit its 32 MiB beside the 16 small ones
        assert all(r["error"]["code"] == "checkpoint_busy" and r["error"]["status"] == 503 for r in busy_first)
        assert "33554432-byte bound" in busy_first[0]["error"]["detail"]
        _flood_big_requests(second, 20, megabyte, 1000)  # the budget has ~9 MiB left for it
        busy_second = [reply(second, 20) for _ in range(20 - 8)]
        assert all(r["error"]["code"] == "checkpoint_busy" for r in busy_second)
        assert "41943040-byte bound" in busy_second[0]["error"]["detail"]
        held_now = budget.held
        assert 39 * megabyte <= held_now <= 40 * megabyte, held_now
        peak = resources()
        release.set()
        answered = [reply(first, 20) for _ in range(16 + 31)] + [reply(second, 20) for _ in range(8)]
        assert all(r["ok"] for r in answered), [r for r in answered if not r["ok"]][:1]
        assert wait_for(lambda: budget.held == 0)
        # The frames refused were never kept: what the process holds grew by about the budget, not the 68 MiB sent.
        assert peak.rss_kib - before.rss_kib < 120 * 1024, f"before {before}, at the peak {peak}"
        first.close()
        second.close()
