"""PostgreSQL servers and networks that fail, on a server of the test's own (``pg_cluster``).

Each test starts a cluster from the session's template (about half a second), breaks it --
a path that stops forwarding, a path that drops every packet, a server SIGSTOPped or
SIGKILLed -- and checks what a writer sees and how long it waits.  The limits are shrunk
(``WAIT_LIMITS``) so the bounds show in seconds; the defaults are the README's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lock_holder
import pg_cluster
import psycopg
import pytest
from factories import make_record
from pg_cluster import Cluster
from tcp_proxy import Proxy, can_blackhole

import store.log.postgres as postgres_module
from store import (
    CommitUncertainError,
    ConnectionLostError,
    LockTimeoutError,
    ServerStartingError,
    ServerUnavailableError,
    StorageError,
    Store,
    open_store,
)
from store.append.staging_rules import stage_event
from store.append.transaction import WriteTransaction
from store.log.engine import write_lock_id
from store.log.events import EventKind

# Small enough for a test, in the same proportions as the defaults.
SHORT = dataclasses.replace(
    postgres_module.WAIT_LIMITS,
    connect=1.0,
    lock=1.0,
    statement=1.0,
    idle_in_transaction=0.5,
    keepalive_idle=1,
    keepalive_interval=1,
    keepalive_count=2,
    tcp_user_timeout=2.0,
    read=1.5,
    write_margin=0.5,
)


@pytest.fixture
def short_limits(monkeypatch: pytest.MonkeyPatch) -> postgres_module.WaitLimits:
    monkeypatch.setattr(postgres_module, "WAIT_LIMITS", SHORT, raising=False)
    return SHORT


def _proxied(cluster: Cluster, proxy: Proxy) -> str:
    return cluster.url().replace(f":{cluster.port}/", f":{proxy.port}/")


@pytest.fixture
def proxy(cluster: Cluster) -> Iterator[Proxy]:
    forwarding = Proxy(cluster.port)
    try:
        yield forwarding
    finally:
        forwarding.close()


def _event_count(cluster: Cluster) -> int:
    return int(cluster.execute("SELECT count(*) FROM events")[0][0])  # type: ignore[call-overload]


def _stall_mid_write(url: str, cut: Any) -> tuple[threading.Thread, list[BaseException | object], Store]:
    """A store on ``url`` takes the write lock, then its network path fails (``cut()``) before
    it commits.  Returns the writer's thread, its outcome and the store."""
    stalled_store = open_store(url)
    holding, stalled = threading.Event(), threading.Event()
    outcome: list[BaseException | object] = []
    record = make_record(rollout_id="stalled")

    def work(tx: WriteTransaction) -> object:
        tx.settle()  # the write lock is granted: the server holds it for this session
        holding.set()
        stalled.wait(10)
        event = stalled_store._record_event(record, None, EventKind.CALL_COMPLETED, None, None)
        return stage_event(tx, event, record.digest)

    def write() -> None:
        try:
            outcome.append(stalled_store._write(work))
        except BaseException as exc:
            outcome.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    assert holding.wait(10)
    cut()
    stalled.set()
    return writer, outcome, stalled_store


@pytest.mark.parametrize("failure", ["stall", "blackhole"])
def test_a_writer_whose_path_dies_mid_write_does_not_block_the_others(
    cluster: Cluster, proxy: Proxy, short_limits: postgres_module.WaitLimits, failure: str
) -> None:
    """The issue's fleet hang: a stager whose path dies holding the write lock.  The server ends
    its idle session (idle_in_transaction_session_timeout) so the others write on within about
    that time; the stalled writer itself gets an error within its write deadline, and close()
    returns."""
    if failure == "blackhole" and (reason := can_blackhole()) is not None:
        pytest.skip(reason)
    direct = open_store(cluster.url())
    cut = proxy.stall if failure == "stall" else proxy.blackhole
    writer, outcome, stalled_store = _stall_mid_write(_proxied(cluster, proxy), cut)
    try:
        started = time.monotonic()
        assert direct.stage(make_record(rollout_id="other")).ok  # waits for the lock, then gets it
        other_waited = time.monotonic() - started
        writer.join(short_limits.write + 10)
        stalled_waited = time.monotonic() - started
        assert not writer.is_alive(), "the stalled writer never returned"
        [error] = outcome
        # Its stage lookup waited on the dead path, before any COMMIT went out: nothing committed.
        # (Lost by TCP's own timeout rather than the deadline, the batch is tried once more on a
        # new connection, which cannot reach the server through the dead path either.)
        assert isinstance(error, (ConnectionLostError, ServerUnavailableError)), error
        assert "nothing was" in str(error)
        closing = time.monotonic()
        stalled_store.close()
        closed_in = time.monotonic() - closing
    finally:
        direct.close()
    # The server freed the lock about idle_in_transaction after the stall: well inside lock_timeout.
    assert other_waited < short_limits.lock, other_waited
    assert stalled_waited < short_limits.write + short_limits.connect + 4, stalled_waited
    assert closed_in < 3, closed_in
    # The stalled record never committed (the server rolled its session back); the other did.
    assert _event_count(cluster) == 1


@pytest.mark.parametrize("pool_size", [1])  # 2 (a writer that holds its connection) behaves the same
def test_a_stopped_server_gives_every_writer_a_bounded_wait_then_an_error(
    cluster: Cluster, short_limits: postgres_module.WaitLimits, pool_size: int
) -> None:
    """SIGSTOP of the whole server: its kernel keeps acknowledging, so only the client's own
    deadlines end the waits.  A stage -- on a writer that holds its connection (``pool_size=2``)
    or checks it out per batch (the default, one connection) -- is cut at the write deadline
    (``CommitUncertainError``: a lone stage sends its COMMIT before it waits).  A fresh open gets
    ``ServerUnavailableError`` within the connect timeout, and once the server runs again the
    same store stages without being reopened."""
    opened = open_store(cluster.url(), pool_size=pool_size)
    assert opened.stage(make_record(rollout_id="before")).ok
    cluster.pause()
    try:
        started = time.monotonic()
        with pytest.raises((ConnectionLostError, CommitUncertainError)) as stage_error:
            opened.stage(make_record(rollout_id="during"))
        stage_waited = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError) as open_error:
            open_store(cluster.url())
        open_waited = time.monotonic() - started
    finally:
        cluster.resume()
    # A lone stage sends its whole transaction, COMMIT included, before it waits.
    assert isinstance(stage_error.value, (ConnectionLostError, CommitUncertainError)), stage_error.value
    assert "no answer from the server" in str(stage_error.value), stage_error.value
    assert stage_waited < short_limits.write + 2, stage_waited
    assert open_waited < short_limits.connect + 2, open_waited
    assert "could not be reached" in str(open_error.value)
    assert opened.stage(make_record(rollout_id="after")).ok  # a fresh connection, no reopen
    assert len(opened.fetch([make_record(rollout_id="after").staging_key])) == 1
    opened.close()


def test_a_read_on_a_stopped_server_is_bounded_too(cluster: Cluster, short_limits: postgres_module.WaitLimits) -> None:
    opened = open_store(cluster.url(), pool_size=2)
    record = make_record()
    assert opened.stage(record).ok
    cluster.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StorageError):
            opened.fetch([record.staging_key])
        waited = time.monotonic() - started
    finally:
        cluster.resume()
    # The pool's ping, then the read itself, each under the read deadline.
    assert waited < 2 * short_limits.read + 2, waited
    assert [snapshot.digest for snapshot in opened.fetch([record.staging_key])] == [record.digest]
    opened.close()


# --- errors that say what happened ---------------------------------------------------------------


def test_connection_refused_is_server_unavailable(cluster: Cluster) -> None:
    cluster.stop()
    with pytest.raises(ServerUnavailableError, match="could not be reached") as raised:
        open_store(cluster.url())
    assert not isinstance(raised.value, ServerStartingError)
    assert "refused" in str(raised.value).lower()
    assert "\n" not in str(raised.value), "the driver's lines are joined: a log line quoting it stays one"


def test_a_server_starting_up_is_server_starting(cluster: Cluster) -> None:
    """A server in crash recovery answers 57P03 ("the database system is starting up"): the
    open says so.  Recovery is held still by SIGSTOPping the startup process."""
    opened = open_store(cluster.url())
    assert opened.stage(make_record()).ok
    opened.close()
    cluster.kill()
    cluster.start(wait=False)
    deadline = time.monotonic() + 20
    error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            open_store(cluster.url()).close()
        except ServerStartingError as exc:
            error = exc
            break
        except ServerUnavailableError:  # not listening yet
            time.sleep(0.01)
            continue
        cluster.kill()  # it finished recovery before we saw it: crash it again and look sooner
        cluster.start(wait=False)
    cluster.wait_ready()
    assert error is not None, "never saw the server starting up"
    assert "starting up" in str(error)


def test_a_held_write_lock_is_a_lock_timeout(cluster: Cluster, short_limits: postgres_module.WaitLimits) -> None:
    opened = open_store(cluster.url())
    with psycopg.connect(cluster.conninfo()) as holder:
        holder.execute(f"SELECT pg_advisory_xact_lock({write_lock_id(None)})")
        started = time.monotonic()
        with pytest.raises(LockTimeoutError, match="write lock was not granted"):
            opened.stage(make_record())
        waited = time.monotonic() - started
    assert short_limits.lock - 0.5 < waited < short_limits.lock + 2, waited
    assert opened.stage(make_record()).ok  # retrying is safe: nothing was written
    opened.close()


def test_a_connection_lost_during_commit_may_have_committed(cluster: Cluster) -> None:
    """The session dies while COMMIT is in flight (a deferred trigger holds the commit open; the
    test terminates the backend meanwhile): the writer cannot know whether it committed, and
    says so (``CommitUncertainError``), never "nothing was written"."""
    opened = open_store(cluster.url())
    assert opened.stage(make_record(rollout_id="first")).ok
    cluster.execute(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_sleep(5); RETURN NULL; END $$"
    )
    cluster.execute(
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON events DEFERRABLE INITIALLY DEFERRED "
        "FOR EACH ROW EXECUTE FUNCTION slow_commit()"
    )
    outcome: list[BaseException | object] = []

    def stage() -> None:
        try:
            outcome.append(opened.stage(make_record(rollout_id="second")))
        except BaseException as exc:
            outcome.append(exc)

    writer = threading.Thread(target=stage)
    writer.start()
    deadline = time.monotonic() + 10
    terminated: list[Any] = []
    while not terminated and time.monotonic() < deadline:
        terminated = cluster.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = 'COMMIT' AND state = 'active'"
        )
        time.sleep(0.02)
    writer.join(10)
    assert terminated, "the commit was never seen in flight"
    [error] = outcome
    assert isinstance(error, CommitUncertainError), error
    assert "may or may not have happened" in str(error)
    opened.close()


# --- durability on a killed server ----------------------------------------------------------------


def test_normal_durability_loses_no_acknowledged_record_when_the_server_is_killed(pg_template: Path) -> None:
    """``durability="normal"`` used to commit with ``synchronous_commit = off`` on PostgreSQL: a
    SIGKILL of the server's processes lost the last batches (its WAL writer, here asleep for
    10 s, had not written them).  Now an acknowledged record has reached the WAL on the server
    (written; with fsync, flushed) before ``stage`` returns, whatever the level."""
    with pg_cluster.running(pg_template, {"wal_writer_delay": "10000ms"}) as server:
        opened = open_store(server.url(), durability="normal")
        acknowledged: list[str] = []
        stop = threading.Event()

        def stage(thread: int) -> None:
            index = 0
            while not stop.is_set():
                record = make_record(rollout_id=f"t{thread}-{index}")
                index += 1
                try:
                    if opened.stage(record).ok:
                        acknowledged.append(record.staging_key)
                except StorageError:
                    return  # the server is gone

        threads = [threading.Thread(target=stage, args=(thread,)) for thread in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        server.kill()
        stop.set()
        for thread in threads:
            thread.join(30)
        opened.close()
        server.start()
        kept = {row[0] for row in server.execute("SELECT staging_key FROM staged_keys")}
    assert len(acknowledged) > 50
    assert [key for key in acknowledged if key not in kept] == []


@pytest.mark.parametrize("pool_size", [1, 2])
def test_a_store_writes_on_after_a_server_restart_without_an_error(cluster: Cluster, pool_size: int) -> None:
    """A restart ends every pooled connection (the server's FATAL message is waiting on each): the
    next stage, at once and without a ping round trip per batch, finds its connection dead
    before it sends anything and takes a new one; the caller sees no error."""
    opened = open_store(cluster.url(), pool_size=pool_size)
    assert opened.stage(make_record(rollout_id="before")).ok
    cluster.restart()
    assert opened.stage(make_record(rollout_id="after")).ok
    assert [snapshot.digest for snapshot in opened.fetch([make_record(rollout_id="after").staging_key])] == [
        make_record(rollout_id="after").digest
    ]
    opened.close()


# --- a writer stuck on its client inside a pipeline or a COPY: its lease ----------------------------

# A lease short enough for a test; lease + 2 * lock_check stays well under the lock timeout.
LEASED = dataclasses.replace(SHORT, lock=5.0, statement=3.0, write_margin=1.0, read=5.0, lease=1.0, lock_check=0.25)


def _holder_session(cluster: Cluster, lock_id: int) -> tuple[int, str, str | None] | None:
    """The session holding the store's write lock: (pid, state, wait event), or None."""
    rows = cluster.execute(
        "SELECT a.pid, a.state, a.wait_event FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        f"WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = 1 "
        f"AND l.classid = {lock_id >> 32} AND l.objid = {lock_id & 0xFFFFFFFF}"
    )
    return None if not rows else (int(rows[0][0]), str(rows[0][1]), rows[0][2])  # type: ignore[call-overload]


def _alive_sessions(cluster: Cluster, pid: int) -> int:
    return int(cluster.execute(f"SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}")[0][0])  # type: ignore[call-overload]


@pytest.mark.parametrize("place", lock_holder.PLACES)
def test_a_writer_frozen_inside_a_pipeline_or_copy_is_ended_at_its_lease(
    cluster: Cluster, proxy: Proxy, monkeypatch: pytest.MonkeyPatch, place: str
) -> None:
    """The issue's lock held for minutes: a write that took the lock and stopped inside its
    pipeline (no Sync sent) or inside a ship's COPY leaves its session ``active`` in
    ``ClientRead`` -- no idle-in-transaction or statement timeout ends it -- and a frozen path
    (the proxy stops forwarding; TCP stays up, so no keepalive notices) kept it so for good:
    every other writer got ``LockTimeoutError``.  Now the other writer ends it once its lease is
    over and stages within lease + 2 looks, with no error; the frozen writer's record is not
    committed."""
    monkeypatch.setattr(postgres_module, "WAIT_LIMITS", LEASED, raising=False)
    limits = LEASED
    direct = open_store(cluster.url())
    frozen = open_store(_proxied(cluster, proxy))
    holding, release = threading.Event(), threading.Event()
    outcome: list[BaseException | object] = []

    def hold() -> None:
        try:
            outcome.append(lock_holder.hold_mid_write(frozen, place, holding.set, lambda: release.wait(30)))
        except BaseException as exc:
            outcome.append(exc)

    writer = threading.Thread(target=hold)
    writer.start()
    try:
        assert holding.wait(10)
        held = _holder_session(cluster, write_lock_id(None))
        assert held is not None
        pid, state, wait_event = held
        # Mid-write with no Sync: active and waiting on its client, never "idle in transaction".
        assert (state, wait_event) == ("active", "ClientRead"), held
        proxy.stall()
        started = time.monotonic()
        assert direct.stage(make_record(rollout_id="other")).ok  # no LockTimeoutError
        waited = time.monotonic() - started
        assert _alive_sessions(cluster, pid) == 0, "the frozen writer's session is still there"
    finally:
        release.set()
        writer.join(limits.write + 10)
        direct.close()
    assert not writer.is_alive()
    [error] = outcome
    assert isinstance(error, StorageError), error  # its connection is gone, or was cut
    frozen.close()
    # It took the lock just before the stall: ended about a lease later, within two looks more.
    assert waited < limits.lease + 2 * limits.lock_check + 1.5, waited
    assert _event_count(cluster) == 1  # the other's record; the frozen one's rolled back


def test_a_lock_holder_that_is_not_a_store_write_is_never_ended(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is a store write's: a migration, a repair or any other session holding the lock
    while it waits on its client (here: a psql-like session idle in its transaction) is waited
    for, and the writer gets ``LockTimeoutError`` as before."""
    monkeypatch.setattr(postgres_module, "WAIT_LIMITS", dataclasses.replace(LEASED, lock=2.0), raising=False)
    opened = open_store(cluster.url())
    with psycopg.connect(cluster.conninfo()) as holder:
        holder.execute(f"SELECT pg_advisory_xact_lock({write_lock_id(None)})")
        with pytest.raises(LockTimeoutError):
            opened.stage(make_record())
        assert holder.execute("SELECT 1").fetchone() == (1,)  # still there
    opened.close()


def test_the_server_watches_each_connection_as_the_client_does(cluster: Cluster) -> None:
    """The server's end of a store's connection probes its client (TCP keepalives) and gives up on
    unacknowledged sends as the client's end does: the session of a host that vanished ends in
    seconds (``test_pg_host_loss.py``), not after the kernel's two hours (the server's default)."""
    limits = postgres_module.WAIT_LIMITS
    opened = open_store(cluster.url())
    with opened._engine.connect() as connection:  # over TCP: the server shows the socket's values
        row = connection.exec_driver_sql(
            "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), "
            "current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')"
        ).one()
        connection.rollback()
    opened.close()
    expected = (
        str(limits.keepalive_idle),
        str(limits.keepalive_interval),
        str(limits.keepalive_count),
        str(round(limits.tcp_user_timeout * 1000)),
    )
    assert tuple(row) == expected


def test_the_lock_a_waiting_writer_takes_is_held_until_its_transaction_ends(cluster: Cluster) -> None:
    """``store_write_lock`` takes the lock inside a subtransaction of its own (each look is one):
    the lock must stay with the writer's transaction once it returns, not end with the
    subtransaction -- else two writers would append at once."""
    open_store(cluster.url()).close()  # migrated: the function exists
    lock = write_lock_id(None)
    with (
        psycopg.connect(cluster.conninfo()) as first,
        psycopg.connect(cluster.conninfo()) as second,
        psycopg.connect(cluster.conninfo(), autocommit=True) as third,
    ):
        first.execute(f"SELECT pg_advisory_xact_lock({lock})")
        waited: list[object] = []
        waiter = threading.Thread(
            target=lambda: waited.append(second.execute(f"SELECT store_write_lock({lock}, 5000, 5000, 200)").fetchone())
        )
        waiter.start()
        time.sleep(0.7)  # a few looks: each a subtransaction that timed out
        first.commit()
        waiter.join(10)
        assert waited == [(True,)]
        assert third.execute(f"SELECT pg_try_advisory_xact_lock({lock})").fetchone() == (False,)
        [[timeout]] = second.execute("SELECT current_setting('lock_timeout')").fetchall()
        assert timeout == "5s"  # its whole wait again, not the last look's slice
        second.commit()
        assert third.execute(f"SELECT pg_try_advisory_xact_lock({lock})").fetchone() == (True,)


def test_the_migration_reads_the_lease_mark_the_write_path_writes() -> None:
    """Migration 0010 does not import the library: its copy of the lease mark's tag must match."""
    path = Path(__file__).resolve().parents[1] / "migrations" / "versions" / "0010_write_lock_lease.py"
    spec = importlib.util.spec_from_file_location("migration_0010", path)
    assert spec is not None and spec.loader is not None
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    assert migration.LEASE_TAG == postgres_module.LEASE_TAG
    assert f"= {postgres_module.LEASE_TAG}" in migration._FUNCTION
