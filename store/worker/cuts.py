"""Generation cuts: serving cut requests and periodic flushes over the live calls' buffers
(wire-contract 5.4, 5.5, 5.7; the buffers are ``store.worker.live_call``); resolving a
continuation from the log is ``store.worker.resolve``."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from store import failpoints
from store.errors import (
    CaptureDataError,
    CaptureError,
    GenerationCutError,
    StoreClosedError,
    StoreError,
)
from store.log.events import Completion, EventKind
from store.store import StageEntry, Store
from store.wire import continuations
from store.wire.codec import from_json, to_json
from store.wire.columns import FloatColumn, TokenIds
from store.wire.cut_records import (
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    chunk_staging_key,
)
from store.wire.records import CommitCoords, StagedCallRecord
from store.worker.active_call import (
    ActiveCall,
    build_generation_chunk_record,
    build_prefix_record,
    prefix_digest,
    record_spans,
)
from store.worker.evidence import Evidence, EvidenceCache
from store.worker.live_call import FrozenBuffer, LiveCall

log = logging.getLogger("store.cuts")

# Bumped in every forked child, so a capture sees it was inherited with one int comparison
# (observe runs per token; os.getpid() is a system call).
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


@dataclass
class _CutPlan:
    live: LiveCall
    ack: GenerationCutPrefixAck
    entry: StageEntry | None
    sealed: bool = False  # its chunk was committed ahead of the receipt (the replicated domain)


class TerminalGate:
    """A call's terminal path, holding its lifecycle lock (``CutServer.terminal_gate``)."""

    def __init__(self, server: CutServer, live: LiveCall | None) -> None:
        self._server = server
        self._live = live

    @property
    def live(self) -> LiveCall | None:
        return self._live

    def check_limit(self, generated_tokens: int) -> None:
        """A tracked call's record may not hold more generated tokens than its output limit."""
        live = self._live
        if live is None or live.effective_output_limit is None:
            return
        refusal = continuations.token_count_within_limit(generated_tokens, live.effective_output_limit)
        if refusal is not None:
            raise CaptureDataError(refusal.message, refusal.code)

    def completion(self) -> Completion | None:
        """How the tracked call finished, kept with its terminal record (None if untracked)."""
        live = self._live
        if live is None:
            return None
        return Completion(
            effective_output_limit=live.effective_output_limit,
            finish_reason=live.finish_reason,
            stop_reason=live.stop_reason,
        )

    def completed(self, coords: CommitCoords, generated_tokens: int, at: float) -> None:
        self._server.completed(self._live, coords, generated_tokens, at)


class CutServer:
    """Serves cut requests and periodic flushes for the live calls of one capture.

    The registry holds the newest tracked admission of each call, by identity: a call begun
    and tracked again replaces the older ``ActiveCall``, whose completion (even one still
    running) then leaves the newer one alone.  Completion evidence (``evidence``) is pruned
    by its TTL at every completion, ``track``, cut and flush pass.
    """

    def __init__(
        self,
        store: Store,
        *,
        flush_threshold_tokens: int,
        flush_interval: float,
        evidence_ttl: float,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._clock = clock
        # A capture serves the process that made it (a forked child makes its own).
        self._pid, self._forks = os.getpid(), _forks
        self._calls: dict[tuple[str, str], LiveCall] = {}
        self._registry = threading.Lock()
        self.evidence = EvidenceCache(store, evidence_ttl)
        self._flush_threshold = flush_threshold_tokens
        self._flush_counter = 0
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._stop_with_store: Callable[[], None] | None = None
        if flush_threshold_tokens > 0:
            # The store's close() stops the thread first, so it never outlives the store.
            self._stop_with_store = store._on_close(self.close)
            self._flusher = threading.Thread(
                target=self._flush_loop, args=(flush_interval,), name="staging-store-flush", daemon=True
            )
            self._flusher.start()

    def now(self) -> float:
        """The capture's clock: seconds since the epoch (admission, completion and evidence times)."""
        value = self._clock()
        if type(value) not in (int, float) or not math.isfinite(value):
            raise CaptureError(f"the capture's clock must return seconds since the epoch, got {value!r}")
        return float(value)

    def check_process(self) -> None:
        """Refuse use from a forked child: it has no flush thread, and the live calls are the parent's."""
        if _forks != self._forks:
            raise CaptureError(
                f"this capture belongs to process {self._pid}; a forked child makes its own RolloutTokenCapture",
                "forked",
            )

    # registry -------------------------------------------------------------------------------

    def track(self, call: ActiveCall, prompt: TokenIds, effective_output_limit: int | None) -> None:
        self.check_process()
        if effective_output_limit is not None and (
            type(effective_output_limit) is not int or effective_output_limit < 1
        ):
            raise CaptureError(f"effective_output_limit must be a positive int, got {effective_output_limit!r}")
        if call.completed:
            raise CaptureError(f"{call} already completed; it cannot be tracked for cuts")
        now = self.now()
        with self._registry:
            self._calls[(call.capture_key, call.model_call_id)] = LiveCall(call, prompt, effective_output_limit)
        self.evidence.prune(now)

    def live(self, call: ActiveCall) -> LiveCall | None:
        """The live call tracked for this very ``ActiveCall`` (not for another admission of its id)."""
        self.check_process()
        with self._registry:
            live = self._calls.get((call.capture_key, call.model_call_id))
        return live if live is not None and live.call is call else None

    def _replaced(self, call: ActiveCall) -> bool:
        with self._registry:
            live = self._calls.get((call.capture_key, call.model_call_id))
        return live is not None and live.call is not call

    def observe(
        self,
        call: ActiveCall,
        ids: Sequence[int],
        logprobs: Sequence[float],
        finish: str | None,
        stop: str | int | None,
    ) -> None:
        if _forks != self._forks:
            self.check_process()
        # One dict read is atomic: the registry lock guards its updates, not this (hot) read.
        live = self._calls.get((call.capture_key, call.model_call_id))
        if live is not None and live.call is not call:
            live = None
        if live is None:
            if call.completed:
                return  # tokens that raced the call's completion change nothing
            if self._replaced(call):
                raise CaptureError(
                    f"{call} was replaced by a newer admission of the same call (begin_call and track again); "
                    "observe the ActiveCall that track() was given last"
                )
            raise CaptureError(f"{call} is not tracked; call track() before observe()")
        live.observe(ids, logprobs, finish, stop)

    def attach(self, call: ActiveCall, engine: Any) -> LiveCall:
        """``generate``: the tracked call's tokens come from ``engine`` until ``detach``."""
        live = self.live(call)
        if live is None:
            raise CaptureError(f"{call} is not tracked; call track() before generate()")
        live.attach(engine)
        return live

    @contextmanager
    def terminal_gate(self, call: ActiveCall) -> Iterator[TerminalGate]:
        """Serialise a call's terminal path with any cut or flush of it, then retire it."""
        live = self.live(call)
        if live is None:
            yield TerminalGate(self, None)
            return
        with live.lifecycle:
            try:
                yield TerminalGate(self, live)
            finally:
                live.terminal = True
                key = (call.capture_key, call.model_call_id)
                with self._registry:
                    if self._calls.get(key) is live:  # a newer admission tracked meanwhile stays
                        del self._calls[key]

    def completed(self, live: LiveCall | None, coords: CommitCoords, generated_tokens: int, at: float) -> None:
        if live is None:
            return
        key = (live.call.capture_key, live.call.model_call_id)
        if coords.staging_key is not None and coords.digest is not None and coords.extras_digest is not None:
            evidence = Evidence(
                coords.staging_key,
                coords.digest,
                coords.extras_digest,
                generated_tokens,
                live.effective_output_limit,
                live.finish_reason,
                live.stop_reason,
                at,
            )
            self.evidence.put(key, evidence)
        obsolete = [k for k in live.own_keys if k not in live.acknowledged]
        try:
            self._store.clear_keys(key[0], key[1], obsolete, "obsolete after completion")
        except StoreError:
            log.exception("clearing obsolete chunk keys of %s/%s failed; the completion stands", *key)

    # serving a cut (5.5) ----------------------------------------------------------------------

    def serve(self, inventory: GenerationCutInventory) -> GenerationCutReceipt:
        self.check_process()
        if not isinstance(inventory, GenerationCutInventory):
            raise CaptureError(f"serve_generation_cut needs a GenerationCutInventory, got {type(inventory).__name__}")
        wait = self._store.replica_wait  # None: the local domain
        replica_deadline = None if wait is None else time.monotonic() + wait
        calls = [(prefix.capture_key, prefix.model_call_id) for prefix in inventory.active_prefixes]
        if len(set(calls)) != len(calls):
            raise GenerationCutError("the inventory names a model call more than once")
        with self._registry:
            named = {call: self._calls[call] for call in calls if call in self._calls}
        locked: list[LiveCall] = []
        plans: list[_CutPlan] = []
        acks: list[GenerationCutPrefixAck] = []
        try:
            # One global lock order (by call), whatever the inventory's ticket order: two cuts
            # naming the same calls in different orders must not wait on each other.
            for call in sorted(named):
                named[call].lifecycle.acquire()
                locked.append(named[call])
            for prefix in inventory.active_prefixes:
                live = named.get((prefix.capture_key, prefix.model_call_id))
                if live is None or live.terminal:
                    acks.append(self._terminal_ack(prefix, inventory.checkpoint_id))
                    continue
                if live.call.checks_tickets and prefix.admitted_at != live.call.admitted_at:
                    # The ticket names another admission of this call than the one decoding here.
                    log.warning(
                        "cut %s: ticket %s names %s admitted at %r, the live call was admitted at %r",
                        inventory.checkpoint_id,
                        prefix.ticket_id,
                        live.call,
                        prefix.admitted_at,
                        live.call.admitted_at,
                    )
                    acks.append(GenerationCutPrefixAck(**_identity(prefix), disposition="durable_failure"))
                    continue
                plan = self._plan(live, prefix, inventory.checkpoint_id)
                if plan.entry is not None or plan.ack.disposition == "durable_prefix":
                    plans.append(plan)
                acks.append(plan.ack)
            if replica_deadline is not None:
                replicated = self._replicated(inventory, plans, acks, replica_deadline)
                if replicated is None:
                    # Served before: its receipt stands, nothing was written, and the buffers go
                    # back as they were (``finally``).
                    served = self._stored_receipt(inventory)
                    if served is None:  # only retention could remove it in between
                        raise GenerationCutError(f"the stored receipt of cut {inventory.checkpoint_id} vanished")
                    return self._in_replica(served, replica_deadline)
                acks = replicated
            receipt = GenerationCutReceipt(
                checkpoint_id=inventory.checkpoint_id,
                cut_id=f"worker-{inventory.inventory_digest}",
                inventory_digest=inventory.inventory_digest,
                inventory=inventory,
                backend_snapshot_id=f"tq-{inventory.inventory_digest}",
                prefixes=tuple(acks),
            )
            receipt.validate_for(inventory)
            entries = [plan.entry for plan in plans if plan.entry is not None and not plan.sealed]
            # A continued call's keys start with the cut it continued, staged by an earlier
            # attempt: the transaction checks every acknowledged key still holds its record.
            acknowledged = [key for ack in acks if ack.disposition == "durable_prefix" for key in ack.staging_keys]
            failpoints.hit("mid_cut")
            cut_receipt = (inventory.checkpoint_id, inventory.inventory_digest, to_json(receipt))
            if replica_deadline is None:
                staged = self._store.stage_all(entries, cut_receipt=cut_receipt, acknowledged=acknowledged)
            else:
                # Its records are in the replica (``_replicated``; every chunk sealed there): the
                # receipt is written as it is, and waited for below.
                assert not entries
                staged = self._store._stage_receipt(cut_receipt, acknowledged)
        except Exception as exc:
            for live in locked:
                live.rollback()
            try:
                cached = self._stored_receipt(inventory)
            except StoreError:
                cached = None  # the error this serve met is the answer
            if cached is not None:
                # Served before: its receipt stands, whatever this serve met.
                return self._in_replica(cached, replica_deadline)
            if isinstance(exc, GenerationCutError):
                raise
            raise GenerationCutError(f"serving cut {inventory.checkpoint_id} failed: {exc}") from exc
        else:
            if staged.receipt_recorded is False:
                # Served before (by this process or another on the same store): nothing was
                # written, and the buffers go back as they were (``finally``).
                stored = self._stored_receipt(inventory)
                if stored is None:  # only retention could remove it in between
                    raise GenerationCutError(f"the stored receipt of cut {inventory.checkpoint_id} vanished")
                return self._in_replica(stored, replica_deadline)
            durable = {ack.ticket_id for ack in acks if ack.disposition == "durable_prefix"}
            for plan in plans:
                if not plan.sealed:
                    plan.live.seal(plan.entry.staging_key if plan.entry is not None else None)
                if plan.ack.ticket_id in durable:
                    plan.live.acknowledged.update(plan.ack.staging_keys)
        finally:
            for live in locked:
                live.rollback()  # a no-op for sealed buffers; frees a buffer frozen for a failure ack
                live.lifecycle.release()
        if replica_deadline is not None:
            # The receipt follows its records into the replica (continue_latest_cut there finds
            # it), within what is left of the wait: a durable_prefix is answered only once it
            # is there (else the cut is refused, and Gym counts each of its calls a failure).
            receipt_seq = getattr(staged, "_last_seq", None)
            if receipt_seq is None:
                return self._in_replica(receipt, replica_deadline)
            left = max(replica_deadline - time.monotonic(), 0.0)
            there = self._store._replicated_through(receipt_seq, left)  # the receipt is the cut's last event
            if not there and _promises(receipt):
                raise self._not_replicated(inventory, "did not reach")
        return receipt  # ours is the one in the log: no need to read it back

    def _in_replica(self, receipt: GenerationCutReceipt, deadline: float | None) -> GenerationCutReceipt:
        """A receipt kept in the log, answered again: in the replicated domain only once it is in
        the replica (a durable_prefix says the replica holds the receipt too)."""
        if deadline is None or not _promises(receipt):
            return receipt
        left = deadline - time.monotonic()
        if left <= 0 or not self._store.replicate(wait=left):
            raise self._not_replicated(receipt.inventory, "is kept here but did not reach")
        return receipt

    def _not_replicated(self, inventory: GenerationCutInventory, what: str) -> GenerationCutError:
        reason = self._store._replication().last_error or "it did not answer in time"
        return GenerationCutError(
            f"cut {inventory.checkpoint_id}: its receipt {what} the replica {self._store.replica_url} within "
            f"replica_wait={self._store.replica_wait:g} s ({reason}); no acknowledgement is made: ask again once the "
            "replica answers (the receipt ships then, and is answered as it is)",
            "replica_unavailable",
        )

    def _stored_receipt(self, inventory: GenerationCutInventory) -> GenerationCutReceipt | None:
        stored = self._store.cut_receipt(inventory.checkpoint_id, inventory.inventory_digest)
        return None if stored is None else from_json(stored, GenerationCutReceipt)

    def _replicated(
        self,
        inventory: GenerationCutInventory,
        plans: list[_CutPlan],
        acks: list[GenerationCutPrefixAck],
        deadline: float,
    ) -> list[GenerationCutPrefixAck] | None:
        """The replicated domain: commit the cut's chunks here (sealed, as a flush seals them), wait
        for every record the acknowledgements name to be in the replica (``replica_wait`` at
        most), and make ``durable_failure`` of each acknowledgement whose records are not there.
        None: the inventory was served before (its receipt is in the log; nothing was written),
        found in the chunks' own transaction (the local domain's one transaction looks too)."""
        entries = [plan.entry for plan in plans if plan.entry is not None]
        staged_through = None
        staged: set[str] = set()
        if not entries and self._store.cut_receipt(inventory.checkpoint_id, inventory.inventory_digest) is not None:
            return None
        if entries:
            results = self._store._stage_unless_served(entries, inventory.checkpoint_id, inventory.inventory_digest)
            if results.receipt_recorded is False:
                return None
            staged_through = getattr(results, "_last_seq", None)
            staged = {result.staging_key for result in results if result.ok and result.staging_key is not None}
            for plan in plans:
                if plan.entry is not None:
                    plan.live.seal(plan.entry.staging_key)
                    plan.sealed = True
        named = sorted({key for ack in acks if ack.disposition == "durable_prefix" for key in ack.staging_keys})
        there = self._store._replicated_keys(named, deadline, staged_through, staged)
        final = []
        for ack in acks:
            if ack.disposition == "durable_prefix" and not all(key in there for key in ack.staging_keys):
                log.warning("cut: %s/%s did not reach the replica in time", ack.rollout_id, ack.model_call_id)
                ack = GenerationCutPrefixAck(**_identity(ack), disposition="durable_failure")
            final.append(ack)
        return final

    def _plan(self, live: LiveCall, prefix: GenerationCutPrefix, checkpoint_id: str) -> _CutPlan:
        if live.observation_error is not None:
            raise GenerationCutError(f"{live.call}: {live.observation_error}")
        frozen = live.freeze(checkpoint_id)
        identity = _identity(prefix)
        generated, logprobs = live.cumulative()
        total = live.restored_count + len(generated)
        if total == 0:
            return _CutPlan(live, GenerationCutPrefixAck(**identity, disposition="durable_failure"), None)
        if live.effective_output_limit is None:
            raise GenerationCutError(f"{live.call}: its effective output limit is unknown", "output_limit")
        if total > live.effective_output_limit:  # observe() refuses such tokens; a receipt never promises them
            raise GenerationCutError(
                f"{live.call}: {total} generated tokens, past its output limit {live.effective_output_limit}",
                "output_limit",
            )
        digest, entry = self._build(live, checkpoint_id, frozen, generated, logprobs)
        keys = [*live.keys, entry.staging_key] if entry is not None and entry.staging_key else list(live.keys)
        ack = GenerationCutPrefixAck(
            **identity,
            disposition="durable_prefix",
            cut_kind="active_prefix",
            frozen_buffer_id=f"active/{checkpoint_id}/{frozen.sequence}",
            staging_keys=tuple(keys),
            prefix_token_count=total,
            prefix_digest=digest,
            effective_output_limit=live.effective_output_limit,
            terminal_finish_reason=live.finish_reason,  # type: ignore[arg-type]
            terminal_stop_reason=live.stop_reason,
        )
        return _CutPlan(live, ack, entry)

    def _build(
        self, live: LiveCall, owner: str, frozen: FrozenBuffer, generated: TokenIds, logprobs: FloatColumn
    ) -> tuple[str, StageEntry | None]:
        """The cumulative record's digest (what a restore checks) and what to stage for the chunk:
        the record itself while the call holds no chunk yet, else only its digest is needed."""
        if live.keys:
            digest = prefix_digest(
                live.call, prompt_token_ids=live.prompt, generated_token_ids=generated, generated_logprobs=logprobs
            )
            return digest, self._chunk(live, owner, frozen, None)
        cumulative = build_prefix_record(
            live.call, prompt_token_ids=live.prompt, generated_token_ids=generated, generated_logprobs=logprobs
        )
        return cumulative.digest, self._chunk(live, owner, frozen, cumulative)

    def _chunk(
        self, live: LiveCall, owner: str, frozen: FrozenBuffer, cumulative: StagedCallRecord | None
    ) -> StageEntry | None:
        """What to stage for the frozen chunk: the cumulative record first (``cumulative``, or
        built here), then generation-only chunks (a flush needs no cumulative record after the
        first: only a cut acknowledges one)."""
        call = live.call
        if not len(frozen.ids):
            return None
        key = chunk_staging_key(owner, call.capture_key, call.model_call_id, len(live.own_keys))
        if not live.keys:
            if cumulative is None:
                generated, logprobs = live.cumulative()
                cumulative = build_prefix_record(
                    call, prompt_token_ids=live.prompt, generated_token_ids=generated, generated_logprobs=logprobs
                )
            return StageEntry(cumulative, key, EventKind.PREFIX_STAGED, record_spans(call, cumulative))
        chunk = build_generation_chunk_record(call, generated_token_ids=frozen.ids, generated_logprobs=frozen.logprobs)
        start = live.carry + len(live.sealed_ids)  # the sealed tokens come first (the lifecycle lock holds them)
        spans = [(start, start + len(frozen.ids), call.weight_version)]
        return StageEntry(chunk, key, EventKind.CHUNK_STAGED, spans)

    def _terminal_ack(self, prefix: GenerationCutPrefix, checkpoint_id: str) -> GenerationCutPrefixAck:
        identity = _identity(prefix)
        evidence = self.evidence.get((prefix.capture_key, prefix.model_call_id), self.now())
        if evidence is None or not evidence.restorable:
            return GenerationCutPrefixAck(**identity, disposition="durable_failure")
        return GenerationCutPrefixAck(
            **identity,
            disposition="durable_prefix",
            cut_kind="terminal_completion",
            frozen_buffer_id=f"terminal/{checkpoint_id}",
            staging_keys=(evidence.staging_key,),
            prefix_token_count=evidence.generated_tokens,
            prefix_digest=evidence.digest,
            effective_output_limit=evidence.effective_output_limit,
            terminal_finish_reason=evidence.finish_reason,  # type: ignore[arg-type]
            terminal_stop_reason=evidence.stop_reason,
        )

    # periodic flush (5.7) -----------------------------------------------------------------------

    def flush_due(self, stop: threading.Event | None = None) -> int:
        """One periodic flush pass (evidence past its TTL is dropped first); the flush thread's
        pass ends early once ``stop`` is set, so closing never waits for a whole pass."""
        self.check_process()
        self.evidence.prune(self.now())
        with self._registry:
            candidates = list(self._calls.values()) if self._flush_threshold > 0 else []
        flushed = 0
        for live in candidates:
            if stop is not None and stop.is_set():
                break
            if live.observation_error is not None or live.frozen is not None:
                continue
            if live.unstaged() < self._flush_threshold:
                continue
            if not live.lifecycle.acquire(blocking=False):
                continue  # a cut or the terminal path owns the call right now
            try:
                if not live.terminal and self._flush(live):
                    flushed += 1
            finally:
                live.lifecycle.release()
        return flushed

    def _flush(self, live: LiveCall) -> bool:
        self._flush_counter += 1
        owner = f"periodic-{self._flush_counter:012d}"
        frozen = live.freeze(owner)
        try:
            entry = self._chunk(live, owner, frozen, None)
            if entry is None:
                live.rollback()
                return False
            self._store.stage_all([entry])
        except Exception as exc:
            live.rollback()
            if isinstance(exc, StoreClosedError):
                raise
            log.exception("periodic flush of %s failed; its tokens stay buffered", live.call)
            return False
        live.seal(entry.staging_key)
        return True

    def _flush_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.flush_due(self._stop)
            except StoreClosedError:
                return  # the store went away under the capture: nothing left to flush into
            except Exception:  # a flush pass never takes the worker down
                log.exception("periodic flush pass failed")

    def close(self) -> None:
        """Stop the flush thread and join it: a flush in progress commits whole (or, refused by a
        closed store, keeps its tokens buffered), and none starts after this returns."""
        self._stop.set()
        stop_with_store, self._stop_with_store = self._stop_with_store, None
        if stop_with_store is not None:
            stop_with_store()
        flusher = self._flusher
        if flusher is None or flusher is threading.current_thread() or _forks != self._forks:
            return  # a forked child has no flush thread to join
        flusher.join(_JOIN_WARNING_SECONDS)
        while flusher.is_alive():  # a store write that long is stuck; say what close() waits for
            log.warning("close() still waits for the periodic flush in progress (a store write)")
            flusher.join(_JOIN_WARNING_SECONDS)


_JOIN_WARNING_SECONDS = 10.0


def _promises(receipt: GenerationCutReceipt) -> bool:
    """Whether a receipt acknowledges any prefix durable."""
    return any(ack.disposition == "durable_prefix" for ack in receipt.prefixes)


def _identity(prefix: GenerationCutPrefix | GenerationCutPrefixAck) -> dict[str, Any]:
    return {
        "ticket_id": prefix.ticket_id,
        "rollout_id": prefix.rollout_id,
        "attempt_index": prefix.attempt_index,
        "model_call_id": prefix.model_call_id,
        "admitted_at": prefix.admitted_at,
    }
