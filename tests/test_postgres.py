"""PostgreSQL for many hosts: schemas, bounded lock waits, the isolation the write path needs,
and the sequence-order rule (events become visible in sequence order) on both backends."""

from __future__ import annotations

import dataclasses
import multiprocessing
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import POSTGRES_URL, reset_postgres
from factories import make_record

import store.log.engine as engine_module
import store.log.postgres as postgres_module
from store import ConfigurationError, LockTimeoutError, RolloutFencedError, StageEntry, StorageError, Store, open_store
from store.append.log import _Pending
from store.append.new_event import NewEvent
from store.append.staging_rules import stage_event
from store.append.transaction import WriteTransaction
from store.log.engine import Statement, write_lock_id
from store.log.events import EventKind, FailureBody
from store.log.schema import SCHEMA_REVISION
from store.retention import removal

needs_postgres = pytest.mark.skipif(POSTGRES_URL is None, reason="STORE_TEST_POSTGRES_URL is not set")


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> str:
    """This run's PostgreSQL database, emptied (PostgreSQL-only tests)."""
    url: str = request.getfixturevalue("postgres_run_url")
    reset_postgres(url)
    return url


def _postgres(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


def _seqs(store_url: str, schema: str | None = None) -> list[int]:
    """Every event's sequence number, read on a connection of its own."""
    table = "events" if schema is None else f'"{schema}".events'
    if "://" not in store_url:
        with sqlite3.connect(store_url) as connection:
            rows = connection.execute(f"SELECT seq FROM {table} ORDER BY seq").fetchall()
        connection.close()
        return [row[0] for row in rows]
    engine = _postgres(store_url)
    try:
        with engine.connect() as connection:
            return [row[0] for row in connection.exec_driver_sql(f"SELECT seq FROM {table} ORDER BY seq")]
    finally:
        engine.dispose()


@contextmanager
def write_lock_held(store_url: str, schema: str | None = None) -> Iterator[None]:
    """Another session holds the store's write lock (SQLite's RESERVED lock, the advisory lock)."""
    if "://" not in store_url:
        connection = sqlite3.connect(store_url, isolation_level=None)
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            connection.execute("ROLLBACK")
            connection.close()
        return
    engine = _postgres(store_url)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({write_lock_id(schema)})")
            try:
                yield
            finally:
                connection.rollback()
    finally:
        engine.dispose()


# --- schemas ------------------------------------------------------------------------------------


@needs_postgres
def test_stores_in_two_schemas_of_one_database_are_independent(pg_url: str) -> None:
    with open_store(pg_url, schema="team_a") as a, open_store(pg_url, schema="team_b") as b:
        assert a.stage(make_record(rollout_id="ra", model_call_id="c")).ok
        assert b.stage(make_record(rollout_id="rb", model_call_id="c", generated=(5, 6, 7))).ok
        assert [call.rollout_id for call in a.calls()] == ["ra"]
        assert [call.rollout_id for call in b.calls()] == ["rb"]
        assert a.store_id != b.store_id
        assert "schema='team_a'" in repr(a)
    with open_store(pg_url) as public:
        assert public.calls() == []  # the public schema holds a store of its own
    assert _seqs(pg_url, "team_a") == [1] and _seqs(pg_url, "team_b") == [1]


@needs_postgres
def test_a_writer_in_one_schema_never_waits_for_another_schemas_lock(pg_url: str) -> None:
    with open_store(pg_url, schema="free") as free, write_lock_held(pg_url, "busy"):
        started = time.monotonic()
        assert free.stage(make_record()).ok
        assert time.monotonic() - started < 5


def _open_at_once(url: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        with open_store(url, schema="fresh") as opened:
            results.put(("ok", opened.store_id, opened.stage(make_record()).ok))
    except Exception as exc:  # reported to the parent, which asserts on it
        results.put(("error", repr(exc), False))


@needs_postgres
def test_processes_opening_one_new_schema_at_the_same_moment_all_succeed(pg_url: str) -> None:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(4), context.Queue()
    processes = [context.Process(target=_open_at_once, args=(pg_url, barrier, results)) for _ in range(4)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    assert [outcome[0] for outcome in outcomes] == ["ok"] * 4, outcomes
    assert len({outcome[1] for outcome in outcomes}) == 1  # one store, migrated once
    engine = _postgres(pg_url)
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT version_num FROM fresh.alembic_version").scalars().all() == [
                SCHEMA_REVISION
            ]
            assert connection.exec_driver_sql("SELECT count(*) FROM fresh.events").scalar() == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize("name", ["", "Upper", "1st", "a-b", "a b", 'a"b', "pg_store", "information_schema", "x" * 64])
def test_a_schema_that_is_not_a_plain_identifier_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="schema"):
        open_store("postgresql://nobody@127.0.0.1:1/none", schema=name)


def test_a_schema_is_refused_on_sqlite(tmp_path: Any) -> None:
    with pytest.raises(ConfigurationError, match="PostgreSQL feature"):
        open_store(str(tmp_path / "store.db"), schema="team_a")
    with pytest.raises(ConfigurationError, match="must be a str"):
        open_store(str(tmp_path / "store.db"), schema=3)  # type: ignore[arg-type]


# --- lock waits ---------------------------------------------------------------------------------


def test_a_writer_gives_up_on_a_held_write_lock_and_close_does_not_hang(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "BUSY_TIMEOUT_MS", 300)
    monkeypatch.setattr(postgres_module, "WAIT_LIMITS", dataclasses.replace(postgres_module.WAIT_LIMITS, lock=0.3))
    opened = open_store(store_url)
    outcome: list[BaseException | bool] = []

    def stage() -> None:
        try:
            outcome.append(opened.stage(make_record()).ok)
        except BaseException as exc:
            outcome.append(exc)

    with write_lock_held(store_url):
        started = time.monotonic()
        writer = threading.Thread(target=stage)
        writer.start()
        time.sleep(0.05)  # the writer is waiting for the lock
        closer = threading.Thread(target=opened.close)
        closer.start()
        closer.join(timeout=10)
        writer.join(timeout=10)
        hung = closer.is_alive() or writer.is_alive()
    writer.join()
    closer.join()
    assert not hung, "the writer or close() waited for the lock without a bound"
    assert time.monotonic() - started < 10
    [error] = outcome
    assert isinstance(error, LockTimeoutError), error  # SQLite's busy timeout and PostgreSQL's lock_timeout
    assert "write lock was not granted" in str(error), error
    assert _seqs(store_url) == []  # nothing was written


# --- isolation ----------------------------------------------------------------------------------


@needs_postgres
def test_staging_is_correct_on_a_database_whose_default_is_repeatable_read(pg_url: str) -> None:
    """Four stores (four connections) stage the same records at once; under REPEATABLE READ
    a writer that waited for the lock would not see the first one's key and fail."""
    repeatable = f"{pg_url}?options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
    stores = [open_store(repeatable) for _ in range(4)]
    engine = stores[0]._engine
    with engine.connect() as connection:
        # The session's default stays the database's; every transaction of the store begins READ COMMITTED.
        assert connection.exec_driver_sql("SHOW default_transaction_isolation").scalar() == "repeatable read"
        assert connection.exec_driver_sql("SHOW transaction_isolation").scalar() == "read committed"
    records = [make_record(rollout_id=f"r{i}", model_call_id="c") for i in range(25)]
    barrier = threading.Barrier(len(stores))
    outcomes: list[Any] = []

    def stage_all(target: Store) -> None:
        barrier.wait()
        for record in records:
            try:
                outcomes.append(target.stage(record).ok)
            except Exception as exc:  # counted below
                outcomes.append(exc)

    threads = [threading.Thread(target=stage_all, args=(target,)) for target in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for target in stores:
        target.close()
    assert [outcome for outcome in outcomes if outcome is not True] == []
    assert len(_seqs(pg_url)) == 25  # each record once


# --- sequence order -----------------------------------------------------------------------------


def test_no_event_with_a_smaller_seq_becomes_visible_after_a_larger_one(store_url: str) -> None:
    """A writer that took a sequence number and has not committed keeps every other writer
    from committing a larger one: the second store waits for the write lock."""
    with open_store(store_url) as first, open_store(store_url) as second:
        appended, release = threading.Event(), threading.Event()

        def slow(tx: WriteTransaction) -> int:
            seq = tx.append(failure_event("slow"))
            appended.set()
            assert release.wait(10)
            return seq

        slow_seq: list[int] = []
        writer = threading.Thread(target=lambda: slow_seq.append(first._write(slow)))
        writer.start()
        assert appended.wait(10)
        fast = threading.Thread(target=lambda: second.stage(make_record(rollout_id="fast")))
        fast.start()
        fast.join(timeout=0.5)
        assert fast.is_alive()  # waits for the lock instead of committing past the open writer
        assert _seqs(store_url) == []  # a reader sees neither
        release.set()
        writer.join(timeout=10)
        fast.join(timeout=10)
        seqs = _seqs(store_url)
        assert seqs[0] == slow_seq[0] and seqs == sorted(seqs) and len(seqs) == 2


def failure_event(rollout_id: str) -> NewEvent:
    return NewEvent(EventKind.CALL_FAILED, rollout_id, "c", FailureBody(reason="test"))


def test_a_reader_following_the_log_by_seq_never_misses_a_late_commit(store_url: str) -> None:
    """Three stores (three connections) write at once while a reader tails ``seq > last``;
    at the end the reader has seen every event, each once, in order."""
    writers = [open_store(store_url, durability="normal") for _ in range(3)]
    done = threading.Event()
    seen: list[int] = []

    def tail() -> None:
        last = 0
        while True:
            finished = done.is_set()  # read before the query: one more pass after the writers end
            for seq in _seqs_after(store_url, last):
                seen.append(seq)
                last = seq
            if finished:
                return

    def write(target: Store, index: int) -> None:
        for n in range(40):
            target.stage(make_record(rollout_id=f"w{index}-{n}", model_call_id="c"))

    reader = threading.Thread(target=tail)
    reader.start()
    threads = [threading.Thread(target=write, args=(target, i)) for i, target in enumerate(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    done.set()
    reader.join(timeout=60)
    for target in writers:
        target.close()
    assert seen == sorted(set(seen))
    assert seen == _seqs(store_url) and len(seen) == 120


_TAIL_ENGINES: dict[str, sa.Engine] = {}


def _seqs_after(store_url: str, last: int) -> list[int]:
    if "://" not in store_url:
        with sqlite3.connect(store_url) as connection:
            rows = connection.execute("SELECT seq FROM events WHERE seq > ? ORDER BY seq", (last,)).fetchall()
        connection.close()
        return [row[0] for row in rows]
    engine = _TAIL_ENGINES.setdefault(store_url, _postgres(store_url))
    with engine.connect() as connection:
        rows = connection.exec_driver_sql("SELECT seq FROM events WHERE seq > %(last)s ORDER BY seq", {"last": last})
        return [row[0] for row in rows]


# --- the pipelined write path (PostgreSQL sends a write transaction as one pipeline) -----------


def _staging(target: Store, record: Any, staging_key: str | None = None) -> _Pending[Any]:
    """A pending stage as ``Store.stage`` queues it, read-ahead hint included."""
    entry = StageEntry(record, staging_key)
    event = target._record_event(entry.record, entry.staging_key, entry.kind, entry.spans, entry.completion)
    stream = (event.rollout_id, event.model_call_id, event.staging_key or "")
    return _Pending(lambda tx: stage_event(tx, event, record.digest), True, (stream,))


@pytest.mark.parametrize("server_answered", [False, True], ids=["commit-first", "error-first"])
def test_a_failing_statement_whose_result_is_never_read_fails_its_own_write_alone(
    store_url: str, server_answered: bool
) -> None:
    """On PostgreSQL the error only surfaces as the batch commits (nothing read it before): the
    batch runs again with each caller settled, so the caller that sent it gets it and the others
    commit.  ``error-first``: the server's error has arrived before COMMIT is queued, so queuing
    COMMIT is what raises it (an idle server answers that fast; this once failed CI).  (Two
    connections: ``_write_batch`` called directly keeps the writer's, as a leader does.)"""
    with open_store(store_url, pool_size=2) as target:
        missing = Statement(sa.text("SELECT * FROM no_such_table WHERE x = :x"), target._engine)

        def bad(tx: WriteTransaction) -> int:
            seq = tx.append(failure_event("bad"))
            tx.run(missing, {"x": 1})  # its result is never read
            if server_answered:
                time.sleep(0.3)
            return seq

        with pytest.raises(StorageError, match=r"writing to the store failed.*no_such_table"):
            target._write(bad)
        good = _Pending(lambda tx: tx.append(failure_event("good")), True)
        failing = _Pending(bad, True)
        target._log._write_batch([good, failing])
        assert good.error is None and isinstance(good.result, int)
        assert isinstance(failing.error, StorageError) and "no_such_table" in str(failing.error)
        assert _seqs(store_url) == [good.result]
        assert target.audit().ok


def test_a_batch_reads_its_checks_ahead_and_never_uses_one_a_write_before_it_made_stale(store_url: str) -> None:
    """One group-commit batch: the same record twice (the second writes nothing), another record
    of the same call under its key (refused), and a stage queued behind a fence of its capture key
    (refused) -- each decided on what the batch wrote before it, not on the lookups read ahead.
    (Two connections: ``_write_batch`` called directly keeps the writer's, as a leader does.)"""
    with open_store(store_url, pool_size=2) as target:
        first = make_record(rollout_id="r1", model_call_id="c1")
        other = make_record(rollout_id="r1", model_call_id="c1", generated=(30, 31))
        late = make_record(rollout_id="r3", model_call_id="c3")
        batch = [
            _staging(target, first),
            _staging(target, first),
            _staging(target, other),
            _staging(target, make_record(rollout_id="r3", model_call_id="c0")),
            _Pending(lambda tx: removal.retire(tx, target._retention, ["r3"]), True),
            _staging(target, late),
        ]
        target._log._write_batch(batch)
        assert [pending.result.ok if pending.error is None else None for pending in batch[:4]] == [
            True,
            True,
            False,
            True,
        ]
        assert isinstance(batch[5].error, RolloutFencedError)
        assert [key.staging_key for key in target.staged_keys()] == sorted(
            [first.staging_key, make_record(rollout_id="r3", model_call_id="c0").staging_key]
        )
        assert target.audit().ok


@needs_postgres
def test_a_schema_named_in_the_url_is_the_same_store_as_the_schema_argument(pg_url: str) -> None:
    """``?schema=NAME`` lets a command line or a config string name a schema."""
    with open_store(pg_url, schema="fleet") as by_argument:
        assert by_argument.stage(make_record()).ok
        url = by_argument.url
    assert url.endswith("?schema=fleet")
    with open_store(f"{pg_url}?schema=fleet") as by_url, open_store(url, schema="fleet", read_only=True) as both:
        assert by_url.store_id == both.store_id
        assert [call.rollout_id for call in by_url.calls()] == ["rollout-1"]
    with open_store(pg_url) as public:
        assert public.calls() == []
    with pytest.raises(ConfigurationError, match="schema='fleet' but schema='other'"):
        open_store(f"{pg_url}?schema=fleet", schema="other")
    with pytest.raises(ConfigurationError, match="name it once"):
        open_store(f"{pg_url}?schema=a&schema=b")


def test_a_schema_in_a_sqlite_url_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ConfigurationError, match="PostgreSQL feature"):
        open_store(f"sqlite:///{tmp_path / 'store.db'}?schema=fleet")
