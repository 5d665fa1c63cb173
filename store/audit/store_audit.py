"""The store-wide audit: one streaming pass over the log by sequence number.

It keeps small per-call and per-record state (hashes, lengths, a content hash), never the
token columns of a record it has passed: checksums, digests, chains, continuations, then
the staged keys and the other projections against the fold of the same pass.  Every fault
becomes an ``AuditProblem`` and the pass goes on.  Only two things are read again after the
pass: a record whose parent only appears later in the log (its chain) and, for each leaf of
a lineage, its ancestors' token ids one record at a time (the cumulative hash).
"""

from __future__ import annotations

import hashlib
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
import xxhash
from sqlalchemy.engine import Engine

from store.audit.pages import PageWalk, page_walk, quick_check
from store.audit.report import (
    CHAIN,
    CHECKSUM,
    CONTINUATION,
    CUMULATIVE,
    DIGEST,
    MAX_PROBLEMS,
    MISPLACED,
    MISSING_PARENT,
    PARENT_LENGTH,
    PROJECTION,
    STAGED_KEY,
    STORAGE,
    TOMBSTONE,
    UNDECODABLE,
    AuditProblem,
    AuditReport,
)
from store.errors import CorruptRecordError, StoreError
from store.log import schema
from store.log.engine import Backend, driver_errors, storage_error
from store.log.events import (
    LEDGER_KINDS,
    RECORD_KINDS,
    RETENTION_KINDS,
    AdmissionBody,
    EventKind,
    RecordBody,
    TombstoneBody,
)
from store.projections.fold import Event
from store.projections.tokens import TOKEN_STREAM
from store.queries.integrity import DECODE_ERRORS, verified_event
from store.queries.reads import record_fields, stored_columns
from store.queries.replay import Folded, ReplayDifference, UnreadableRow, paused_gc, stored_rows, table_rows
from store.wire import continuations
from store.wire.codec import from_json
from store.wire.columns import TokenIds, decode_ids
from store.wire.digest import (
    CUMULATIVE_DOMAIN,
    PackedColumns,
    compute_chain_hash,
    hash_token_columns,
    staging_digest_and_columns,
    stored_record_digest,
)
from store.wire.records import GenerationCutContinuation

Progress = Callable[[int, int], object]
_PROGRESS_EVERY = 256
_LIVE_BATCH = 1000


@dataclass(slots=True)
class _Record:
    """What the audit keeps of one record event: hashes and lengths, never its tokens."""

    seq: int
    kind: EventKind
    rollout_id: str
    model_call_id: str
    staging_key: str
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    cum_len: int
    generated: int
    weight_version: int
    chain_hash: str
    cumulative_hash: str
    parent_chain: str | None = None  # the chain hash it chained from, once known
    chain_known: bool = False


@dataclass(slots=True)
class _Restored:
    """One chunk a continued call restored: its key, length and content hash."""

    staging_key: str
    length: int
    content: bytes


@dataclass(slots=True)
class _Call:
    """Per-call state: the latest admission's lineage and continuation, the terminal record."""

    admitted: bool = False
    parent_chain_hash: str | None = None
    continues: tuple[str, str] | None = None
    restored: list[_Restored] | None = None
    completed: _Record | None = None


def audit_store(
    engine: Engine, backend: Backend, progress: Progress | None = None, *, read_only: bool = False
) -> AuditReport:
    """Audit the whole store in one read transaction (a consistent snapshot)."""
    try:
        with engine.connect() as connection, paused_gc(), page_walk(engine, connection, backend, read_only) as walk:
            report = _Audit(connection, progress, walk).run()
            connection.rollback()
    except driver_errors(engine) as exc:
        raise storage_error("auditing the store", exc) from exc
    return report


class _Audit:
    def __init__(self, connection: sa.Connection, progress: Progress | None, walk: PageWalk | None) -> None:
        self.connection = connection
        self.progress = progress
        self.walk = walk
        self.problems: list[AuditProblem] = []
        self.problems_total = 0
        self.counts: Counter[str] = Counter()
        self.calls: dict[tuple[str, str], _Call] = {}
        self.records_by_key: dict[str, _Record] = {}  # every key ever staged: its latest record
        self.by_chain: dict[str, _Record] = {}  # terminal records by their chain hash
        self.chained_from: set[str] = set()
        self.deferred: list[_Record] = []  # chain checks waiting for a parent later in the log
        self.unreadable_streams: set[tuple[str, str]] = set()
        self.unreadable_keys: set[str] = set()
        # The projections rebuilt by the same folds the write path runs.
        self.rebuilt = Folded()
        self.fold = self.rebuilt.fold
        # Capture keys with a delete (a tombstone): their removed events explain gaps, and
        # the events of theirs the pass meets are kept to check the delete really removed them.
        self.deleted = self._deleted_keys()
        self.fully_deleted: set[str] = set()  # capture keys a (not ledger-only) delete emptied
        self.survivors: dict[str, list[tuple[int, EventKind]]] = {}
        self.orphans: set[int] = set()  # records already named as missing their parent
        ids = connection.execute(sa.select(schema.store_identity.c.store_id)).scalars().all()
        self.store_id = str(ids[0]) if len(ids) == 1 else None

    # --- the pass ---------------------------------------------------------------------------

    def run(self) -> AuditReport:
        total = int(self.connection.execute(sa.select(sa.func.count()).select_from(schema.events)).scalar_one())
        done = 0
        self._report_progress(0, total)
        if self.walk is None:
            self._file_pages(quick_check(self.connection) if self.connection.dialect.name == "sqlite" else None)
        for row in stored_rows(self.connection):
            self._event(row)
            done += 1
            if done % _PROGRESS_EVERY == 0:
                self._report_progress(done, total)
        self.counts["events"] = done
        self._deferred_chains()
        self._leaves()
        self._projections()
        if done % _PROGRESS_EVERY:
            self._report_progress(done, total)
        problems = self.problems
        if self.walk is not None:  # its problems go first, where a walk before the pass puts them
            self.problems = []
            self._file_pages(self.walk.result())
            problems = (self.problems + problems)[:MAX_PROBLEMS]
        return AuditReport(
            ok=self.problems_total == 0,
            problems=tuple(problems),
            problems_total=self.problems_total,
            counts=dict(self.counts),
        )

    def _file_pages(self, lines: list[str] | None) -> None:
        """SQLite: every page of the file is well formed (``lines``: what PRAGMA quick_check said).

        Damage in an index, a page's free space or its header is met by no row the pass reads
        (reads may still succeed), so the audit asks SQLite to walk every page of every table.
        Its problems come first in the report, whichever connection walked.
        """
        if lines is None:
            return
        if lines != ["ok"]:
            for line in lines:
                self.problem(STORAGE, f"the database file is damaged: {line}")
        self.counts["file_checked"] = 1

    def _report_progress(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, max(total, done))

    def problem(self, code: str, reason: str, **where: Any) -> None:
        self.problems_total += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(AuditProblem(code, reason, **where))

    def _event(self, row: Mapping[str, Any] | UnreadableRow) -> None:
        if isinstance(row, UnreadableRow):
            self.problem(UNDECODABLE, row.reason, seq=row.seq)
            return
        try:
            event = verified_event(row)
        except CorruptRecordError as exc:
            self._unreadable(row, exc)
            return
        self.fold(event)
        written_for = row.get("store_id")
        if written_for is not None and written_for != self.store_id:
            self.problem(
                MISPLACED,
                f"event {event.seq} was written for store {written_for}, not this one ({self.store_id}): "
                "a pooler or a session's search_path sent it to the wrong schema; that store is missing it",
                **_event_where(event),
            )
        if event.rollout_id in self.deleted:
            self._deleted_stream(event)
        if event.kind is EventKind.CALL_ADMITTED:
            self._admission(event)
        elif event.kind in RECORD_KINDS:
            self._record(event, row)

    # --- deletions: tombstones ----------------------------------------------------------------

    def _deleted_keys(self) -> set[str]:
        rollouts = schema.rollouts
        query = sa.select(rollouts.c.rollout_id).where(rollouts.c.deletions > 0)
        return {row[0] for row in self.connection.execute(query)}

    def _deleted_stream(self, event: Event) -> None:
        """A tombstone explains the gap it left; an event it should have removed is a problem."""
        if event.kind is not EventKind.ROLLOUT_DELETED:
            if event.kind not in RETENTION_KINDS:
                self.survivors.setdefault(event.rollout_id, []).append((event.seq, event.kind))
            return
        body: TombstoneBody = event.body
        self.counts["tombstones"] += 1
        if not body.ledger_only:
            self.fully_deleted.add(event.rollout_id)
        self.counts["deleted_events"] += body.events
        seen = self.survivors.pop(event.rollout_id, [])
        left = [seq for seq, kind in seen if not body.ledger_only or kind in LEDGER_KINDS]
        if body.ledger_only:  # the staged events stay; a later full delete must remove them
            self.survivors[event.rollout_id] = [item for item in seen if item[1] not in LEDGER_KINDS]
        if left:
            reason = f"the delete at event {event.seq} left {len(left)} event(s) of the capture key (first {left[0]})"
            self.problem(TOMBSTONE, reason, seq=event.seq, rollout_id=event.rollout_id)

    def _unreadable(self, row: Mapping[str, Any], exc: CorruptRecordError) -> None:
        """A damaged event: named, and its call and key left out of the projection check
        (they cannot be rebuilt without it; the damage is this one problem)."""
        rollout_id, model_call_id, key = row.get("rollout_id"), row.get("model_call_id"), row.get("staging_key")
        stream = (rollout_id, model_call_id) if isinstance(rollout_id, str) and isinstance(model_call_id, str) else None
        if stream is not None:
            self.unreadable_streams.add(stream)
        if isinstance(key, str):
            self.unreadable_keys.add(key)
        code = CHECKSUM if "checksum" in str(exc) or "cannot hold" in str(exc) else UNDECODABLE
        where = {"rollout_id": stream[0], "model_call_id": stream[1]} if stream else {}
        self.problem(code, str(exc), seq=row.get("seq"), staging_key=key if isinstance(key, str) else None, **where)

    # --- records: digest, chain, continuation -------------------------------------------------

    def _record(self, event: Event, row: Mapping[str, Any]) -> None:
        body: RecordBody = event.body
        key = event.staging_key
        assert key is not None  # verified_event refuses a record event without its key
        self.counts["records"] += 1
        verified = self._verified_ids(event, row)
        if verified is None:
            return
        token_ids, columns = verified
        record = _Record(
            seq=event.seq,
            kind=event.kind,
            rollout_id=event.rollout_id,
            model_call_id=event.model_call_id,
            staging_key=key,
            parent_call_id=body.parent_call_id,
            prev_len=body.prev_len,
            delta_len=body.delta_len,
            cum_len=body.cum_len,
            generated=sum(end - start for start, end, _ in body.spans),
            weight_version=body.weight_version,
            chain_hash=body.chain_hash,
            cumulative_hash=body.cumulative_hash,
        )
        self.records_by_key[key] = record
        call = self.calls.setdefault((event.rollout_id, event.model_call_id), _Call())
        if not self._check_chain(record, token_ids, call):
            self.deferred.append(record)
        if record.parent_call_id is None and hash_token_columns(token_ids) != record.cumulative_hash:
            reason = "the cumulative hash of a root record is not the hash of its tokens"
            self.problem(CUMULATIVE, reason, **_where(record))
        if event.kind is EventKind.CALL_COMPLETED:
            self.by_chain.setdefault(record.chain_hash, record)
            call.completed = record
            if call.restored is not None:
                self._check_resumed(record, columns or stored_columns(row), call.restored)

    def _verified_ids(self, event: Event, row: Mapping[str, Any]) -> tuple[TokenIds, PackedColumns | None] | None:
        """The record's token ids once its digest recomputes from its columns and its body (else
        a problem), and its unpacked columns when they were built (the general path)."""
        body: RecordBody = event.body
        ids, mask, log_probs = bytes(row["token_ids"]), bytes(row["token_mask"]), bytes(row["log_probs"])
        # The common layout is hashed from the stored bytes; anything else (or anything
        # invalid) takes the general path, which validates, unpacks and names the problem.
        fast = stored_record_digest(body, ids, mask, log_probs)
        if fast is not None:
            digest, token_ids = fast
            if digest != body.digest:
                self.problem(DIGEST, "its record does not match its staged digest", **_event_where(event))
                return None
            return token_ids, None
        try:
            columns = stored_columns(row)
            digest, columns = staging_digest_and_columns(
                **record_fields(body),
                digest_version=2,
                extras_digest_version=1,
                token_ids_delta=columns.token_ids,
                token_mask_delta=columns.token_mask,
                generation_log_probs_delta=columns.log_probs,
            )
        except DECODE_ERRORS as exc:
            self.problem(DIGEST, f"its record no longer validates: {exc}", **_event_where(event))
            return None
        if digest != body.digest:
            self.problem(DIGEST, "its record does not match its staged digest", **_event_where(event))
            return None
        return columns.token_ids, columns

    def _check_chain(self, record: _Record, ids: Any, call: _Call) -> bool:
        """Recompute the record's chain hash from its parent's; False when the parent is not known yet."""
        known, parent_chain = self._parent_chain(record, call)
        if not known:
            return False
        self._recompute_chain(record, parent_chain, ids)
        return True

    def _recompute_chain(self, record: _Record, parent_chain: str | None, ids: Any) -> None:
        record.parent_chain, record.chain_known = parent_chain, True
        if parent_chain is not None:
            self.chained_from.add(parent_chain)
        self.counts["chains"] += 1
        if compute_chain_hash(parent_chain, ids) != record.chain_hash:
            parent = "no parent" if parent_chain is None else f"parent chain {parent_chain[:16]}..."
            self.problem(CHAIN, f"its chain hash does not recompute from {parent} and its tokens", **_where(record))

    def _parent_chain(self, record: _Record, call: _Call) -> tuple[bool, str | None]:
        if record.parent_call_id is None:
            return True, None
        parent = self.calls.get((record.rollout_id, record.parent_call_id))
        if parent is not None and parent.completed is not None:
            if parent.completed.cum_len != record.prev_len:
                self.problem(
                    PARENT_LENGTH,
                    f"prev_len {record.prev_len} is not the cum_len {parent.completed.cum_len} "
                    f"of its parent {record.parent_call_id!r} (event {parent.completed.seq})",
                    **_where(record),
                )
            return True, parent.completed.chain_hash
        if call.admitted and call.parent_chain_hash is not None:
            return True, call.parent_chain_hash  # a parent of another attempt, bound by its chain hash
        return False, None

    def _check_resumed(self, record: _Record, columns: PackedColumns, restored: list[_Restored]) -> None:
        """A continued call's terminal record must start with the chunks of the cut it resumed."""
        self.counts["resumed_records"] += 1
        offset = 0
        for index, chunk in enumerate(restored):
            end = offset + chunk.length
            if end > record.delta_len or _content(columns, offset, end) != chunk.content:
                self.problem(
                    CONTINUATION,
                    f"its record does not start with the cut it continued: positions [{offset}, {end}) "
                    f"are not chunk {index} ({chunk.staging_key!r})",
                    **_where(record),
                )
                return
            offset = end

    # --- admissions: continuations ----------------------------------------------------------------

    def _admission(self, event: Event) -> None:
        body: AdmissionBody = event.body
        call = self.calls.setdefault((event.rollout_id, event.model_call_id), _Call())
        call.admitted, call.parent_chain_hash, call.continues = True, body.parent_chain_hash, body.continues
        call.restored = None
        if body.generation_cut is None and body.continues is None:
            return
        self.counts["continuations"] += 1
        where = {"seq": event.seq, "rollout_id": event.rollout_id, "model_call_id": event.model_call_id}
        try:
            if body.generation_cut is None:
                raise CorruptRecordError("it continues a call but carries no continuation")
            continuation = from_json(body.generation_cut, GenerationCutContinuation)
        except (StoreError, *DECODE_ERRORS) as exc:
            self.problem(CONTINUATION, f"its continuation cannot be read: {exc}", **where)
            return
        gone = any(key not in self.records_by_key for key in continuation.staging_keys)
        if gone and continuation.source_capture_key in self.deleted:
            self.counts["continuations_of_deleted"] += 1  # the cut went with its attempt's delete
            return
        reasons = self._continuation_problems(event, body, continuation)
        for reason in reasons:
            self.problem(CONTINUATION, reason, **where)
        if not reasons:
            # The chunks' tokens are read again here (a continuation is rare; a content hash
            # kept for every record would cost every record).
            chunks = [self.records_by_key[key] for key in continuation.staging_keys]
            call.restored = [
                _Restored(chunk.staging_key, chunk.delta_len, _content(self._columns(chunk.seq), 0, chunk.delta_len))
                for chunk in chunks
            ]

    def _continuation_problems(
        self, event: Event, body: AdmissionBody, continuation: GenerationCutContinuation
    ) -> list[str]:
        """Whether the cut it names was staged earlier, by an earlier attempt of the call, as a cut:
        the rules ``begin_call`` admits by (``store.wire.continuations``), read from the log."""
        source = (continuation.source_capture_key, continuation.source_model_call_id)
        reasons = []
        if body.continues != source:
            reasons.append(f"it says it continues {body.continues}, its continuation names {source}")
        own = continuations.own_attempt(event.rollout_id, source[0])
        if own is not None:
            reasons.append(own.message)
        records = [self.records_by_key.get(key) for key in continuation.staging_keys]
        first = records[0] if records else None
        chains = None if first is None or not first.chain_known else first.parent_chain == body.parent_chain_hash
        refusals = continuations.chunk_problems(
            staging_keys=continuation.staging_keys,
            generation_token_count=continuation.generation_token_count,
            chunks=[None if record is None else _facts(record) for record in records],
            owners=self._continued_calls(source),
            parent_call_id=body.parent_call_id,
            prev_len=body.prev_len,
            chains_from_parent=chains,
        )
        return reasons + [refusal.message for refusal in refusals]

    def _continued_calls(self, source: tuple[str, str]) -> set[tuple[str, str]]:
        """The cut call and the calls it continued, oldest last (a chunk may be a record of any)."""
        owners = {source}
        current = self.calls.get(source)
        while current is not None and current.continues is not None and current.continues not in owners:
            owners.add(current.continues)
            current = self.calls.get(current.continues)
        return owners

    # --- after the pass ------------------------------------------------------------------------

    def _deferred_chains(self) -> None:
        """Records whose parent was staged after them: checked now, reading their ids again."""
        for record in self.deferred:
            call = self.calls[(record.rollout_id, record.model_call_id)]
            # One look at the parent (it reports a wrong parent length once), then the ids read again.
            known, parent_chain = self._parent_chain(record, call)
            if not known:
                self._parent_unknown(record, f"its parent {record.parent_call_id!r} was never staged in this log")
                continue
            self._recompute_chain(record, parent_chain, self._token_ids(record.seq))

    def _parent_unknown(self, record: _Record, reason: str) -> None:
        """Unverifiable where the log records the parent's removal (a delete of its capture key,
        or of the attempt the call continues); anywhere else the store holds an orphan."""
        call = self.calls.get((record.rollout_id, record.model_call_id))
        removed = {record.rollout_id} | ({call.continues[0]} if call is not None and call.continues else set())
        if removed & self.fully_deleted:
            self.counts["unverifiable"] += 1
        elif record.seq not in self.orphans:
            self.orphans.add(record.seq)
            self.problem(MISSING_PARENT, f"{reason}, and no delete removed it", **_where(record))

    def _leaves(self) -> None:
        """The cumulative hash of each leaf (a terminal record nothing chained from), over its lineage."""
        for record in self.by_chain.values():
            if record.chain_hash in self.chained_from or record.parent_call_id is None:
                continue  # not a leaf, or a root (checked in the pass)
            lineage, broken = self._lineage(record)
            if lineage is None:
                assert broken is not None
                self._parent_unknown(broken, f"the tokens of its parent {broken.parent_call_id!r} are not in this log")
                continue
            self.counts["leaves"] += 1
            total = sum(ancestor.delta_len for ancestor in lineage)
            if total != record.cum_len:
                reason = f"cum_len {record.cum_len} is not the {total} tokens of its lineage"
                self.problem(CUMULATIVE, reason, **_where(record))
                continue
            hasher = hashlib.sha256(CUMULATIVE_DOMAIN)
            hasher.update(total.to_bytes(8, "big"))
            for ancestor in lineage:
                hasher.update(self._token_ids(ancestor.seq).big_endian().data)
            if hasher.hexdigest() != record.cumulative_hash:
                reason = "its cumulative hash is not the hash of its lineage's tokens"
                self.problem(CUMULATIVE, reason, **_where(record))

    def _lineage(self, leaf: _Record) -> tuple[list[_Record] | None, _Record | None]:
        """Root first; (None, the record whose link is unknown) when a parent's tokens are not in the store."""
        lineage = [leaf]
        current = leaf
        while current.parent_call_id is not None:
            if not current.chain_known or current.parent_chain is None:
                return None, current
            parent = self.by_chain.get(current.parent_chain)
            if parent is None or len(lineage) > len(self.by_chain):
                return None, current
            lineage.append(parent)
            current = parent
        lineage.reverse()
        return lineage, None

    def _columns(self, seq: int) -> PackedColumns:
        events = schema.events
        query = sa.select(events.c.token_ids, events.c.token_mask, events.c.log_probs).where(events.c.seq == seq)
        return stored_columns(self.connection.execute(query).one()._mapping)

    def _token_ids(self, seq: int) -> Any:
        events = schema.events
        data = self.connection.execute(sa.select(events.c.token_ids).where(events.c.seq == seq)).scalar_one()
        return decode_ids(bytes(data))  # the row passed its checksum in this same snapshot

    # --- projections against the fold -----------------------------------------------------------

    def _projections(self) -> None:
        self._compare(schema.staged_keys, ("staging_key",), self._key_problem)
        self._compare(schema.calls, ("rollout_id", "model_call_id"), self._row_problem)
        self._compare(schema.cut_receipts, ("checkpoint_id", "inventory_digest"), self._row_problem)
        self._compare(schema.rollouts, ("rollout_id",), self._row_problem)
        self._compare(schema.workers, ("join_seq",), self._row_problem)
        self._compare(schema.token_rollouts, ("rollout_id",), self._row_problem)
        self._compare(schema.token_entries, ("rollout_id", "model_call_id"), self._row_problem)

    def _compare(
        self, table: sa.Table, key_columns: tuple[str, ...], report: Callable[[ReplayDifference], None]
    ) -> None:
        """Stream the live table against the rebuilt rows (each rebuilt row is dropped once matched).

        Rows are compared as tuples in column order (what the driver's cursor returns); a
        mapping is made only for a row that differs.
        """
        names = [column.name for column in table.c]
        expected_rows = self.rebuilt.row_tuples(table)
        key_of = operator.itemgetter(*(names.index(name) for name in key_columns))
        single = len(key_columns) == 1
        pop = expected_rows.pop
        seen = 0
        for row in self._live_rows(table):
            key = (key_of(row),) if single else key_of(row)
            seen += 1
            expected = pop(key, None)
            if expected != row and not self._skipped(table, key):
                report(ReplayDifference(table.name, key, _mapping(names, row), _mapping(names, expected)))
        self.counts["projection_rows"] += seen
        for key, expected in sorted(expected_rows.items(), key=lambda item: repr(item[0])):
            if not self._skipped(table, key):
                report(ReplayDifference(table.name, key, None, _mapping(names, expected)))

    def _live_rows(self, table: sa.Table) -> Iterator[tuple[Any, ...]]:
        """The live rows as tuples in column order (SQLite: on the raw driver cursor)."""
        try:
            if self.connection.dialect.name == "sqlite":
                yield from table_rows(self.connection, table)
                return
            query = sa.select(*table.c).execution_options(yield_per=_LIVE_BATCH)
            for row in self.connection.execute(query):
                yield tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
        except driver_errors(self.connection.engine) as exc:
            self.problem(PROJECTION, f"the {table.name} table cannot be read to its end: {exc}")

    def _skipped(self, table: sa.Table, key: tuple[Any, ...]) -> bool:
        """Rows of a call or key whose event is damaged (already one problem of its own)."""
        if table is schema.staged_keys:
            return key[0] in self.unreadable_keys
        if table is schema.token_rollouts or table is schema.token_entries:  # a damaged transport event's rollout
            return (key[0], TOKEN_STREAM) in self.unreadable_streams
        return table is schema.calls and key in self.unreadable_streams

    def _key_problem(self, difference: ReplayDifference) -> None:
        (key,) = difference.key
        live, rebuilt = difference.live, difference.rebuilt
        if self._key_names_another_record(key, live):
            return
        if live is None:
            assert rebuilt is not None
            reason = f"the log stages this key at event {rebuilt['event_seq']}, but staged_keys has no row for it"
        elif rebuilt is None:
            reason = f"staged_keys names event {live['event_seq']}, but no live record of the log is under this key"
        else:
            reason = str(difference)
        seq = (live or rebuilt or {}).get("event_seq")
        self.problem(STAGED_KEY, reason, seq=seq, staging_key=key)

    def _key_names_another_record(self, key: str, live: dict[str, Any] | None) -> bool:
        """A live row pointing at an event that is not this key's record: said exactly so."""
        if live is None:
            return False
        events = schema.events
        query = sa.select(events.c.staging_key, events.c.rollout_id, events.c.model_call_id).where(
            events.c.seq == live["event_seq"]
        )
        owner = self.connection.execute(query).first()
        if owner is None or owner.staging_key is None or owner.staging_key == key:
            return False
        reason = (
            f"it points at event {live['event_seq']}, the record of key {owner.staging_key!r} "
            f"({owner.rollout_id}/{owner.model_call_id}), not at its own record"
        )
        self.problem(STAGED_KEY, reason, seq=live["event_seq"], staging_key=key)
        return True

    def _row_problem(self, difference: ReplayDifference) -> None:
        key = difference.key
        where: dict[str, Any] = {}
        if difference.table == "calls":
            where = {"rollout_id": key[0], "model_call_id": key[1]}
        row = difference.live or difference.rebuilt or {}
        seq = row.get("last_seq", row.get("event_seq"))
        self.problem(PROJECTION, f"does not equal a replay of the log: {difference}", seq=seq, **where)


def _mapping(names: list[str], row: tuple[Any, ...] | None) -> dict[str, Any] | None:
    return None if row is None else dict(zip(names, row, strict=True))


def _facts(record: _Record) -> continuations.ChunkFacts:
    return continuations.ChunkFacts(
        staging_key=record.staging_key,
        rollout_id=record.rollout_id,
        model_call_id=record.model_call_id,
        kind=record.kind.value,
        generated=record.generated,
        weight_version=record.weight_version,
        parent_call_id=record.parent_call_id,
        prev_len=record.prev_len,
    )


def _content(columns: PackedColumns, start: int, end: int) -> bytes:
    """xxh3-128 of positions [start, end) of the three columns (a fast identity, not a digest)."""
    hasher = xxhash.xxh3_128()
    hasher.update(columns.token_ids.big_endian()[start:end].data)
    hasher.update(columns.token_mask.big_endian_f32()[start:end].data)
    hasher.update(columns.log_probs.big_endian_f32()[start:end].data)
    return hasher.digest()


def _where(record: _Record) -> dict[str, Any]:
    return {
        "seq": record.seq,
        "staging_key": record.staging_key,
        "rollout_id": record.rollout_id,
        "model_call_id": record.model_call_id,
    }


def _event_where(event: Event) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "staging_key": event.staging_key,
        "rollout_id": event.rollout_id,
        "model_call_id": event.model_call_id,
    }
