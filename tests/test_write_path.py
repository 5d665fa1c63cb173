"""The write path and the store's lifecycle under faults: a fork while another thread writes,
an interrupt in the group-commit leader, close() racing stage(), replay beside writers, the
WAL's size after a long reader, and a durable acknowledgement of a record written unsynced."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sqlite3
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from factories import make_record

from store import StagedCallRecord, StageEntry, StageResult, Store, StoreClosedError, open_store
from store.append.log import EventLog
from store.append.statements import KEYS_PER_STATEMENT
from store.errors import RolloutFencedError, StagingRefusedError, StorageError, UnknownKeyError
from store.lifecycle import CallGate
from store.log import checkpointer as checkpointer_module
from store.log import engine as engine_module
from store.queries import replay as replay_module

HANG = 60.0  # seconds after which a thread or child that has not finished is taken as hung


def raw_engine(store_url: str) -> sa.Engine:
    if "://" not in store_url:
        return sa.create_engine(f"sqlite:///{store_url}")
    return sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))


def scalar(store_url: str, sql: str) -> Any:
    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            return connection.execute(sa.text(sql)).scalar()
    finally:
        engine.dispose()


def run_in_thread(body: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``body`` on a thread; the returned function joins it (failing if it hangs) and returns its result."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = body()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(HANG)
        assert not thread.is_alive(), "the call hung"
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    return join


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """Closed on a thread at teardown, so a wedged store fails its test instead of hanging the run."""
    opened = open_store(store_url)
    yield opened
    run_in_thread(opened.close)()


def outcome_of(body: Callable[[], Any]) -> Any:
    """What ``body`` returns, or the exception it raises (an interrupt included)."""
    try:
        return body()
    except BaseException as exc:  # returned for the test to inspect
        return exc


def wait_for_child(pid: int) -> int:
    """The child's exit code; a child still running after HANG seconds is killed and fails the test."""
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"forked child {pid} hung")


# --- 2: fork while another thread writes ---------------------------------------------------------

FORKS = 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_another_thread_writes_can_stage(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(store_url) as opened:
        stop = threading.Event()
        resume = threading.Event()  # cleared while a child stages: SQLite's busy wait is unfair, and
        resume.set()  # a parent writing on meanwhile could starve the child past its timeout on a busy host
        staged: list[str] = []

        def stage_continuously() -> None:
            while not stop.is_set():
                resume.wait()
                record = make_record(rollout_id="busy-parent", model_call_id=f"c{len(staged)}")
                assert opened.stage(record).ok
                staged.append(record.staging_key)

        finish = run_in_thread(stage_continuously)
        children: list[StagedCallRecord] = []
        try:
            for trial in range(FORKS):
                while len(staged) < 2 * (trial + 1):  # the parent's thread is writing when we fork
                    time.sleep(0.001)
                child_record = make_record(rollout_id="forked-child", model_call_id=f"c{trial}")
                children.append(child_record)
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child
                    code = 1
                    try:
                        # A child that inherited the parent's lock bookkeeping would wait this long, then fail.
                        engine_module.BUSY_TIMEOUT_MS = 3000
                        code = 0 if opened.stage(child_record).ok else 2
                    except BaseException:
                        traceback.print_exc()  # the parent's assertion shows why (captured output)
                    finally:
                        os._exit(code)
                resume.clear()  # forked while the thread wrote; it finishes that write, then waits
                try:
                    assert wait_for_child(pid) == 0, f"the child of fork {trial} could not stage"
                finally:
                    resume.set()
        finally:
            stop.set()
            finish()
        keys = [record.staging_key for record in children] + staged
        fetched = opened.fetch(keys)
        assert [snapshot.digest for snapshot in fetched[: len(children)]] == [r.digest for r in children]
        assert opened.replay().ok


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_keeps_staging_after_the_parent_closes_its_store(tmp_path: Path) -> None:
    """The child's SQLite connections hold their own locks, not the parent's bookkeeping: when
    the parent closes its last connection, SQLite must not fold and delete the WAL the child
    is still writing."""
    path = tmp_path / "forked.db"
    opened = open_store(path)
    assert opened.stage(make_record(model_call_id="parent")).ok
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    records = [make_record(rollout_id="forked-child", model_call_id=f"c{i}") for i in range(2)]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            first = opened.stage(records[0]).ok
            os.write(to_parent_w, b"1")
            os.read(to_child_r, 1)  # the parent has closed its store
            second = opened.stage(records[1]).ok
            code = 0 if first and second else 2
        finally:
            os._exit(code)
    assert os.read(to_parent_r, 1) == b"1"
    opened.close()
    os.write(to_child_w, b"1")
    assert wait_for_child(pid) == 0
    for descriptor in (to_child_r, to_child_w, to_parent_r, to_parent_w):
        os.close(descriptor)
    with open_store(path) as reopened:
        fetched = reopened.fetch([record.staging_key for record in records])
        assert [snapshot.digest for snapshot in fetched] == [record.digest for record in records]


# --- 13: an interrupt in the group-commit leader ---------------------------------------------------


def test_an_interrupt_while_taking_the_writer_role_does_not_wedge_the_store(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = EventLog._gather
    interrupts = [KeyboardInterrupt()]

    def interrupted(self: EventLog) -> None:
        if interrupts:
            raise interrupts.pop()
        original(self)

    monkeypatch.setattr(EventLog, "_gather", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.stage(make_record(model_call_id="interrupted"))
    after = make_record(model_call_id="after")
    assert run_in_thread(lambda: store.stage(after))().ok
    assert store.fetch([after.staging_key])[0].digest == after.digest
    run_in_thread(store.close)()


def test_a_follower_whose_leader_was_interrupted_before_writing_is_still_written(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader takes a batch with a follower in it, then is interrupted before writing:
    the follower must neither wait for ever nor return without its write."""
    leader_gathering = threading.Event()
    gather, write_batch = EventLog._gather, EventLog._write_batch
    first = [True]

    def gather_with_follower(self: EventLog) -> None:
        if first[0]:
            first[0] = False
            self._gathering = True
            leader_gathering.set()
            self._arrived.wait_for(lambda: len(self._queue) >= 2, timeout=HANG)
            self._gathering = False
            return
        gather(self)

    def interrupted_once(self: EventLog, batch: list[Any]) -> None:
        if len(batch) == 2 and not getattr(self, "_interrupted", False):
            self._interrupted = True  # type: ignore[attr-defined]
            raise KeyboardInterrupt
        write_batch(self, batch)

    monkeypatch.setattr(EventLog, "_gather", gather_with_follower)
    monkeypatch.setattr(EventLog, "_write_batch", interrupted_once)
    leader_record, follower_record = make_record(model_call_id="leader"), make_record(model_call_id="follower")
    leader = run_in_thread(lambda: store.stage(leader_record))
    assert leader_gathering.wait(HANG)
    follower = run_in_thread(lambda: store.stage(follower_record))
    with pytest.raises(KeyboardInterrupt):
        leader()
    result = follower()
    assert isinstance(result, StageResult) and result.ok
    assert store.fetch([follower_record.staging_key])[0].digest == follower_record.digest
    assert run_in_thread(lambda: store.stage(make_record(model_call_id="later")))().ok
    run_in_thread(store.close)()


def test_an_interrupt_while_a_batch_is_written_gives_followers_a_store_error(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt inside the batch belongs to the leader's thread; its followers get a
    ``StorageError`` (never the leader's ``KeyboardInterrupt``) and the store stays usable."""
    followers_queued = threading.Event()
    gather, run_batch = EventLog._gather, EventLog._run_batch

    def gather_with_follower(self: EventLog) -> None:
        if not followers_queued.is_set():
            self._gathering = True
            followers_queued.set()
            self._arrived.wait_for(lambda: len(self._queue) >= 2, timeout=HANG)
            self._gathering = False
            return
        gather(self)

    def interrupted(self: EventLog, batch: list[Any], durable: bool, isolate: bool) -> None:
        if len(batch) == 2:
            raise KeyboardInterrupt
        run_batch(self, batch, durable, isolate)

    monkeypatch.setattr(EventLog, "_gather", gather_with_follower)
    monkeypatch.setattr(EventLog, "_run_batch", interrupted)
    leader = run_in_thread(lambda: store.stage(make_record(model_call_id="leader")))
    assert followers_queued.wait(HANG)
    follower = run_in_thread(lambda: outcome_of(lambda: store.stage(make_record(model_call_id="follower"))))
    with pytest.raises(KeyboardInterrupt):
        leader()
    error = follower()
    assert isinstance(error, StorageError) and "interrupted" in str(error)
    assert run_in_thread(lambda: store.stage(make_record(model_call_id="later")))().ok
    run_in_thread(store.close)()


def test_an_interrupt_while_the_leader_leaves_still_gives_the_writer_role_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = EventLog._leave
    interrupts = [KeyboardInterrupt()]

    def interrupted_on_entry(self: EventLog, pending: Any) -> None:
        if interrupts:
            raise interrupts.pop()
        original(self, pending)

    monkeypatch.setattr(EventLog, "_leave", interrupted_on_entry)
    with pytest.raises(KeyboardInterrupt):
        store.stage(make_record(model_call_id="interrupted"))
    assert run_in_thread(lambda: store.stage(make_record(model_call_id="after")))().ok
    run_in_thread(store.close)()


def test_an_interrupt_while_a_call_is_counted_out_does_not_keep_close_waiting(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = CallGate.leave
    interrupts = [KeyboardInterrupt()]

    def interrupted_on_entry(self: CallGate, entered: list[bool]) -> None:
        if interrupts:
            raise interrupts.pop()
        original(self, entered)

    monkeypatch.setattr(CallGate, "leave", interrupted_on_entry)
    with pytest.raises(KeyboardInterrupt):
        store.calls()
    run_in_thread(store.close)()


# --- 14: close() racing stage() --------------------------------------------------------------------

CLOSE_TRIALS = 12
STAGERS = 8


def open_descriptors(path: str) -> list[str]:
    """This process's file descriptors on the SQLite store (database, -wal, -shm)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(path):
            found.append(target)
    return found


def postgres_backends(store_url: str) -> int:
    """Other server backends connected to the test database (the counting one excluded)."""
    return int(
        scalar(
            store_url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
    )


def connections_left(store_url: str, baseline: int) -> int:
    if "://" not in store_url:
        return len(open_descriptors(store_url))
    deadline = time.monotonic() + HANG  # a server backend exits a moment after its client closes
    while (count := postgres_backends(store_url) - baseline) > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return count


def event_count(store_url: str) -> int:
    return int(scalar(store_url, "SELECT count(*) FROM events"))


Outcome = tuple[bool, StagedCallRecord, object]  # (the stage began after close() returned, record, result or error)


def stage_until_closed(
    opened: Store, name: str, started: threading.Barrier, closed: threading.Event, progress: list[str]
) -> list[Outcome]:
    started.wait()
    outcomes: list[Outcome] = []
    for n in range(1_000):
        record = make_record(rollout_id=name, model_call_id=f"c{n}")
        after_close = closed.is_set()
        try:
            outcome: object = opened.stage(record)
        except StoreClosedError as exc:
            outcome = exc
        outcomes.append((after_close, record, outcome))
        progress.append(name)
        if isinstance(outcome, StoreClosedError):
            break
    return outcomes


def read_until_closed(opened: Store, key: str, started: threading.Barrier) -> None:
    started.wait()
    while True:
        try:
            opened.fetch([key])
            opened.calls()
        except StoreClosedError:
            return


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_close_racing_stagers_commits_nothing_after_it_returns_and_leaves_nothing_open(store_url: str) -> None:
    baseline = 0 if "://" not in store_url else postgres_backends(store_url)
    acknowledged: list[str] = []
    for trial in range(CLOSE_TRIALS):
        opened = open_store(store_url)
        closed, started, progress = threading.Event(), threading.Barrier(STAGERS + 1), list[str]()
        stagers = [
            run_in_thread(functools.partial(stage_until_closed, opened, f"t{trial}-s{i}", started, closed, progress))
            for i in range(STAGERS)
        ]
        started.wait()
        while len(progress) < 4 + trial:  # close at a different point of the stream each trial
            time.sleep(0.0005)
        opened.close()
        closed.set()
        events_when_closed = event_count(store_url)
        outcomes = [outcome for join in stagers for outcome in join()]
        assert event_count(store_url) == events_when_closed, f"trial {trial}: a stage committed after close()"
        assert connections_left(store_url, baseline) == 0, f"trial {trial}: a connection stayed open"
        for after_close, record, outcome in outcomes:
            if after_close:
                assert isinstance(outcome, StoreClosedError), f"trial {trial}: a stage after close() gave {outcome!r}"
            if isinstance(outcome, StageResult):
                assert outcome.ok
                acknowledged.append(record.staging_key)
            else:
                assert isinstance(outcome, StoreClosedError), outcome
    with open_store(store_url) as reopened:
        assert len(reopened.fetch(acknowledged)) == len(acknowledged)
        assert reopened.replay().ok
        assert event_count(store_url) == len(acknowledged)  # nothing committed that was not acknowledged


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_reads_racing_close_leave_no_connection_open(store_url: str) -> None:
    baseline = 0 if "://" not in store_url else postgres_backends(store_url)
    with open_store(store_url) as opened:
        record = make_record()
        assert opened.stage(record).ok
    for _ in range(CLOSE_TRIALS):
        opened = open_store(store_url)
        started = threading.Barrier(STAGERS + 1)
        readers = [
            run_in_thread(functools.partial(read_until_closed, opened, record.staging_key, started))
            for _ in range(STAGERS)
        ]
        started.wait()
        opened.close()
        for join in readers:
            join()
        assert connections_left(store_url, baseline) == 0


# --- 15: replay beside writers ---------------------------------------------------------------------


@pytest.fixture
def paused_replay(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Replay pauses after folding the log, inside its transaction, until ``resume`` is set."""
    folded, resume = threading.Event(), threading.Event()
    live_tables = replay_module.live_tables

    def pausing(connection: sa.Connection) -> Any:
        folded.set()
        assert resume.wait(HANG)
        return live_tables(connection)

    monkeypatch.setattr(replay_module, "live_tables", pausing)
    yield folded, resume
    resume.set()


Pause = tuple[threading.Event, threading.Event]


def test_a_replay_check_reads_a_snapshot_and_does_not_block_writers(
    store_url: str, store: Store, monkeypatch: pytest.MonkeyPatch, paused_replay: Pause
) -> None:
    folded, resume = paused_replay
    for i in range(3):
        assert store.stage(make_record(model_call_id=f"before-{i}")).ok
    report = run_in_thread(store.replay)
    assert folded.wait(HANG)
    monkeypatch.setattr(engine_module, "BUSY_TIMEOUT_MS", 1000)  # a stager that would wait for the lock fails
    with open_store(store_url) as other:
        during = make_record(model_call_id="during")
        assert run_in_thread(lambda: other.stage(during))().ok  # not blocked by the replay
    resume.set()
    result = report()
    assert result.ok and result.events == 3  # one snapshot: the stage made during the fold is in neither side
    assert store.replay().events == 4


def test_a_replay_repair_holds_the_write_lock_while_it_folds(
    store_url: str, store: Store, paused_replay: Pause
) -> None:
    folded, resume = paused_replay
    assert store.stage(make_record(model_call_id="before")).ok
    report = run_in_thread(lambda: store.replay(repair=True))
    assert folded.wait(HANG)
    with open_store(store_url) as other:
        during = make_record(model_call_id="during")
        staged = run_in_thread(lambda: other.stage(during))
        time.sleep(0.2)  # not an assertion on time: gives the stager a chance to overtake the repair
        resume.set()
        assert report().ok
        assert staged().ok
    report_after = store.replay()
    assert report_after.ok and report_after.events == 2


# --- 16: the WAL shrinks after a long reader ------------------------------------------------------


def test_the_wal_is_truncated_after_a_long_reader_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 256 * 1024
    monkeypatch.setattr(engine_module, "WAL_SIZE_LIMIT_BYTES", limit)
    monkeypatch.setattr(checkpointer_module, "CHECKPOINT_BYTES", limit)  # checkpoints requested while it grows
    path = tmp_path / "wal.db"
    wal = Path(f"{path}-wal")
    big = [i % 50_000 + 70_000 for i in range(4096)]  # ids beyond u16: 4 bytes each
    with open_store(path, durability="normal") as opened:
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM events").fetchone()  # holds its snapshot: no checkpoint can finish
        for i in range(120):
            assert opened.stage(make_record(model_call_id=f"grow-{i}", generated=big)).ok
        peak = wal.stat().st_size
        assert peak > 16 * limit  # the WAL grew behind the reader
        reader.execute("COMMIT")
        reader.close()
        # The background checkpointer finishes what the reader held back; the first commit after
        # that restarts the WAL and truncates it to the limit.
        deadline = time.monotonic() + HANG
        i = 0
        while wal.stat().st_size > limit and time.monotonic() < deadline:
            assert opened.stage(make_record(model_call_id=f"after-{i}")).ok
            i += 1
            time.sleep(0.02)
        assert wal.stat().st_size <= limit


def test_the_writer_does_not_checkpoint_and_the_wal_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WAL checkpoints run off the committing thread; the -wal still stays bounded (a background
    PASSIVE checkpoint per CHECKPOINT_BYTES committed, the writer's own past BEHIND_REQUESTS)."""
    every = 64 * 1024
    monkeypatch.setattr(checkpointer_module, "CHECKPOINT_BYTES", every)
    path = tmp_path / "bounded.db"
    big = [i % 50_000 + 70_000 for i in range(4096)]  # ids beyond u16: about 16 KiB a record
    with open_store(path, durability="full") as opened:
        records = [make_record(model_call_id=f"c{i}", generated=big) for i in range(200)]
        for record in records:
            assert opened.stage(record).ok
        writer = opened._log._connection
        assert writer.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0  # commits never checkpoint
        assert any(thread.name == "store-wal-checkpoint" for thread in threading.enumerate())
        # Without checkpoints the -wal would hold all 200 records (over 6 MiB); the writer's own
        # fallback past 16 requests' worth keeps it near 1 MiB (more only while the thread's
        # checkpoints keep the writer's from finishing).
        assert Path(f"{path}-wal").stat().st_size < 4 * 1024 * 1024
        assert [s.digest for s in opened.fetch([r.staging_key for r in records])] == [r.digest for r in records]
        assert opened.replay().ok
    assert not any(thread.name == "store-wal-checkpoint" for thread in threading.enumerate())  # stopped
    with sqlite3.connect(path) as connection:  # what the pool's next user gets back: SQLite's default
        assert connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000


def test_a_failing_checkpoint_after_a_commit_does_not_fail_the_committed_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_store(tmp_path / "failing-checkpoint.db") as opened:
        log = opened._log
        assert log._checkpointer is not None
        broken = dataclasses.replace(log._backend, checkpoint_sql="PRAGMA wal_checkpoint(NO_SUCH_MODE")
        monkeypatch.setattr(log, "_backend", broken)
        monkeypatch.setattr(log._checkpointer, "due_in_line", lambda: True)
        record = make_record(model_call_id="committed")
        assert opened.stage(record).ok  # the checkpoint after its commit failed: ignored, tried again later
        assert opened.fetch([record.staging_key])[0].digest == record.digest


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_while_checkpoints_run_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork waits for a background checkpoint (no connection open across it); the parent and
    the child each go on staging and checkpointing."""
    monkeypatch.setattr(checkpointer_module, "CHECKPOINT_BYTES", 16 * 1024)
    path = tmp_path / "forked.db"
    big = [i % 50_000 + 70_000 for i in range(4096)]

    def stage_some(opened: Store, prefix: str) -> list[StagedCallRecord]:
        records = [make_record(model_call_id=f"{prefix}-{i}", generated=big) for i in range(20)]
        assert all(opened.stage(record).ok for record in records)
        return records

    with open_store(path) as opened:
        staged = stage_some(opened, "before")
        assert any(thread.name == "store-wal-checkpoint" for thread in threading.enumerate())
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                stage_some(opened, "child")
                code = 0 if opened.replay().ok else 2
            finally:
                os._exit(code)
        staged += stage_some(opened, "parent")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        child = [make_record(model_call_id=f"child-{i}", generated=big) for i in range(20)]
        everything = staged + child
        fetched = opened.fetch([record.staging_key for record in everything])
        assert [s.digest for s in fetched] == [record.digest for record in everything]
        report = opened.replay()
        assert report.ok and report.events == 60


# --- 17: a durable acknowledgement of a record written without a sync -------------------------------


def test_a_durable_restage_of_an_unsynced_record_syncs_the_wal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sync.db"
    synced: list[str] = []
    fsync = os.fsync

    def counting_fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    record = make_record()
    with open_store(path, durability="normal") as normal, open_store(path) as durable:
        assert normal.stage(record).ok  # committed, not synced
        monkeypatch.setattr(os, "fsync", counting_fsync)
        assert durable.stage(record).ok  # acknowledged durably: must sync what it acknowledges
        assert synced == [f"{path}-wal"]
        synced.clear()
        assert durable.stage(make_record(model_call_id="new")).ok  # a commit that writes syncs by itself
        assert synced == []
        assert normal.stage(make_record(model_call_id="normal")).ok  # a normal store never syncs
        assert normal.stage(make_record(model_call_id="normal")).ok
        assert synced == []


@pytest.mark.skipif(not os.environ.get("STORE_TEST_POSTGRES_URL"), reason="needs STORE_TEST_POSTGRES_URL")
def test_a_durable_restage_on_postgres_commits_a_record_that_flushes_the_log(store_url: str) -> None:
    if "://" not in store_url:
        pytest.skip("PostgreSQL only")
    record = make_record()
    with open_store(store_url, durability="normal") as normal, open_store(store_url) as durable:
        assert normal.stage(record).ok
        xids: list[Any] = []
        writer = durable._log._writer

        class RecordingCursor:
            """The write transaction's cursor; notes whether its COMMIT carries a transaction id."""

            def __init__(self, cursor: Any) -> None:
                self._cursor = cursor

            def __getattr__(self, name: str) -> Any:
                return getattr(self._cursor, name)

            def execute(self, sql: Any, *args: Any, **kwargs: Any) -> Any:
                if sql == "COMMIT":  # the write path sends COMMIT in its pipeline
                    xids.append(self._cursor.execute("SELECT txid_current_if_assigned()").fetchone()[0])
                return self._cursor.execute(sql, *args, **kwargs)

        class Recording:
            """The writer connection, handing out recording cursors."""

            def __init__(self, connection: Any) -> None:
                object.__setattr__(self, "_connection", connection)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._connection, name)

            def __setattr__(self, name: str, value: Any) -> None:
                setattr(self._connection, name, value)

            def cursor(self) -> RecordingCursor:
                return RecordingCursor(self._connection.cursor())

        durable._log._writer = lambda: Recording(writer())  # type: ignore[method-assign]
        assert durable.stage(record).ok
        # ``durable`` never saw this stream, so its lone stage first guesses a new stream: that
        # guarded statement finds the record and writes nothing, its COMMIT has no transaction
        # id.  The stage then runs again, reading first: a commit with a transaction id writes a
        # commit record and, with synchronous_commit on, waits until the log is flushed up to
        # it (the unsynced commit included).
        assert len(xids) == 2 and xids[0] is None and xids[1] is not None


def test_a_record_is_encoded_before_the_write_lock_and_once(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """stage() takes the writer role with the record's stored bytes ready: no encoding runs in the batch."""
    from store.append import new_event as new_event_module

    store = open_store(store_url)
    try:
        in_batch = threading.Event()
        calls: list[bool] = []
        for name in ("encode_ids", "encode_mask", "encode_floats", "encode_body"):
            original = getattr(new_event_module, name)

            def counting(value: Any, _original: Any = original) -> Any:
                calls.append(in_batch.is_set())
                return _original(value)

            monkeypatch.setattr(new_event_module, name, counting)
        write_batch = store._log._write_batch

        def flagged(batch: list[Any]) -> None:
            in_batch.set()
            try:
                write_batch(batch)
            finally:
                in_batch.clear()

        monkeypatch.setattr(store._log, "_write_batch", flagged)
        record = make_record(rollout_id="encode-once")
        assert store.stage(record).ok
        assert calls == [False] * 4  # body and three columns, each once, all before the lock
        assert store.fetch([record.staging_key])[0].digest == record.digest
    finally:
        store.close()


def test_a_stage_runs_one_read_and_one_write_per_table(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new record: one lookup (fence, key, call, version), then the event, the calls row and the
    key; on PostgreSQL a lone stage of a new stream sends those three in one guarded statement."""
    from store.append.transaction import WriteTransaction

    executed: list[str] = []
    guessed: list[bool] = []
    original_guess = WriteTransaction.guess_new_stream

    def counting_guess(self: WriteTransaction, new: Any) -> bool:
        sent = original_guess(self, new)
        guessed.append(sent)
        return sent

    monkeypatch.setattr(WriteTransaction, "guess_new_stream", counting_guess)
    original = WriteTransaction._execute

    def counting(self: WriteTransaction, statement: Any, values: dict[str, Any]) -> Any:
        executed.append(statement.sql.split()[0].upper())
        return original(self, statement, values)

    monkeypatch.setattr(WriteTransaction, "_execute", counting)
    original_insert = WriteTransaction._insert

    def counting_insert(self: WriteTransaction, statement: Any, in_order: bool, names: Any, values: Any) -> Any:
        if in_order:  # else it runs through _execute, counted there
            executed.append(statement.sql.split()[0].upper())
        return original_insert(self, statement, in_order, names, values)

    monkeypatch.setattr(WriteTransaction, "_insert", counting_insert)
    original_later = WriteTransaction._insert_later

    def counting_later(self: WriteTransaction, statement: Any, values: dict[str, Any]) -> None:
        executed.append(statement.sql.split()[0].upper())  # sent with the others of its statement
        original_later(self, statement, values)

    monkeypatch.setattr(WriteTransaction, "_insert_later", counting_later)
    store = open_store(store_url)
    try:
        record = make_record(rollout_id="lean")
        assert store.stage(record).ok
        if store.backend == "postgresql":
            assert guessed == [True] and executed == []  # no read, nothing else sent
        else:
            assert guessed == [False] and executed == ["SELECT", "INSERT", "INSERT", "INSERT"]
        executed.clear()
        guessed.clear()
        assert store.stage(record).ok  # an identical re-stage of a stream it wrote: the lookup alone
        assert guessed == [False] and executed == ["SELECT"]
        assert store.call("lean", record.model_call_id) is not None
        executed.clear()
        monkeypatch.setattr(WriteTransaction, "guess_new_stream", lambda self, new: False)
        assert store.stage(make_record(rollout_id="lean", model_call_id="other")).ok  # reading first
        assert executed == ["SELECT", "INSERT", "INSERT", "INSERT"]
    finally:
        store.close()


@pytest.mark.parametrize("columns", [True, False])
@pytest.mark.parametrize("staging_key", ["k-1", None])
def test_an_events_checksum_framed_before_the_lock_equals_event_checksum(
    columns: bool, staging_key: str | None
) -> None:
    """``NewEvent`` frames its checksum before the write lock; the append's bytes must be
    exactly those ``event_checksum`` (what every read verifies) hashes over the stored row."""
    from store.append.new_event import NewEvent
    from store.log.checksum import event_checksum
    from store.log.events import EventKind, FailureBody, record_body
    from store.projections.fold import generated_spans

    record = make_record(rollout_id="r-\u00e9\U0001f600", model_call_id="c-1")
    if columns:
        spans = generated_spans(record.columns.token_mask, record.weight_version)
        event = NewEvent(
            EventKind.CALL_COMPLETED,
            record.rollout_id,
            record.model_call_id,
            record_body(record, spans),
            staging_key,
            record.columns,
        )
    else:
        body_ = FailureBody(reason="x" * 3000)  # a body hashed in place (past the inline size)
        event = NewEvent(EventKind.CALL_FAILED, record.rollout_id, record.model_call_id, body_, staging_key)
    body, ids, mask, log_probs = event.stored
    cases: list[tuple[int, int, Any]] = [(1, 1, 0.0), (2**40, os.getpid(), time.time()), (7, 2**31 - 1, 1.5e9)]
    cases.append((3, 5, 1_700_000_000))  # an int time: framed as an int, as event_checksum does
    for version, pid, recorded_at in cases:
        row = {
            "rollout_id": event.rollout_id,
            "model_call_id": event.model_call_id,
            "stream_version": version,
            "kind": event.kind.value,
            "staging_key": staging_key,
            "writer_pid": pid,
            "recorded_at": recorded_at,
            "body": body,
            "token_ids": ids,
            "token_mask": mask,
            "log_probs": log_probs,
        }
        assert event.checksum_parts.checksum(version, pid, recorded_at) == event_checksum(row)


def test_checksum_parts_frame_what_event_checksum_frames() -> None:
    """``ChecksumParts`` frames texts, kinds and columns on its own fast paths: over texts that
    are empty, not ASCII or lone surrogates, columns either side of the inline size or absent,
    and versions and pids at the 64-bit limits, it hashes exactly ``event_checksum``'s bytes."""
    import random

    from store.log.checksum import ChecksumParts, event_checksum

    rng = random.Random(11)
    texts = ["", "a", "rollout-000001", "\u00e9\u2603" * 40, "\ud800 lone", "x" * 2000]
    columns = [None, b"", b"x" * 1023, b"y" * 1024, b"z" * 3000]
    for _ in range(2000):
        rollout_id, model_call_id, staging_key = rng.choice(texts), rng.choice(texts), rng.choice([None, *texts])
        kind = rng.choice(["call_completed", "keys_cleared", *texts])
        stored = (bytes(rng.randint(0, 1100)), rng.choice(columns), rng.choice(columns), rng.choice(columns))
        version, pid = rng.choice([0, 1, 2**63 - 1, -(2**63)]), rng.choice([1, 2**31, 2**63 - 1])
        recorded_at = rng.choice([0.0, -0.0, 1.5e9, float("inf"), 7])
        row = dict(zip(("body", "token_ids", "token_mask", "log_probs"), stored, strict=True))
        row.update(rollout_id=rollout_id, model_call_id=model_call_id, stream_version=version, kind=kind)
        row.update(staging_key=staging_key, writer_pid=pid, recorded_at=recorded_at)
        parts = ChecksumParts(rollout_id, model_call_id, kind, staging_key, stored)
        assert parts.checksum(version, pid, recorded_at) == event_checksum(row)
    for version in (2**63, -(2**63) - 1):  # beyond a stored integer: refused as event_checksum refuses it
        with pytest.raises(OverflowError):
            ChecksumParts("r", "c", "call_failed", None, (b"", None, None, None)).checksum(version, 1, 0.0)
    with pytest.raises(TypeError):
        ChecksumParts("r", "c", "call_failed", None, ("not bytes", None, None, None))  # type: ignore[arg-type]


# --- PostgreSQL: a lone stage guesses a new stream (one round trip) -----------------------------


def _counting_guesses(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Notes whether each lone stage sent its guarded new-stream statement."""
    from store.append.transaction import WriteTransaction

    sent: list[bool] = []
    original = WriteTransaction.guess_new_stream

    def counting(self: WriteTransaction, new: Any) -> bool:
        guessed = original(self, new)
        sent.append(guessed)
        return guessed

    monkeypatch.setattr(WriteTransaction, "guess_new_stream", counting)
    return sent


def test_guessed_stages_write_what_stages_reading_first_write(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guarded statement's rows are the append's: replay (projections refolded from the
    events) and the audit agree, and each record reads back; a guess is only tried on PostgreSQL."""
    sent = _counting_guesses(monkeypatch)
    store = open_store(store_url)
    try:
        records = [make_record(rollout_id=f"g{n % 2}", model_call_id=f"c{n}") for n in range(6)]
        for record in records:
            assert store.stage(record).ok
        assert sent == [store.backend == "postgresql"] * len(records)
        assert event_count(store_url) == len(records)
        for record in records:
            assert store.fetch([record.staging_key])[0].digest == record.digest
            call = store.call(record.rollout_id, record.model_call_id)
            assert call is not None and call.state == "completed"
        assert store.replay().ok
        assert store.audit().ok
    finally:
        store.close()


@pytest.mark.skipif(not os.environ.get("STORE_TEST_POSTGRES_URL"), reason="needs STORE_TEST_POSTGRES_URL")
def test_a_missed_guess_writes_nothing_and_the_stage_reads_first(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer made the stream, the key or a fence: the guarded statement writes nothing
    and the stage runs again, reading first, with the usual outcome (identical re-stage, refusal,
    fence)."""
    if "://" not in store_url:
        pytest.skip("PostgreSQL only")
    record = make_record(rollout_id="miss", model_call_id="c1")
    other = make_record(rollout_id="miss", model_call_id="c1", generated=(30, 31))
    with open_store(store_url) as first, open_store(store_url) as second:
        assert first.stage(record).ok
        sent = _counting_guesses(monkeypatch)
        assert second.stage(record).ok  # identical: nothing new
        refused = second.stage(other)  # (a known stream now: read first, no guess)
        assert not refused.ok and "already holds a different record" in (refused.error or "")
        # The guess missed (nothing written) and the stage ran again; then no guess at all.
        assert sent == [True, False, False] and event_count(store_url) == 1
        sent.clear()
        third = make_record(rollout_id="miss", model_call_id="c2", generated=(40,))
        with open_store(store_url) as fresh:
            refused = fresh.stage(other)  # a guess that misses on the key, then the refusal
            assert not refused.ok and "already holds a different record" in (refused.error or "")
            first.retire(["miss"])
            with pytest.raises(RolloutFencedError):
                fresh.stage(third)  # a new stream of a fenced capture key: the guard, then the fence
        assert sent == [True, False, True, False]  # each guess missed, each stage ran again
        assert event_count(store_url) == 2  # the record and the fence
        with pytest.raises(UnknownKeyError):
            first.fetch([third.staging_key])
        assert first.replay().ok


@pytest.mark.skipif(not os.environ.get("STORE_TEST_POSTGRES_URL"), reason="needs STORE_TEST_POSTGRES_URL")
def test_a_failing_guessed_statement_writes_no_row_and_the_stage_reads_first(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guarded statement fails on the server after its event insert (its calls row breaks a
    NOT NULL): none of its rows commit, and the stage is run again reading first."""
    if "://" not in store_url:
        pytest.skip("PostgreSQL only")
    from store.append import transaction as transaction_module

    original = transaction_module.new_stream_values

    def broken(*args: Any) -> dict[str, Any] | None:
        values = original(*args)
        assert values is not None
        return {**values, "c_state": None}

    monkeypatch.setattr(transaction_module, "new_stream_values", broken)
    sent = _counting_guesses(monkeypatch)
    store = open_store(store_url)
    try:
        record = make_record(rollout_id="broken")
        assert store.stage(record).ok
        assert sent[0] is True and event_count(store_url) == 1
        assert store.fetch([record.staging_key])[0].digest == record.digest
        assert store.replay().ok and store.audit().ok
    finally:
        store.close()


def test_events_take_their_seqs_after_what_another_writer_committed_between_two_stages(store_url: str) -> None:
    """Another writer's commit between two stages is seen by the next one: seqs stay unique
    and ascending in commit order, and the rows are exactly what a replay folds (a guard for
    any write path that takes seqs or stream versions ahead of its inserts)."""
    first, second = open_store(store_url), open_store(store_url)  # two writer connections, as two processes
    try:
        stagers = [first, second, first, first, second, first]
        records = [make_record(rollout_id=f"turns-{index}", model_call_id="c0") for index in range(len(stagers))]
        for stager, record in zip(stagers, records, strict=True):
            assert stager.stage(record).ok
        engine = sa.create_engine(
            f"sqlite:///{store_url}"
            if "://" not in store_url
            else store_url.replace("postgresql://", "postgresql+psycopg://", 1)
        )
        try:
            with engine.connect() as connection:
                rows = connection.execute(sa.text("SELECT seq, rollout_id FROM events ORDER BY seq")).fetchall()
        finally:
            engine.dispose()
        assert [row[1] for row in rows] == [record.rollout_id for record in records]  # seq order = commit order
        assert len({row[0] for row in rows}) == len(records)
        batch = [make_record(rollout_id=f"batch-{index}", model_call_id="c0") for index in range(3)]
        assert all(result.ok for result in first.stage_all([StageEntry(record) for record in batch]))
        assert second.stage(make_record(rollout_id="after-batch", model_call_id="c0")).ok
        report = first.replay()
        assert report.ok, report.summary()
        assert report.events == len(records) + len(batch) + 1
    finally:
        first.close()
        second.close()


def test_stage_all_refuses_an_acknowledged_key_that_holds_no_record_past_one_statement(store: Store) -> None:
    """``acknowledged`` is checked in statements of many keys: a missing key late in a long list
    is still named, and nothing is written; keys staged by the same call count as held."""
    held = [make_record(rollout_id=f"ack-{index}", model_call_id="c0") for index in range(KEYS_PER_STATEMENT + 20)]
    store.stage_all([StageEntry(record) for record in held])
    keys = [record.staging_key for record in held]
    staged_now = make_record(rollout_id="ack-new", model_call_id="c0")
    assert store.stage_all([StageEntry(staged_now)], acknowledged=[*keys, staged_now.staging_key])[0].ok
    missing = "ack-gone/c0"
    late = make_record(rollout_id="ack-late", model_call_id="c0")
    with pytest.raises(StagingRefusedError, match="'ack-gone/c0'"):
        store.stage_all([StageEntry(late)], acknowledged=[*keys[:-5], missing, *keys[-5:]])
    with pytest.raises(UnknownKeyError):
        store.fetch([late.staging_key])  # refused whole: the batch's record was not written
