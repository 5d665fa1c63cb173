"""The durability domain (``open_store(replica=, domain="replicated")``): a cut acknowledges a
``durable_prefix`` only once its records are in the replica, says ``durable_failure`` for what
did not get there within ``replica_wait``, resumes by itself when the replica is back, and a
replacement worker continues the cut from the replica alone.

The worker store runs on every backend of the suite (``store_url``); the replica is a SQLite
file, or a PostgreSQL server of the test's own where the test stops and starts it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import msgspec
import pg_cluster
import pytest
import replica_helpers as rh
from factories import make_record

from store import (
    ConfigurationError,
    InvalidRecordError,
    ReplicaUnavailableError,
    StageEntry,
    StageResult,
    open_store,
)
from store.cli.app import main
from store.log.events import CutReceiptBody

CALLS = range(1, 4)


def replica_path(tmp_path: Path) -> str:
    return str(tmp_path / "replica.db")


# --- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"domain": "remote"}, "domain must be one of"),
        ({"domain": 1}, "domain must be one of"),
        ({"domain": "replicated"}, "needs replica="),
        ({"replica": "x.db"}, 'domain="local"'),
        ({"replica": 5, "domain": "replicated"}, "replica must be the URL or path"),
        ({"replica": "  ", "domain": "replicated"}, "replica must name a store"),
        ({"replica": "x.db", "domain": "replicated", "replicate_terminal": 1}, "replicate_terminal must be"),
        ({"replicate_terminal": True}, "replicate_terminal=True needs"),
        ({"replica": "x.db", "domain": "replicated", "replica_wait": 0}, "replica_wait must be"),
        ({"replica": "x.db", "domain": "replicated", "replica_wait": float("inf")}, "replica_wait must be"),
        ({"replica": "x.db", "domain": "replicated", "replica_wait": True}, "replica_wait must be"),
        ({"replica": "x.db", "domain": "replicated", "replica_wait": 601}, "replica_wait must be"),
        ({"replica_wait": 1.0}, "replica_wait is the bound"),
        ({"replica": "x.db", "domain": "replicated", "read_only": True}, "read_only=True"),
    ],
)
def test_each_bad_durability_option_is_refused_before_anything_is_created(
    tmp_path: Path, options: dict[str, object], names: str
) -> None:
    path = tmp_path / "worker.db"
    with pytest.raises(ConfigurationError, match=names):
        open_store(path, **options)  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == []  # no store, no replica file


def test_a_store_is_not_its_own_replica(tmp_path: Path) -> None:
    path = str(tmp_path / "worker.db")
    with open_store(path, replica=path, domain="replicated", replica_wait=0.5) as store:
        assert store.replicate() is False  # refused (and retried) by the replicator, never shipped
        assert store._replication().last_error is not None
        assert "is this store itself" in store._replication().last_error


def test_the_local_domain_keeps_its_receipts_bytes_and_says_local(store_url: str) -> None:
    body = CutReceiptBody(checkpoint_id="c", inventory_digest="d", receipt=b"{}")
    assert b"domain" not in msgspec.msgpack.encode(body) and b"domain" not in msgspec.json.encode(body)
    with open_store(store_url) as store:
        assert (store.domain, store.replica_url, store.replica_wait, store.replicate_terminal) == (
            "local",
            None,
            None,
            False,
        )
        capture, _, receipt = rh.serve_until_cut(store, CALLS, 4)
        assert {ack.disposition for ack in receipt.prefixes} == {"durable_prefix"}
        assert store.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "local"
        assert store.cut_domain("nothing", "none") is None
        with pytest.raises(ConfigurationError, match="no replica"):
            store.replicate()
        capture.close()


# --- the replicated domain ---------------------------------------------------------------------


def test_a_replicated_cut_is_in_the_replica_and_continues_from_it_alone(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = rh.uninterrupted(open_store(tmp_path / "reference.db"), CALLS)
    replica = replica_path(tmp_path)
    with open_store(store_url, replica=replica, domain="replicated") as worker:
        assert (worker.domain, worker.replica_url, worker.replica_wait) == ("replicated", replica, 5.0)
        capture, live, receipt = rh.serve_until_cut(worker, CALLS, 5)
        assert [ack.disposition for ack in receipt.prefixes] == ["durable_prefix"] * len(CALLS)
        assert worker.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
        # Decoded after the cut: lost with the worker.
        for call, active in live.items():
            rh.decode(capture, active, call, 5, 9)
        capture.close()
    # The worker's host is gone: the replacement opens the replica alone.
    with open_store(replica) as restored:
        assert restored.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
        (kept,) = restored.cut_receipts()
        assert kept == receipt
        assert restored.kept_receipts(checkpoint_id=receipt.checkpoint_id) == [(receipt, "replicated")]
        # What an orchestrator that lost the worker's host reads: every acknowledgement replicated.
        assert main(["receipts", replica, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["domains"] == ["replicated"]
        assert main(["receipts", replica]) == 0
        rows = capsys.readouterr().out.splitlines()[3 : 3 + len(CALLS)]  # after a count, the header and a rule
        assert [row.split()[3:5] for row in rows] == [["durable_prefix", "replicated"]] * len(CALLS)
        for call in CALLS:
            assert rh.continue_from(restored, call) == reference[call]
        assert restored.audit().ok


def test_the_replica_down_gives_durable_failure_and_acknowledgements_resume(
    store_url: str, cluster: pg_cluster.Cluster
) -> None:
    with open_store(
        store_url, replica=cluster.url(connect_timeout="2"), domain="replicated", replica_wait=1.0
    ) as worker:
        capture = rh.capture_on(worker)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call) for call in CALLS}
        for call, active in live.items():
            rh.decode(capture, active, call, 0, 3)
        first = capture.serve_generation_cut(rh.inventory("checkpoint-1", CALLS))
        assert {ack.disposition for ack in first.prefixes} == {"durable_prefix"}

        cluster.stop()
        for call, active in live.items():
            rh.decode(capture, active, call, 3, 6)
        started = time.monotonic()
        second = capture.serve_generation_cut(rh.inventory("checkpoint-2", CALLS))
        assert time.monotonic() - started < 1.0 + 2.5  # the bound, and the local commits
        assert [ack.disposition for ack in second.prefixes] == ["durable_failure"] * len(CALLS)
        # Asked again, the same inventory gets the same answer (the receipt is kept).
        assert capture.serve_generation_cut(rh.inventory("checkpoint-2", CALLS)) == second

        cluster.start()
        for call, active in live.items():
            rh.decode(capture, active, call, 6, 8)
        third = capture.serve_generation_cut(rh.inventory("checkpoint-3", CALLS))
        assert [ack.disposition for ack in third.prefixes] == ["durable_prefix"] * len(CALLS)
        assert [ack.prefix_token_count for ack in third.prefixes] == [8] * len(CALLS)
        capture.close()
    with open_store(cluster.url()) as replica:
        for ack in third.prefixes:
            assert replica.latest_cut("r0", ack.model_call_id) == ack
        assert replica.audit().ok


def test_replicate_terminal_raises_when_the_replica_is_unreachable_and_keeps_the_record(
    store_url: str, cluster: pg_cluster.Cluster
) -> None:
    url = cluster.url(connect_timeout="2")
    with open_store(store_url, replica=url, domain="replicated", replicate_terminal=True, replica_wait=0.5) as worker:
        assert worker.replicate_terminal
        assert worker.replicate(wait=10.0)
        capture = rh.capture_on(worker)
        root = rh.stage_root(capture)  # waited for the replica
        with open_store(cluster.url()) as replica:
            assert replica.fetch([root.staging_key])[0].digest == root.digest  # type: ignore[list-item]
        cluster.stop()
        lone = make_record(rollout_id="r9", model_call_id="c0")
        with pytest.raises(ReplicaUnavailableError, match="did not reach the replica") as raised:
            worker.stage(lone)
        assert raised.value.results == [StageResult(ok=True, staging_key="r9/c0")]
        assert worker.fetch(["r9/c0"])[0].digest == lone.digest  # kept here
        # The capture completes the call all the same: the record is staged (here).
        active = rh.admit(capture, root, 1)
        rh.decode(capture, active, 1, 0, rh.TOTAL)
        coords = capture.complete_observed(active)
        assert coords.disposition == "staged"
        cluster.start()
        assert worker.replicate(wait=10.0)  # the replicator found the replica again by itself
        assert worker.stage(lone).ok  # the identical record again: a no-op that waits for the replica
        capture.close()
    with open_store(cluster.url()) as replica:
        assert coords.staging_key is not None
        fetched = replica.fetch(["r9/c0", coords.staging_key])
        assert [snapshot.digest for snapshot in fetched] == [lone.digest, coords.digest]
        assert replica.audit().ok


def test_replicate_takes_a_bounded_wait(tmp_path: Path) -> None:
    with open_store(tmp_path / "w.db", replica=replica_path(tmp_path), domain="replicated") as worker:
        for bad in (0, -1.0, float("nan"), "1", True):
            with pytest.raises(InvalidRecordError, match="wait"):
                worker.replicate(wait=bad)  # type: ignore[arg-type]
        assert worker.replicate(wait=10.0)


def test_a_replica_whose_resume_point_went_back_is_shipped_from_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The replicator starts each ship at its own watermark without asking; a replica restored to
    an older state (its resume point lower: here a copy taken before the first cut, put back
    with SQLite's backup API) is found in the batch's transaction and caught up."""
    import sqlite3

    def copy(source: str, target: str) -> None:
        reading, writing = sqlite3.connect(source), sqlite3.connect(target)
        try:
            reading.backup(writing)
        finally:
            writing.close()
            reading.close()

    replica = replica_path(tmp_path)
    backup = str(tmp_path / "replica-backup.db")
    with open_store(tmp_path / "w.db", replica=replica, domain="replicated") as worker:
        capture = rh.capture_on(worker)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call) for call in CALLS}
        for call, active in live.items():
            rh.decode(capture, active, call, 0, 3)
        assert worker.replicate(wait=10.0)
        copy(replica, backup)
        first = capture.serve_generation_cut(rh.inventory("checkpoint-1", CALLS))
        assert {ack.disposition for ack in first.prefixes} == {"durable_prefix"}
        copy(backup, replica)
        for call, active in live.items():
            rh.decode(capture, active, call, 3, 6)
        second = capture.serve_generation_cut(rh.inventory("checkpoint-2", CALLS))
        assert {ack.disposition for ack in second.prefixes} == {"durable_prefix"}
        assert "resume point moved" in caplog.text
        capture.close()
    with open_store(replica) as restored:
        assert [restored.latest_cut("r0", ack.model_call_id) for ack in second.prefixes] == list(second.prefixes)
        assert restored.audit().ok


def test_a_forked_child_replicates_on_its_own(tmp_path: Path) -> None:
    replica = replica_path(tmp_path)
    with open_store(tmp_path / "w.db", replica=replica, domain="replicated", replicate_terminal=True) as worker:
        worker.stage(make_record(rollout_id="parent", model_call_id="c0"))
        pid = os.fork()
        if pid == 0:  # the child: its stage waits for the replica through a shipper of its own
            code = 1
            try:
                worker.stage(make_record(rollout_id="child", model_call_id="c0"))
                code = 0 if worker.replicate(wait=10.0) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert worker.replicate(wait=10.0), worker._replication().last_error
    with open_store(replica) as restored:
        assert [snapshot.rollout_id for snapshot in restored.fetch(["parent/c0", "child/c0"])] == ["parent", "child"]


def test_a_replica_down_from_the_start_opens_and_says_so(tmp_path: Path) -> None:
    """Nothing listens on the replica's port: the worker opens all the same, its cuts say
    durable_failure, and a stage_all of terminal records under replicate_terminal raises, kept here."""
    port, reserved = pg_cluster.reserve_port(pg_cluster.PORTS)  # nothing listens there, and no cluster will
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=1"
    options = {"replica": url, "domain": "replicated", "replicate_terminal": True, "replica_wait": 0.3}
    with reserved, open_store(tmp_path / "w.db", **options) as worker:  # type: ignore[arg-type]
        entry = StageEntry(make_record(rollout_id="t0", model_call_id="c0"))
        with pytest.raises(ReplicaUnavailableError) as raised:
            worker.stage_all([entry])
        assert raised.value.results == [StageResult(ok=True, staging_key="t0/c0")]
        assert worker.fetch(["t0/c0"])[0].rollout_id == "t0"  # kept here
        capture, _, receipt = rh.serve_until_cut(worker, CALLS, 2)  # the root's completion: staged here
        assert [ack.disposition for ack in receipt.prefixes] == ["durable_failure"] * len(CALLS)
        assert worker.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
        assert worker.replicate(wait=0.2) is False
        capture.close()


def test_the_replica_keeps_up_with_nobody_waiting(tmp_path: Path) -> None:
    """Between acknowledgements the shipper looks for new events every FOLLOW_INTERVAL."""
    from store.shipping.replica import FOLLOW_INTERVAL

    replica = replica_path(tmp_path)
    with open_store(tmp_path / "w.db", replica=replica, domain="replicated") as worker:
        assert worker.replicate(wait=10.0)
        staged = worker.stage(make_record(rollout_id="quiet", model_call_id="c0"))  # waits for nothing
        deadline = time.monotonic() + 10 * FOLLOW_INTERVAL + 5.0
        found = False
        with open_store(replica, read_only=True) as reader:
            while not found and time.monotonic() < deadline:
                found = any(info.staging_key == staged.staging_key for info in reader.staged_keys())
                time.sleep(0.05)
        assert found, "the record did not reach the replica by itself"


def test_a_cut_reads_its_keys_seqs_once_its_chunks_are_in_the_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replicated cut waits for the ship of the chunks it just committed (their last seq is at or
    above every key's) before it reads the seqs of the keys its acknowledgements name: that read
    never runs beside the shipping thread's reading and verifying.  Only the keys of earlier
    chunks are read: a first cut reads none, the next one its calls' first chunks."""
    from store.shipping import replica as replication

    seen: list[tuple[int, int, int]] = []  # (keys read, the replica's watermark then, the highest seq)
    original = replication.key_seqs

    def recording(reader: object, keys: list[str]) -> dict[str, int]:
        found = original(reader, keys)  # type: ignore[arg-type]
        seen.append((len(keys), worker._replicator.through, max(found.values())))  # type: ignore[union-attr]
        return found

    with open_store(tmp_path / "w.db", replica=replica_path(tmp_path), domain="replicated") as worker:
        monkeypatch.setattr(replication, "key_seqs", recording)
        capture, live, first = rh.serve_until_cut(worker, CALLS, 5)
        assert [ack.disposition for ack in first.prefixes] == ["durable_prefix"] * len(CALLS)
        assert seen == []
        for call, active in live.items():
            rh.decode(capture, active, call, 5, 7)
        second = capture.serve_generation_cut(rh.inventory("checkpoint-2", CALLS))
        assert [ack.disposition for ack in second.prefixes] == ["durable_prefix"] * len(CALLS)
        assert [len(ack.staging_keys) for ack in second.prefixes] == [2] * len(CALLS)
        capture.close()
    assert len(seen) == 1 and seen[0][0] == len(CALLS) and seen[0][1] >= seen[0][2], seen


def test_a_replicated_cut_ships_its_events_without_reading_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cut's chunks and its receipt ship as this process wrote them (the write path hands
    each commit's events to the replicator), verified, not read back from the log; the replica
    alone still continues every call."""
    from store.shipping import replica as replication
    from store.shipping import source as shipping_source

    monkeypatch.setattr(replication, "FOLLOW_INTERVAL", 60.0)  # no ship but the ones the cut asks for
    reads: list[tuple[int, int]] = []
    read = shipping_source._read

    def recording(source: object, after: int, upto: int, size: int) -> object:
        reads.append((after, upto))
        return read(source, after, upto, size)  # type: ignore[arg-type]

    reference = rh.uninterrupted(open_store(tmp_path / "reference.db"), CALLS)
    replica = replica_path(tmp_path)
    with open_store(tmp_path / "w.db", replica=replica, domain="replicated") as worker:
        capture = rh.capture_on(worker)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call) for call in CALLS}
        for call, active in live.items():
            rh.decode(capture, active, call, 0, 5)
        assert worker.replicate(wait=10.0)
        monkeypatch.setattr(shipping_source, "_read", recording)
        receipt = capture.serve_generation_cut(rh.inventory("checkpoint-1", CALLS))
        monkeypatch.setattr(shipping_source, "_read", read)
        assert [ack.disposition for ack in receipt.prefixes] == ["durable_prefix"] * len(CALLS)
        assert reads == [], reads
        capture.close()
    with open_store(replica) as restored:
        assert restored.cut_receipts() == [receipt]
        for call in CALLS:
            assert rh.continue_from(restored, call) == reference[call]
        assert restored.audit().ok


def test_the_replicas_writer_keeps_its_connection_between_ships(store_url: str, tmp_path: Path) -> None:
    """The replica store is only written by the shipping thread once its id is read: its writer
    keeps the connection between ships (no pool checkout and return around each) and the
    acknowledgements hold as before."""
    with open_store(tmp_path / "w.db", replica=store_url, domain="replicated") as worker:
        assert worker.replicate(wait=10.0)
        replica = worker._replicator.replica  # type: ignore[union-attr]
        assert replica is not None
        held = replica._log._connection
        assert held is not None
        capture, _, receipt = rh.serve_until_cut(worker, CALLS, 5)
        assert [ack.disposition for ack in receipt.prefixes] == ["durable_prefix"] * len(CALLS)
        assert worker.replicate(wait=10.0)
        assert replica._log._connection is held
        capture.close()
    with open_store(store_url) as restored:
        assert restored.cut_receipts() == [receipt]


def test_a_replicated_cut_looks_for_its_receipt_in_its_chunks_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replicated cut reads no receipt before it plans (its chunks' transaction looks for one
    of the inventory, as the local domain's one transaction does); an inventory served before
    gets its stored receipt, nothing is written, and the calls' buffers go back as they were:
    decoding goes on and the next cut acknowledges every token."""
    from store.store import Store

    reads: list[str] = []
    original = Store.cut_receipt

    def recording(self: Store, checkpoint_id: str, inventory_digest: str) -> bytes | None:
        reads.append(checkpoint_id)
        return original(self, checkpoint_id, inventory_digest)

    with open_store(tmp_path / "w.db", replica=replica_path(tmp_path), domain="replicated") as worker:
        capture = rh.capture_on(worker)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call) for call in CALLS}
        for call, active in live.items():
            rh.decode(capture, active, call, 0, 5)
        monkeypatch.setattr(Store, "cut_receipt", recording)
        first = capture.serve_generation_cut(rh.inventory("checkpoint-1", CALLS))
        assert reads == []
        assert [ack.disposition for ack in first.prefixes] == ["durable_prefix"] * len(CALLS)
        for call, active in live.items():
            rh.decode(capture, active, call, 5, 7)
        with worker._engine.connect() as connection:
            before = connection.exec_driver_sql("SELECT count(*) FROM events").scalar()
        again = capture.serve_generation_cut(rh.inventory("checkpoint-1", CALLS))
        assert again == first and reads == ["checkpoint-1"]
        with worker._engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT count(*) FROM events").scalar() == before
        second = capture.serve_generation_cut(rh.inventory("checkpoint-2", CALLS))
        assert [ack.prefix_token_count for ack in second.prefixes] == [7] * len(CALLS)
        capture.close()
