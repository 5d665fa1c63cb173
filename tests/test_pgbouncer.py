"""Stores behind a real PgBouncer (Debian's package), in both pool modes, on a server of the test's own.

Transaction pooling hands each transaction to whichever server session is free: a store that
kept session state (``SET search_path``, ``SET synchronous_commit``, prepared statements) wrote
into another store's schema and lost its prepared statements.  Every setting now lives in its
transaction, so two schemas behind one pooler never see each other's records, and an audit
reports an event that was written for another store.  Also here: 64 stores fit a default
server (``max_connections = 100``), with and without the pooler.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from factories import make_record
from pg_cluster import Cluster
from pgbouncer import Bouncer, why_not

from store import StagedCallRecord, Store, open_store

pytestmark = pytest.mark.skipif(why_not() is not None, reason=why_not() or "")

THREADS = 4
_CLIENTS = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
RECORDS = 12  # per thread and store


@pytest.fixture(params=["transaction", "session"])
def bouncer(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Bouncer]:
    # Session pooling holds a server session per client for its whole life: room for all four.
    running = Bouncer(cluster.port, request.param, pool_size=2 if request.param == "transaction" else 8)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _stage_from_threads(stores: dict[str, Store]) -> tuple[dict[str, list[StagedCallRecord]], list[BaseException]]:
    staged: dict[str, list[StagedCallRecord]] = {name: [] for name in stores}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(name: str, target: Store, thread: int) -> None:
        for index in range(RECORDS):
            record = make_record(rollout_id=f"{name}-{thread}-{index}")
            try:
                ok = target.stage(record).ok
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                continue
            if ok:
                with lock:
                    staged[name].append(record)

    threads = [
        threading.Thread(target=run, args=(name, target, thread))
        for name, target in stores.items()
        for thread in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return staged, errors


def test_two_schemas_behind_a_pooler_keep_their_own_records(bouncer: Bouncer, cluster: Cluster) -> None:
    stores = {name: open_store(bouncer.url(), schema=name, pool_size=2) for name in ("team_a", "team_b")}
    try:
        for target in stores.values():
            # Transaction pooling was seen at open: no statement is prepared on a shared session.
            assert target._backend.sessions is not None
            assert target._backend.sessions.prepared is (bouncer.pool_mode == "session")
        staged, errors = _stage_from_threads(stores)
        assert errors == []
        for name, target in stores.items():
            assert len(staged[name]) == THREADS * RECORDS
            fetched = target.fetch([record.staging_key for record in staged[name]])
            assert [snapshot.digest for snapshot in fetched] == [record.digest for record in staged[name]]
            assert target.audit().ok
        ids = {name: target.store_id for name, target in stores.items()}
    finally:
        for target in stores.values():
            target.close()
    # On the server, straight from each schema: every event there was written for that schema's store.
    for name, store_id in ids.items():
        rows = cluster.execute(f"SELECT store_id, count(*) FROM {name}.events GROUP BY store_id")
        assert rows == [(store_id, THREADS * RECORDS)], (name, rows)


def test_an_audit_reports_an_event_written_for_another_store(cluster: Cluster) -> None:
    """What a misrouting pooler left behind (made by hand here): store A's event in B's log.
    B's audit names it, and the store it was meant for."""
    with open_store(cluster.url(), schema="team_a") as a, open_store(cluster.url(), schema="team_b") as b:
        assert a.stage(make_record(rollout_id="a")).ok
        assert b.stage(make_record(rollout_id="b")).ok
        a_id = a.store_id
        with psycopg.connect(cluster.conninfo(), autocommit=True) as connection:
            columns = (
                "rollout_id, model_call_id, stream_version, kind, staging_key, writer_pid, recorded_at, "
                "body, token_ids, token_mask, log_probs, checksum, writer_host, store_id"
            )
            connection.execute(f"INSERT INTO team_b.events ({columns}) SELECT {columns} FROM team_a.events")
        report = b.audit()
        assert a.audit().ok
    assert not report.ok
    misplaced = [problem for problem in report.problems if problem.code == "misplaced"]
    assert len(misplaced) == 1, report.summary()
    assert a_id in misplaced[0].reason


@pytest.mark.parametrize("through", ["direct", "pgbouncer"])
def test_64_stores_fit_a_default_server(cluster: Cluster, through: str) -> None:
    """64 stores (a fleet's workers) stage and read at once, two threads each, on a server with
    PostgreSQL's default ``max_connections = 100``: each holds one connection (the default
    ``pool_size``), so none is refused; behind a transaction pooler the server sees its pool only."""
    assert cluster.execute("SHOW max_connections") == [("100",)]
    bouncer: Bouncer | None = None
    url = cluster.url()
    if through == "pgbouncer":
        if (reason := why_not()) is not None:
            pytest.skip(reason)
        bouncer = Bouncer(cluster.port, "transaction", pool_size=20)
        bouncer.start()
        url = bouncer.url()
    stores: list[Store] = []
    try:
        stores = [open_store(url) for _ in range(64)]
        errors: list[BaseException] = []
        peak = [0]

        def work(index: int, half: int) -> None:
            try:
                for step in range(2):
                    record = make_record(rollout_id=f"w{index}-{half}-{step}")
                    assert stores[index].stage(record).ok
                    assert stores[index].fetch([record.staging_key])[0].digest == record.digest
                    stores[index].calls(record.rollout_id)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(index, half)) for index in range(64) for half in range(2)]
        for thread in threads:
            thread.start()
        watching = True

        def watch() -> None:  # on one connection of its own (a new one per look would count twice)
            with psycopg.connect(cluster.conninfo(), autocommit=True) as connection:
                while watching:
                    [[count]] = connection.execute(_CLIENTS).fetchall()
                    peak[0] = max(peak[0], int(count))

        watcher = threading.Thread(target=watch)
        watcher.start()
        for thread in threads:
            thread.join(120)
        watching = False
        watcher.join()
        assert errors == [], errors[:3]
        assert int(cluster.execute("SELECT count(*) FROM events")[0][0]) == 64 * 2 * 2  # type: ignore[call-overload]
        # The watcher's own connection is one of them; a pooler keeps the server at its pool size.
        assert peak[0] <= (64 + 1 if bouncer is None else 20 + 1), peak[0]
    finally:
        for target in stores:
            target.close()
        if bouncer is not None:
            bouncer.stop()
