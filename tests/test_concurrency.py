"""Concurrency: group commit across threads, several processes on one file, SIGKILL durability."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from factories import make_record
from stage_worker import record_for

import store as lib
from store import StagedCallRecord, StageResult, Store, open_store
from store.append import transaction as transaction_module

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "stage_worker.py"

THREADS = 16
PER_THREAD = 20


# --- helpers ----------------------------------------------------------------------------------


def raw_engine(store_url: str) -> sa.Engine:
    if "://" not in store_url:
        return sa.create_engine(f"sqlite:///{store_url}")
    return sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))


def query(store_url: str, sql: str) -> list[Any]:
    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(sa.text(sql)))
    finally:
        engine.dispose()


def count_batches(target: Store) -> list[int]:
    """Wrap the log's batch writer; the returned list collects each batch's size."""
    sizes: list[int] = []
    original = target._log._write_batch

    def counting(batch: list[Any]) -> None:
        try:
            original(batch)
        finally:
            sizes.append(len(batch))  # after: callers that queue while a batch runs join it

    target._log._write_batch = counting  # type: ignore[method-assign]
    return sizes


def run_threads(count: int, body: Callable[[int], None]) -> list[BaseException]:
    """Run ``body(i)`` on ``count`` threads released together; returns uncaught errors."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def target(index: int) -> None:
        barrier.wait()
        try:
            body(index)
        except BaseException as exc:  # collected and asserted on by the caller
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a staging thread hung"
    return errors


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Worker:
    """A child process running ``stage_worker.py``, its stdout lines read on a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            cwd=REPO,
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, deadline: float) -> str | None:
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"worker {self.proc.pid} produced no output in time; stderr:\n{self.finish(kill=True)}")

    def all_lines(self, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        out: list[str] = []
        while (line := self.next_line(deadline)) is not None:
            out.append(line)
        return out

    def finish(self, *, kill: bool = False) -> str:
        if kill and self.proc.poll() is None:
            self.proc.kill()
        try:
            _, self.stderr = self.proc.communicate(timeout=60)
        except ValueError:  # stdout already consumed by the reader thread
            self.proc.wait(timeout=60)
            assert self.proc.stderr is not None
            self.stderr = self.proc.stderr.read()
        return self.stderr


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(timeout=30)


# --- threads: group commit ---------------------------------------------------------------------


def test_sixteen_threads_staging_share_commits(store: Store, store_url: str) -> None:
    records = [
        [make_record(rollout_id=f"t{t}", model_call_id=f"c{i}", generated=(t, i, 7)) for i in range(PER_THREAD)]
        for t in range(THREADS)
    ]
    sizes = count_batches(store)
    results: list[list[StageResult]] = [[] for _ in range(THREADS)]

    def body(t: int) -> None:
        for record in records[t]:
            results[t].append(store.stage(record))

    assert run_threads(THREADS, body) == []
    total = THREADS * PER_THREAD
    flat = [r for per_thread in results for r in per_thread]
    assert len(flat) == total
    assert all(r.ok for r in flat), [r.error for r in flat if not r.ok][:3]

    # Group commit: every stage went through a batch, and batches were shared.
    assert sum(sizes) == total
    assert len(sizes) < total, f"{len(sizes)} commits for {total} stages: no commit was shared"
    assert max(sizes) > 1

    everything = [r for per_thread in records for r in per_thread]
    fetched = store.fetch([r.staging_key for r in everything])
    assert [s.digest for s in fetched] == [r.digest for r in everything]
    report = store.replay()
    assert report.ok, report.summary()
    assert report.events == total
    assert len(store.calls()) == total
    # Per-stream versions and sequence numbers stay unique under concurrency.
    rows = query(store_url, "SELECT count(DISTINCT seq), count(*) FROM events")
    assert tuple(rows[0]) == (total, total)


def test_concurrent_identical_and_conflicting_stages(store: Store, store_url: str) -> None:
    shared = [make_record(rollout_id="shared", model_call_id=f"c{i}") for i in range(PER_THREAD)]
    contested_keys = [f"contest/c{i}" for i in range(PER_THREAD)]  # each thread's record of the call differs
    outcomes: dict[str, list[tuple[int, StageResult]]] = {key: [] for key in contested_keys}
    lock = threading.Lock()

    def body(t: int) -> None:
        for i, record in enumerate(shared):
            assert store.stage(record).ok  # identical records from every thread: all succeed
            mine = make_record(rollout_id="contest", model_call_id=f"c{i}", generated=(t, t + 1))
            result = store.stage(mine)
            with lock:
                outcomes[contested_keys[i]].append((t, result))

    assert run_threads(THREADS, body) == []
    for key, results in outcomes.items():
        winners = [t for t, r in results if r.ok]
        assert len(winners) == 1, f"{key}: {len(winners)} writers won"
        assert all(key in (r.error or "") for _, r in results if not r.ok)
        i = int(key.removeprefix("contest/c"))
        expected = make_record(rollout_id="contest", model_call_id=f"c{i}", generated=(winners[0], winners[0] + 1))
        assert store.fetch([key])[0].digest == expected.digest
    report = store.replay()
    assert report.ok, report.summary()
    assert report.events == 2 * PER_THREAD  # one per shared record, one per contested key
    rows = query(store_url, "SELECT count(*) FROM events WHERE rollout_id = 'shared'")
    assert rows[0][0] == PER_THREAD


def test_one_callers_error_does_not_undo_the_rest_of_its_batch(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    log = store._log
    original_batch = log._write_batch
    sizes: list[int] = []
    gate = threading.Event()

    def gated(batch: list[Any]) -> None:
        if not sizes:  # hold the first commit until everyone else has queued behind it
            deadline = time.monotonic() + 30
            while len(log._queue) < THREADS - 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            gate.set()
        sizes.append(len(batch))
        original_batch(batch)

    log._write_batch = gated  # type: ignore[method-assign]
    original_project = transaction_module.WriteTransaction._project

    def failing_project(self: Any, event: Any, *args: Any, **kwargs: Any) -> None:
        original_project(self, event, *args, **kwargs)
        if event.rollout_id == "bad":
            raise RuntimeError(f"projection refused {event.model_call_id}")

    monkeypatch.setattr(transaction_module.WriteTransaction, "_project", failing_project)
    # Every stage projects through ``_project`` (PostgreSQL's first, lone stage would otherwise
    # send its rows in one guarded statement, not projected there).
    monkeypatch.setattr(transaction_module.WriteTransaction, "guess_new_stream", lambda self, new: False)
    records = [make_record(rollout_id="bad" if t % 3 == 0 else "good", model_call_id=f"c{t}") for t in range(THREADS)]
    results: dict[int, StageResult | BaseException] = {}

    def body(t: int) -> None:
        try:
            results[t] = store.stage(records[t])
        except RuntimeError as exc:
            results[t] = exc

    assert run_threads(THREADS, body) == []
    monkeypatch.undo()
    assert gate.is_set()
    assert max(sizes) >= THREADS - 1, f"the queued stages were not batched together: {sizes}"

    good = [t for t in range(THREADS) if records[t].rollout_id == "good"]
    bad = [t for t in range(THREADS) if records[t].rollout_id == "bad"]
    for t in good:
        assert isinstance(results[t], StageResult) and results[t].ok, results[t]  # type: ignore[union-attr]
    for t in bad:
        assert isinstance(results[t], RuntimeError) and f"c{t}" in str(results[t])
    assert [s.digest for s in store.fetch([records[t].staging_key for t in good])] == [records[t].digest for t in good]
    for t in bad:
        with pytest.raises(lib.UnknownKeyError):
            store.fetch([records[t].staging_key])
    report = store.replay()
    assert report.ok, report.summary()
    assert report.events == len(good)


def test_a_callers_insert_failing_in_the_database_fails_only_that_caller(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row the database refuses (here a key row's primary key) inside a shared batch fails
    only its own caller, with a store error; the rest of the batch commits."""
    assert store.stage(make_record(rollout_id="first", model_call_id="c0")).ok
    taken = make_record(rollout_id="first", model_call_id="c0").staging_key
    log = store._log
    original_batch = log._write_batch
    sizes: list[int] = []

    def gated(batch: list[Any]) -> None:
        if not sizes:  # hold the first commit until everyone else has queued behind it
            deadline = time.monotonic() + 30
            while len(log._queue) < THREADS - 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        sizes.append(0)
        # The first batch (held above) is a lone stage: on PostgreSQL it would send its key row in
        # one guarded statement, not through fold_keys, so a "bad" caller that came first would
        # be staged (seen in CI). Every caller's key row goes through the folds here.
        for pending in batch:
            pending.guess = False
        try:
            original_batch(batch)
        finally:
            sizes[-1] = len(batch)  # callers queued while it ran joined it

    log._write_batch = gated  # type: ignore[method-assign]
    original_fold_keys = transaction_module.fold_keys

    def clashing_keys(event: Any) -> Any:
        added, removed = original_fold_keys(event)
        if event.rollout_id == "bad":  # its key row names a key already staged: the primary key refuses it
            (state,) = added.values()
            added = {taken: state}
        return added, removed

    monkeypatch.setattr(transaction_module, "fold_keys", clashing_keys)
    records = [make_record(rollout_id="bad" if t % 4 == 1 else "good", model_call_id=f"c{t}") for t in range(THREADS)]
    results: dict[int, StageResult | BaseException] = {}

    def body(t: int) -> None:
        try:
            results[t] = store.stage(records[t])
        except lib.StoreError as exc:
            results[t] = exc

    assert run_threads(THREADS, body) == []
    monkeypatch.undo()
    assert max(sizes) >= THREADS - 1, f"the queued stages were not batched together: {sizes}"
    good = [t for t in range(THREADS) if records[t].rollout_id == "good"]
    bad = [t for t in range(THREADS) if records[t].rollout_id == "bad"]
    for t in good:
        assert isinstance(results[t], StageResult) and results[t].ok, results[t]  # type: ignore[union-attr]
    for t in bad:
        assert isinstance(results[t], lib.StorageError), results[t]
        with pytest.raises(lib.UnknownKeyError):
            store.fetch([records[t].staging_key])
        assert store.call("bad", f"c{t}") is None
    assert [s.digest for s in store.fetch([records[t].staging_key for t in good])] == [records[t].digest for t in good]
    report = store.replay()
    assert report.ok, report.summary()
    assert report.events == len(good) + 1


# --- processes -----------------------------------------------------------------------------------


def test_two_processes_stage_into_one_store_at_once(store_url: str, workers: list[Worker]) -> None:
    count = 60
    start_at = time.time() + 2.0
    for prefix in ("proc-a", "proc-b"):
        workers.append(Worker("stage", store_url, prefix, str(count), "--threads", "2", "--start-at", str(start_at)))
    outputs = [w.all_lines() for w in workers]
    for worker, lines in zip(workers, outputs, strict=True):
        stderr = worker.finish()
        assert worker.proc.returncode == 0, f"worker failed:\n{lines[-5:]}\n{stderr}"
        assert lines[-1] == "DONE"
        assert sum(line.startswith("ACK ") for line in lines) == count

    expected: list[StagedCallRecord] = [record_for(p, i) for p in ("proc-a", "proc-b") for i in range(count)]
    with open_store(store_url) as opened:
        fetched = opened.fetch([r.staging_key for r in expected])
        assert [s.digest for s in fetched] == [r.digest for r in expected]
        report = opened.replay()
        assert report.ok, report.summary()
        assert report.events == 2 * count
    pids = {row[0] for row in query(store_url, "SELECT DISTINCT writer_pid FROM events")}
    assert pids == {w.proc.pid for w in workers}


def test_processes_staging_conflicting_records_under_the_same_keys(store_url: str, workers: list[Worker]) -> None:
    """Two processes stage different records under the same keys: each key has exactly one
    winner, the loser is told, and what is stored is the winner's record."""
    count = 40
    start_at = time.time() + 2.0
    writers = ("writer-a", "writer-b")
    for writer in writers:
        workers.append(
            Worker(
                "stage",
                store_url,
                "shared",
                str(count),
                "--threads",
                "2",
                "--start-at",
                str(start_at),
                "--writer",
                writer,
            )
        )
    winners: dict[str, str] = {}
    for worker, writer in zip(workers, writers, strict=True):
        lines = worker.all_lines()
        stderr = worker.finish()
        assert worker.proc.returncode == 0, f"worker failed:\n{lines[-5:]}\n{stderr}"
        assert lines[-1] == "DONE"
        for line in lines:
            verb, _, key = line.partition(" ")
            if verb == "ACK":
                assert key not in winners, f"{key} was acknowledged to both writers"
                winners[key] = writer
    assert len(winners) == count, "every key must have exactly one acknowledged writer"
    with open_store(store_url) as opened:
        keys = sorted(winners)
        for key, snapshot in zip(keys, opened.fetch(keys), strict=True):
            assert snapshot.extras is not None and snapshot.extras["writer"] == winners[key]
        report = opened.replay()
        assert report.ok, report.summary()
        assert report.events == count  # the losers wrote nothing


def test_sigkill_while_staging_loses_no_acknowledged_record(tmp_path: Path, workers: list[Worker]) -> None:
    path = str(tmp_path / "killed.db")
    acknowledged: list[str] = []
    for round_ in range(2):
        prefix = f"kill-{round_}"
        worker = Worker("stage", path, prefix, "0", "--threads", "4", "--durability", "full")
        workers.append(worker)
        deadline = time.monotonic() + 60
        acks: list[str] = []
        while len(acks) < 30:
            line = worker.next_line(deadline)
            if line is None:
                pytest.fail(f"worker exited early:\n{worker.finish()}")
            assert not line.startswith("FAIL"), line
            if line.startswith("ACK "):
                acks.append(line[4:])
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(timeout=30)
        assert worker.proc.returncode == -signal.SIGKILL
        # Acks printed between reading the 30th and the kill count too.
        while (line := worker.next_line(time.monotonic() + 30)) is not None:
            if line.startswith("ACK "):
                acks.append(line[4:])
        acknowledged += acks

    with open_store(path) as reopened:
        fetched = reopened.fetch(acknowledged)
        assert len(fetched) == len(acknowledged) >= 60
        for key, snapshot in zip(acknowledged, fetched, strict=True):
            prefix, call = key.split("/")
            assert snapshot.digest == record_for(prefix, int(call[1:])).digest
        report = reopened.replay()
        assert report.ok, report.summary()
        assert report.events >= len(acknowledged)
        # The store is still writable after the crash.
        after = make_record(rollout_id="after-kill", model_call_id="c0")
        assert reopened.stage(after).ok
        assert reopened.fetch([after.staging_key])[0].digest == after.digest


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_stages_through_the_parents_store(tmp_path: Path) -> None:
    path = tmp_path / "forked.db"
    with open_store(path) as opened:
        before = make_record(model_call_id="parent-before")
        assert opened.stage(before).ok
        child_record = make_record(model_call_id="child")
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                ok = opened.stage(child_record).ok
                fetched = opened.fetch([before.staging_key])[0].digest == before.digest
                code = 0 if ok and fetched else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        after = make_record(model_call_id="parent-after")
        assert opened.stage(after).ok  # the parent's connections still work after the fork
        fetched = opened.fetch([before.staging_key, child_record.staging_key, after.staging_key])
        assert [s.digest for s in fetched] == [before.digest, child_record.digest, after.digest]
        report = opened.replay()
        assert report.ok and report.events == 3
