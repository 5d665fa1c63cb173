"""Log shipping: ``Store.ship`` copies a worker-local SQLite log into another store (each backend).

Idempotent, resumable after SIGKILL, verified on arrival, identity kept across hops, several
origins into one target, conflicts refused and reported.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import replica_helpers as rh
import sqlalchemy as sa
from capture_helpers import damage_token_ids, raw_event_count
from corruption_helpers import populate
from factories import make_record
from lineage_helpers import two_call_rollout
from shipping_helpers import assert_target_reads_like_source, origins, staged_keys

from store import (
    EventOrigin,
    InvalidRecordError,
    RolloutFencedError,
    StagingRefusedError,
    StorageError,
    Store,
    StoreClosedError,
    open_store,
)
from store.log.events import AdmissionBody
from store.shipping import receive

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def worker_store(path: Path) -> Store:
    """A worker's local store with an event of every kind (records, admissions, a cut and its
    receipt, a restored continuation, withdrawn keys, a failed call)."""
    local = open_store(str(path))
    populate(local)
    two_call_rollout(local, "rc", interrupted=True)
    assert local.stage(make_record(rollout_id="r5", model_call_id="c0"), staging_key=None).ok
    flushed = "__generation_cut__/checkpoint-1/r3/c0/0"
    local.clear_keys("r3", "c0", [flushed], "rolled back")
    assert flushed not in staged_keys(local)
    return local


def test_a_ship_copies_every_event_and_the_target_reads_like_the_source(store_url: str, tmp_path: Path) -> None:
    with worker_store(tmp_path / "worker.db") as source, open_store(store_url) as target:
        seen: list[tuple[int, int]] = []
        report = source.ship(target, progress=lambda done, total: seen.append((done, total)))
        assert report.ok, report.summary()
        events = raw_event_count(source)
        assert (report.read, report.appended, report.present, report.last_seq) == (events, events, 0, events)
        assert (report.source_store_id, report.target_store_id) == (source.store_id, target.store_id)
        assert seen[0] == (0, events) and seen[-1] == (events, events)
        assert_target_reads_like_source(source, target)
        # Every event keeps its identity: the worker's store id and its sequence number there.
        assert origins(target) == [EventOrigin(source.store_id, seq) for seq in range(1, events + 1)]
        assert target.replay().ok


def test_a_second_ship_sends_only_what_is_new(store_url: str, tmp_path: Path) -> None:
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for index in range(3):
            assert source.stage(make_record(rollout_id=f"r{index}")).ok
        assert source.ship(target).appended == 3
        again = source.ship(target)
        assert (again.ok, again.read, again.appended, again.last_seq) == (True, 0, 0, 3)
        assert source.stage(make_record(rollout_id="late")).ok
        later = source.ship(target)
        assert (later.read, later.appended, later.last_seq) == (1, 1, 4)
        assert raw_event_count(target) == 4
        assert_target_reads_like_source(source, target)


def test_two_ships_of_one_source_at_once_append_each_event_once(store_url: str, tmp_path: Path) -> None:
    with open_store(str(tmp_path / "worker.db"), durability="normal") as source:
        source.stage_all([_entry(f"r{n}") for n in range(300)])
    targets = [open_store(store_url) for _ in range(2)]  # two connections: the batches race
    sources = [open_store(str(tmp_path / "worker.db")) for _ in range(2)]
    reports: list[object] = []
    threads = [
        threading.Thread(target=lambda s=s, t=t: reports.append(s.ship(t)))  # type: ignore[misc]
        for s, t in zip(sources, targets, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sum(report.appended for report in reports) == 300  # type: ignore[attr-defined]
    assert all(report.ok for report in reports)  # type: ignore[attr-defined]
    assert raw_event_count(targets[0]) == 300
    assert_target_reads_like_source(sources[0], targets[0])
    for opened in (*sources, *targets):
        opened.close()


def test_several_workers_ship_into_one_target(store_url: str, tmp_path: Path) -> None:
    with (
        open_store(str(tmp_path / "a.db")) as a,
        open_store(str(tmp_path / "b.db")) as b,
        open_store(store_url) as target,
    ):
        two_call_rollout(a, "ra", interrupted=True)
        two_call_rollout(b, "rb", interrupted=False)
        shared = make_record(rollout_id="shared", model_call_id="c")
        assert a.stage(shared).ok and b.stage(shared).ok  # the same record, staged by both
        assert a.ship(target).ok
        report = b.ship(target)
        assert report.ok and report.present == 1  # the identical record was already there
        assert_target_reads_like_source(a, target, only_source=False)
        assert_target_reads_like_source(b, target, same_times=False, only_source=False)
        assert {origin.store_id for origin in origins(target)} == {a.store_id, b.store_id}


def test_a_conflict_is_refused_and_reported_never_merged(store_url: str, tmp_path: Path) -> None:
    with (
        open_store(str(tmp_path / "a.db")) as a,
        open_store(str(tmp_path / "b.db")) as b,
        open_store(store_url) as target,
    ):
        assert a.stage(make_record(rollout_id="r", model_call_id="c", generated=(1, 2))).ok
        assert a.ship(target).ok
        assert b.stage(make_record(rollout_id="before", model_call_id="c")).ok
        other = make_record(rollout_id="r", model_call_id="c", generated=(3, 4))  # another record, same key
        assert b.stage(other).ok
        assert b.stage(make_record(rollout_id="after", model_call_id="c")).ok
        for _ in range(2):  # a later ship stops there again
            report = b.ship(target)
            assert not report.ok
            [problem] = report.problems
            assert (problem.code, problem.staging_key, problem.source_seq) == ("conflict", "r/c", 2)
            assert (problem.origin_store_id, problem.origin_seq) == (b.store_id, 2)
            assert "already holds a different record" in problem.reason and "conflict" in report.summary()
            assert report.last_seq == 1  # the event before the conflict is shipped
        assert target.fetch(["r/c"])[0].token_ids_delta.tolist()[-2:] == [1, 2]  # never overwritten
        assert target.call("after", "c") is None
        assert target.call("before", "c") is not None
        assert target.audit().ok


def test_another_receipt_for_the_same_inventory_is_a_conflict(store_url: str, tmp_path: Path) -> None:
    digest = "ab" * 32
    with (
        open_store(str(tmp_path / "a.db")) as a,
        open_store(str(tmp_path / "b.db")) as b,
        open_store(store_url) as target,
    ):
        a.stage_all([], cut_receipt=("ckpt", digest, b'{"receipt": "a"}'))
        b.stage_all([], cut_receipt=("ckpt", digest, b'{"receipt": "b"}'))
        c_receipt = b'{"receipt": "a"}'
        assert a.ship(target).ok
        report = b.ship(target)
        [problem] = report.problems
        assert problem.code == "conflict" and "another receipt" in problem.reason
        assert target.cut_receipt("ckpt", digest) == c_receipt
        with open_store(str(tmp_path / "c.db")) as c:
            c.stage_all([], cut_receipt=("ckpt", digest, c_receipt))
            same = c.ship(target)
            assert (same.ok, same.appended, same.present) == (True, 0, 1)  # the identical receipt


def test_a_damaged_source_event_stops_the_ship_before_it(store_url: str, tmp_path: Path) -> None:
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for name in ("r1", "r2", "r3"):
            assert source.stage(make_record(rollout_id=name)).ok
        damage_token_ids(source, "r2/call-1")
        report = source.ship(target)
        assert not report.ok
        [problem] = report.problems
        assert (problem.code, problem.source_seq, problem.staging_key) == ("corrupt", 2, "r2/call-1")
        assert "checksum" in problem.reason
        assert report.last_seq == 1 and raw_event_count(target) == 1


def test_a_check_in_the_target_write_transaction_applies_to_shipped_events(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where retention's fences hook in: a check raising inside the target's write transaction
    (here in place of ``stage_refusal``, staging's checks) refuses the event; the events before it
    are shipped."""
    real_stage = receive.stage_refusal

    def fenced(tx: object, event: object, digest: str) -> object:
        if getattr(event, "rollout_id", None) == "fenced":
            raise StagingRefusedError("rollout 'fenced' is retired")
        return real_stage(tx, event, digest)  # type: ignore[arg-type]

    monkeypatch.setattr(receive, "stage_refusal", fenced)
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for name in ("ok1", "ok2", "fenced", "ok3"):
            assert source.stage(make_record(rollout_id=name)).ok
        report = source.ship(target)
        [problem] = report.problems
        assert (problem.code, problem.rollout_id, problem.source_seq) == ("refused", "fenced", 3)
        assert "retired" in problem.reason
        assert (report.appended, report.last_seq) == (2, 2)
        assert [call.rollout_id for call in target.calls()] == ["ok1", "ok2"]
        assert target.replay().ok


def test_identity_is_kept_across_hops(store_url: str, tmp_path: Path) -> None:
    with (
        worker_store(tmp_path / "worker.db") as worker,
        open_store(str(tmp_path / "region.db")) as region,
        open_store(store_url) as central,
    ):
        assert worker.ship(region).ok
        assert region.ship(central).ok
        events = raw_event_count(worker)
        assert origins(central) == [EventOrigin(worker.store_id, seq) for seq in range(1, events + 1)]
        direct = worker.ship(central)  # the same events by another path: nothing appended
        assert (direct.ok, direct.appended, direct.present) == (True, 0, events)
        assert central.ship(worker).appended == 0  # shipped back home: the worker's own events
        assert_target_reads_like_source(worker, central)


def test_bad_arguments_are_refused(store_url: str, tmp_path: Path) -> None:
    with open_store(str(tmp_path / "worker.db")) as source:
        with pytest.raises(InvalidRecordError, match="takes a Store"):
            source.ship("postgresql://elsewhere")  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError, match="this store"):
            source.ship(source)
        same_file = open_store(str(tmp_path / "worker.db"))
        with pytest.raises(InvalidRecordError, match="this store"):
            source.ship(same_file)
        same_file.close()
        target = open_store(store_url)
        with pytest.raises(InvalidRecordError, match="progress must be callable"):
            source.ship(target, progress=3)  # type: ignore[arg-type]
        target.close()
        with pytest.raises(StoreClosedError):
            source.ship(target)


_KILLED_SHIP = """
import sys
sys.path.insert(0, {tests!r})
from store import open_store
from store.shipping import ship
ship.BATCH_EVENTS = 40
with open_store({source!r}) as source, open_store({target!r}) as target:
    source.ship(target)
print("NOT KILLED")
"""


@pytest.mark.parametrize("failpoint", ["before_commit", "after_commit"])
def test_a_ship_killed_mid_way_resumes_without_loss_or_duplicates(
    store_url: str, tmp_path: Path, failpoint: str
) -> None:
    path = tmp_path / "worker.db"
    with open_store(str(path), durability="normal") as source:
        for block in range(4):  # 200 events: five batches of 40
            assert source.stage_all([_entry(f"r{block}-{n}") for n in range(50)]) is not None
    program = _KILLED_SHIP.format(tests=str(TESTS), source=str(path), target=store_url)
    # Skip the resume-point write and two batches: killed in the third batch.
    env = {**os.environ, "STORE_FAILPOINT": failpoint, "STORE_FAILPOINT_SKIP": "3"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, (done.stdout, done.stderr)
    with open_store(str(path)) as source, open_store(store_url) as target:
        shipped = raw_event_count(target)
        assert shipped == (80 if failpoint == "before_commit" else 120)  # whole batches only
        report = source.ship(target)
        assert report.ok and report.appended == 200 - shipped and report.last_seq == 200
        assert raw_event_count(target) == 200
        assert_target_reads_like_source(source, target)


def _entry(rollout_id: str) -> object:
    from store import StageEntry

    return StageEntry(make_record(rollout_id=rollout_id))


def test_retention_events_ship_as_fences_and_deletes_of_the_target(store_url: str, tmp_path: Path) -> None:
    """A retired capture key is fenced in the target too; a deleted one is removed there as well."""
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for rollout_id in ("kept", "retired", "deleted"):
            assert source.stage(make_record(rollout_id=rollout_id)).ok
        assert source.ship(target).ok
        source.retire(["retired", "deleted"])
        source.delete(["deleted"])
        report = source.ship(target)
        assert report.ok, report.summary()
        with pytest.raises(RolloutFencedError, match="retired"):
            target.stage(make_record(rollout_id="retired", model_call_id="late"))
        assert {key.split("/")[0] for key in staged_keys(target)} == {"kept", "retired"}
        assert target.call("deleted", "c1") is None
        audit = target.audit()
        assert audit.ok, audit.summary()
        assert audit.counts["tombstones"] == 1 and target.replay().ok
        assert source.ship(target).appended == 0  # the delete is not applied twice


def test_a_shipped_worker_leave_names_its_join_in_the_target(store_url: str, tmp_path: Path) -> None:
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        assert target.stage(make_record(rollout_id="local")).ok  # the target's seqs differ from the source's
        joined = source.record_worker("worker_joined", 4242, index=0, connected=1, expected=1)
        source.record_worker("worker_lost", 4242, index=0, joined_seq=joined, connected=0, expected=1)
        assert source.ship(target).ok
        [worker] = target.workers()
        assert (worker.pid, worker.state) == (4242, "lost")
        assert worker.join_seq != joined
        assert target.event_origin(worker.join_seq) == EventOrigin(source.store_id, joined)
        assert target.replay().ok and target.audit().ok


def test_retention_cleanup_past_a_fence_ships_past_it_too(store_url: str, tmp_path: Path) -> None:
    """Store.retain withdraws keys of a retired capture key at its origin; the ship must not refuse it."""
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for call in ("c0", "c1"):
            assert source.stage(make_record(rollout_id="r1", model_call_id=call)).ok
        source.retire(["r1"])
        assert source.retain(["r1/c0"], capture_keys=["r1"]).removed == ["r1/c1"]
        report = source.ship(target)
        assert report.ok, report.summary()
        assert staged_keys(target) == staged_keys(source) and set(staged_keys(source)) == {"r1/c0"}
        assert target.replay().ok and target.audit().ok


def test_a_record_appended_at_another_stream_version_than_its_source_gets_its_own_checksum(
    store_url: str, tmp_path: Path
) -> None:
    """A shipped event keeps its source's checksum only where every column it covers is the
    source's: here the target's stream already holds an admission, so the record lands one
    version later and is hashed again (a kept checksum would read as damage)."""
    admission = AdmissionBody(
        schema_version=2, parent_call_id=None, mode="text", prev_len=0, parent_chain_hash=None, weight_version=7
    )
    record = make_record()
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        target.record_admission(record.rollout_id, record.model_call_id, admission)
        assert source.stage(record).ok
        report = source.ship(target)
        assert report.ok and report.appended == 1, report.summary()
        versions = {}
        for name, store in (("source", source), ("target", target)):
            with store._engine.connect() as connection:
                query = sa.text("SELECT stream_version FROM events WHERE staging_key = :key")
                versions[name] = connection.execute(query, {"key": record.staging_key}).scalar_one()
        assert versions == {"source": 1, "target": 2}
        assert target.fetch([record.staging_key])[0].digest == record.digest
        audit = target.audit()
        assert audit.ok, audit.summary()


def test_a_batch_whose_rows_the_server_refuses_mid_stream_commits_none_of_them(store_url: str, tmp_path: Path) -> None:
    """PostgreSQL: a batch's events stream to the server (COPY) as they are folded; a row the
    server refuses part way through fails the whole batch, which commits nothing, and the
    next ship sends it all."""
    if "://" not in store_url:
        pytest.skip("a PostgreSQL trigger refuses the row")
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        assert source.stage_all([_entry(f"r{n}") for n in range(30)]) is not None
        with target._engine.begin() as connection:
            connection.execute(
                sa.text(
                    "CREATE FUNCTION refuse_r17() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "IF NEW.rollout_id = 'r17' THEN RAISE EXCEPTION 'r17 refused'; END IF; RETURN NEW; END $$"
                )
            )
            connection.execute(
                sa.text("CREATE TRIGGER refuse_r17 BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION refuse_r17()")
            )
        with pytest.raises(StorageError):
            source.ship(target)
        assert raw_event_count(target) == 0  # nothing of the batch, though r0..r16 had gone out
        with target._engine.begin() as connection:
            connection.execute(sa.text("DROP TRIGGER refuse_r17 ON events"))
        report = source.ship(target)
        assert report.ok and report.appended == 30, report.summary()
        assert_target_reads_like_source(source, target)


def test_a_cut_of_many_calls_of_one_rollout_ships_without_a_statement_per_call(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch reads its lookups ahead once (an append makes only its own stream's stale, not its
    rollout's) and updates the calls rows together: on PostgreSQL no stage lookup and no calls
    update is sent per event.  The target reads like the source and replays clean either way."""
    from store.append.transaction import WriteTransaction

    sent: list[str] = []
    original = WriteTransaction._execute

    def counting(self: WriteTransaction, statement: Any, values: dict[str, Any]) -> Any:
        sql = self._sql
        per_event = {sql.stage_lookup.sql: "lookup", sql.update_call.sql: "update"}
        if sql.stage_lookup_seq is not None:
            per_event[sql.stage_lookup_seq.sql] = "lookup"
        sent.append(per_event.get(statement.sql, "other"))
        return original(self, statement, values)

    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        capture = rh.capture_on(source)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call, limit=64) for call in range(1, 17)}
        assert source.ship(target).ok  # the admissions: every call's row is in the target
        for active in live.values():
            capture.observe(active, list(range(1000, 1008)), [-0.5] * 8)
        receipt = capture.serve_generation_cut(rh.inventory("checkpoint-1", live))
        assert {ack.disposition for ack in receipt.prefixes} == {"durable_prefix"}
        capture.close()
        monkeypatch.setattr(WriteTransaction, "_execute", counting)
        report = source.ship(target)
        monkeypatch.undo()
        assert report.ok and report.appended == len(live) + 1, report.summary()  # 16 chunks and the receipt
        if target.backend == "postgresql":
            assert "lookup" not in sent and "update" not in sent, sent
        else:  # SQLite reads and writes each at once (nothing to save a round trip on)
            assert sent.count("lookup") == len(live) and sent.count("update") == len(live)
        assert_target_reads_like_source(source, target)
        assert target.replay().ok


def test_a_receipt_ships_in_one_round_trip_before_its_commit(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's reads before its first append (the resume point, which identities are here, a
    receipt's lookup -- whether one of its inventory stands, its stream's fence and last version,
    in one statement -- the stage lookups and seqs) go out together, read ahead; a small batch
    (a cut's receipt, shipped on its own) is sent as statements with the COMMIT, not a COPY.
    On PostgreSQL a receipt's ship then runs no statement of its own before the inserts and
    opens no COPY; on SQLite each read runs as it comes."""
    from store.append.transaction import WriteTransaction
    from store.log.write_transaction import _PipelinedCursor
    from store.shipping.ship import Bounds

    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        capture = rh.capture_on(source)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call, limit=64) for call in range(1, 4)}
        for active in live.values():
            capture.observe(active, list(range(1000, 1008)), [-0.5] * 8)
        assert source.ship(target).ok
        receipt = capture.serve_generation_cut(rh.inventory("checkpoint-1", live))
        capture.close()
        report = source.ship(target, limit=len(live))  # the chunks; the receipt is left
        assert report.ok and report.remaining == 1, report.summary()
        reads: list[str] = []
        copies: list[str] = []
        original = WriteTransaction._execute

        def counting(self: WriteTransaction, statement: Any, values: dict[str, Any]) -> Any:
            if statement.sql.lstrip().upper().startswith("SELECT"):
                reads.append(statement.sql)
            return original(self, statement, values)

        monkeypatch.setattr(WriteTransaction, "_execute", counting)
        monkeypatch.setattr(_PipelinedCursor, "copy_rows", lambda *args: copies.append("rows"))
        monkeypatch.setattr(_PipelinedCursor, "copy_row", lambda *args: copies.append("row"))
        # As the replicator ships: from the resume point its last ship ended at (not read first).
        report = source._ship_round(target, Bounds(), report.last_seq)
        monkeypatch.undo()
        assert report.ok and report.appended == 1, report.summary()
        if target.backend == "postgresql":
            assert reads == [] and copies == [], (reads, copies)
        else:
            assert len(reads) == 3, reads  # resume point, identities, the receipt's lookup: one by one
        assert target.cut_receipt(receipt.checkpoint_id, receipt.inventory_digest) is not None
        assert_target_reads_like_source(source, target)
        assert target.replay().ok


def test_a_ship_of_one_batch_verifies_each_event_just_before_appending_it(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ship of one batch (a replicated cut's) reads its events and verifies them in the target's
    transaction: the first half while the server runs the batch's reads, each of the rest just
    before it is appended (the ones before it stream to the server meanwhile).  A damaged one
    still stops the batch there (the ones before it commit) and is reported as before, and
    nothing of it reaches the target."""
    from store.append.transaction import WriteTransaction
    from store.shipping import source as shipping_source

    order: list[str] = []
    verified, append = shipping_source._verified, WriteTransaction.append

    def verifying(row: Any, origin: Any) -> Any:
        order.append(f"verify {row['rollout_id']}")
        return verified(row, origin)

    def appending(self: WriteTransaction, new: Any, lookup: Any = None) -> int:
        order.append(f"append {new.rollout_id}")
        return append(self, new, lookup)

    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for name in ("r1", "r2", "r3", "r4"):
            assert source.stage(make_record(rollout_id=name)).ok
        damage_token_ids(source, "r3/call-1")
        monkeypatch.setattr(shipping_source, "_verified", verifying)
        monkeypatch.setattr(WriteTransaction, "append", appending)
        report = source.ship(target)
        monkeypatch.undo()
        assert order == ["verify r1", "verify r2", "append r1", "append r2", "verify r3"], order
        assert not report.ok
        [problem] = report.problems
        assert (problem.code, problem.source_seq, problem.staging_key) == ("corrupt", 3, "r3/call-1")
        assert "checksum" in problem.reason
        assert report.last_seq == 2 and raw_event_count(target) == 2 and report.remaining == 2
        report = source.ship(target)  # it stops there again: nothing after it goes
        assert not report.ok and report.appended == 0 and raw_event_count(target) == 2


def test_a_batch_of_some_dozens_copies_only_its_events(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a ship's batch of 16 or more events streams its events as COPY; the rows
    of the smaller tables (keys, calls, shipped identities) go as COPY only from COPY_MANY_ROWS
    of them, fewer as one statement each, sent with the COMMIT without a wait of their own."""
    if "://" not in store_url:
        pytest.skip("SQLite sends no COPY")
    from store.append.transaction import COPY_MANY_ROWS, COPY_MIN_ROWS
    from store.log.write_transaction import _PipelinedCursor

    copied: list[str] = []
    copy_rows = _PipelinedCursor.copy_rows

    def recording(self: _PipelinedCursor, statement: str, types: Any, rows: Any) -> None:
        copied.append(statement.split("(")[0])
        copy_rows(self, statement, types, rows)

    count = COPY_MIN_ROWS + 8
    assert count < COPY_MANY_ROWS
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        assert source.stage_all([_entry(f"r{n}") for n in range(count)]) is not None
        monkeypatch.setattr(_PipelinedCursor, "copy_rows", recording)
        report = source.ship(target)
        monkeypatch.undo()
        assert report.ok and report.appended == count, report.summary()
        assert copied == [], copied
        assert_target_reads_like_source(source, target)
        assert target.audit().ok and target.replay().ok


def _kept_source(path: Path) -> tuple[Store, Any]:
    """A worker store whose commits hand their rows to a ``Recent``, as a replicated store's do."""
    from store.shipping.replica import Recent

    source = open_store(str(path))
    recent = Recent()
    source._keep_committed(recent.remember)
    return source, recent


def test_a_ship_of_events_this_process_committed_reads_none_of_them_back(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replicator's ship of events this process just committed takes them as written (the
    write path hands them on after its commit) instead of reading them back from the log, and
    verifies them the same: the target reads like the source."""
    from store.shipping import source as shipping_source
    from store.shipping.ship import Bounds

    reads: list[tuple[int, int]] = []
    read = shipping_source._read

    def recording(source: Any, after: int, upto: int, size: int) -> Any:
        reads.append((after, upto))
        return read(source, after, upto, size)

    source, recent = _kept_source(tmp_path / "worker.db")
    with source, open_store(store_url) as target:
        assert source.stage_all([_entry(f"r{n}") for n in range(20)]) is not None
        monkeypatch.setattr(shipping_source, "_read", recording)
        report = source._ship_round(target, Bounds(), None, recent)
        assert report.ok and report.appended == 20, report.summary()
        assert reads == [], reads
        assert source.stage(make_record(rollout_id="later")).ok
        report = source._ship_round(target, Bounds(), report.last_seq, recent)
        assert report.ok and report.appended == 1 and reads == [], (report.summary(), reads)
        recent.shipped(report.last_seq)  # (the replicator's, after each ship)
        assert recent.rows(0, 1) is None and recent.rows(report.last_seq - 1, report.last_seq) is None
        assert_target_reads_like_source(source, target)
        assert target.audit().ok and target.replay().ok


@pytest.mark.parametrize("remover", ["this process", "another process", "no later event"])
def test_kept_events_removed_since_are_read_from_the_log_instead(store_url: str, tmp_path: Path, remover: str) -> None:
    """Events this process committed and kept, then removed (``delete``) before they shipped, are
    not shipped from what was kept: a removal in this process forgets everything kept (another
    module wrote in its commit), one in another process (another handle on the file) leaves the
    kept rows with seqs the log no longer holds, and the ship reads the log instead -- also when
    nothing was appended after the removal (the ship checks the kept seqs are all in the log)."""
    from store.shipping.ship import Bounds

    source, recent = _kept_source(tmp_path / "worker.db")
    with source, open_store(store_url) as target:
        assert source.stage_all([_entry("gone"), _entry("kept")]) is not None
        assert recent.rows(0, 2) is not None
        if remover == "this process":
            source.delete(["gone"])
            assert recent.rows(0, 2) is None
        elif remover == "another process":
            with open_store(str(tmp_path / "worker.db")) as other:
                other.delete(["gone"])
            assert recent.rows(0, 2) is not None  # (the other handle's commits are not seen here)
        else:  # the first event's rows gone, behind the store's back, the second still the last
            with sqlite3.connect(tmp_path / "worker.db") as raw:
                raw.execute("DELETE FROM staged_keys WHERE rollout_id = 'gone'")
                raw.execute("DELETE FROM calls WHERE rollout_id = 'gone'")
                raw.execute("DELETE FROM events WHERE rollout_id = 'gone'")
            raw.close()
        report = source._ship_round(target, Bounds(), None, recent)
        assert report.ok, report.summary()
        assert [info.rollout_id for info in target.staged_keys()] == ["kept"]
        assert_target_reads_like_source(source, target)


def test_rows_of_a_caller_rolled_back_to_its_savepoint_are_not_kept(tmp_path: Path) -> None:
    """A caller of a shared batch that fails is rolled back to its savepoint: its events never
    commit, and none of them is handed on; the other callers' events are."""
    from store.append.new_event import NewEvent
    from store.log.events import EventKind

    handed: list[list[int] | None] = []
    with open_store(str(tmp_path / "worker.db")) as source:
        source._keep_committed(lambda rows: handed.append(None if rows is None else [seq for seq, _ in rows]))
        record = make_record(rollout_id="r1")
        event = source._record_event(record, None, EventKind.CALL_COMPLETED, None, None)
        assert isinstance(event, NewEvent)

        def work(tx: Any) -> None:
            tx.savepoint("op0")
            tx.append(event)
            tx.rollback_to("op0")
            tx.savepoint("op1")
            tx.append(event)
            tx.release("op1")

        source._log.write(work)
        assert handed == [[1]], handed
        assert [key.rollout_id for key in source.staged_keys()] == ["r1"]


def test_two_receipts_of_one_checkpoint_ship_in_one_batch(store_url: str, tmp_path: Path) -> None:
    """Two receipts of one checkpoint (two inventories: one stream) in one batch: the second's
    lookup read ahead with the batch is stale once the first is appended (its stream's version),
    so it is read again; both arrive, in order, and the target replays clean."""
    with open_store(str(tmp_path / "worker.db")) as source, open_store(store_url) as target:
        for digest in ("a" * 64, "b" * 64):
            staged = source.stage_all(
                [], cut_receipt=("checkpoint-1", digest, b'{"receipt": "' + digest.encode() + b'"}')
            )
            assert staged.receipt_recorded is True
        report = source.ship(target)
        assert report.ok and report.appended == 2, report.summary()
        for digest in ("a" * 64, "b" * 64):
            assert target.cut_receipt("checkpoint-1", digest) == source.cut_receipt("checkpoint-1", digest)
        assert target.audit().ok and target.replay().ok
