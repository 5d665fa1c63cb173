"""The append path: one write transaction per batch, shared by concurrent callers (group commit).

A caller hands ``EventLog.write`` a function of a ``WriteTransaction``.  The first caller to
arrive while no batch is being written becomes the leader: it runs every queued function
in one transaction and commits once, then wakes the others.  Each function runs inside a
savepoint when it shares a batch, so one caller's error never undoes another's events.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from store import failpoints
from store.errors import ReadOnlyStoreError, RolloutFencedError, StorageError, StoreClosedError, StoreError
from store.lifecycle import repeat_through_interrupts
from store.log import schema
from store.log.checkpointer import Checkpointer
from store.log.engine import (
    Backend,
    DeferredStatementError,
    Statement,
    driver_errors,
    lock_wait_ended,
    raw_write_transaction,
    storage_error,
    sync_file,
)
from store.log.events import RECORD_KINDS, EventKind, decode_body, encode_body
from store.projections.fold import (
    CALL_ROW_COLUMNS,
    ROLLOUT_COLUMNS,
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
from store.wire.columns import CHECKSUMMED_COLUMNS, ChecksumParts, encode_floats, encode_ids, encode_mask
from store.wire.digest import PackedColumns

T = TypeVar("T")


@dataclass(frozen=True, init=False)
class NewEvent:
    """An event to append; ``columns`` are stored packed beside the body."""

    kind: EventKind
    rollout_id: str
    model_call_id: str
    body: msgspec.Struct
    staging_key: str | None = None
    columns: PackedColumns | None = None
    # The framework's own cleanup (``Store.retain``) withdraws keys of retired capture keys too.
    past_fence: bool = False
    recorded_at: float | None = None  # None: now; a shipped event keeps its origin's time
    # The stored form (body, ids, mask, log-probs), encoded once when the event is built, so
    # callers build their events before ``EventLog.write`` and the lock is taken with bytes ready.
    stored: tuple[bytes, bytes | None, bytes | None, bytes | None] = field(init=False, repr=False, compare=False)
    size: int = field(init=False, repr=False, compare=False)  # bytes of the stored form (checkpoint pacing)
    # Its checksum's framing, also made here: the append only frames version, pid and time.
    checksum_parts: ChecksumParts = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        kind: EventKind,
        rollout_id: str,
        model_call_id: str,
        body: msgspec.Struct,
        staging_key: str | None = None,
        columns: PackedColumns | None = None,
        past_fence: bool = False,
        recorded_at: float | None = None,
    ) -> None:
        # The fields are set as one ``__dict__`` (a frozen dataclass's own ``__init__`` sets
        # each through ``object.__setattr__``; one event is built per staged record).
        stored: tuple[bytes, bytes | None, bytes | None, bytes | None]
        encoded = encode_body(body)
        if columns is None:
            stored, size = (encoded, None, None, None), len(encoded)
        else:
            ids, mask = encode_ids(columns.token_ids), encode_mask(columns.token_mask)
            log_probs = encode_floats(columns.log_probs)
            stored, size = (encoded, ids, mask, log_probs), len(encoded) + len(ids) + len(mask) + len(log_probs)
        parts = ChecksumParts(rollout_id, model_call_id, _KIND_VALUES[kind], staging_key, stored)
        _set_attribute(
            self,
            "__dict__",
            {
                "kind": kind,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "body": body,
                "staging_key": staging_key,
                "columns": columns,
                "past_fence": past_fence,
                "recorded_at": recorded_at,
                "stored": stored,
                "size": size,
                "checksum_parts": parts,
            },
        )


_set_attribute = object.__setattr__
# Each kind's plain string (``EventKind.value`` is an Enum property: several times a dict lookup).
_KIND_VALUES: dict[EventKind, str] = {kind: kind._value_ for kind in EventKind}


class _Statements:
    """The write path's statements, compiled once for the store's dialect."""

    def __init__(self, engine: Engine) -> None:
        events, keys, calls, receipts = schema.events, schema.staged_keys, schema.calls, schema.cut_receipts
        event_columns = [c for c in events.c if c.name != "seq"]
        # SQLite: seq is the table's rowid, so the driver's ``lastrowid`` is the new event's seq
        # (no RETURNING: one step, none more to read the row back).
        insert_event = sa.insert(events).values({c: sa.bindparam(c.name) for c in event_columns})
        self.insert_event = Statement(insert_event, engine)
        # Where the driver binds by position in these orders (SQLite), the append passes its
        # values as a tuple: no dict per row to be picked apart again.
        self.event_tuple = _binds_in_order(insert_event, engine, EVENT_INSERT_COLUMNS)
        # PostgreSQL: the seq was taken ahead (``take_seq``), so nothing is read back.
        self.insert_event_at = Statement(sa.insert(events).values({c: sa.bindparam(c.name) for c in events.c}), engine)
        self.stream_version = Statement(
            sa.select(sa.func.max(events.c.stream_version)).where(
                events.c.rollout_id == sa.bindparam("rollout_id"),
                events.c.model_call_id == sa.bindparam("model_call_id"),
            ),
            engine,
        )
        self.select_key = Statement(
            sa.select(keys.c.event_seq, keys.c.rollout_id, keys.c.model_call_id, keys.c.digest).where(
                keys.c.staging_key == sa.bindparam("staging_key")
            ),
            engine,
        )
        insert_key = sa.insert(keys).values({c: sa.bindparam(c.name) for c in keys.c})
        self.insert_key = Statement(insert_key, engine)
        self.key_tuple = _binds_in_order(insert_key, engine, KEY_INSERT_COLUMNS)
        self.delete_key = Statement(sa.delete(keys).where(keys.c.staging_key == sa.bindparam("staging_key")), engine)
        self.call_columns = [c.name for c in calls.c]
        self.select_call = Statement(
            sa.select(*calls.c).where(
                calls.c.rollout_id == sa.bindparam("rollout_id"),
                calls.c.model_call_id == sa.bindparam("model_call_id"),
            ),
            engine,
        )
        insert_call = sa.insert(calls).values({c: sa.bindparam(c.name) for c in calls.c})
        self.insert_call = Statement(insert_call, engine)
        self.call_tuple = _binds_in_order(insert_call, engine, CALL_ROW_COLUMNS)
        updated = [c for c in calls.c if c.name not in ("rollout_id", "model_call_id")]
        self.update_call = Statement(
            sa.update(calls)
            .where(
                calls.c.rollout_id == sa.bindparam("b_rollout_id"),
                calls.c.model_call_id == sa.bindparam("b_model_call_id"),
            )
            .values({c: sa.bindparam(c.name) for c in updated}),
            engine,
        )
        self.select_receipt = Statement(
            sa.select(receipts.c.event_seq).where(
                receipts.c.checkpoint_id == sa.bindparam("checkpoint_id"),
                receipts.c.inventory_digest == sa.bindparam("inventory_digest"),
            ),
            engine,
        )
        self.insert_receipt = Statement(
            sa.insert(receipts).values({c: sa.bindparam(c.name) for c in receipts.c}), engine
        )
        self.stream_bodies = Statement(
            sa.select(events.c.kind, events.c.body)
            .where(
                events.c.rollout_id == sa.bindparam("rollout_id"),
                events.c.model_call_id == sa.bindparam("model_call_id"),
            )
            .order_by(events.c.seq),
            engine,
        )
        rollouts = schema.rollouts
        self.select_rollout = Statement(
            sa.select(*(rollouts.c[name] for name in ROLLOUT_COLUMNS)).where(
                rollouts.c.rollout_id == sa.bindparam("rollout_id")
            ),
            engine,
        )
        self.select_fence = Statement(
            sa.select(rollouts.c.fenced, rollouts.c.fence_seq).where(
                rollouts.c.rollout_id == sa.bindparam("rollout_id")
            ),
            engine,
        )
        self.insert_rollout = Statement(
            sa.insert(rollouts).values({c: sa.bindparam(c.name) for c in rollouts.c}), engine
        )
        self.update_rollout = Statement(
            sa.update(rollouts)
            .where(rollouts.c.rollout_id == sa.bindparam("b_rollout_id"))
            .values({c: sa.bindparam(c.name) for c in rollouts.c if c.name != "rollout_id"}),
            engine,
        )
        self.stage_lookup = _stage_lookup(engine)
        postgres = engine.dialect.name == "postgresql"
        self.stage_lookups = _stage_lookups(engine) if postgres else None
        self.stage_lookup_seq = _stage_lookup(engine, next_seq=True) if postgres else None
        self.stage_new = _stage_new_stream_sql(engine) if postgres else None
        workers = schema.workers
        self.select_worker = Statement(sa.select(*workers.c).where(workers.c.join_seq == sa.bindparam("key")), engine)
        self.delete_worker = Statement(sa.delete(workers).where(workers.c.join_seq == sa.bindparam("key")), engine)
        self.insert_worker = Statement(sa.insert(workers).values({c: sa.bindparam(c.name) for c in workers.c}), engine)
        self._engine = engine

    def held_keys(self, count: int) -> Statement:
        """Which of ``count`` staging keys (binds ``k0`` ... ) hold a record.  Compiled once per
        count and driver for the process (about 1.4 ms for 64 keys: a store opened per job
        must not pay it on its first cut)."""
        dialect = self._engine.dialect
        cache_key = (dialect.name, dialect.driver, dialect.paramstyle, count)
        statement = _HELD_KEYS.get(cache_key)
        if statement is None:
            keys = schema.staged_keys
            wanted: list[sa.BindParameter[str]] = [sa.bindparam(f"k{index}", type_=sa.String) for index in range(count)]
            statement = Statement(sa.select(keys.c.staging_key).where(keys.c.staging_key.in_(wanted)), self._engine)
            _HELD_KEYS[cache_key] = statement  # the same text whichever thread compiles it first
        return statement


_HELD_KEYS: dict[tuple[str, str, str, int], Statement] = {}


EVENT_INSERT_COLUMNS = (*CHECKSUMMED_COLUMNS, "checksum")  # every events column but seq
KEY_INSERT_COLUMNS = ("staging_key", "event_seq", "rollout_id", "model_call_id", "digest")
KEYS_PER_STATEMENT = 256  # staging keys one ``missing_keys`` statement asks about


def _binds_in_order(statement: sa.sql.ClauseElement, engine: Engine, names: tuple[str, ...]) -> bool:
    """Whether the dialect binds ``statement``'s parameters by position, in exactly ``names``'s order."""
    order = getattr(statement.compile(dialect=engine.dialect), "positiontup", None)
    return order is not None and tuple(order) == names


def _stage_lookup(engine: Engine, *, next_seq: bool = False) -> Statement:
    """Everything a stage reads, in one statement: the capture key's fence, the staging key,
    the calls row and the stream's last version (one row always: primary-key left joins).
    ``next_seq`` (PostgreSQL): and, last, the next event seq, taken under the write lock."""
    events, keys, calls, rollouts = schema.events, schema.staged_keys, schema.calls, schema.rollouts
    rollout_id: sa.BindParameter[str] = sa.bindparam("rollout_id")
    model_call_id: sa.BindParameter[str] = sa.bindparam("model_call_id")
    one = sa.select(sa.literal_column("1").label("one")).subquery("one")
    last_version = (
        sa.select(sa.func.max(events.c.stream_version))
        .where(events.c.rollout_id == rollout_id, events.c.model_call_id == model_call_id)
        .scalar_subquery()
    )
    joined = (
        one.outerjoin(rollouts, rollouts.c.rollout_id == rollout_id)
        .outerjoin(keys, keys.c.staging_key == sa.bindparam("staging_key"))
        .outerjoin(calls, sa.and_(calls.c.rollout_id == rollout_id, calls.c.model_call_id == model_call_id))
    )
    picked = _lookup_columns(last_version)
    if next_seq:
        picked.append(sa.literal_column("nextval(pg_get_serial_sequence('events', 'seq'))").label("next_seq"))
    return Statement(sa.select(*picked).select_from(joined), engine)


def _stage_new_stream_sql(engine: Engine) -> str:
    """PostgreSQL: a record that opens a new stream, in one statement (``WriteTransaction.
    guess_new_stream``): its event, calls row and key are inserted, with a seq taken under the
    write lock, only if the stream has no event and no calls row, the key is free and the
    capture key is not fenced -- exactly when ``stage_lookup`` would find nothing and the
    append would write these rows.  Returns the seq, or no row (nothing written).

    Parameters are named after their columns (``e_``, ``c_``, ``k_`` per table); each is cast
    to its column's type, as the inserts take them from a SELECT."""
    events, keys, calls, rollouts = schema.events, schema.staged_keys, schema.calls, schema.rollouts

    def cast(prefix: str, column: sa.Column[Any]) -> str:
        return f"%({prefix}{column.name})s::{column.type.compile(dialect=engine.dialect)}"

    def insert(table: sa.Table, prefix: str, seq_column: str) -> str:
        names = [c.name for c in table.c]
        picked = ["s.seq" if c.name == seq_column else cast(prefix, c) for c in table.c]
        return f"INSERT INTO {table.name} ({', '.join(names)}) SELECT {', '.join(picked)} FROM s"

    rollout, call = cast("e_", events.c.rollout_id), cast("e_", events.c.model_call_id)
    key = cast("e_", events.c.staging_key)
    stream = f"rollout_id = {rollout} AND model_call_id = {call}"
    return (
        "WITH s AS (SELECT nextval(pg_get_serial_sequence('events', 'seq')) AS seq"
        f" WHERE NOT EXISTS (SELECT 1 FROM {events.name} WHERE {stream})"
        f" AND NOT EXISTS (SELECT 1 FROM {calls.name} WHERE {stream})"
        f" AND NOT EXISTS (SELECT 1 FROM {keys.name} WHERE staging_key = {key})"
        f" AND NOT EXISTS (SELECT 1 FROM {rollouts.name} WHERE rollout_id = {rollout} AND fenced <> 0)),"
        f" e AS ({insert(events, 'e_', 'seq')}),"
        f" c AS ({insert(calls, 'c_', 'last_seq')}),"
        f" k AS ({insert(keys, 'k_', 'event_seq')})"
        " SELECT seq FROM s"
    )


def _stage_lookups(engine: Engine) -> Statement:
    """PostgreSQL: ``_stage_lookup`` for many streams at once (arrays of rollouts, calls and
    keys, unnested; one row per stream, in the order given)."""
    events, keys, calls, rollouts = schema.events, schema.staged_keys, schema.calls, schema.rollouts
    texts = postgresql.ARRAY(sa.String)
    wanted = (
        sa.func.unnest(
            sa.bindparam("rollout_ids", type_=texts),
            sa.bindparam("model_call_ids", type_=texts),
            sa.bindparam("staging_keys", type_=texts),
        )
        .table_valued("rollout_id", "model_call_id", "staging_key", with_ordinality="n")
        .render_derived(name="wanted")
    )
    last_version = (
        sa.select(sa.func.max(events.c.stream_version))
        .where(events.c.rollout_id == wanted.c.rollout_id, events.c.model_call_id == wanted.c.model_call_id)
        .scalar_subquery()
    )
    joined = (
        wanted.outerjoin(rollouts, rollouts.c.rollout_id == wanted.c.rollout_id)
        .outerjoin(keys, keys.c.staging_key == wanted.c.staging_key)
        .outerjoin(
            calls,
            sa.and_(calls.c.rollout_id == wanted.c.rollout_id, calls.c.model_call_id == wanted.c.model_call_id),
        )
    )
    picked = _lookup_columns(last_version)
    return Statement(sa.select(*picked).select_from(joined).order_by(wanted.c.n), engine)


def _lookup_columns(last_version: sa.ScalarSelect[Any]) -> list[sa.ColumnElement[Any]]:
    """What a stage lookup reads, in ``StageLookup``'s order: the fence, the key, the stream's
    last version and the calls row."""
    rollouts, keys = schema.rollouts, schema.staged_keys
    return [
        rollouts.c.fenced,
        rollouts.c.fence_seq,
        keys.c.event_seq,
        keys.c.rollout_id,
        keys.c.model_call_id,
        keys.c.digest,
        last_version.label("last_version"),
        *schema.calls.c,
    ]


def new_stream_values(new: NewEvent, pid: int, recorded_at: float) -> dict[str, Any] | None:
    """The parameters of ``_stage_new_stream_sql`` for ``new`` (a record opening its stream):
    the rows ``append`` would write for it, folded the same way, the seq left to the statement.
    None if ``new`` adds other keys than its own or withdraws any (not a plain record)."""
    event_row = stored_event_row(new, 1, pid, recorded_at)
    event = Event(0, new.kind, new.rollout_id, new.model_call_id, 1, new.staging_key, new.body)
    added, removed = fold_keys(event)
    if removed or new.staging_key is None or list(added) != [new.staging_key]:
        return None
    key = added[new.staging_key]
    values = dict(zip(_NEW_EVENT_PARAMS, event_row, strict=True))
    values.update(zip(_NEW_CALL_PARAMS, fold_call(None, event).row_values(), strict=True))
    values.update(
        k_staging_key=new.staging_key,
        k_rollout_id=key.rollout_id,
        k_model_call_id=key.model_call_id,
        k_digest=key.digest,
    )
    return values


def stored_event_row(new: NewEvent, version: int, pid: int, recorded_at: float) -> tuple[Any, ...]:
    """The events row of ``new`` at ``version``, in ``EVENT_INSERT_COLUMNS`` order; its checksum
    covers every column that says what the event is (``event_checksum``'s bytes)."""
    body, token_ids, token_mask, log_probs = new.stored
    checksum = new.checksum_parts.checksum(version, pid, recorded_at)
    return (
        new.rollout_id,
        new.model_call_id,
        version,
        _KIND_VALUES[new.kind],
        new.staging_key,
        pid,
        recorded_at,
        body,
        token_ids,
        token_mask,
        log_probs,
        checksum,
    )


_NEW_EVENT_PARAMS = tuple(f"e_{name}" for name in EVENT_INSERT_COLUMNS)
_NEW_CALL_PARAMS = tuple(f"c_{name}" for name in CALL_ROW_COLUMNS)


class StageLookup(NamedTuple):
    """What one stage found in the transaction (``WriteTransaction.stage_lookup``); a named
    tuple: built once per stage inside the batch, where a frozen dataclass costs more."""

    key: KeyState | None
    call: CallState | None
    last_version: int  # the stream's highest stream_version, 0 for a new stream


# A transaction's read-ahead lookups before any: shared, never written (``WriteTransaction``).
_NOTHING_AHEAD: dict[tuple[str, str, str], Any] = {}
_NOTHING_AHEAD_BY_ROLLOUT: dict[str, list[tuple[str, str, str]]] = {}
_NOTHING_AHEAD_BY_KEY: dict[str, tuple[str, str, str]] = {}


class WriteTransaction:
    """What a write function may do inside the shared transaction."""

    def __init__(
        self,
        cursor: Any,
        statements: _Statements,
        pid: int | None = None,
        *,
        guess: bool = False,
        known_streams: Container[tuple[str, str]] = (),
    ) -> None:
        self._cursor = cursor
        self._sql = statements
        self._pid = os.getpid() if pid is None else pid
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
        # Stage lookups read ahead (``read_ahead``), by (rollout, call, key); dropped once stale.
        # Empty and shared until a read ahead makes the transaction its own (most never do).
        self._ahead: dict[tuple[str, str, str], Any] = _NOTHING_AHEAD
        self._ahead_by_rollout: dict[str, list[tuple[str, str, str]]] = _NOTHING_AHEAD_BY_ROLLOUT
        self._ahead_by_key: dict[str, tuple[str, str, str]] = _NOTHING_AHEAD_BY_KEY

    def run(self, statement: Statement, values: dict[str, Any]) -> Any:
        """Run another module's compiled statement in this transaction (retention, log shipping)."""
        self._forget_all_ahead()  # it may change what a read-ahead lookup saw
        return self._execute(statement, values)

    def run_many(self, statement: Statement, rows: list[dict[str, Any]]) -> None:
        self._forget_all_ahead()
        self._cursor.executemany(statement.sql, [statement.params(values) for values in rows])

    def read_ahead(self, streams: list[tuple[str, str, str]], appends: int) -> None:
        """PostgreSQL: read the stage lookups of ``streams`` ((rollout, call, key) each) with one
        statement, and take the seqs of ``appends`` events, in one round trip.  A lookup is
        used by ``stage_lookup`` only while nothing written since could have changed it (no
        event of its rollout or key appended, no other statement run).  SQLite: nothing to gain."""
        statement = self._sql.stage_lookups
        side_cursor = getattr(self._cursor, "side_cursor", None)
        if statement is None or side_cursor is None:
            return
        if self._takes_seqs:
            self._cursor.reserve_seqs(appends)
        wanted = list(dict.fromkeys(streams))
        if not wanted:
            return
        values = {
            "rollout_ids": [stream[0] for stream in wanted],
            "model_call_ids": [stream[1] for stream in wanted],
            "staging_keys": [stream[2] for stream in wanted],
        }
        cursor = side_cursor()
        try:
            rows = cursor.execute(statement.sql, statement.params(values)).fetchall()
        finally:
            cursor.close()
        if self._ahead is _NOTHING_AHEAD:
            self._ahead, self._ahead_by_rollout, self._ahead_by_key = {}, {}, {}
        for stream, row in zip(wanted, rows, strict=True):
            self._ahead[stream] = row
            self._ahead_by_rollout.setdefault(stream[0], []).append(stream)
            self._ahead_by_key[stream[2]] = stream

    def _forget_ahead(self, rollout_id: str, keys: Any) -> None:
        """Drop read-ahead lookups an append made stale (its rollout's, or naming its keys)."""
        if not self._ahead:
            return
        for stream in self._ahead_by_rollout.pop(rollout_id, ()):
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
        self._ahead_by_key.clear()

    def _execute(self, statement: Statement, values: dict[str, Any]) -> Any:
        return self._cursor.execute(statement.sql, statement.params(values))

    def _insert(self, statement: Statement, in_order: bool, names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
        """Run an insert given its values in ``names``'s order: as they are where the driver binds
        them in that order (``in_order``), else by name."""
        if in_order:
            return self._cursor.execute(statement.sql, values)
        return self._execute(statement, dict(zip(names, values, strict=True)))

    def key(self, staging_key: str) -> KeyState | None:
        row = self._execute(self._sql.select_key, {"staging_key": staging_key}).fetchone()
        return None if row is None else KeyState(*row)

    def missing_keys(self, staging_keys: Sequence[str]) -> list[str]:
        """The keys of ``staging_keys`` that hold no record, in order (one statement per
        ``KEYS_PER_STATEMENT`` keys, not one per key)."""
        wanted = list(dict.fromkeys(staging_keys))
        held: set[str] = set()
        for start in range(0, len(wanted), KEYS_PER_STATEMENT):
            part = wanted[start : start + KEYS_PER_STATEMENT]
            # Asked in statements of 1, 2, 4, ... keys (the last key repeated): a call cut again and
            # again names one key more each time, and compiling a statement per count cost ~2 ms a cut.
            size = 1 << (len(part) - 1).bit_length()
            values = {f"k{index}": part[min(index, len(part) - 1)] for index in range(size)}
            held.update(row[0] for row in self._execute(self._sql.held_keys(size), values).fetchall())
        return [key for key in wanted if key not in held]

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
        values = new_stream_values(new, self._pid, time.time() if new.recorded_at is None else new.recorded_at)
        if values is None:
            return False
        cursor = self._cursor.side_cursor()
        cursor.execute(self._sql.stage_new, values)  # not waited for (pipeline)
        self.guessed, self.guessed_stream = cursor, (new.rollout_id, new.model_call_id)
        self.appended += 1
        self.appended_bytes += new.size
        return True

    def stage_lookup(self, rollout_id: str, model_call_id: str, staging_key: str) -> StageLookup:
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
        event_row = stored_event_row(new, version, self._pid, recorded_at)
        sql = self._sql
        if self._takes_seqs:
            seq = int(self._cursor.take_seq())
            stored = dict(zip(EVENT_INSERT_COLUMNS, event_row, strict=True))
            stored["seq"] = seq
            self._execute(sql.insert_event_at, stored)  # not waited for (pipeline)
        else:  # SQLite (PostgreSQL's pipelined cursor always takes seqs ahead)
            seq = int(self._insert(sql.insert_event, sql.event_tuple, EVENT_INSERT_COLUMNS, event_row).lastrowid)
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

    def _project_call(self, event: Event, current: CallState | None) -> None:
        folded = fold_call(current, event)
        if current is None:
            self._insert(self._sql.insert_call, self._sql.call_tuple, CALL_ROW_COLUMNS, folded.row_values())
            return
        row = folded.to_row()
        row["b_rollout_id"], row["b_model_call_id"] = event.rollout_id, event.model_call_id
        self._execute(self._sql.update_call, row)

    def _project_keys(self, event: Event) -> None:
        added, removed = fold_keys(event)
        if self._ahead:
            self._forget_ahead(event.rollout_id, (*added, *removed))
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
        settle = getattr(self._cursor, "settle", None)
        if settle is not None:
            settle()

    def savepoint(self, name: str) -> None:
        self._cursor.execute(f"SAVEPOINT {name}")

    def release(self, name: str) -> None:
        self._cursor.execute(f"RELEASE SAVEPOINT {name}")

    def rollback_to(self, name: str) -> None:
        self._forget_all_ahead()
        self._cursor.execute(f"ROLLBACK TO SAVEPOINT {name}")


class _FailedCaller(Exception):
    """A caller's work failed in a batch run without savepoints."""


class _GuessMissed(Exception):
    """A lone stage's guarded new-stream statement wrote nothing (the stream, key or a fence
    exists): its transaction committed nothing, and the work runs again with lookups."""


class _Wake:
    """A waiting caller's wake-up: a lock held while the wake is unset.  ``set`` and ``clear`` are
    called holding the log's lock, ``wait`` only by the caller's own thread.  A ``threading.Event``
    does the same with a Condition, a lock per wait and Python around each step; this is two
    lock operations a wait.  An interrupted ``wait`` leaves it unusable, as its caller leaves."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def clear(self) -> None:
        if self._set:
            self._set = False
            self._lock.acquire()  # free: ``set`` released it and ``wait`` gave it back

    def wait(self) -> None:
        self._lock.acquire()  # until ``set``
        self._lock.release()


class _Pending(Generic[T]):
    __slots__ = ("ahead", "done", "durable", "error", "guess", "result", "wake", "work")

    def __init__(
        self,
        work: Callable[[WriteTransaction], T],
        durable: bool,
        ahead: Sequence[tuple[str, str, str]] = (),
        guess: bool = False,
    ) -> None:
        self.work = work
        self.durable = durable
        self.ahead = ahead
        self.guess = guess
        self.done = False
        # Set (holding the log's lock) when the caller should look again: its batch was written,
        # or the writer role is free and it is first in the queue.  Each waiting caller has its
        # own, so a commit wakes exactly its callers, none of them contending for the log's lock.
        # Made only when the caller first has to wait: a caller that leads at once never needs one.
        self.wake: _Wake | None = None
        self.result: T | None = None
        self.error: BaseException | None = None


# How long a running batch may wait for the callers of the previous batch to queue again: at
# least this, at most the max, else as long as the last commit took.
GATHER_SECONDS = 0.0005
GATHER_MAX_SECONDS = 0.005
RECENT_BATCHES = 8  # a batch waits for as many callers as the largest of the last few had
MAX_BATCH = 1024  # callers a batch takes in at most (a commit must come)
KNOWN_STREAMS = 4096  # streams remembered as existing (a lone stage of one reads before it writes)
PAGE_BYTES = 4096
COMMIT_PAGES = 4  # pages a commit writes beside its events' own bytes (tables' leaves, indexes)


class EventLog:
    """The single write path of a store: group commit over one writer connection.

    The writer role belongs to one pending write at a time (``_leader``); it is taken with a
    single assignment and given back in a ``finally`` that every path out of ``write``
    runs, so an interrupt (``KeyboardInterrupt``, an async exception) never leaves it taken.
    """

    def __init__(
        self,
        engine: Engine,
        backend: Backend,
        *,
        durable: bool = True,
        wal_path: str | None = None,
        read_only: bool = False,
    ) -> None:
        self._engine = engine
        self._read_only = read_only  # every write is refused before it is queued
        self._backend = backend
        self._durable = durable
        self._wal_path = wal_path  # SQLite: the -wal file a durable acknowledgement may have to sync
        self._statements = _Statements(engine)
        self._pid = os.getpid()  # the events' writer_pid (a forked child sets its own)
        self._checkpointer = (
            None
            if backend.checkpoint_sql is None or read_only
            else Checkpointer(engine, backend.checkpoint_sql, database=wal_path and wal_path.removesuffix("-wal"))
        )
        self._driver_errors = driver_errors(engine)
        self._closed = False
        self._recent_batches: collections.deque[int] = collections.deque([1], maxlen=RECENT_BATCHES)
        self._expected = 1  # the largest of the recent batches: how many callers a batch waits for
        self._last_commit_seconds = 0.0  # how long the last batch's commit took (bounds the gathering)
        # Streams this writer saw exist, most recent last: a lone stage of one of them does not
        # guess a new stream.  A hint only (another process may write any stream): the guess's
        # own guard decides what is written.
        self._known_streams: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._guessing = False  # the batch being written may guess (``WriteTransaction.guess_new_stream``)
        self._reset_state()

    def _reset_state(self) -> None:
        """Fresh locks and an empty queue; no connection (the current one is not closed)."""
        # An RLock: if an interrupt inside Condition.wait leaves it released, the ``with`` that
        # then releases it again fails instead of releasing another thread's hold.
        self._lock = threading.RLock()
        self._finished = threading.Condition(self._lock)  # close() waits for the writer role to be free
        self._arrived = threading.Condition(self._lock)  # a gathering leader waits for callers
        self._queue: list[_Pending[Any]] = []
        self._leader: _Pending[Any] | None = None  # the pending whose thread holds the writer role
        self._batch: list[_Pending[Any]] = []  # what the leader took from the queue
        self._batch_started = False  # the leader began writing its batch
        self._gathering = False
        self._connection: Any = None
        self._fairy: Any = None  # the pool's wrapper of _connection, kept to return it
        self._commit_mode: bool | None = None  # the writer connection's current durability

    def write(
        self,
        work: Callable[[WriteTransaction], T],
        *,
        durable: bool = True,
        ahead: Sequence[tuple[str, str, str]] = (),
        guess: bool = False,
    ) -> T:
        """Run ``work`` in a write transaction and return its result once committed.

        ``durable=False`` is for bookkeeping events that hold no staged tokens: their commit
        does not wait for the disk unless a durable write shares the batch.  ``ahead``: the
        (rollout, call, key) of each record ``work`` stages, read ahead for the whole batch
        in one round trip on PostgreSQL (``WriteTransaction.read_ahead``).  ``guess``: ``work``
        does nothing but one ``stage_event``, so when it runs alone on PostgreSQL it may send its
        record as a new stream's, guarded, and be run again if the guess missed.  Raises
        ``StoreClosedError`` if the log is closed before the write began.
        """
        if self._read_only:
            raise ReadOnlyStoreError("this store was opened read-only; nothing was written")
        pending: _Pending[T] = _Pending(work, durable, ahead, guess)
        try:
            self._take_turn(pending)
            if self._leader is pending:
                self._write_batch(self._batch)
        finally:
            repeat_through_interrupts(self._leave, pending)  # else the writer role stays taken
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]

    def _take_turn(self, pending: _Pending[Any]) -> None:
        """Queue ``pending``; return once another leader wrote it, or with the writer role and a batch."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("this store was closed")
            self._queue.append(pending)
            if self._gathering:
                self._arrived.notify()
            if self._settled_or_leading(pending):
                return
        while True:
            assert pending.wake is not None  # made by _settled_or_leading before it said wait
            pending.wake.wait()
            if pending.done:  # written (set before its wake, never undone): no need for the lock
                return
            with self._lock:
                if self._settled_or_leading(pending):
                    return

    def _settled_or_leading(self, pending: _Pending[Any]) -> bool:
        """(Holding the lock.)  True once another leader wrote ``pending``, or when it takes the
        free writer role with a batch; else False, its ``wake`` cleared for waiting again."""
        if pending.done:
            return True
        if self._leader is not None:
            # Every set happens under the lock: none is lost before the wait.
            if pending.wake is None:
                pending.wake = _Wake()
            else:
                pending.wake.clear()
            return False
        self._leader = pending  # one assignment: from here on _leave gives the role back
        self._batch_started = False
        self._gather()
        self._batch, self._queue = self._queue, []
        return True

    def _leave(self, pending: _Pending[Any]) -> None:
        """Every path out of ``write``: give back the writer role, and settle a batch left unwritten."""
        if pending.done and self._leader is not pending:
            return  # a follower whose batch was written holds nothing (only its own thread leads it)
        with self._lock:
            self._leave_locked(pending)

    def _leave_locked(self, pending: _Pending[Any]) -> None:
        """``_leave``'s steps; each can be repeated after an interrupt."""
        if not pending.done and pending in self._queue:
            self._queue.remove(pending)  # interrupted while waiting or gathering: its work never runs
        if self._leader is pending:
            for other in self._batch:
                if other is not pending and not other.done and other not in self._queue:
                    self._settle_orphan(other)
            self._recent_batches.append(max(1, len(self._batch)))
            self._expected = max(self._recent_batches)
            for other in self._batch:
                if other.done and other.wake is not None:  # None: it never waited (this leader's own)
                    other.wake.set()
            if self._closed:  # close() waits for the role (before it is given back: a repeat notifies again)
                self._finished.notify_all()
            self._batch = []
            self._leader = None
        if self._leader is None and self._queue:
            first = self._queue[0].wake  # the role is free: the first waiting caller takes it
            if first is not None:  # (None: it queued but has not yet looked, and will under the lock)
                first.set()

    def _settle_orphan(self, pending: _Pending[Any]) -> None:
        """A follower whose leader was interrupted (called holding the lock)."""
        if self._closed:
            pending.error = StoreClosedError("this store was closed before the write began")
        elif not self._batch_started:
            self._queue.insert(0, pending)  # never written: a waiting follower leads it next
            return
        elif pending.error is None:
            pending.error = StorageError(
                "the write was interrupted in another thread; it may or may not have been committed "
                "(re-staging an identical record is a no-op)"
            )
        pending.done = True

    def _gather(self) -> None:
        """Wait briefly (``GATHER_SECONDS``) for as many callers as recent batches had before
        the batch starts (called holding the lock); later ones join it while it runs."""
        expected = self._expected
        if expected <= 1 or len(self._queue) >= expected:
            return
        deadline = time.monotonic() + GATHER_SECONDS
        self._gathering = True
        try:
            while len(self._queue) < expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.wait(remaining)
        finally:
            self._gathering = False

    def _take_arrivals(self, batch: list[_Pending[Any]], durable: bool, began: float) -> bool:
        """Move callers that queued while the batch ran into it (its transaction is still open);
        while it is smaller than recent batches, wait for them up to one commit's time from
        ``began`` (bounded by ``GATHER_SECONDS`` and ``GATHER_MAX_SECONDS``).

        The gathering overlaps the batch's own statements, so a leader starts at once and the
        batch fills while it works.  A durable caller never joins a batch that commits without
        a sync; it leads or joins the next one.
        """
        expected = self._expected
        if expected <= 1 and not self._queue:  # one caller at a time: nothing to wait for
            return False
        # Up to one commit's time: callers released by the last commit are usually back by then.
        deadline = began + min(GATHER_MAX_SECONDS, max(GATHER_SECONDS, self._last_commit_seconds))
        with self._lock:
            self._gathering = True
            try:
                while not self._closed and len(batch) < MAX_BATCH:
                    arrived = [pending for pending in self._queue if durable or not pending.durable]
                    if arrived:
                        self._queue = [pending for pending in self._queue if not (durable or not pending.durable)]
                        for pending in arrived:
                            pending.error = pending.result = None
                        batch.extend(arrived)
                        return True
                    remaining = deadline - time.monotonic()
                    if len(batch) >= expected or remaining <= 0:
                        return False
                    self._arrived.wait(remaining)
                return False
            finally:
                self._gathering = False

    def _write_batch(self, batch: list[_Pending[Any]]) -> None:
        """One transaction for the batch.  Savepoints cost two statements per caller, so
        they are used only when a first pass finds a failing caller: then the batch is
        rolled back and run again with each caller isolated (its work only reads and writes
        the transaction, so running it again is safe)."""
        self._batch_started = True
        durable = False
        if self._durable:
            for pending in batch:
                if pending.durable:
                    durable = True
                    break
        isolate = False
        # A lone stage while stages come one at a time (a batch of several reads ahead instead).
        self._guessing = len(batch) == 1 and batch[0].guess and self._expected <= 1 and self._backend.pipelined
        try:
            while True:
                try:
                    self._run_batch(batch, durable, isolate)
                    failpoints.hit("after_commit")
                    return
                except _GuessMissed:
                    self._guessing = False  # nothing was written: run it again, reading first
                except _FailedCaller:
                    if len(batch) == 1 or isolate:
                        return  # the failing caller's error is set; nothing was committed
                    isolate = True
                except DeferredStatementError as exc:
                    if isolate:
                        raise exc.cause from None
                    isolate = True  # a pipelined statement failed: find whose, each caller settled
        except BaseException as exc:
            if not isinstance(exc, StoreError):
                self._discard_writer()  # the connection's state is unknown after a driver error
            for pending in batch:
                if pending.error is None:
                    # An interrupt belongs to the leader's thread; the others get a store error.
                    interrupt = not isinstance(exc, Exception)
                    pending.error = exc if interrupt and pending is self._leader else self._translate(exc)
                pending.result = None
        finally:
            for pending in batch:
                pending.done = True

    def _run_batch(self, batch: list[_Pending[Any]], durable: bool, isolate: bool) -> None:
        for pending in batch:
            pending.error = pending.result = None
        connection = self._writer()
        mode_set = self._commit_mode == durable
        self._commit_mode = durable
        began = time.monotonic()
        guess = self._guessing and not isolate
        with raw_write_transaction(connection, self._backend, durable=durable, mode_set=mode_set) as cursor:
            transaction = WriteTransaction(
                cursor, self._statements, self._pid, guess=guess, known_streams=self._known_streams
            )
            if len(batch) > 1:  # a lone stage reads its lookup in the round trip of its BEGIN
                streams = [stream for pending in batch for stream in pending.ahead]
                transaction.read_ahead(streams, len(streams))
            index = 0
            while True:
                while index < len(batch):
                    if index:
                        failpoints.hit("mid_batch")
                    pending = batch[index]
                    self._run_one(transaction, pending, f"op{index}" if isolate else None)
                    if pending.error is not None and not isolate:
                        raise _FailedCaller  # roll back; run again isolated (or report a lone caller)
                    index += 1
                if isolate or transaction.guessed is not None or not self._take_arrivals(batch, durable, began):
                    # A batch run again isolated keeps exactly its callers; so does a guess, which
                    # may have to run again (the callers it took in would have committed).
                    break
            committing = time.perf_counter()
            unsynced = durable and transaction.appended == 0
            if unsynced and self._backend.force_commit_record_sql is not None:
                cursor.execute(self._backend.force_commit_record_sql)
            failpoints.hit("before_commit")
        if unsynced and self._wal_path is not None:
            sync_file(self._wal_path)
        self._last_commit_seconds = time.perf_counter() - committing
        self._after_commit(connection, transaction.appended_bytes)
        if transaction.guessed is not None:
            try:
                row = transaction.guessed.fetchone()  # arrived with the COMMIT's sync
            finally:
                transaction.guessed.close()
            if row is None:
                raise _GuessMissed
            transaction.last_seq = int(row[0])
            transaction.streams.append(transaction.guessed_stream)
        if self._backend.pipelined:  # only a PostgreSQL stage guesses
            self._remember(transaction.streams)

    def _remember(self, streams: list[tuple[str, str]]) -> None:
        """Note streams seen to exist (most recent last; the oldest forgotten past ``KNOWN_STREAMS``)."""
        known = self._known_streams
        for stream in streams:
            known[stream] = None
            known.move_to_end(stream)
        while len(known) > KNOWN_STREAMS:
            known.popitem(last=False)

    def _after_commit(self, connection: Any, appended_bytes: int) -> None:
        """Pace WAL checkpoints: a background thread's, then the writer's own to finish it (see
        ``store.log.checkpointer``)."""
        checkpointer = self._checkpointer
        if checkpointer is None:
            return
        # Pages the commit wrote, about: the events' stored bytes and a few projection pages.
        checkpointer.committed(appended_bytes + COMMIT_PAGES * PAGE_BYTES)
        if checkpointer.due_in_line() and self._backend.checkpoint_sql is not None:
            # After the commit: a failing checkpoint must not fail callers whose batch committed.
            try:
                cursor = connection.cursor()
                try:
                    if not checkpointer.room_to_finish(cursor):
                        return  # a full disk: the space goes to commits until the checkpoint can finish
                    row = cursor.execute(self._backend.checkpoint_sql).fetchone()
                finally:
                    cursor.close()
            except self._driver_errors:
                return  # the next commit tries again
            # (busy, frames in the -wal, frames copied): the thread still at work, or a reader's
            # snapshot, can leave frames behind; the next commit tries again.
            if row is None or row[2] >= row[1]:
                checkpointer.checkpointed_in_line()

    def _run_one(self, transaction: WriteTransaction, pending: _Pending[Any], savepoint: str | None) -> None:
        if savepoint is not None:
            transaction.savepoint(savepoint)
        appended = transaction.appended
        try:
            pending.result = pending.work(transaction)
            if savepoint is not None:
                transaction.settle()  # its own statements' errors are its own
        except self._driver_errors as exc:
            if lock_wait_ended(exc):
                raise  # the write lock, not this caller: the whole batch fails
            pending.error = storage_error("writing to the store", exc)
            pending.error.__cause__ = exc
        except Exception as exc:  # reported to its own caller; the batch's other work stands
            pending.error = exc
        if savepoint is not None:
            if pending.error is None:
                transaction.release(savepoint)
            else:
                transaction.rollback_to(savepoint)
                transaction.release(savepoint)
                transaction.appended = appended  # its events were undone

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, self._driver_errors):
            error = storage_error("committing to the store", exc)
        elif isinstance(exc, Exception):
            return exc
        else:  # an interrupt of the leader's thread, before or after the commit
            error = StorageError(
                f"the write was interrupted in another thread ({type(exc).__name__}); "
                "it may or may not have been committed (re-staging an identical record is a no-op)"
            )
        error.__cause__ = exc
        return error

    def _writer(self) -> Any:
        if self._connection is None:
            self._fairy = self._engine.raw_connection()
            # The driver's own connection: the write path is hot, the pool's proxy is not needed.
            self._connection = self._fairy.dbapi_connection
            self._commit_mode = None
            self._run_on_writer(self._backend.writer_setup_sql)
        return self._connection

    def _run_on_writer(self, statements: tuple[str, ...]) -> None:
        if statements:
            cursor = self._connection.cursor()
            try:
                for sql in statements:
                    cursor.execute(sql).fetchall()
            finally:
                cursor.close()

    def _discard_writer(self) -> None:
        # Forget it first: even if invalidating is interrupted, the next batch opens a new one.
        fairy, self._fairy, self._connection = self._fairy, None, None
        if fairy is not None:
            with contextlib.suppress(Exception):  # the connection is being thrown away anyway
                fairy.invalidate()

    def release_writer(self) -> None:
        """Return the writer connection to the pool (before a fork: no connection is held in use)."""
        with self._lock:
            if self._connection is not None:
                with contextlib.suppress(*self._driver_errors):  # a broken connection is closed anyway
                    self._run_on_writer(self._backend.writer_reset_sql)
            fairy, self._fairy, self._connection = self._fairy, None, None
        if fairy is not None:
            fairy.close()

    def hold_checkpoints_for_fork(self) -> None:
        """Before a fork: no background checkpoint holds a connection across it."""
        if self._checkpointer is not None:
            self._checkpointer.hold_for_fork()

    def release_checkpoints_after_fork(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.release_after_fork()

    def after_fork_in_child(self) -> None:
        """In a forked child: new locks and queue; the parent's connection is neither used nor closed."""
        self._reset_state()
        self._pid = os.getpid()
        if self._checkpointer is not None:
            self._checkpointer.after_fork_in_child()

    def close(self) -> None:
        """Refuse new writes, fail the queued ones, let the batch being written commit, close the writer."""
        with self._lock:
            self._closed = True
            for pending in self._queue:
                if pending is not self._leader:
                    pending.error = StoreClosedError("this store was closed before the write began")
                    pending.done = True
                    if pending.wake is not None:
                        pending.wake.set()
            self._queue = [pending for pending in self._queue if pending is self._leader]
            self._finished.notify_all()
            while self._leader is not None:
                self._finished.wait()
        self.release_writer()
        if self._checkpointer is not None:
            self._checkpointer.close()
