"""``Store``: the staging sink and source over the event log, and ``open_store``."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TypeVar

from store import arguments
from store.append.log import EventLog
from store.append.new_event import NewEvent
from store.append.staging_rules import owned_key, stage_event
from store.append.transaction import WriteTransaction
from store.errors import (
    AttachmentsUnsupportedError,
    InvalidRecordError,
    ReadOnlyStoreError,
    ReplicaUnavailableError,
    StagingRefusedError,
    StoreClosedError,
)
from store.lifecycle import CallGate, operation, track_for_fork
from store.lineage import export, tree, versions
from store.lineage import linearize as lineage_linearize
from store.lineage import workers as worker_log
from store.lineage.export import ExportReport
from store.lineage.tree import RolloutLineage, RolloutSummary
from store.lineage.versions import RolloutVersions, StaleReport
from store.log.engine import (
    SQLITE,
    check_schema,
    create_store_engine,
    learn_sessions,
    migrate,
    resolve_url,
    split_schema,
    wal_path,
)
from store.log.events import (
    AdmissionBody,
    Completion,
    CutReceiptBody,
    EventKind,
    FailureBody,
    KeysClearedBody,
    Span,
    record_body,
)
from store.projections.fold import RECEIPT_STREAM, generated_spans
from store.queries.reads import CallInfo, Reader, StagedKeyInfo, StoredChunk, StoredCompletion, VersionSpan
from store.queries.replay import ReplayReport, replay
from store.rebuild.verify import LinearizedRollout
from store.retention import ids as retention_ids
from store.retention import preview as retention_preview
from store.retention import removal
from store.retention import retain as retention_retain
from store.retention.compact import CompactReport
from store.retention.compact import compact as compact_store
from store.retention.ledger import CaptureLedger
from store.shipping import replica as replication
from store.shipping.domain import DurabilityDomain
from store.shipping.methods import LogShipping
from store.wire import foreign
from store.wire.codec import from_json
from store.wire.cut_records import GenerationCutPrefixAck, GenerationCutReceipt, capture_key
from store.wire.records import RolloutRemoval, StagedCallRecord, StagedCallSnapshot, StageResult

if TYPE_CHECKING:
    from store.audit import AuditReport

T = TypeVar("T")

log = logging.getLogger("store")


@dataclass(frozen=True)
class StageEntry:
    """One record to stage: under ``staging_key`` (default key if None), as ``kind``, with its version spans."""

    record: StagedCallRecord
    staging_key: str | None = None
    kind: EventKind = EventKind.CALL_COMPLETED
    spans: Sequence[Span] | None = None
    completion: Completion | None = None


class StageResults(list[StageResult]):
    """``stage_all``'s results, one per entry in order.  ``receipt_recorded``: whether the cut
    receipt given was recorded by this call (False: that inventory's receipt was in the log
    already and stands, and nothing was written: no results; None: no receipt was given)."""

    receipt_recorded: bool | None = None
    # The seq of the last event this call appended (None: none), for the replicated domain's
    # wait for its receipt (``CutServer.serve``): not read back from the log.
    _last_seq: int | None = None


class Store(LogShipping, DurabilityDomain):
    """A durable token staging store (use ``open_store``).  Thread-safe; one per process."""

    def __init__(
        self,
        url_or_path: str | os.PathLike[str],
        *,
        durability: str = "full",
        schema: str | None = None,
        read_only: bool = False,
        pool_size: int | None = None,
        replica: str | os.PathLike[str] | None = None,
        domain: str = "local",
        replicate_terminal: bool = False,
        replica_wait: float | None = None,
    ) -> None:
        self._url, schema = split_schema(resolve_url(url_or_path), schema)
        pool_size = arguments.pool_size(pool_size)
        self._read_only = arguments.flag("read_only", read_only)
        self._domain = replication.domain_options(
            replica, domain, replicate_terminal, replica_wait, read_only=self._read_only
        )
        self._replicator: replication.Replicator | None = None
        self._durability = durability
        self._schema = schema
        self._store_id: str | None = None
        self._calls = CallGate()
        # Stops for the threads of objects built on this store (a capture's flush thread), run
        # first by close(): none of them outlives the store, and none writes after it.
        self._close_hooks: dict[object, Callable[[], None]] = {}
        self._close_hooks_lock = threading.Lock()
        self._closing = False
        self._engine, self._backend = create_store_engine(
            self._url, self._durability, schema, read_only=self._read_only, pool_size=pool_size
        )
        self._log = EventLog(
            self._engine,
            self._backend,
            # PostgreSQL has no commit that survives a crash of the server's processes without
            # waiting for its WAL flush: "normal" commits records as "full" does there.
            durable=self._durability == "full" or self._backend is not SQLITE,
            wal_path=wal_path(self._url),
            read_only=self._read_only,
            hold_writer=self._backend is SQLITE or pool_size > 1,
        )
        self._reader = Reader(self._engine, self._backend)
        self._retention = removal.RetentionStatements(self._engine)
        self._retain = retention_retain.RetainStatements(self._engine)
        self._pid = os.getpid()
        try:
            learn_sessions(self._engine, self._backend, read_only=self._read_only)
            if self._read_only:
                check_schema(self._engine, self._url, schema)  # never migrates: the store stays as it is
            else:
                migrate(self._engine, self._backend, schema)
                self._log.written_for(self._known_id())  # every event names the store it is for
            if self._domain.domain == replication.REPLICATED:
                self._replicator = replication.start(self, self._domain, lambda at: Store(at, pool_size=1))
        except BaseException:
            self._engine.dispose()
            raise
        track_for_fork(self)

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked where os.register_at_fork did not run (fork() from C)
            self._forget_parent_connections()

    # --- fork: the child reconnects; no SQLite connection is open across the fork -------------

    def _before_fork(self) -> None:
        """Hold the store still: wait for calls in flight, keep new ones out until after the fork.

        SQLite keeps lock bookkeeping per process, shared by every connection to a file, and
        a child inherits the parent's copy: a connection the child opens would trust locks
        only the parent holds.  So the parent's SQLite connections are closed here (they
        reopen on next use); PostgreSQL connections stay open and the child leaves them alone.
        """
        if self._calls.hold_for_fork():
            self._log.hold_checkpoints_for_fork()
            with contextlib.suppress(Exception):  # a broken connection is reopened after the fork anyway
                self._log.release_writer()
            if self._backend is SQLITE:
                with contextlib.suppress(Exception):
                    self._engine.dispose()

    def _after_fork_in_parent(self) -> None:
        self._log.release_checkpoints_after_fork()
        self._calls.release_after_fork()

    def _after_fork_in_child(self) -> None:
        self._calls.reset_in_child()
        self._close_hooks_lock = threading.Lock()  # the parent's may be held by a thread the child lacks
        self._forget_parent_connections()
        if self._replicator is not None:
            self._replicator.after_fork_in_child()

    def _forget_parent_connections(self) -> None:
        """In a forked child: drop the parent's connections without using or closing them."""
        self._engine.dispose(close=False)
        self._log.after_fork_in_child()
        self._pid = os.getpid()

    @property
    def url(self) -> str:
        """The database URL (password hidden), with ``?schema=`` when the store has one, so
        ``open_store(store.url)`` opens the same store."""
        url = self._url if self._schema is None else self._url.update_query_dict({"schema": self._schema})
        return url.render_as_string(hide_password=True)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def read_only(self) -> bool:
        """Whether the store was opened read-only (every write raises ``ReadOnlyStoreError``)."""
        return self._read_only

    # --- the staging sink and source -------------------------------------------------------

    @operation
    def stage(
        self,
        record: StagedCallRecord,
        *,
        attachments: Mapping[str, Any] | None = None,
        staging_key: str | None = None,
        kind: EventKind = EventKind.CALL_COMPLETED,
        spans: Sequence[Span] | None = None,
        completion: Completion | None = None,
        recorded_at: float | None = None,
    ) -> StageResult:
        """Stage ``record`` durably; returns only after the commit.

        Re-staging an identical record under its key succeeds and writes nothing; a
        different record under a used key is refused (``ok=False``) and writes nothing.
        ``kind`` and ``spans`` let the capture mark cut prefixes and chunks; the default
        is a call's terminal record, its generated tokens produced by its weight version.
        ``recorded_at``: the event's time (seconds since the epoch; now when None), as the
        capture's clock stamps a completion so its evidence ages on that clock.

        NeMo Gym's ``StagedCallRecord`` (a pydantic model) is staged as the store's own record
        (read through its JSON, every check and digest verified), and the answer is Gym's
        ``StageResult``, so the store is Gym's ``StagingSink`` as it is.  ``attachments``
        (Gym's framework payloads): None or empty only; the store holds no attachments and
        refuses any (``AttachmentsUnsupportedError``, nothing written) rather than drop them.
        """
        family: type | None = None
        if not isinstance(record, StagedCallRecord):
            family = type(record)
            record = foreign.native_record(record)
        if attachments is not None:
            if not isinstance(attachments, Mapping):
                raise InvalidRecordError(f"attachments must be a mapping or None, got {type(attachments).__name__}")
            if attachments:
                raise AttachmentsUnsupportedError(
                    f"stage(attachments=...) names {sorted(map(str, attachments))[:4]}: this store holds no "
                    f"attachments, so the call for {record.rollout_id}/{record.model_call_id} is refused "
                    "(nothing written) rather than staged without them"
                )
        event = self._record_event(record, staging_key, kind, spans, completion, _recorded_at(recorded_at))
        stream = (event.rollout_id, event.model_call_id, event.staging_key or "")
        staged = record
        result = self._log.write(lambda tx: stage_event(tx, event, staged.digest), ahead=(stream,), guess=True)
        if result.ok and event.kind is EventKind.CALL_COMPLETED and self._domain.replicate_terminal:
            self._replicate_terminal([result], f"the terminal record of {record.rollout_id}/{record.model_call_id}")
        if family is not None:
            answer = foreign.family_class(family, "StageResult")
            if answer is not None:
                return foreign.as_model(result, answer)  # type: ignore[no-any-return]
        return result

    @operation
    def _stage_unless_served(
        self, entries: Sequence[StageEntry], checkpoint_id: str, inventory_digest: str
    ) -> StageResults:
        """``_unless_served`` as an operation of its own (a replicated cut's)."""
        return self._unless_served(entries, checkpoint_id, inventory_digest)

    def _unless_served(self, entries: Sequence[StageEntry], checkpoint_id: str, inventory_digest: str) -> StageResults:
        """``stage_all(entries)`` for a replicated cut's chunks, unless a receipt of that inventory
        is in the log already: then it stands, and nothing is written (``receipt_recorded``
        False, no results).  The look is in the chunks' own transaction, not a read before."""
        events = [
            self._record_event(entry.record, entry.staging_key, entry.kind, entry.spans, entry.completion)
            for entry in entries
        ]

        def work(tx: WriteTransaction) -> StageResults:
            results = StageResults()
            if tx.receipt_seq(checkpoint_id, inventory_digest) is not None:
                results.receipt_recorded = False
                return results
            before = tx.appended
            for event, entry in zip(events, entries, strict=True):
                result = stage_event(tx, event, entry.record.digest)
                if not result.ok:
                    raise StagingRefusedError(result.error or "refused")
                results.append(result)
            if tx.appended > before:
                results._last_seq = tx.last_seq
            return results

        return self._log.write(work)

    @operation
    def stage_all(
        self,
        entries: Sequence[StageEntry],
        *,
        cut_receipt: tuple[str, str, bytes] | None = None,
        acknowledged: Sequence[str] = (),
    ) -> StageResults:
        """Stage several records, and optionally a cut receipt, in one transaction: all or nothing.

        Raises ``StagingRefusedError`` (nothing written) if any key holds a different record, or
        if a key of ``acknowledged`` (the keys a cut receipt acknowledges) holds no record once
        the entries are staged: a receipt never names a key that does not fetch.  Used by
        generation cuts, whose acknowledgements must all hold before any is sealed.  When a
        receipt of the same inventory is in the log already, it stands and nothing is written
        (``receipt_recorded`` False, no results).

        In the replicated domain a cut receipt is recorded only once the records it names are in
        the replica: the entries commit first (one transaction), then, once the entries and
        every ``acknowledged`` key are in the replica, the receipt (a second one), and the call
        returns once the receipt is there too, all within ``replica_wait``.  Past it,
        ``ReplicaUnavailableError`` (``.results``: the entries' results): the records are kept
        here, and the receipt too if it was recorded; calling again with the same arguments
        waits again.
        """
        required = arguments.texts("acknowledged", acknowledged)
        entries = arguments.sequence_of("entries", entries, StageEntry)
        if cut_receipt is not None and self._replicator is not None:
            return self._stage_all_replicated(entries, arguments.cut_receipt(cut_receipt), required)
        return self._stage_all(entries, cut_receipt, required)

    @operation
    def _stage_receipt(self, cut_receipt: tuple[str, str, bytes], acknowledged: Sequence[str]) -> StageResults:
        """A replicated cut's receipt, its records in the replica already (``CutServer`` waited)."""
        return self._stage_all([], cut_receipt, acknowledged)

    def _stage_all(
        self, entries: Sequence[StageEntry], cut_receipt: tuple[str, str, bytes] | None, required: Sequence[str]
    ) -> StageResults:
        """``stage_all`` in one transaction (its arguments checked)."""
        events = [
            self._record_event(entry.record, entry.staging_key, entry.kind, entry.spans, entry.completion)
            for entry in entries
        ]
        staged_here = {event.staging_key for event in events}  # hold their records once staged
        receipt_event = None
        if cut_receipt is not None:
            checkpoint_id, inventory_digest, receipt = arguments.cut_receipt(cut_receipt)
            receipt_body = CutReceiptBody(
                checkpoint_id=checkpoint_id, inventory_digest=inventory_digest, receipt=receipt, domain=self.domain
            )
            receipt_event = NewEvent(EventKind.CUT_RECEIPT, RECEIPT_STREAM, checkpoint_id, receipt_body)

        def work(tx: WriteTransaction) -> StageResults:
            results = StageResults()
            receipt_lookup = None
            if receipt_event is not None:
                body = receipt_event.body
                assert isinstance(body, CutReceiptBody)
                standing, receipt_lookup = tx.receipt_lookup(receipt_event, body.checkpoint_id, body.inventory_digest)
                if standing is not None:
                    # That inventory was served already: its receipt stands, and this serve's
                    # records (which no stored receipt acknowledges) are not written.
                    results.receipt_recorded = False
                    return results
            before = tx.appended  # (a transaction shared with other callers: theirs came first)
            for event, entry in zip(events, entries, strict=True):
                result = stage_event(tx, event, entry.record.digest)
                if not result.ok:
                    raise StagingRefusedError(result.error or "refused")
                results.append(result)
            missing = tx.missing_keys([key for key in required if key not in staged_here])
            if missing:
                raise StagingRefusedError(
                    f"the cut acknowledges key {missing[0]!r}, which holds no record (withdrawn or deleted); "
                    "nothing was written"
                )
            if receipt_event is not None:
                results.receipt_recorded = True
                tx.append(receipt_event, receipt_lookup)  # the entries are other streams' records
            if tx.appended > before:
                results._last_seq = tx.last_seq
            return results

        results = self._log.write(work)
        if self._domain.replicate_terminal and results.receipt_recorded is not False:
            terminal = [
                result for result, event in zip(results, events, strict=True) if event.kind is EventKind.CALL_COMPLETED
            ]
            if terminal:
                self._replicate_terminal(terminal, f"{len(terminal)} terminal record(s) of stage_all")
        return results

    def _stage_all_replicated(
        self, entries: Sequence[StageEntry], cut_receipt: tuple[str, str, bytes], acknowledged: Sequence[str]
    ) -> StageResults:
        """``stage_all`` with a cut receipt in the replicated domain: the entries, then (once they
        and every acknowledged key are in the replica) the receipt, then its ship; all within
        ``replica_wait``, else ``ReplicaUnavailableError`` with the entries' results."""
        replicator = self._replication()
        wait = self._domain.replica_wait
        deadline = time.monotonic() + wait
        checkpoint_id, inventory_digest, _ = cut_receipt
        results = self._unless_served(entries, checkpoint_id, inventory_digest)
        if results.receipt_recorded is False:
            return self._standing(results, checkpoint_id, deadline)
        staged = [result.staging_key for result in results if result.staging_key is not None]
        keys = list(dict.fromkeys([*staged, *acknowledged]))
        there = self._keys_in_replica(keys, deadline, results._last_seq, staged)
        missing = [key for key in keys if key not in there]
        where = f"the replica {self._domain.replica} within replica_wait={wait:g} s"

        def reason() -> str:
            return replicator.last_error or f"the replica did not answer within {wait:g} s"

        if missing:
            raise ReplicaUnavailableError(
                f"stage_all: staged here, but key {missing[0]!r} did not reach {where} ({reason()}); no receipt "
                "was recorded (a replicated receipt is recorded once its records are in the replica): "
                "stage_all again once the replica answers",
                results,
            )
        recorded = self._stage_all([], cut_receipt, acknowledged)
        if recorded.receipt_recorded is False:
            return self._standing(recorded, checkpoint_id, deadline)  # recorded by another caller meanwhile
        receipt_seq = recorded._last_seq
        if receipt_seq is not None and not replicator.reach(receipt_seq, deadline):
            raise ReplicaUnavailableError(
                f"stage_all: the receipt of {checkpoint_id!r} was recorded here but did not reach {where} "
                f"({reason()}); it ships once the replica answers (stage_all again waits for it)",
                results,
            )
        results.receipt_recorded = True
        results._last_seq = receipt_seq
        return results

    def _standing(self, results: StageResults, checkpoint_id: str, deadline: float) -> StageResults:
        """That inventory's receipt stands (nothing was written): returned once everything
        committed here, the receipt included, is in the replica."""
        replicator = self._replication()
        if not replicator.reach(replication.head(self._reader), deadline):
            reason = replicator.last_error or "it did not answer in time"
            raise ReplicaUnavailableError(
                f"stage_all: the receipt of {checkpoint_id!r} is recorded here but is not in the replica "
                f"{self._domain.replica} within replica_wait={self._domain.replica_wait:g} s ({reason}); "
                "it ships once the replica answers",
                results,
            )
        return results

    def _record_event(
        self,
        record: StagedCallRecord,
        staging_key: str | None,
        kind: EventKind,
        spans: Sequence[Span] | None,
        completion: Completion | None,
        recorded_at: float | None = None,
    ) -> NewEvent:
        """The event of one record to stage (a ``StageEntry``'s fields; ``stage`` makes no
        entry); every argument is checked here, before any write."""
        if not isinstance(record, StagedCallRecord):
            kind_of = f"{type(record).__module__}.{type(record).__qualname__}"
            raise InvalidRecordError(f"a StageEntry holds the store's StagedCallRecord, got {kind_of}")
        rollout_id, model_call_id = record.rollout_id, record.model_call_id
        arguments.ids("the record's id", rollout_id, model_call_id, record.parent_call_id)
        kind = arguments.record_kind(kind)
        key = arguments.staging_key(rollout_id, model_call_id, record.staging_key, staging_key, kind)
        arguments.extras(record.extras, record.extras_digest)
        columns = record.columns
        if spans is None:  # a terminal record: its generated tokens, at its version
            checked = generated_spans(columns.token_mask, record.weight_version)
        else:
            checked = arguments.spans(spans, columns.token_mask, kind)
        body = record_body(record, checked, arguments.completion(completion))
        return NewEvent(kind, rollout_id, model_call_id, body, key, columns, recorded_at=recorded_at)

    @operation
    def fetch(self, keys: Sequence[str], *, snapshot_type: type[Any] | None = None) -> list[StagedCallSnapshot]:
        """One verified snapshot per key, in the order asked; ``UnknownKeyError`` if any is absent.

        ``snapshot_type``: a pydantic model class of the wire, NeMo Gym's ``StagedCallSnapshot``
        or ``StagedCallBaseSnapshot``, to get that class's instances (what Gym's
        ``verify_and_linearize`` accepts), each validated by the class itself;
        ``InvalidRecordError`` when it refuses a record (a schema-3 cut chunk: Gym 0.7.0 knows
        only schema 2).  Log-probs are the float32 values the digest commits to (see
        docs/reference.md).
        """
        wanted = arguments.texts("fetch() keys", keys)
        model = None if snapshot_type is None else foreign.snapshot_model(snapshot_type)
        snapshots = self._reader.fetch(wanted)
        if model is None:
            return snapshots
        return [foreign.as_snapshot(snapshot, model) for snapshot in snapshots]

    @operation
    def fetch_chunks(self, keys: Sequence[str]) -> list[StoredChunk]:
        """Like ``fetch``, with each record's version spans and event kind; checksums verified,
        digests not re-hashed.

        Only for callers that verify one digest over the concatenation, as restoring a
        generation cut does (the rebuilt prefix must match the continuation's digest).
        """
        return self._reader.fetch_with_spans(arguments.texts("fetch_chunks() keys", keys), verify_digests=False)

    # --- projections ------------------------------------------------------------------------

    @operation
    def call(self, rollout_id: str, model_call_id: str) -> CallInfo | None:
        """The calls projection for one call (lineage, state, policy versions), or None."""
        arguments.stream(rollout_id, model_call_id)
        return self._reader.call(rollout_id, model_call_id)

    @operation
    def calls(self, rollout_id: str | None = None) -> list[CallInfo]:
        """Every call (of one rollout, when given), in the order they were last written."""
        return self._reader.calls(arguments.optional_text("rollout_id", rollout_id))

    @operation
    def staged_keys(self, rollout_id: str | None = None) -> list[StagedKeyInfo]:
        """Every live staging key (of one rollout and its attempts, when given), in key order."""
        return tree.staged_keys(self._reader, arguments.optional_text("rollout_id", rollout_id))

    def version_spans(self, rollout_id: str, model_call_id: str) -> tuple[VersionSpan, ...]:
        """Which delta positions of the call each policy version generated."""
        info = self.call(rollout_id, model_call_id)
        return () if info is None else info.version_spans

    # --- lineage views (store.lineage) ------------------------------------------------------

    @operation
    def version_tokens(self, rollout_id: str | None = None) -> dict[int, int]:
        """Generated tokens per policy version, store-wide or of one rollout (every attempt)."""
        return versions.version_tokens(self._reader, arguments.optional_text("rollout_id", rollout_id))

    @operation
    def rollout_versions(self, rollout_id: str | None = None) -> list[RolloutVersions]:
        """Per rollout: generated tokens per policy version, and its oldest and newest version."""
        return versions.rollout_versions(self._reader, arguments.optional_text("rollout_id", rollout_id))

    @operation
    def stale(self, current_version: int, max_lag: int) -> StaleReport:
        """Calls holding tokens more than ``max_lag`` versions behind ``current_version``, with counts."""
        return versions.stale(self._reader, current_version, max_lag)

    @operation
    def rollouts(self) -> list[RolloutSummary]:
        """Every rollout, its attempts grouped under it, sorted by id."""
        return tree.rollouts(self._reader)

    @operation
    def lineage(self, rollout_id: str) -> RolloutLineage | None:
        """The call tree of a rollout over every attempt (parents, continuations, states, versions), or None."""
        return tree.lineage(self._reader, arguments.text("rollout_id", rollout_id))

    @operation
    def linearize(self, rollout_id: str) -> LinearizedRollout:
        """Verify and linearize a rollout (every attempt) from the log: ``rows[0]`` is its terminal chain.

        The receipt is built from the calls projection and the terminal records (terminal
        selection of wire-contract 6.3, admission times from the admission events), then
        ``verify_and_linearize_all`` runs; its ``ReceiptVerificationError`` codes say why not.
        """
        return lineage_linearize.linearize_rollout(self._reader, arguments.text("rollout_id", rollout_id))

    @operation
    def export_jsonl(
        self,
        file: str | os.PathLike[str] | IO[str] | IO[bytes],
        *,
        rollout_ids: Sequence[str] | None = None,
        progress: Callable[[int, int], object] | None = None,
    ) -> ExportReport:
        """Write one JSON object per linearized row of every (or each named) rollout, verified as written.

        Streams one rollout at a time.  Rollouts that fail to verify write nothing and are
        listed in the report with their code; ``progress(done, total)`` is called per rollout.
        """
        wanted = None if rollout_ids is None else arguments.texts("rollout_ids", rollout_ids)
        return export.export_jsonl(self._reader, file, wanted, progress)

    @operation
    def replay(self, *, repair: bool = False) -> ReplayReport:
        """Rebuild every projection from the log and compare; ``repair`` replaces differing rows."""
        if repair is True and self._read_only:
            raise ReadOnlyStoreError("replay(repair=True) writes; this store was opened read-only")
        return replay(self._engine, self._backend, repair=arguments.flag("repair", repair))

    @operation
    def audit(self, *, progress: Callable[[int, int], object] | None = None) -> AuditReport:
        """Check the whole store in one streaming pass and report every problem found.

        Checksums and digests of every event, every call's chain (parent lengths, chain and
        cumulative hashes), every continuation, that staged keys point at their own records,
        and that the projections equal a replay.  ``progress(done, total)`` is called with
        events done as the pass goes on.
        """
        if progress is not None and not callable(progress):
            raise InvalidRecordError(f"audit() progress must be callable, got {type(progress).__name__}")
        from store.audit import audit_store  # the audit builds on the store, never the other way

        return audit_store(self._engine, self._backend, progress, read_only=self._read_only)

    # --- policy workers (store.lineage.workers; the coordinator logs them) ---------------------------

    @operation
    def record_worker(
        self,
        kind: str,
        pid: int,
        *,
        index: int,
        joined_seq: int | None = None,
        connected: int,
        expected: int,
        checkpoint_id: str | None = None,
    ) -> int:
        """Log a policy worker joining, stopping or lost (the coordinator does); returns its sequence number."""
        event = worker_log.worker_event(
            kind,
            pid,
            index=index,
            joined_seq=joined_seq,
            connected=connected,
            expected=expected,
            checkpoint_id=checkpoint_id,
        )
        return self._log.write(lambda tx: tx.append(event), durable=False)  # holds no tokens

    @operation
    def workers(self) -> list[worker_log.PolicyWorker]:
        """Every policy worker the coordinator logged, with the calls it staged and those it left in flight."""
        return worker_log.policy_workers(self._engine)

    def _write(self, work: Callable[[WriteTransaction], T], *, durable: bool = True) -> T:
        """The write path for store.shipping (the target of a ship): staging's transaction and checks.

        Not an ``operation``: a ship runs inside the source's operation, and nesting another
        store's gate in it could deadlock a fork; the log refuses writes once closed.
        """
        return self._log.write(work, durable=durable)

    # --- events the worker capture appends ----------------------------------------------------

    @operation
    def record_admission(
        self, rollout_id: str, model_call_id: str, body: AdmissionBody, *, recorded_at: float | None = None
    ) -> None:
        """Log an accepted admission; ``recorded_at`` is its admission time (now when None)."""
        arguments.stream(rollout_id, model_call_id)
        arguments.body(EventKind.CALL_ADMITTED, body)
        at = _recorded_at(recorded_at)
        event = NewEvent(EventKind.CALL_ADMITTED, rollout_id, model_call_id, body, recorded_at=at)
        self._log.write(lambda tx: tx.append(event), durable=False)  # holds no tokens

    @operation
    def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        arguments.stream(rollout_id, model_call_id)
        body = FailureBody(reason=arguments.text("reason", reason, empty=True, free=True))
        event = NewEvent(EventKind.CALL_FAILED, rollout_id, model_call_id, body)
        self._log.write(lambda tx: tx.append(event), durable=False)

    @operation
    def clear_keys(self, rollout_id: str, model_call_id: str, keys: Sequence[str], reason: str) -> None:
        """Withdraw staged cut keys of one call (a rolled-back cut, or chunks made obsolete).

        Keys that hold nothing are skipped; if none is live, nothing is written.  Only the
        call's own cut and flush keys may be withdrawn: any other key is refused
        (``InvalidRecordError``) and nothing is written.
        """
        arguments.stream(rollout_id, model_call_id)
        wanted = list(dict.fromkeys(arguments.texts("clear_keys() keys", keys)))
        reason = arguments.text("reason", reason, empty=True, free=True)
        for key in wanted:
            arguments.clearable_key(rollout_id, model_call_id, key)

        def work(tx: WriteTransaction) -> None:
            live = [key for key in wanted if owned_key(tx, key, rollout_id, model_call_id)]
            if live:
                body = KeysClearedBody(staging_keys=live, reason=reason)
                tx.append(NewEvent(EventKind.KEYS_CLEARED, rollout_id, model_call_id, body))

        if wanted:
            self._log.write(work, durable=False)  # a key that reappears after power loss is harmless

    @operation
    def completion(self, rollout_id: str, model_call_id: str) -> StoredCompletion | None:
        """The call's latest terminal record: its key, digest, generated count and how it finished."""
        arguments.stream(rollout_id, model_call_id)
        return self._reader.completion(rollout_id, model_call_id)

    @operation
    def cut_receipt(self, checkpoint_id: str, inventory_digest: str) -> bytes | None:
        """The receipt (JSON) already returned for this inventory, if any."""
        arguments.text("checkpoint_id", checkpoint_id)
        arguments.text("inventory_digest", inventory_digest)
        return self._reader.cut_receipt(checkpoint_id, inventory_digest)

    def cut_receipts(
        self, *, checkpoint_id: str | None = None, rollout_id: str | None = None
    ) -> list[GenerationCutReceipt]:
        """The cut receipts kept in the log, oldest first: every one, one checkpoint's, or those
        acknowledging a call of ``rollout_id`` (the bare rollout or an attempt's capture key).

        By checkpoint reads that checkpoint's receipts only; by rollout reads every receipt.
        """
        return [receipt for receipt, _ in self.kept_receipts(checkpoint_id=checkpoint_id, rollout_id=rollout_id)]

    @operation
    def kept_receipts(
        self, *, checkpoint_id: str | None = None, rollout_id: str | None = None
    ) -> list[tuple[GenerationCutReceipt, str]]:
        """``cut_receipts``, each with the durability domain it is durable in (``cut_domain``'s
        ``"local"`` or ``"replicated"``), read with it in one pass."""
        checkpoint = arguments.optional_text("checkpoint_id", checkpoint_id)
        rollout = arguments.optional_text("rollout_id", rollout_id)
        kept = [(from_json(raw, GenerationCutReceipt), domain) for raw, domain in self._reader.cut_receipts(checkpoint)]
        if rollout is None:
            return kept
        return [(receipt, domain) for receipt, domain in kept if any(_names(ack, rollout) for ack in receipt.prefixes)]

    def latest_cut(self, rollout_id: str, model_call_id: str) -> GenerationCutPrefixAck | None:
        """The newest ``durable_prefix`` acknowledgement of the call: of its latest attempt that was
        cut, from the newest receipt (what ``RolloutTokenCapture.continue_latest_cut`` continues)."""
        arguments.stream(rollout_id, model_call_id)
        latest: GenerationCutPrefixAck | None = None
        for receipt in self.cut_receipts(rollout_id=rollout_id):
            for ack in receipt.prefixes:
                if ack.model_call_id != model_call_id or ack.disposition != "durable_prefix":
                    continue
                if _names(ack, rollout_id) and (latest is None or ack.attempt_index >= latest.attempt_index):
                    latest = ack
        return latest

    # --- retention (store.retention) -------------------------------------------------------

    @operation
    def retire(self, capture_keys: Sequence[str]) -> RolloutRemoval:
        """Fence capture keys: later stage/stage_all/cuts/admissions/ledger writes for them raise
        ``RolloutFencedError`` and write nothing; staged records stay readable.  ``removed``
        names keys that hold events, ``absent`` the others (fenced too).  Again: a no-op."""
        keys = retention_ids.capture_keys("capture_keys", capture_keys)
        return self._log.write(lambda tx: removal.retire(tx, self._retention, keys))

    @operation
    def forget(self, capture_keys: Sequence[str]) -> RolloutRemoval:
        """Remove the fences of capture keys; ``absent`` names keys that had none."""
        keys = retention_ids.capture_keys("capture_keys", capture_keys)
        return self._log.write(lambda tx: removal.forget(tx, keys), durable=False)

    @operation
    def delete(self, capture_keys: Sequence[str]) -> RolloutRemoval:
        """Remove every event of the capture keys (staged tokens, admissions, ledger rows),
        their projection rows and fences, leaving a tombstone each; ``compact()`` returns the
        space to the file system.  Sequence numbers are never reused."""
        keys = retention_ids.capture_keys("capture_keys", capture_keys)
        return self._log.write(lambda tx: removal.delete(tx, self._retention, keys))

    @operation
    def removal_preview(self, capture_keys: Sequence[str]) -> list[retention_preview.RemovalPreview]:
        """What ``retire``/``forget``/``delete`` would find for each capture key, read without
        writing (also on a read-only store): the events and records a delete would remove, their
        stored bytes, and the fence; ``RemovalPreview.outcome(action)`` says ``removed`` or ``absent``."""
        keys = retention_ids.capture_keys("capture_keys", capture_keys)
        return retention_preview.removal_preview(self._reader, keys)

    @operation
    def retain(self, keys: Sequence[str], *, capture_keys: Sequence[str] | None = None) -> RolloutRemoval:
        """Keep exactly ``keys`` (a commit's retain set, 5.2) of the capture keys in scope
        (``capture_keys``, else those owning a kept key): every other live key of theirs is
        withdrawn, retired or not.  ``removed``: the withdrawn keys; ``absent``: kept keys that
        hold nothing.  The records stay in the log (``delete`` frees space)."""
        keep = list(dict.fromkeys(arguments.texts("retain() keys", keys)))
        scope = None if capture_keys is None else retention_ids.capture_keys("capture_keys", capture_keys)
        return self._log.write(lambda tx: retention_retain.retain(tx, self._retain, keep, scope), durable=False)

    @operation
    def compact(self) -> CompactReport:
        """Give deleted space back to the file system (SQLite: incremental vacuum and a WAL
        truncate, converting an older store once; PostgreSQL: VACUUM)."""
        return compact_store(self._engine, self._backend)

    @operation
    def ledger(self) -> CaptureLedger:
        """The capture ledger (wire-contract 6.5) over this store's log and fences."""
        return CaptureLedger(self._log, self._reader, self._retention, self._calls, self._check_process)

    # --- lifecycle ----------------------------------------------------------------------------

    def _on_close(self, stop: Callable[[], None]) -> Callable[[], None]:
        """Have ``close()`` call ``stop`` first, while the store is still open, so a thread built
        on this store (a capture's flush thread) ends, finishing the write it is in, before
        calls are refused.  Returns the function that removes ``stop``; ``StoreClosedError``
        once the store is closing."""
        token = object()
        with self._close_hooks_lock:
            if self._closing:
                raise StoreClosedError("this store was closed")
            self._close_hooks[token] = stop

        def remove() -> None:
            with self._close_hooks_lock:
                self._close_hooks.pop(token, None)

        return remove

    def close(self) -> None:
        """Close the store.  Threads built on it (a capture's periodic flush) are stopped and
        joined first, a flush in progress committing whole; then calls in flight finish, and a
        write queued behind the batch being committed raises ``StoreClosedError``.  Once
        ``close()`` returns nothing more commits and no connection stays open; every later call
        raises ``StoreClosedError``."""
        with self._close_hooks_lock:
            self._closing = True
            stops, self._close_hooks = list(self._close_hooks.values()), {}
        try:
            for stop in stops:
                try:
                    stop()
                except Exception:  # one object's stop never keeps the store open
                    log.exception("stopping %r before closing the store failed", stop)
        finally:
            self._calls.close(stop_writes=self._log.close, release=self._engine.dispose)

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        schema = "" if self._schema is None else f", schema={self._schema!r}"
        return f"Store({self.url!r}, durability={self._durability!r}{schema})"


def open_store(
    url_or_path: str | os.PathLike[str],
    *,
    durability: str = "full",
    schema: str | None = None,
    read_only: bool = False,
    pool_size: int | None = None,
    replica: str | os.PathLike[str] | None = None,
    domain: str = "local",
    replicate_terminal: bool = False,
    replica_wait: float | None = None,
) -> Store:
    """Open (creating and migrating if needed) a store.

    A plain path is a SQLite file in WAL mode; ``postgresql://...`` uses PostgreSQL, in
    ``schema`` when given (created and migrated on open), so several stores share a database.
    ``durability="full"`` (default) makes every acknowledged stage survive power loss;
    ``"normal"`` may lose the last commits on power loss (never on a process crash).
    On PostgreSQL "normal" commits as "full" does (there is no commit that survives a
    crash of the server's processes without waiting for its WAL flush).
    ``read_only=True`` creates, migrates and changes nothing: the store must exist with
    this library's schema (else ``StorageError``/``MigrationError``), and every write
    raises ``ReadOnlyStoreError``.  ``pool_size`` (PostgreSQL; default 1): the most
    connections the store holds at once, its writer's included; with one, stages and reads
    take turns on it.  SQLite ignores it (a file has no connection limit).

    The durability domain: ``domain="local"`` (default) acknowledges what is durable in this
    store.  ``domain="replicated"`` with ``replica=`` (the URL or path of another store, a
    central PostgreSQL store for a fleet) ships this store's log into the replica
    (``Store.ship``, from a thread of the store's own) and has a generation cut acknowledge a
    ``durable_prefix`` only once every record it names is in the replica, waiting at most
    ``replica_wait`` seconds (default 5); a call whose records did not get there in time is
    acknowledged ``durable_failure``.  ``replicate_terminal=True`` makes a terminal stage wait
    for the replica too, raising ``ReplicaUnavailableError`` (the record kept here) when the wait
    runs out.  Each bad option raises ``ConfigurationError``.
    """
    return Store(
        url_or_path,
        durability=durability,
        schema=schema,
        read_only=read_only,
        pool_size=pool_size,
        replica=replica,
        domain=domain,
        replicate_terminal=replicate_terminal,
        replica_wait=replica_wait,
    )


def _recorded_at(value: float | None) -> float | None:
    if value is not None and (type(value) is not float or not math.isfinite(value)):
        raise InvalidRecordError(f"recorded_at must be a finite float (seconds since the epoch), got {value!r}")
    return value


def _names(ack: GenerationCutPrefixAck, rollout_id: str) -> bool:
    """Whether an acknowledgement is of ``rollout_id``: its bare rollout, or its attempt's capture key."""
    return ack.rollout_id == rollout_id or capture_key(ack.rollout_id, ack.attempt_index) == rollout_id
