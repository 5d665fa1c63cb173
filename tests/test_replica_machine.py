"""Random sequences of worker operations on a store of the replicated durability domain (issue 25),
the state machine's friend for ``open_store(replica=, domain="replicated", replicate_terminal=,
replica_wait=)``.

A hypothesis ``RuleBasedStateMachine`` drives a worker store (SQLite) whose replica is another
SQLite store: admissions, decoding, cuts, completions, the replica made unreachable and
reachable again (its ship path refuses while it is "down", as a dead network would), and a
restore on another host: a replacement worker on a copy of the replica alone continues a cut
call with ``continue_latest_cut`` (``begin_call`` validates the prefix).  ``replicate_terminal``
is drawn per run.  After every step:

* no receipt says ``durable_prefix`` for a prefix the replica lacks: at the moment a cut returns,
  every key it acknowledges fetches from the replica as the model's tokens;
* while the replica is down, no acknowledgement names a key staged during the outage;
* once the replica is reachable again (``Store.replicate`` waits; nothing is restarted), a cut
  acknowledges every call with tokens as ``durable_prefix``: acknowledgements resume by themselves;
* a completion under ``replicate_terminal`` is staged either way, and in the replica once
  the replica answers;
* every kept receipt's domain is ``replicated``; the worker's and the replica's audits are clean.
"""

from __future__ import annotations

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
    GenerationCutReceipt,
    RolloutTokenCapture,
    ServerUnavailableError,
    Store,
    open_store,
)

WAIT = 0.5  # replica_wait: short, so a run of many cuts with the replica down stays fast
MAX_CALLS = 4  # live at once


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

    @initialize(replicate_terminal=st.booleans())
    def open(self, replicate_terminal: bool) -> None:
        self.store = open_store(
            os.path.join(self.folder, "worker.db"),
            replica=self.replica_path,
            domain="replicated",
            replicate_terminal=replicate_terminal,
            replica_wait=WAIT,
        )
        replicator = self.store._replication()
        real = replicator._ship

        def ship(replica: Store, bounds: Any, start: int | None, recent: Any = None) -> Any:
            if self.down.is_set():
                raise ServerUnavailableError("the replica is unreachable (the machine cut it off)")
            return real(replica, bounds, start, recent)

        replicator._ship = ship  # type: ignore[method-assign]
        assert self.store.replicate(wait=10.0)
        self.capture = rh.capture_on(self.store)
        self.root = rh.stage_root(self.capture)

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
        calls = sorted(self.live)
        before = self._live_keys()
        # Reachable: the shipper has caught up (it finds the replica by itself; this only waits).
        caught_up = not self.down.is_set() and self.store.replicate(wait=5.0)
        receipt = self.capture.serve_generation_cut(rh.inventory(f"checkpoint-{self.cuts}", calls))
        if self.down.is_set():
            event("a cut with the replica down")
            self.staged_while_down |= self._live_keys() - before
        self.receipts.append(receipt)
        assert self.store.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
        assert self.store.kept_receipts(checkpoint_id=receipt.checkpoint_id) == [(receipt, "replicated")]
        with open_store(self.replica_path, read_only=True) as replica:
            for ack, call in zip(receipt.prefixes, calls, strict=True):
                if ack.disposition != "durable_prefix":
                    continue
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
            for call in calls:
                if replica.latest_cut("r0", rh.model_call_id(call)) is not None:
                    self.restorable.add(call)
        if caught_up:
            # Acknowledgements resumed by themselves: every call with tokens is durable.
            with_tokens = [ack for ack, call in zip(receipt.prefixes, calls, strict=True) if self.decoded[call]]
            assert all(ack.disposition == "durable_prefix" for ack in with_tokens), receipt

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        assert self.capture is not None and self.store is not None
        call = data.draw(st.sampled_from(sorted(self.live)))
        active = self.live.pop(call)
        rh.decode(self.capture, active, call, self.decoded[call], rh.TOTAL)
        self.decoded[call] = rh.TOTAL
        coords = self.capture.complete_observed(active)
        assert coords.disposition == "staged", coords  # also when the replica is down
        self.completed[call] = coords
        assert coords.staging_key is not None
        assert self.store.fetch([coords.staging_key])[0].digest == coords.digest
        if self.store.replicate_terminal and not self.down.is_set():
            with open_store(self.replica_path, read_only=True) as replica:
                assert replica.fetch([coords.staging_key])[0].digest == coords.digest

    @rule(wait=st.sampled_from([0.001, 0.5]))
    def replicate(self, wait: float) -> None:
        """``Store.replicate``: True only when everything committed is in the replica."""
        assert self.store is not None
        there = self.store.replicate(wait=wait)
        if self.down.is_set():
            assert there is False or not self.staged_while_down
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
            final = rh.continue_from(alone, call)
            (reference,) = rh.uninterrupted(open_store(copy + ".ref"), [call]).values()
            assert final == reference
        for path in (copy, copy + ".ref"):
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.remove(path + suffix)

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

    def _live_keys(self) -> set[str]:
        assert self.store is not None
        return {info.staging_key for info in self.store.staged_keys()}


ReplicaMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STORE_MACHINE_EXAMPLES") or examples(15)),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReplicaMachine = ReplicaMachine.TestCase
