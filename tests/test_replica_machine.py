"""Random sequences of worker operations on a store of the replicated durability domain (issue 25),
the state machine's friend for ``open_store(replica=, domain="replicated", replicate_terminal=,
replica_wait=)``.

A hypothesis ``RuleBasedStateMachine`` drives a worker store (SQLite) whose replica is another
SQLite store: admissions, decoding, cuts, completions, the replica made unreachable and
reachable again (its ship path refuses while it is "down", as a dead network would), and a
restore on another host: a replacement worker on a copy of the replica alone continues a cut
call with ``continue_latest_cut`` (``begin_call`` validates the prefix).  And what befalls either
side (issue 33): a power loss (the worker reopened from a copy of its file taken before its
last unsynced commits: admissions, which the shipper may have sent already), a backup of the
worker restored, the replica rolled back (a copy of it put back: a restore, a lagging standby),
the link dying between a cut's records and its receipt, and the documented remedy for a worker
whose log is behind its replica (a fresh store, after which it acknowledges again).
``replicate_terminal`` is drawn per run.  After every step:

* no receipt says ``durable_prefix`` for a prefix the replica lacks: at the moment a cut returns,
  every key it acknowledges fetches from the replica as the model's tokens, the receipt is in the
  replica, and ``latest_cut`` there is the acknowledgement (what a replacement continues);
* a worker whose log is behind the replica's resume point for its id, or holds other events
  there (the model reads both files), acknowledges nothing: its cuts say ``durable_failure``,
  ``replicate()`` is False;
* while the replica is down, no acknowledgement names a key staged during the outage;
* once the replica is reachable again (``Store.replicate`` waits; nothing is restarted), a cut
  acknowledges every call with tokens as ``durable_prefix``: acknowledgements resume by themselves
  (for a worker whose log is the replica's);
* a completion under ``replicate_terminal`` is staged either way, and in the replica once
  the replica answers;
* every kept receipt's domain is ``replicated``; the worker's and the replica's audits are clean.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
import threading
from typing import Any

import replica_helpers as rh
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from profiles import examples

from store import (
    ActiveCall,
    CommitCoords,
    GenerationCutError,
    GenerationCutReceipt,
    RolloutTokenCapture,
    ServerUnavailableError,
    Store,
    open_store,
)

WAIT = 0.5  # replica_wait: short, so a run of many cuts with the replica down stays fast
MAX_CALLS = 4  # live at once
MAX_RESTARTS = 2  # power losses, restores and fresh stores a run: the other rules get their share


class ReplicaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.mkdtemp(prefix="store-replica-machine-")
        self.replica_path = os.path.join(self.folder, "replica.db")
        self.down = threading.Event()
        self.store: Store | None = None
        self.capture: RolloutTokenCapture | None = None
        self.root: CommitCoords | None = None
        self.live: dict[int, ActiveCall] = {}
        self.decoded: dict[int, int] = {}
        self.completed: dict[int, CommitCoords] = {}
        self.next_call = 1
        self.cuts = 0
        self.staged_while_down: set[str] = set()
        self.receipts: list[GenerationCutReceipt] = []
        self.restorable: set[int] = set()  # live calls the replica's receipts acknowledge a prefix of
        self.replicate_terminal = False
        self.worker_path = os.path.join(self.folder, "worker.db")
        self.rollout = "r0"  # a new one after each restart (the calls before it died with the process)
        self.restarts = 0
        # The worker's file as the disk held it before the unsynced commits since (admissions):
        # a power loss puts it back.  None once a durable commit came after it.
        self.disk: str | None = None
        self.worker_backup: str | None = None
        self.replica_backup: str | None = None
        self.receipt_kills_link: tuple[str, str] | None = None  # the link dies as this receipt ships

    @initialize(replicate_terminal=st.booleans())
    def open(self, replicate_terminal: bool) -> None:
        self.replicate_terminal = replicate_terminal
        self._open_worker()
        assert self.store is not None
        assert self.store.replicate(wait=10.0)
        self._start_rollout()

    def _open_worker(self) -> None:
        self.store = open_store(
            self.worker_path,
            replica=self.replica_path,
            domain="replicated",
            replicate_terminal=self.replicate_terminal,
            replica_wait=WAIT,
        )
        store = self.store
        replicator = store._replication()
        real = replicator._ship

        def ship(replica: Store, bounds: Any, start: int | None, recent: Any, confirm: bool) -> Any:
            kills = self.receipt_kills_link
            if kills is not None and store.cut_receipt(*kills) is not None:
                self.down.set()  # the link dies as the receipt is about to ship
            if self.down.is_set():
                raise ServerUnavailableError("the replica is unreachable (the machine cut it off)")
            return real(replica, bounds, start, recent, confirm)

        replicator._ship = ship  # type: ignore[method-assign]

    def _start_rollout(self) -> None:
        assert self.store is not None
        self.capture = rh.capture_on(self.store)
        self.root = rh.stage_root(self.capture, self.rollout)

    def teardown(self) -> None:
        try:
            if self.capture is not None:
                self.capture.close()
            if self.store is not None:
                self.down.clear()
                self.store.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    # --- rules ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < MAX_CALLS)
    @rule()
    def admit(self) -> None:
        assert self.capture is not None and self.root is not None
        call = self.next_call
        self.next_call += 1
        if self.disk is None:
            # Everything committed so far is on the disk (the last commit before it was durable);
            # the admission is not, until a durable commit follows.
            self.disk = self._copy(self.worker_path, "disk")
        self.live[call] = rh.admit(self.capture, self.root, call)
        self.decoded[call] = 0

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 3))
    def decode(self, data: st.DataObject, count: int) -> None:
        assert self.capture is not None
        call = data.draw(st.sampled_from(sorted(self.live)))
        upto = min(rh.TOTAL, self.decoded[call] + count)
        rh.decode(self.capture, self.live[call], call, self.decoded[call], upto)
        self.decoded[call] = upto

    @precondition(lambda self: self.live)
    @rule()
    def cut(self) -> None:
        assert self.capture is not None and self.store is not None
        self.cuts += 1
        self.disk = None  # its chunks and receipt commit durably
        calls = sorted(self.live)
        before = self._live_keys()
        # Reachable: the shipper has caught up (it finds the replica by itself; this only waits).
        caught_up = not self.down.is_set() and self.store.replicate(wait=5.0)
        diverged = self._diverged()
        try:
            receipt = self.capture.serve_generation_cut(rh.inventory(f"checkpoint-{self.cuts}", calls, self.rollout))
        except GenerationCutError as exc:
            # Its records reached the replica and its receipt did not within the wait: nothing
            # acknowledged (Gym makes durable_failure of each call of a refused cut).
            assert exc.code == "replica_unavailable", exc
            event("a cut refused: its receipt did not reach the replica in time")
            return
        if self.down.is_set():
            event("a cut with the replica down")
            self.staged_while_down |= self._live_keys() - before
        self.receipts.append(receipt)
        assert self.store.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
        assert self.store.kept_receipts(checkpoint_id=receipt.checkpoint_id) == [(receipt, "replicated")]
        if diverged:
            event("a cut by a worker whose log is behind its replica")
            assert {ack.disposition for ack in receipt.prefixes} == {"durable_failure"}, receipt
        self._check_acknowledged(receipt, calls)
        if caught_up:
            # Acknowledgements resumed by themselves: every call with tokens is durable.
            with_tokens = [ack for ack, call in zip(receipt.prefixes, calls, strict=True) if self.decoded[call]]
            assert all(ack.disposition == "durable_prefix" for ack in with_tokens), receipt

    @precondition(lambda self: self.live and not self.down.is_set())
    @rule()
    def cut_while_the_link_dies(self) -> None:
        """The link dies once the cut's records shipped, as its receipt is about to: no
        ``durable_prefix`` is answered (the receipt is not in the replica)."""
        assert self.capture is not None and self.store is not None
        self.cuts += 1
        self.disk = None
        calls = sorted(self.live)
        cut = rh.inventory(f"checkpoint-{self.cuts}", calls, self.rollout)
        self.receipt_kills_link = (cut.checkpoint_id, cut.inventory_digest)
        try:
            receipt = self.capture.serve_generation_cut(cut)
        except GenerationCutError as exc:
            assert exc.code == "replica_unavailable", exc
            event("a cut refused: the link died before its receipt shipped")
        else:
            assert {ack.disposition for ack in receipt.prefixes} <= {"durable_failure"}, receipt
        finally:
            self.receipt_kills_link = None
        with open_store(self.replica_path, read_only=True) as replica:
            assert replica.cut_receipt(cut.checkpoint_id, cut.inventory_digest) is None
        self.down.set()  # the link stays down until replica_reachable

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        assert self.capture is not None and self.store is not None
        call = data.draw(st.sampled_from(sorted(self.live)))
        active = self.live.pop(call)
        self.disk = None  # the terminal record commits durably
        rh.decode(self.capture, active, call, self.decoded[call], rh.TOTAL)
        self.decoded[call] = rh.TOTAL
        coords = self.capture.complete_observed(active)
        assert coords.disposition == "staged", coords  # also when the replica is down
        self.completed[call] = coords
        assert coords.staging_key is not None
        assert self.store.fetch([coords.staging_key])[0].digest == coords.digest
        if self.store.replicate_terminal and not self.down.is_set() and not self._diverged():
            with open_store(self.replica_path, read_only=True) as replica:
                assert replica.fetch([coords.staging_key])[0].digest == coords.digest

    @rule(wait=st.sampled_from([0.001, 0.5]))
    def replicate(self, wait: float) -> None:
        """``Store.replicate``: True only when everything committed is in the replica."""
        assert self.store is not None
        there = self.store.replicate(wait=wait)
        if self.down.is_set():
            assert there is False or not self.staged_while_down
        if self._diverged():
            assert there is False
        if there:
            with open_store(self.replica_path, read_only=True) as replica:
                keys = sorted(self._live_keys())
                assert len(replica.fetch(keys)) == len(keys)

    @precondition(lambda self: not self.down.is_set())
    @rule()
    def replica_unreachable(self) -> None:
        self.down.set()

    @precondition(lambda self: self.down.is_set())
    @rule()
    def replica_reachable(self) -> None:
        assert self.store is not None
        self.down.clear()
        self.staged_while_down.clear()
        if self._diverged():
            assert self.store.replicate(wait=0.5) is False
        else:
            assert self.store.replicate(wait=10.0), "the replicator did not find the replica again by itself"

    @precondition(lambda self: self.restorable & set(self.live))
    @rule(data=st.data())
    def restore_on_another_host(self, data: st.DataObject) -> None:
        """A replacement worker on a copy of the replica alone continues a cut call."""
        call = data.draw(st.sampled_from(sorted(self.restorable & set(self.live))))
        event("a restore on another host")
        copy = os.path.join(self.folder, f"host-b-{self.cuts}-{call}.db")
        with sqlite3.connect(self.replica_path) as source, sqlite3.connect(copy) as target:
            source.backup(target)
        with open_store(copy) as alone:
            final = rh.continue_from(alone, call, self.rollout)
            (reference,) = rh.uninterrupted(open_store(copy + ".ref"), [call], self.rollout).values()
            assert final == reference
        for path in (copy, copy + ".ref"):
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.remove(path + suffix)

    @precondition(lambda self: self.disk is not None and self.restarts < MAX_RESTARTS)
    @rule(shipped_first=st.booleans())
    def power_loss(self, shipped_first: bool) -> None:
        """The host loses power: the worker's file comes back as the disk held it, without the
        admissions committed since its last durable commit (which the shipper may have sent)."""
        assert self.store is not None and self.disk is not None
        if shipped_first and not self.down.is_set():
            self.store.replicate(wait=5.0)
        event("a power loss")
        self._restart_from(self.disk)

    @rule(which=st.sampled_from(["worker", "replica", "both"]))
    def back_up(self, which: str) -> None:
        if which != "replica":
            self.worker_backup = self._copy(self.worker_path, "worker-backup")
        if which != "worker":
            self.replica_backup = self._copy(self.replica_path, "replica-backup")

    @precondition(lambda self: self.worker_backup is not None and self.restarts < MAX_RESTARTS)
    @rule()
    def restore_the_worker_from_its_backup(self) -> None:
        assert self.worker_backup is not None
        event("the worker restored from a backup")
        self._restart_from(self.worker_backup)

    @precondition(lambda self: self.replica_backup is not None)
    @rule()
    def roll_the_replica_back(self) -> None:
        """The replica restored from its backup (or failed over to a standby that lags): it holds
        less than the worker was told; acknowledgements ask it again, it is shipped again."""
        assert self.replica_backup is not None
        event("the replica rolled back")
        _backup(self.replica_backup, self.replica_path)
        with open_store(self.replica_path, read_only=True) as replica:
            self.restorable = {
                call for call in self.restorable if replica.latest_cut(self.rollout, rh.model_call_id(call)) is not None
            }

    # The model's own state only (a precondition must not race the shipper): after a restart.
    @precondition(lambda self: 0 < self.restarts <= MAX_RESTARTS)
    @rule()
    def a_fresh_store(self) -> None:
        """The documented remedy for a worker whose log is behind its replica: a fresh store (a new
        id) on its host; it acknowledges again."""
        event("a fresh store for a worker behind its replica" if self._diverged() else "a fresh store")
        self._restart_from(None, os.path.join(self.folder, f"worker-{self.restarts + 1}.db"))
        assert self.store is not None
        if not self.down.is_set():
            assert self.store.replicate(wait=10.0), self.store._replication().last_error

    # --- invariants -------------------------------------------------------------------------

    @invariant()
    def audits_are_clean(self) -> None:
        if self.store is None or self.cuts % 4:
            return
        assert self.store.audit().ok
        with open_store(self.replica_path, read_only=True) as replica:
            report = replica.audit()
            assert report.ok, report.summary()

    # --- helpers ----------------------------------------------------------------------------

    def _check_acknowledged(self, receipt: GenerationCutReceipt, calls: list[int]) -> None:
        """Every durable_prefix the receipt says is in the replica: the tokens, the receipt, and
        the acknowledgement as the call's latest cut there."""
        with open_store(self.replica_path, read_only=True) as replica:
            promised = False
            for ack, call in zip(receipt.prefixes, calls, strict=True):
                if ack.disposition != "durable_prefix":
                    continue
                promised = True
                assert not set(ack.staging_keys) & self.staged_while_down, ack
                # The acknowledged prefix is in the replica now, as the model's tokens.
                snapshots = replica.fetch(list(ack.staging_keys))
                generated = [
                    int(token)
                    for snapshot in snapshots
                    for token, mask in zip(snapshot.token_ids_delta, snapshot.token_mask_delta, strict=True)
                    if mask == 1.0
                ]
                assert ack.prefix_token_count is not None
                assert generated == [rh.token(call, p) for p in range(ack.prefix_token_count)]
                assert replica.latest_cut(self.rollout, ack.model_call_id) == ack
            if promised:
                assert replica.cut_receipt(receipt.checkpoint_id, receipt.inventory_digest) is not None
            for call in calls:
                if replica.latest_cut(self.rollout, rh.model_call_id(call)) is not None:
                    self.restorable.add(call)

    def _restart_from(self, snapshot: str | None, path: str | None = None) -> None:
        """The worker's process is gone (its capture and calls with it); its file is put back as
        ``snapshot`` holds it, or (None) a fresh store is made at ``path``, and it starts again,
        on a rollout of its own."""
        assert self.store is not None and self.capture is not None
        self.capture.close()
        self.store.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.worker_path + suffix):
                os.remove(self.worker_path + suffix)
        if path is not None:
            self.worker_path = path
        if snapshot is not None:
            shutil.copyfile(snapshot, self.worker_path)
        self.restarts += 1
        self.rollout = f"r{self.restarts}"
        self.live.clear()
        self.decoded.clear()
        self.restorable.clear()
        self.disk = None
        self.worker_backup = None if snapshot is None else self.worker_backup
        self._open_worker()
        assert self.store is not None
        self._start_rollout()
        if self._diverged():
            event("a worker behind its replica")
            if not self.down.is_set():
                assert self.store.replicate(wait=1.0) is False
            # What it answers at once: a call with tokens, cut (the cut rule checks it says
            # durable_failure).
            self.admit()
            call = max(self.live)
            rh.decode(self.capture, self.live[call], call, 0, 2)  # type: ignore[arg-type]
            self.decoded[call] = 2
            self.cut()

    def _copy(self, path: str, name: str) -> str:
        target = os.path.join(self.folder, f"{name}.db")
        if os.path.exists(target):
            os.remove(target)
        _backup(path, target)
        return target

    def _diverged(self) -> bool:
        """The model's own reading of both files: the replica's resume point for the worker's id
        is past the worker's last event, or the worker's event there is another."""
        assert self.store is not None
        with contextlib.closing(sqlite3.connect(f"file:{self.replica_path}?mode=ro", uri=True)) as replica:
            row = replica.execute(
                "SELECT last_seq, last_checksum FROM ship_sources WHERE source_store_id = ?", (self.store.store_id,)
            ).fetchone()
        if row is None:
            return False
        with contextlib.closing(sqlite3.connect(f"file:{self.worker_path}?mode=ro", uri=True)) as worker:
            (head,) = worker.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
            mine = worker.execute("SELECT checksum FROM events WHERE seq = ?", (row[0],)).fetchone()
        if row[0] > head:
            return True
        return row[1] is not None and mine is not None and bytes(mine[0]) != bytes(row[1])

    def _live_keys(self) -> set[str]:
        assert self.store is not None
        return {info.staging_key for info in self.store.staged_keys()}


def _backup(source: str, target: str) -> None:
    """A consistent copy of a live SQLite store (its backup API), or a restore into a live one."""
    with contextlib.closing(sqlite3.connect(source)) as reading, contextlib.closing(sqlite3.connect(target)) as writing:
        reading.backup(writing)


ReplicaMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STORE_MACHINE_EXAMPLES") or examples(15)),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReplicaMachine = ReplicaMachine.TestCase
