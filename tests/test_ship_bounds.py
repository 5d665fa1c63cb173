"""Ships that end: ``limit``, ``deadline``, a source that keeps being written, ``Store.follow``
and ``staging-store ship --follow``; and the lineage a ship keeps (each event's writer pid and host)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from factories import make_record
from shipping_helpers import assert_target_reads_like_source

from store import InvalidRecordError, Store, UnknownKeyError, open_store
from store.shipping import ship as ship_module

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CLI = [sys.executable, "-c", "from store.cli import main; main()"]


def _source(path: Path, records: int, prefix: str = "r") -> Store:
    source = open_store(str(path), durability="normal")
    for index in range(records):
        assert source.stage(make_record(rollout_id=f"{prefix}{index}")).ok
    return source


def test_a_ship_of_a_source_that_keeps_being_written_returns(store_url: str, tmp_path: Path) -> None:
    """It ships up to the source's last event when it began; before, it chased the writer forever."""
    source = _source(tmp_path / "worker.db", 10)
    target = open_store(store_url)
    stop = threading.Event()

    def keep_writing() -> None:
        index = 0
        while not stop.is_set():  # faster than a ship of two-event batches: it never caught up
            source.stage(make_record(rollout_id=f"later{index}"))
            index += 1

    writer = threading.Thread(target=keep_writing)
    writer.start()
    monkeypatch_batch = ship_module.BATCH_EVENTS
    ship_module.BATCH_EVENTS = 2  # many batches: the writer stages between them
    outcome: list[Any] = []
    try:
        shipper = threading.Thread(target=lambda: outcome.append(source.ship(target)))
        shipper.start()
        shipper.join(10)
        alive = shipper.is_alive()
        stop.set()  # (a ship that chased the writer ends once the writer stops)
        shipper.join()
        assert not alive, "the ship did not return while its source was being written"
    finally:
        ship_module.BATCH_EVENTS = monkeypatch_batch
        stop.set()
        writer.join()
    [report] = outcome
    assert report.ok and report.read >= 10 and report.stopped is None
    assert source.ship(target).ok  # the rest
    assert_target_reads_like_source(source, target)
    source.close()
    target.close()


def test_a_limit_ships_that_many_events_and_says_how_many_are_left(store_url: str, tmp_path: Path) -> None:
    source = _source(tmp_path / "worker.db", 10)
    target = open_store(store_url)
    first = source.ship(target, limit=3)
    assert (first.ok, first.read, first.appended, first.remaining, first.stopped) == (True, 3, 3, 7, "limit")
    assert "stopped (limit) with 7 event(s) left" in first.summary()
    second = source.ship(target, limit=100)
    assert (second.read, second.remaining, second.stopped) == (7, 0, None)
    assert_target_reads_like_source(source, target)
    source.close()
    target.close()


def test_a_deadline_starts_no_batch_after_it(store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ship_module, "BATCH_EVENTS", 4)
    source = _source(tmp_path / "worker.db", 10)
    target = open_store(store_url)
    report = source.ship(target, deadline=1e-6)  # passed once the first batch is read
    assert (report.ok, report.read, report.remaining, report.stopped) == (True, 4, 6, "deadline")
    assert source.ship(target).remaining == 0
    assert_target_reads_like_source(source, target)
    source.close()
    target.close()


@pytest.mark.parametrize(
    ("option", "value"),
    [("limit", 0), ("limit", 1.5), ("limit", True), ("deadline", 0), ("deadline", -1), ("deadline", float("nan"))],
)
def test_a_bad_limit_or_deadline_is_refused_and_ships_nothing(tmp_path: Path, option: str, value: Any) -> None:
    source = _source(tmp_path / "worker.db", 2)
    target = open_store(str(tmp_path / "target.db"))
    with pytest.raises(InvalidRecordError, match=option):
        source.ship(target, **{option: value})
    assert source.ship(target).appended == 2  # nothing was shipped before
    source.close()
    target.close()


def test_follow_tails_its_source_with_a_bounded_lag_and_stops_when_asked(store_url: str, tmp_path: Path) -> None:
    interval = 0.1
    source = _source(tmp_path / "worker.db", 3)
    target = open_store(store_url)
    stop = threading.Event()
    rounds: list[Any] = []
    outcome: list[Any] = []
    follower = threading.Thread(
        target=lambda: outcome.append(source.follow(target, stop=stop, interval=interval, on_round=rounds.append))
    )
    follower.start()
    lags = []
    try:
        for index in range(5):
            record = make_record(rollout_id=f"tail{index}")
            assert source.stage(record).ok
            staged = time.monotonic()
            while True:
                try:
                    target.fetch([record.staging_key])
                    break
                except UnknownKeyError:
                    assert time.monotonic() - staged < 10, "the follower never shipped it"
                    time.sleep(0.01)
            lags.append(time.monotonic() - staged)
    finally:
        stop.set()
        follower.join(10)
    assert not follower.is_alive()
    [report] = outcome
    assert report.ok and report.stopped == "stopped" and report.appended == 8
    assert rounds and all(round_.read for round_ in rounds)
    assert max(lags) < interval + 2.0, lags  # a look every interval, then one round
    assert_target_reads_like_source(source, target)
    source.close()
    target.close()


def test_ship_follow_on_the_command_line_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    source = _source(tmp_path / "worker.db", 3)
    source.close()
    open_store(str(tmp_path / "target.db")).close()
    command = [*CLI, "ship", str(tmp_path / "worker.db"), str(tmp_path / "target.db"), "--follow", "--json"]
    process = subprocess.Popen(
        [*command, "--interval", "0.1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    first = json.loads(process.stdout.readline())  # the first round's line
    assert first["round"]["appended"] == 3
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    [line] = out.splitlines()  # JSON Lines: the totals are one line too (issue 34: they were 13 pretty ones)
    totals = json.loads(line)
    assert (totals["ok"], totals["appended"], totals["stopped"]) == (True, 3, "stopped")


def test_ship_follow_started_on_a_closed_store_ships_what_a_worker_commits_later(tmp_path: Path) -> None:
    """Issue 33 item 7: a follow that opened its source while no process had it open read it
    ``immutable``: a worker that opened it afterwards was never shipped (0 events, exit 0)."""
    source = _source(tmp_path / "worker.db", 3)
    source.close()
    assert not (tmp_path / "worker.db-wal").exists()
    open_store(str(tmp_path / "target.db")).close()
    command = [*CLI, "ship", str(tmp_path / "worker.db"), str(tmp_path / "target.db"), "--follow", "--json"]
    process = subprocess.Popen(
        [*command, "--interval", "0.1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in iter(stdout.readline, "")], daemon=True).start()
    try:
        assert json.loads(lines.get(timeout=20))["round"]["appended"] == 3
        worker = _source(tmp_path / "worker.db", 2, prefix="later")  # the worker starts again, and stages
        with sqlite3.connect(tmp_path / "worker.db") as checkpoint:  # and its commits reach the database file
            checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        checkpoint.close()
        assert worker.stage(make_record(rollout_id="last")).ok
        shipped = 0
        while shipped < 3:  # the later rounds' lines (before: none ever came)
            shipped += json.loads(lines.get(timeout=20))["round"]["appended"]
        assert shipped == 3
        worker.close()
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    time.sleep(0.2)  # the reader thread takes the last lines
    totals = "".join(lines.get_nowait() for _ in range(lines.qsize()))
    assert json.loads(totals)["appended"] == 6
    with open_store(str(tmp_path / "target.db"), read_only=True) as target:
        assert {key.rollout_id for key in target.staged_keys()} == {"r0", "r1", "r2", "later0", "later1", "last"}
    assert sorted(os.listdir(tmp_path)) == ["target.db", "worker.db"]  # the follower removed what it needed


_SIGNAL_IN_THE_WAIT = """
import os, signal, threading, time
from store.cli.ship import _stop_on_signals
with _stop_on_signals() as stop:
    with stop._cond:  # where the follow loop is entering or leaving stop.wait()
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, in this thread
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while not stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("stopped" if stop.is_set() else "not stopped")
"""


def test_a_signal_landing_inside_the_follow_loops_wait_still_stops_it() -> None:
    """A SIGINT whose handler runs while the main thread holds the stop event's lock: setting
    the event in the handler took that lock again and hung ``ship --follow`` for good."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_THE_WAIT], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr


_WORKER = """
import sys
sys.path.insert(0, {tests!r})
from factories import make_record
from store import open_store
with open_store({path!r}) as store:
    store.stage(make_record(rollout_id="far"))
"""


def test_a_shipped_event_keeps_the_pid_and_host_that_wrote_it_across_hops(store_url: str, tmp_path: Path) -> None:
    """Before: the central store named the shipper's pid, and no host."""
    worker = tmp_path / "worker.db"
    staged = subprocess.run(
        [sys.executable, "-c", _WORKER.format(tests=str(TESTS), path=str(worker))], capture_output=True, text=True
    )
    assert staged.returncode == 0, staged.stderr
    [(worker_pid, worker_host)] = _writers(str(worker))
    assert worker_pid != os.getpid() and worker_host == socket.gethostname()
    hop = tmp_path / "hop.db"
    with open_store(str(worker)) as source, open_store(str(hop)) as middle, open_store(store_url) as central:
        assert source.ship(middle).ok and middle.ship(central).ok
    assert _writers(str(hop)) == [(worker_pid, worker_host)]
    assert _writers(store_url) == [(worker_pid, worker_host)]


def _writers(url: str) -> list[tuple[int, str]]:
    if "://" in url:
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    else:
        engine = sa.create_engine(f"sqlite:///{url}")
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT DISTINCT writer_pid, writer_host FROM events")).all()
    finally:
        engine.dispose()
    return [(int(pid), str(host)) for pid, host in rows]
