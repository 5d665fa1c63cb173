"""Acknowledged means true in the replicated domain (issue 33, items 1-4): no acknowledgement
(a cut's ``durable_prefix``, ``replicate()``'s True, a ``stage_all`` receipt's ``replicated``)
for anything the replica lacks, whatever happened to either side:

1. a worker store whose log is behind its replica (power loss, a backup restored, two stores
   with one id) is refused: its cuts say ``durable_failure``, ``replicate()`` False;
2. a cut with nothing new to ship asks the replica (restored from a backup) before it answers;
3. a cut whose receipt does not reach the replica answers no ``durable_prefix``;
4. ``stage_all(..., cut_receipt=...)`` records a ``replicated`` receipt only once its records are
   in the replica, and returns only once the receipt is.

The worker store runs on every backend of the suite (``store_url``) where the test restores no
worker file; the replica is a SQLite file the test copies and restores with SQLite's backup API.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import replica_helpers as rh
from factories import make_record

from store import (
    GenerationCutError,
    ReplicaUnavailableError,
    ServerUnavailableError,
    StageEntry,
    Store,
    open_store,
)

CALLS = range(1, 3)


def cut_off(store: Store, when: Callable[[], bool] = lambda: False) -> threading.Event:
    """An event that, while set, makes the store's replica unreachable (its ship raises, as a
    dead link would) without restarting anything; ``when()`` True does the same."""
    down = threading.Event()
    replicator = store._replication()
    real = replicator._ship

    def ship(replica: Store, bounds: Any, start: int | None, recent: Any, confirm: bool) -> Any:
        if down.is_set() or when():
            raise ServerUnavailableError("the replica is unreachable (the test cut the link)")
        return real(replica, bounds, start, recent, confirm)

    replicator._ship = ship  # type: ignore[method-assign]
    return down


def copy_sqlite(source: str, target: str) -> None:
    """A consistent copy of a live SQLite store (its backup API), or a restore into a live one."""
    reading, writing = sqlite3.connect(source), sqlite3.connect(target)
    try:
        reading.backup(writing)
    finally:  # closed: the copy's own WAL (if any) is checkpointed into its file
        writing.close()
        reading.close()


def restore_file(snapshot: str, path: str) -> None:
    """Put a closed store's file back as ``snapshot`` holds it (a restore, or the disk after a power
    loss that lost the commits since the snapshot)."""
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    shutil.copyfile(snapshot, path)


def replica_keys(replica: str) -> set[str]:
    with open_store(replica, read_only=True) as reader:
        return {info.staging_key for info in reader.staged_keys()}


@contextmanager
def replicated(path: str | Path, replica: str, wait: float = 1.0) -> Iterator[Store]:
    with open_store(path, replica=replica, domain="replicated", replica_wait=wait) as store:
        yield store


# --- 1. a log behind its replica -------------------------------------------------------------


def test_a_worker_restored_from_a_backup_is_refused_not_acknowledged(tmp_path: Path) -> None:
    """The worker's file is restored from a copy taken before events the replica holds: its new
    events would reuse their seqs (the replica's resume point skips them), so nothing it stages
    is acknowledged ``replicated`` and the replica never gets a second history."""
    worker, replica = str(tmp_path / "w.db"), str(tmp_path / "replica.db")
    snapshot = str(tmp_path / "w-backup.db")
    with replicated(worker, replica) as store:
        store.stage(make_record(rollout_id="before", model_call_id="c0"))
        assert store.replicate(wait=10.0)
        copy_sqlite(worker, snapshot)
        for n in range(3):
            store.stage(make_record(rollout_id="lost", model_call_id=f"c{n}"))
        assert store.replicate(wait=10.0)
    restore_file(snapshot, worker)
    with replicated(worker, replica, wait=0.5) as store:
        capture, _, receipt = rh.serve_until_cut(store, CALLS, 3)
        assert [ack.disposition for ack in receipt.prefixes] == ["durable_failure"] * len(CALLS)
        assert store.replicate(wait=0.5) is False
        error = store._replication().last_error
        # Behind (found as it opened) or another event at the replica's resume point (found
        # once the new events passed it): either way refused.
        assert error is not None and ("is behind" in error or "differ" in error), error
        capture.close()
    # The replica kept what it was sent (the lost events too) and got nothing of the second history.
    keys = replica_keys(replica)
    assert {"before/c0", "lost/c0", "lost/c1", "lost/c2"} <= keys
    assert not any(key.startswith("r0/") for key in keys), keys


def test_a_power_loss_that_lost_shipped_commits_is_found_at_reopen(tmp_path: Path) -> None:
    """Admissions commit without waiting for the disk (``durability="full"`` too) and ship within
    the follow interval: a power loss can leave the worker's file without events the replica has.
    Modelled by the file as it was before those commits (copied then), reopened after the replica
    received them; the new events at the same seqs differ from the replica's."""
    worker, replica = str(tmp_path / "w.db"), str(tmp_path / "replica.db")
    on_disk = str(tmp_path / "w-on-disk.db")
    with replicated(worker, replica) as store:
        capture = rh.capture_on(store)
        root = rh.stage_root(capture)
        assert store.replicate(wait=10.0)
        copy_sqlite(worker, on_disk)  # what the disk held when the power went
        active = rh.admit(capture, root, 1)  # an admission: committed without a sync
        rh.decode(capture, active, 1, 0, 4)
        receipt = capture.serve_generation_cut(rh.inventory("checkpoint-1", [1]))
        assert receipt.prefixes[0].disposition == "durable_prefix"  # true: it is in the replica
        capture.close()
    restore_file(on_disk, worker)
    with replicated(worker, replica, wait=0.5) as store:
        capture = rh.capture_on(store)
        # The rebooted worker stages more than it lost: the same seqs, other events.
        for n in range(8):
            store.stage(make_record(rollout_id="after", model_call_id=f"c{n}"))
        assert store.replicate(wait=0.5) is False
        error = store._replication().last_error
        assert error is not None and ("is behind" in error or "differ" in error), error
        capture.close()
    assert not any(key.startswith("after/") for key in replica_keys(replica))


def test_two_hosts_from_one_template_file_do_not_share_acknowledgements(tmp_path: Path) -> None:
    """Two worker files copied from one template hold one store id: the second to ship finds the
    replica's resume point for that id on events of the other, and is refused."""
    template, replica = str(tmp_path / "template.db"), str(tmp_path / "replica.db")
    open_store(template).close()
    host_a, host_b = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    shutil.copyfile(template, host_a)
    shutil.copyfile(template, host_b)
    with replicated(host_a, replica) as a:
        for n in range(3):
            a.stage(make_record(rollout_id="a", model_call_id=f"c{n}"))
        assert a.replicate(wait=10.0)
        with replicated(host_b, replica, wait=0.5) as b:
            assert b.store_id == a.store_id
            for n in range(5):
                b.stage(make_record(rollout_id="b", model_call_id=f"c{n}"))
            assert b.replicate(wait=0.5) is False
            # A keeps acknowledging its own events.
            a.stage(make_record(rollout_id="a", model_call_id="c9"))
            assert a.replicate(wait=10.0)
    keys = replica_keys(replica)
    assert {"a/c0", "a/c1", "a/c2", "a/c9"} <= keys
    assert not any(key.startswith("b/") for key in keys), keys


def test_a_worker_overtaken_by_another_store_with_its_id_is_refused(tmp_path: Path) -> None:
    """Both copies of one template file ship: the one whose batch finds the replica's resume point
    moved past its own, at an event that is not its own, is refused in that batch's transaction;
    the other goes on."""
    template, replica = str(tmp_path / "template.db"), str(tmp_path / "replica.db")
    with open_store(template) as store:
        store.stage(make_record(rollout_id="template", model_call_id="c0"))
    host_a, host_b = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    shutil.copyfile(template, host_a)
    shutil.copyfile(template, host_b)
    with replicated(host_a, replica, wait=0.5) as a, replicated(host_b, replica) as b:
        assert a.replicate(wait=10.0) and b.replicate(wait=10.0)  # one history so far: both ship
        for n in range(3):
            b.stage(make_record(rollout_id="b", model_call_id=f"c{n}"))
        assert b.replicate(wait=10.0)
        a.stage(make_record(rollout_id="a", model_call_id="c0"))
        assert a.replicate(wait=0.5) is False
        error = a._replication().last_error
        assert error is not None and ("not this store's" in error or "differ" in error), error
        b.stage(make_record(rollout_id="b", model_call_id="c9"))
        assert b.replicate(wait=10.0)
    keys = replica_keys(replica)
    assert {"template/c0", "b/c0", "b/c1", "b/c2", "b/c9"} <= keys
    assert "a/c0" not in keys


def test_a_manual_ship_of_a_diverged_log_stops_with_a_problem(tmp_path: Path) -> None:
    """``Store.ship`` into a target that holds a different history of this store id reports it
    (``diverged``) and writes nothing."""
    template = str(tmp_path / "template.db")
    open_store(template).close()
    for name in ("a.db", "b.db"):
        shutil.copyfile(template, tmp_path / name)
    with open_store(tmp_path / "a.db") as a, open_store(tmp_path / "b.db") as b, open_store(tmp_path / "t.db") as t:
        for n in range(2):
            a.stage(make_record(rollout_id="a", model_call_id=f"c{n}"))
        for n in range(4):
            b.stage(make_record(rollout_id="b", model_call_id=f"c{n}"))
        assert a.ship(t).ok
        report = b.ship(t)
        assert not report.ok and report.appended == 0
        (problem,) = report.problems
        assert problem.code == "diverged" and "differ" in problem.reason, problem
        # Behind: a store whose log ends before the target's resume point for its id.
        for n in range(4):
            a.stage(make_record(rollout_id="a", model_call_id=f"d{n}"))
        assert a.ship(t).ok
        behind = b.ship(t)
        assert not behind.ok and behind.problems[0].code == "diverged"
        assert "behind" in behind.problems[0].reason
        assert not any(info.staging_key.startswith("b/") for info in t.staged_keys())


# --- 2. nothing new to ship ------------------------------------------------------------------


def test_a_cut_with_nothing_new_asks_the_replica_restored_from_a_backup(tmp_path: Path) -> None:
    """The replica is restored from a copy taken before the first cut; the next cut has no new
    token to ship: it must not acknowledge the first cut's chunks from the shipper's memory."""
    worker, replica = str(tmp_path / "w.db"), str(tmp_path / "replica.db")
    backup = str(tmp_path / "replica-backup.db")
    with replicated(worker, replica, wait=0.5) as store:
        down = cut_off(store)
        capture = rh.capture_on(store)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call) for call in CALLS}
        for call, active in live.items():
            rh.decode(capture, active, call, 0, 4)
        assert store.replicate(wait=10.0)
        copy_sqlite(replica, backup)
        first = capture.serve_generation_cut(rh.inventory("checkpoint-1", CALLS))
        assert {ack.disposition for ack in first.prefixes} == {"durable_prefix"}
        copy_sqlite(backup, replica)  # the replica restored: the first cut's chunks are gone
        down.set()  # and it does not answer for now
        assert store.replicate(wait=0.3) is False
        second = capture.serve_generation_cut(rh.inventory("checkpoint-2", CALLS))
        assert [ack.disposition for ack in second.prefixes] == ["durable_failure"] * len(CALLS)
        down.clear()
        # Answering again (found after the shipper's back-off), it is caught up from its own
        # resume point, and acknowledgements resume.
        assert store.replicate(wait=10.0)
        third = capture.serve_generation_cut(rh.inventory("checkpoint-3", CALLS))
        assert {ack.disposition for ack in third.prefixes} == {"durable_prefix"}, store._replication().last_error
        keys = replica_keys(replica)
        assert all(key in keys for ack in third.prefixes for key in ack.staging_keys)
        capture.close()


def test_replicate_asks_a_replica_that_went_back_to_a_lagging_standby(tmp_path: Path) -> None:
    """``replicate()`` with everything shipped asks the replica: one that failed over to a standby
    that lags (here: the same path restored from an older copy) is not taken at its word."""
    worker, replica = str(tmp_path / "w.db"), str(tmp_path / "replica.db")
    standby = str(tmp_path / "standby.db")
    with replicated(worker, replica, wait=0.5) as store:
        store.stage(make_record(rollout_id="old", model_call_id="c0"))
        assert store.replicate(wait=10.0)
        copy_sqlite(replica, standby)  # the standby stops here
        store.stage(make_record(rollout_id="new", model_call_id="c0"))
        assert store.replicate(wait=10.0)
        down = cut_off(store)
        copy_sqlite(standby, replica)
        down.set()
        assert store.replicate(wait=0.3) is False
        down.clear()
        assert store.replicate(wait=10.0)
        assert "new/c0" in replica_keys(replica)


# --- 3. the receipt never reaches the replica -------------------------------------------------


def test_a_cut_whose_receipt_does_not_reach_the_replica_promises_nothing(tmp_path: Path) -> None:
    """The link dies once the cut's records are in the replica, before its receipt ships: the
    cut is refused (Gym makes ``durable_failure`` of every call of a refused cut), and asked
    again once the link is back it answers the kept receipt, now in the replica."""
    worker, replica = str(tmp_path / "w.db"), str(tmp_path / "replica.db")
    cut = rh.inventory("checkpoint-1", CALLS)
    identity = (cut.checkpoint_id, cut.inventory_digest)
    dies = threading.Event()
    with replicated(worker, replica, wait=0.5) as store:
        # The link dies as the first ship holding the receipt starts: the records shipped before.
        down = cut_off(store, lambda: dies.is_set() and store.cut_receipt(*identity) is not None)
        capture = rh.capture_on(store)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call) for call in CALLS}
        for call, active in live.items():
            rh.decode(capture, active, call, 0, 5)
        dies.set()
        with pytest.raises(GenerationCutError, match="receipt did not reach the replica"):
            capture.serve_generation_cut(cut)
        with open_store(replica, read_only=True) as reader:
            assert reader.cut_receipts() == []
            assert all(reader.latest_cut("r0", rh.model_call_id(call)) is None for call in CALLS)
        # Asked again while the link is down: still refused, the kept receipt is not answered.
        with pytest.raises(GenerationCutError, match="did not reach the replica"):
            capture.serve_generation_cut(cut)
        dies.clear()
        down.clear()
        assert store.replicate(wait=10.0)  # found again after the shipper's back-off
        receipt = capture.serve_generation_cut(cut)
        assert {ack.disposition for ack in receipt.prefixes} == {"durable_prefix"}
        with open_store(replica, read_only=True) as reader:
            assert reader.cut_receipts() == [receipt]
            assert [reader.latest_cut("r0", ack.model_call_id) for ack in receipt.prefixes] == list(receipt.prefixes)
        capture.close()


# --- 4. stage_all with a cut receipt -----------------------------------------------------------


def test_stage_all_with_a_receipt_waits_for_the_replica(store_url: str, tmp_path: Path) -> None:
    """On a replicated store ``stage_all(..., cut_receipt=...)`` records a ``replicated`` receipt
    only once its records are in the replica and returns once the receipt is; with the replica
    unreachable it raises ``ReplicaUnavailableError``, the records kept here and no receipt."""
    replica = str(tmp_path / "replica.db")
    record = make_record(rollout_id="s0", model_call_id="c0")
    receipt = (b'{"cut": 1}', ("checkpoint-s", "digest-s"))
    with open_store(store_url, replica=replica, domain="replicated", replica_wait=0.5) as store:
        down = cut_off(store)
        assert store.replicate(wait=10.0)
        down.set()
        with pytest.raises(ReplicaUnavailableError, match="did not reach the replica") as raised:
            store.stage_all([StageEntry(record)], cut_receipt=(*receipt[1], receipt[0]), acknowledged=["s0/c0"])
        assert [result.staging_key for result in raised.value.results] == ["s0/c0"]
        assert store.fetch(["s0/c0"])[0].digest == record.digest  # kept here
        assert store.cut_domain(*receipt[1]) is None  # no receipt claims the replica
        down.clear()
        results = store.stage_all([StageEntry(record)], cut_receipt=(*receipt[1], receipt[0]), acknowledged=["s0/c0"])
        assert results.receipt_recorded is True
        assert store.cut_domain(*receipt[1]) == "replicated"
        with open_store(replica, read_only=True) as reader:
            assert reader.cut_receipt(*receipt[1]) == receipt[0]  # in the replica when it returned
            assert reader.cut_domain(*receipt[1]) == "replicated"
            assert reader.fetch(["s0/c0"])[0].digest == record.digest
        # The same receipt again: it stands, nothing written.
        again = store.stage_all([StageEntry(record)], cut_receipt=(*receipt[1], receipt[0]), acknowledged=["s0/c0"])
        assert again.receipt_recorded is False
