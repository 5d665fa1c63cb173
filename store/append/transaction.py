"""What a write function may do inside the shared write transaction (``WriteTransaction``): read
the projections, append events and fold them in, under savepoints when it shares a batch."""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, NamedTuple

from store.append.new_event import EVENT_INSERT_COLUMNS, NewEvent, Writer, stored_event_row, this_writer
from store.append.statements import KEY_INSERT_COLUMNS, WriteStatements, held_keys_binds, new_stream_values
from store.errors import RolloutFencedError
from store.log.engine import Statement
from store.log.events import RECORD_KINDS, TOKEN_KINDS, EventKind, decode_body
from store.projections.fold import (
    CALL_ROW_COLUMNS,
    ROLLOUT_KINDS,
    CallState,
    Event,
    KeyState,
    RolloutState,
    WorkerState,
    affects_call,
    fenced_kind,
    filled,
    fold_call,
    fold_keys,
    fold_receipt,
    fold_rollout,
    fold_worker,
    worker_key,
)
from store.projections.tokens import (
    TOKEN_ENTRY_COLUMNS,
    TokenRolloutState,
    fold_token_rollout,
    token_entry_row,
)


class StageLookup(NamedTuple):
    """What one stage found in the transaction (``WriteTransaction.stage_lookup``); a named
    tuple: built once per stage inside the batch, where a frozen dataclass costs more."""

    key: KeyState | None
    call: CallState | None
    last_version: int  # the stream's highest stream_version, 0 for a new stream


# A ship's batch of this many events runs inside ``WriteTransaction.bulk`` (its events stream
# to the server as COPY); a smaller one (a cut's receipt) sends its events as statements with
# the COMMIT (each COPY waits for the statements sent before it: a round trip of its own).
COPY_MIN_ROWS = 16
# Inside ``bulk``, the rows of the smaller tables (calls, keys, a ship's identities: an insert
# queued, or given to ``run_many``) go out as COPY only from this many: fewer go as one
# statement each (``unnest``), sent with the COMMIT without a wait of their own (a COPY of
# them waits for the server twice: a cut's ship of 64 events waited about 1 ms for its keys
# and identities that way).  The events themselves always stream as COPY.
COPY_MANY_ROWS = 256

Stream = tuple[str, str, str | None]  # a read-ahead lookup's (rollout, call, staging key or None)

# A transaction's read-ahead lookups before any: shared, never written (``WriteTransaction``).
_NOTHING_AHEAD: dict[Stream, Any] = {}
_NOTHING_AHEAD_BY_ROLLOUT: dict[str, list[Stream]] = {}
_NOTHING_AHEAD_BY_CALL: dict[tuple[str, str], list[Stream]] = {}
_NOTHING_AHEAD_BY_KEY: dict[str, Stream] = {}


class WriteTransaction:
    """What a write function may do inside the shared transaction."""

    def __init__(
        self,
        cursor: Any,
        statements: WriteStatements,
        writer: Writer | None = None,
        *,
        guess: bool = False,
        known_streams: Container[tuple[str, str]] = (),
        keep_rows: bool = False,
    ) -> None:
        self._cursor = cursor
        self._sql = statements
        self._writer = this_writer(None) if writer is None else writer
        # ``guess_new_stream`` may send its guarded statement (once, before anything else) for
        # a stream not in ``known_streams`` (streams this writer saw exist: a guess would miss).
        self._guess = guess and statements.stage_new is not None and hasattr(cursor, "side_cursor")
        self._known_streams = known_streams
        self.guessed: Any = None  # the cursor whose row says whether the guess held (None: none sent)
        self.guessed_stream = ("", "")
        self.streams: list[tuple[str, str]] = []  # streams found to exist or appended to (the log's hint)
        self.appended = 0  # events appended so far (a durable batch that appended none must still sync)
        self.appended_bytes = 0  # their stored size (paces WAL checkpoints)
        # Capture keys found unfenced in this transaction; a fence appended here clears it.
        self._unfenced: set[str] = set()
        self.last_seq: int | None = None  # the sequence number of the last event appended
        self._takes_seqs = bool(getattr(cursor, "takes_seqs", False))
        # PostgreSQL: the inserts of appended events, calls rows and keys wait here, by statement,
        # and go out as one ``executemany`` each before any other statement (which may read them)
        # and before COMMIT (``flush``): a batch of many records sends three, not three per record.
        self._later: dict[str, list[Any]] = {}
        # Stage lookups read ahead (``read_ahead``), by (rollout, call, key); dropped once stale.
        # Empty and shared until a read ahead makes the transaction its own (most never do).
        self._ahead: dict[Stream, Any] = _NOTHING_AHEAD
        self._ahead_by_rollout: dict[str, list[Stream]] = _NOTHING_AHEAD_BY_ROLLOUT
        self._ahead_by_call: dict[tuple[str, str], list[Stream]] = _NOTHING_AHEAD_BY_CALL
        self._ahead_by_key: dict[str, Stream] = _NOTHING_AHEAD_BY_KEY
        self._bulk = False  # inside ``bulk``: inserts of many rows go out as COPY
        self._copy_later: dict[str, list[tuple[Any, ...]]] = {}  # inside ``bulk``: rows by statement, as tuples
        # PostgreSQL: the calls rows updated since the last flush, by stream (the newest state of
        # each), sent as one statement by ``flush``, after the inserts (a row updated may be one
        # inserted in this transaction): a cut of 64 existing calls sends one update, not 64.
        self._calls_later: dict[tuple[str, str], tuple[Any, ...]] = {}
        # SQLite, ``keep_rows``: each appended event's seq and row as written (``kept``), handed
        # on once the transaction commits (``EventLog``'s ``on_commit``: the replicator ships
        # them without reading them back).  ``foreign``: another module's statement ran here
        # (a ship's identities, retention's deletes): no row of it is handed on.
        # The transport's ``token_rollouts`` rows read or written in this transaction, by rollout
        # (None: no row), while no other module's statement and no rollback can have changed them.
        self._token_rows: dict[str, TokenRolloutState | None] = {}
        self.kept: list[tuple[int, tuple[Any, ...]]] | None = [] if keep_rows else None
        self.foreign = False
        self._kept_marks: dict[str, int] = {}

    def _not_own(self) -> None:
        """Another module writes in this transaction (its rows are not only appended events)."""
        self.foreign = True
        self.kept = None

    def run(self, statement: Statement, values: dict[str, Any]) -> Any:
        """Run another module's compiled statement in this transaction (retention, log shipping)."""
        self._not_own()
        self._forget_all_ahead()  # it may change what a read-ahead lookup saw
        self._token_rows.clear()  # or a transport row (a delete removes them)
        return self._execute(statement, values)

    def run_many(
        self,
        statement: Statement,
        rows: list[dict[str, Any]],
        *,
        unnest: tuple[str, tuple[str, ...]] | None = None,
        copy: tuple[str, tuple[str, ...], tuple[str, ...]] | None = None,
    ) -> None:
        """Run ``statement`` once per row; ``unnest`` (PostgreSQL, ``statements.unnest_insert``):
        the same insert as one statement for all the rows; ``copy`` (``statements.copy_insert``):
        as one ``COPY``, inside ``bulk``."""
        self._not_own()
        self._forget_all_ahead()
        self._token_rows.clear()
        self.flush()
        if copy is not None and self._bulk and len(rows) >= COPY_MANY_ROWS:
            sql, names, types = copy
            self._cursor.copy_rows(sql, types, map(operator.itemgetter(*names), rows))
            return
        if unnest is not None and self._takes_seqs and len(rows) > 1:
            sql, names = unnest
            self._cursor.execute(sql, {name: [row[name] for row in rows] for name in names})
            return
        self._cursor.executemany(statement.sql, [statement.params(values) for values in rows])

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """PostgreSQL: inside, appended events stream to the server with ``COPY`` as they are
        appended (the server stores them while the next are folded), and the waiting inserts of
        many rows go out as one ``COPY`` each (``statements.copy_insert``), not one statement:
        a ship's batch of hundreds of events.  What is still waiting is sent before it ends; a
        failure fails the caller's work.  SQLite: nothing changes."""
        if not hasattr(self._cursor, "copy_rows"):
            yield
            return
        self._bulk = True
        try:
            yield
            self.flush()
            self._cursor.end_copy()
        finally:
            self._bulk = False

    def flush(self) -> None:
        """Send the inserts still waiting (``_later``), in the order their statements first came."""
        if self._copy_later:
            waiting, self._copy_later = self._copy_later, {}
            for sql, tuples in waiting.items():
                copy_sql, names, types = self._sql.copy_rows[sql]
                many = self._sql.many_rows.get(sql)
                if len(tuples) >= COPY_MANY_ROWS or many is None or many[1] != names:
                    self._cursor.copy_rows(copy_sql, types, tuples)
                    continue
                unnest, _ = many  # one statement, its columns in the tuples' order
                self._cursor.execute(unnest, dict(zip(names, map(list, zip(*tuples, strict=True)), strict=True)))
        if self._later:
            later, self._later = self._later, {}
            many_rows = self._sql.many_rows
            for sql, rows in later.items():
                copy = self._sql.copy_rows.get(sql) if self._bulk and len(rows) >= COPY_MANY_ROWS else None
                if copy is not None:
                    copy_sql, names, types = copy
                    self._cursor.copy_rows(copy_sql, types, map(operator.itemgetter(*names), rows))
                    continue
                bulk = many_rows.get(sql)
                if bulk is None or len(rows) == 1:
                    for row in rows:
                        self._cursor.execute(sql, row)
                    continue
                # One statement for all the rows (psycopg's executemany, pipelined, loses track of
                # its prepared statements when a caller of the batch is rolled back to a savepoint).
                unnest, names = bulk
                self._cursor.execute(unnest, {name: [row[name] for row in rows] for name in names})
        if self._calls_later:
            updated, self._calls_later = self._calls_later, {}
            if len(updated) == 1:
                (values,) = updated.values()
                row = dict(zip(CALL_ROW_COLUMNS, values, strict=True))
                row["b_rollout_id"], row["b_model_call_id"] = row["rollout_id"], row["model_call_id"]
                self._cursor.execute(self._sql.update_call.sql, self._sql.update_call.params(row))
            else:
                assert self._sql.update_calls is not None
                sql, names = self._sql.update_calls
                columns = [list(column) for column in zip(*updated.values(), strict=True)]
                self._cursor.execute(sql, dict(zip(names, columns, strict=True)))

    def _insert_later(self, statement: Statement, values: dict[str, Any]) -> None:
        self._later.setdefault(statement.sql, []).append(statement.params(values))

    def read_ahead(
        self,
        streams: Sequence[Stream],
        appends: int,
        also: Sequence[tuple[Statement, dict[str, Any]]] = (),
        meanwhile: Callable[[], object] | None = None,
    ) -> list[list[Any]]:
        """PostgreSQL: read the stage lookups of ``streams`` ((rollout, call, key) each; key None:
        a stream's fence and last version only) with one statement, and take the seqs of
        ``appends`` events, in one round trip.  A lookup is used by ``stage_lookup`` only while
        nothing written since could have changed it (no event of its rollout or key appended,
        no other statement run).  SQLite: nothing to gain.

        ``also``: other modules' read statements (as ``run`` takes them), sent in the same round
        trip, before the lookups; their rows are returned, in order (run one by one on SQLite).
        ``meanwhile``: called once everything is sent, before anything is waited for (the
        caller's own work while the server runs the reads)."""
        statement = self._sql.stage_lookups
        side_cursor = getattr(self._cursor, "side_cursor", None)
        if also:
            self._not_own()
        if statement is None or side_cursor is None:
            found = [self.run(run, values).fetchall() for run, values in also]
            if meanwhile is not None:
                meanwhile()
            return found
        if also:
            self._forget_all_ahead()  # as ``run`` does
        self.flush()
        cursors: list[Any] = []
        try:
            for run, values in also:
                cursors.append(side_cursor())
                cursors[-1].execute(run.sql, run.params(values))  # not waited for (pipeline)
            if self._takes_seqs:
                self._cursor.reserve_seqs(appends)
            wanted = list(dict.fromkeys(streams))
            rows: list[Any] = []
            if wanted:
                lookups = {
                    "rollout_ids": [stream[0] for stream in wanted],
                    "model_call_ids": [stream[1] for stream in wanted],
                    "staging_keys": [stream[2] for stream in wanted],
                }
                cursors.append(side_cursor())
                cursors[-1].execute(statement.sql, statement.params(lookups))
            if meanwhile is not None:
                meanwhile()
            if wanted:
                rows = cursors[-1].fetchall()
            found = [cursor.fetchall() for cursor in cursors[: len(also)]]
        finally:
            for cursor in cursors:
                cursor.close()
        if not wanted:
            return found
        if self._ahead is _NOTHING_AHEAD:
            self._ahead, self._ahead_by_rollout, self._ahead_by_key = {}, {}, {}
            self._ahead_by_call = {}
        for stream, row in zip(wanted, rows, strict=True):
            self._ahead[stream] = row
            self._ahead_by_rollout.setdefault(stream[0], []).append(stream)
            self._ahead_by_call.setdefault((stream[0], stream[1]), []).append(stream)
            if stream[2] is not None:
                self._ahead_by_key[stream[2]] = stream
        return found

    def _forget_ahead(self, event: Event, keys: Any) -> None:
        """Drop read-ahead lookups an append made stale: its stream's (the calls row and last
        version), those naming its keys, and, for an event of the rollout's own (a fence, a
        tombstone, a ledger entry: ``ROLLOUT_KINDS``), every one of its rollout (the fence).
        Other events change nothing else a lookup reads: a cut's 64 calls of one rollout keep
        their lookups read ahead."""
        if not self._ahead:
            return
        if event.kind in ROLLOUT_KINDS:
            stale = self._ahead_by_rollout.pop(event.rollout_id, ())
        else:
            stale = self._ahead_by_call.pop((event.rollout_id, event.model_call_id), ())
        for stream in stale:
            self._ahead.pop(stream, None)
        for key in keys:
            named = self._ahead_by_key.pop(key, None)
            if named is not None:
                self._ahead.pop(named, None)

    def _forget_all_ahead(self) -> None:
        if self._ahead is _NOTHING_AHEAD:
            return  # the shared empty dicts are never changed
        self._ahead.clear()
        self._ahead_by_rollout.clear()
        self._ahead_by_call.clear()
        self._ahead_by_key.clear()

    def _execute(self, statement: Statement, values: dict[str, Any]) -> Any:
        if self._later or self._copy_later or self._calls_later:
            self.flush()
        return self._cursor.execute(statement.sql, statement.params(values))

    def _insert(self, statement: Statement, in_order: bool, names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
        """Run an insert given its values in ``names``'s order: as they are where the driver binds
        them in that order (``in_order``: SQLite, run at once), else by name, later (PostgreSQL)."""
        if in_order:
            return self._cursor.execute(statement.sql, values)
        if self._bulk:  # sent as one COPY of all the statement's rows, in ``names``'s order
            self._copy_later.setdefault(statement.sql, []).append(values)
            return None
        named = dict(zip(names, values, strict=True))
        if self._takes_seqs:
            self._insert_later(statement, named)
            return None
        return self._execute(statement, named)

    def key(self, staging_key: str) -> KeyState | None:
        row = self._execute(self._sql.select_key, {"staging_key": staging_key}).fetchone()
        return None if row is None else KeyState(*row)

    def missing_keys(self, staging_keys: Sequence[str]) -> list[str]:
        """The keys of ``staging_keys`` that hold no record, in order (one statement per
        ``KEYS_PER_STATEMENT`` keys, not one per key).  Each part is counted first: every cut
        asks this of every key its acknowledgements name, and they almost always hold; only a
        part that counts short is read key by key."""
        missing: list[str] = []
        for size, values, part in held_keys_binds(staging_keys):
            if self._execute(self._sql.held_count(size), values).fetchone()[0] == len(part):
                continue
            held = {row[0] for row in self._execute(self._sql.held_keys(size), values).fetchall()}
            missing.extend(key for key in part if key not in held)
        return missing

    def call(self, rollout_id: str, model_call_id: str) -> CallState | None:
        row = self._execute(
            self._sql.select_call, {"rollout_id": rollout_id, "model_call_id": model_call_id}
        ).fetchone()
        return None if row is None else CallState.from_row(dict(zip(self._sql.call_columns, row, strict=True)))

    def receipt_seq(self, checkpoint_id: str, inventory_digest: str) -> int | None:
        row = self._execute(
            self._sql.select_receipt, {"checkpoint_id": checkpoint_id, "inventory_digest": inventory_digest}
        ).fetchone()
        return None if row is None else int(row[0])

    def receipt_lookup(
        self, new: NewEvent, checkpoint_id: str, inventory_digest: str
    ) -> tuple[int | None, StageLookup]:
        """One read before recording the receipt event ``new``: the seq of the receipt of that
        inventory if one stands, and what ``append(new, lookup)`` needs (its stream's fence
        refused here, as ``check_fence`` would, and its last version).  Nothing may be appended
        to the receipt's stream between this and that append."""
        values = {
            "checkpoint_id": checkpoint_id,
            "inventory_digest": inventory_digest,
            "rollout_id": new.rollout_id,
            "model_call_id": new.model_call_id,
        }
        return self.receipt_looked_up(new, self._execute(self._sql.receipt_lookup, values).fetchone())

    def receipt_looked_up(self, new: NewEvent, row: Sequence[Any]) -> tuple[int | None, StageLookup]:
        """``receipt_lookup`` given its statement's row, read by the caller (``receipt_lookup_statement``,
        read ahead with other reads of the transaction, nothing appended to its stream since)."""
        standing, fenced, fence_seq, last_version = row
        if new.rollout_id not in self._unfenced and not new.past_fence:
            if fenced:
                raise RolloutFencedError(new.rollout_id, None if fence_seq is None else int(fence_seq))
            self._unfenced.add(new.rollout_id)
        seq = None if standing is None else int(standing)
        return seq, StageLookup(None, None, int(last_version or 0))

    def stream_bodies(self, rollout_id: str, model_call_id: str) -> list[tuple[EventKind, Any]]:
        """The decoded bodies of one stream's events, in order (the ledger's idempotency check)."""
        values = {"rollout_id": rollout_id, "model_call_id": model_call_id}
        rows = self._execute(self._sql.stream_bodies, values).fetchall()
        decoded = []
        for kind, body in rows:
            event_kind = EventKind(kind)
            decoded.append((event_kind, decode_body(event_kind, bytes(body))))
        return decoded

    def rollout(self, rollout_id: str) -> RolloutState | None:
        row = self._execute(self._sql.select_rollout, {"rollout_id": rollout_id}).fetchone()
        return None if row is None else RolloutState.from_row(row)

    def check_fence(self, rollout_id: str) -> None:
        """Refuse (``RolloutFencedError``) a write for a retired capture key.

        Runs inside the write transaction, so a write queued in a batch behind the fence, or
        in another process, sees it.  One indexed read per capture key per transaction.
        """
        if rollout_id in self._unfenced:
            return
        row = self._execute(self._sql.select_fence, {"rollout_id": rollout_id}).fetchone()
        if row is not None and row[0]:
            raise RolloutFencedError(rollout_id, None if row[1] is None else int(row[1]))
        self._unfenced.add(rollout_id)

    def guess_new_stream(self, new: NewEvent) -> bool:
        """PostgreSQL, a lone stage: send ``new`` (a record) as the first event of a new stream in
        one guarded statement, without reading first; True if sent.  The statement writes exactly
        what ``stage_lookup`` and ``append`` would for a new stream, and nothing if the stream,
        the key or a fence exists (seen under the write lock, as the lookup would).  The log reads
        its row after COMMIT (one round trip for the stage); no row: nothing was written and the
        log runs the work again, with lookups (``EventLog._write_batch``)."""
        if not self._guess:
            return False
        self._guess = False  # once, and only as the transaction's first statement after the lock
        if self.appended or new.kind not in RECORD_KINDS or new.staging_key is None:
            return False
        if (new.rollout_id, new.model_call_id) in self._known_streams:
            return False
        values = new_stream_values(new, self._writer, time.time() if new.recorded_at is None else new.recorded_at)
        if values is None:
            return False
        cursor = self._cursor.side_cursor()
        cursor.execute(self._sql.stage_new, values)  # not waited for (pipeline)
        self.guessed, self.guessed_stream = cursor, (new.rollout_id, new.model_call_id)
        self.appended += 1
        self.appended_bytes += new.size
        return True

    def stage_lookup(self, rollout_id: str, model_call_id: str, staging_key: str | None) -> StageLookup:
        """One read for a stage: refuses a retired capture key as ``check_fence`` does, and
        returns the staging key's row, the calls row and the stream's last version."""
        row = None
        if self._ahead:
            row = self._ahead.pop((rollout_id, model_call_id, staging_key), None)
        if row is None:
            # PostgreSQL: the event's seq comes with this read (one statement fewer).
            take_seq = self._takes_seqs and self._sql.stage_lookup_seq is not None and self._cursor.needs_seq()
            statement = self._sql.stage_lookup_seq if take_seq else self._sql.stage_lookup
            assert statement is not None
            row = self._execute(
                statement, {"rollout_id": rollout_id, "model_call_id": model_call_id, "staging_key": staging_key}
            ).fetchone()
            if take_seq:
                self._cursor.give_seq(int(row[-1]))
                row = row[:-1]
        if row[2] is not None or row[6] or row[7] is not None:
            self.streams.append((rollout_id, model_call_id))  # a guess would miss it
        if rollout_id not in self._unfenced:
            if row[0]:
                raise RolloutFencedError(rollout_id, None if row[1] is None else int(row[1]))
            self._unfenced.add(rollout_id)
        key = None if row[2] is None else KeyState(int(row[2]), row[3], row[4], row[5])
        call = None
        if row[7] is not None:
            call = CallState.from_row(dict(zip(self._sql.call_columns, row[7:], strict=True)))
        return StageLookup(key, call, int(row[6] or 0))

    def append(self, new: NewEvent, lookup: StageLookup | None = None) -> int:
        """Append one event and fold it into the projections; returns its sequence number.

        ``lookup``: what ``stage_lookup`` just read for this event's stream, in this
        transaction with nothing appended since (saves reading the calls row and version again).
        """
        kind = new.kind
        call: CallState | None
        if lookup is not None:  # it refused a fenced capture key already
            call = lookup.call if affects_call(kind) else None
            last_version: int | None = lookup.last_version
        else:
            if fenced_kind(kind) and not new.past_fence:
                self.check_fence(new.rollout_id)
            call = self.call(new.rollout_id, new.model_call_id) if affects_call(kind) else None
            last_version = None
        if call is not None:
            version = call.stream_version + 1  # the calls row tracks its stream's position
        else:
            if last_version is None:
                values = {"rollout_id": new.rollout_id, "model_call_id": new.model_call_id}
                last_version = self._execute(self._sql.stream_version, values).fetchone()[0] or 0
            version = last_version + 1
        recorded_at = time.time() if new.recorded_at is None else new.recorded_at
        event_row = stored_event_row(new, version, self._writer, recorded_at)
        sql = self._sql
        if self._takes_seqs:
            seq = int(self._cursor.take_seq())
            copy_events = self._sql.copy_events
            if self._bulk and copy_events is not None:  # streamed to the server now, while the next are folded
                self._cursor.copy_row(copy_events[0], copy_events[2], (seq, *event_row))
            else:
                stored = dict(zip(EVENT_INSERT_COLUMNS, event_row, strict=True))
                stored["seq"] = seq
                self._insert_later(sql.insert_event_at, stored)
        else:  # SQLite (PostgreSQL's pipelined cursor always takes seqs ahead)
            seq = int(self._insert(sql.insert_event, sql.event_tuple, EVENT_INSERT_COLUMNS, event_row).lastrowid)
            if self.kept is not None:
                self.kept.append((seq, event_row))
        self.appended += 1
        self.appended_bytes += new.size
        self.last_seq = seq
        self.streams.append((new.rollout_id, new.model_call_id))
        event = filled(
            Event,
            {
                "seq": seq,
                "kind": kind,
                "rollout_id": new.rollout_id,
                "model_call_id": new.model_call_id,
                "stream_version": version,
                "staging_key": new.staging_key,
                "body": new.body,
            },
        )
        self._project(event, call)
        return seq

    def _project(self, event: Event, current: CallState | None) -> None:
        kind = event.kind
        if kind in RECORD_KINDS:  # the staging path: a calls row and a key, nothing else
            self._project_call(event, current)
            self._project_keys(event)
            return
        if affects_call(kind):
            self._project_call(event, current)
        self._project_keys(event)
        if kind in ROLLOUT_KINDS:
            self._project_rollout(event)
        receipt = fold_receipt(event)
        if receipt is not None:
            (checkpoint_id, inventory_digest), seq = receipt
            self._execute(
                self._sql.insert_receipt,
                {"checkpoint_id": checkpoint_id, "inventory_digest": inventory_digest, "event_seq": seq},
            )
        worker = worker_key(event)
        if worker is not None:
            self._project_worker(worker, event)
        if kind in TOKEN_KINDS:
            self._project_tokens(event)

    def _project_call(self, event: Event, current: CallState | None) -> None:
        folded = fold_call(current, event)
        if current is None:
            self._insert(self._sql.insert_call, self._sql.call_tuple, CALL_ROW_COLUMNS, folded.row_values())
            return
        if self._takes_seqs and self._sql.update_calls is not None:
            # Sent with the next statement or COMMIT (``flush``): whatever reads the row goes after it.
            self._calls_later[(event.rollout_id, event.model_call_id)] = folded.row_values()
            return
        row = folded.to_row()
        row["b_rollout_id"], row["b_model_call_id"] = event.rollout_id, event.model_call_id
        self._execute(self._sql.update_call, row)

    def _project_keys(self, event: Event) -> None:
        added, removed = fold_keys(event)
        if self._ahead:
            self._forget_ahead(event, (*added, *removed))
        for key in removed:
            self._execute(self._sql.delete_key, {"staging_key": key})
        for key, state in added.items():
            # Callers append a record only under a key they found free in this transaction.
            values = (key, state.event_seq, state.rollout_id, state.model_call_id, state.digest)
            self._insert(self._sql.insert_key, self._sql.key_tuple, KEY_INSERT_COLUMNS, values)

    def _project_worker(self, key: int, event: Event) -> None:
        """Replace the ``workers`` row a worker event changes (rare: no update statement needed)."""
        row = self._execute(self._sql.select_worker, {"key": key}).fetchone()
        current = None if row is None else WorkerState(*row)
        self._execute(self._sql.delete_worker, {"key": key})
        self._execute(self._sql.insert_worker, fold_worker(current, event).to_row())

    def token_lookup(
        self, rollout_id: str, model_call_id: str
    ) -> tuple[TokenRolloutState | None, tuple[bool, int | None], str | None]:
        """One read for a transport write: the rollout's ``token_rollouts`` row, the capture
        key's fence (fenced, fence seq) and the payload digest of the call's entry, if any."""
        row = self._execute(
            self._sql.tokens.lookup, {"rollout_id": rollout_id, "model_call_id": model_call_id}
        ).fetchone()
        width = len(TokenRolloutState.__dataclass_fields__)
        state = None if row[0] is None else TokenRolloutState.from_row(row[:width])
        self._token_rows[rollout_id] = state
        fenced, fence_seq, digest = row[width:]
        if not fenced:
            self._unfenced.add(rollout_id)  # the append's own fence check need not read it again
        return state, (bool(fenced), None if fence_seq is None else int(fence_seq)), digest

    def token_rollout(self, rollout_id: str) -> TokenRolloutState | None:
        if rollout_id in self._token_rows:
            return self._token_rows[rollout_id]
        row = self._execute(self._sql.tokens.select_rollout, {"rollout_id": rollout_id}).fetchone()
        state = None if row is None else TokenRolloutState.from_row(row)
        self._token_rows[rollout_id] = state
        return state

    def _project_tokens(self, event: Event) -> None:
        """Fold a transport event into its rollout's row (and a put's entry row).  A put is
        appended only for a call with no entry (``token_rules.put_entry``: else it is a no-op or
        a conflict), so its entry row is inserted without a look (a second would break the key).
        The rollout's row just read or written in this transaction is not read again."""
        statements = self._sql.tokens
        rollout_id = event.rollout_id
        current = self._token_rows[rollout_id] if rollout_id in self._token_rows else self.token_rollout(rollout_id)
        if event.kind is EventKind.TOKENS_PUT:
            self._execute(statements.insert_entry, dict(zip(TOKEN_ENTRY_COLUMNS, token_entry_row(event), strict=True)))
        folded = fold_token_rollout(current, event)
        row = folded.to_row()
        if current is None:
            self._execute(statements.insert_rollout, row)
        else:
            row["b_rollout_id"] = rollout_id
            self._execute(statements.update_rollout, row)
        self._token_rows[rollout_id] = folded

    def _project_rollout(self, event: Event) -> None:
        current = self.rollout(event.rollout_id)
        folded = fold_rollout(current, event)
        assert folded is not None
        row = folded.to_row()
        if current is None:
            self._execute(self._sql.insert_rollout, row)
        else:
            row["b_rollout_id"] = event.rollout_id
            self._execute(self._sql.update_rollout, row)
        self._unfenced.discard(event.rollout_id)

    def settle(self) -> None:
        """Wait for every statement sent so far and raise the first failure (PostgreSQL sends
        statements in a pipeline; SQLite has run them already)."""
        self.flush()
        settle = getattr(self._cursor, "settle", None)
        if settle is not None:
            settle()

    def savepoint(self, name: str) -> None:
        self.flush()
        self._cursor.execute(f"SAVEPOINT {name}")
        if self.kept is not None:
            self._kept_marks[name] = len(self.kept)

    def release(self, name: str) -> None:
        self.flush()
        self._cursor.execute(f"RELEASE SAVEPOINT {name}")

    def rollback_to(self, name: str) -> None:
        self._forget_all_ahead()
        self._token_rows.clear()  # rows the failed caller read or wrote
        self._later = {}  # the failed caller's inserts never went out: they go with its savepoint
        self._copy_later = {}
        self._calls_later = {}
        abandon_copy = getattr(self._cursor, "abandon_copy", None)
        if abandon_copy is not None:  # its rows still streaming go too
            abandon_copy(RuntimeError("rolled back to its savepoint"))
        self._cursor.execute(f"ROLLBACK TO SAVEPOINT {name}")
        if self.kept is not None:
            del self.kept[self._kept_marks.get(name, 0) :]  # its rows were never committed
