"""The write path's statements, compiled once per dialect: the inserts and updates of an append,
the stage lookups (one stream, many, or a guarded new stream in one statement on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from store.append.new_event import EVENT_INSERT_COLUMNS, NewEvent, Writer, stored_event_row
from store.append.token_statements import TokenStatements
from store.log import schema
from store.log.engine import (
    Statement,
)
from store.projections.fold import (
    CALL_ROW_COLUMNS,
    ROLLOUT_COLUMNS,
    Event,
    fold_call,
    fold_keys,
)


class WriteStatements:
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
        self.stage_lookup = stage_lookup_statement(engine)
        self.receipt_lookup = receipt_lookup_statement(engine)
        postgres = engine.dialect.name == "postgresql"
        self.stage_lookups = _stage_lookups(engine) if postgres else None
        self.stage_lookup_seq = stage_lookup_statement(engine, next_seq=True) if postgres else None
        self.stage_new = _stage_new_stream_sql(engine) if postgres else None
        workers = schema.workers
        self.select_worker = Statement(sa.select(*workers.c).where(workers.c.join_seq == sa.bindparam("key")), engine)
        self.delete_worker = Statement(sa.delete(workers).where(workers.c.join_seq == sa.bindparam("key")), engine)
        self.insert_worker = Statement(sa.insert(workers).values({c: sa.bindparam(c.name) for c in workers.c}), engine)
        self.tokens = TokenStatements(engine)  # the complete-record transport's projections
        self._engine = engine
        # PostgreSQL: each insert the transaction sends later as one statement for many rows.
        self.many_rows: dict[str, tuple[str, tuple[str, ...]]] = {}
        # PostgreSQL: the same inserts as one ``COPY`` each, for a transaction that sends many
        # rows (``WriteTransaction.bulk``: a ship's batch).
        self.copy_rows: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
        # Inside ``bulk``, an event's row streams as it is appended: seq, then the insert's columns.
        self.copy_events = copy_insert(events, engine, ("seq", *EVENT_INSERT_COLUMNS)) if postgres else None
        if postgres:
            for statement, table in ((self.insert_event_at, events), (self.insert_call, calls)):
                self.many_rows[statement.sql] = unnest_insert(table, engine)
            self.many_rows[self.insert_key.sql] = unnest_insert(keys, engine)
            # In the order the append gives their values (``_insert``'s names).
            self.copy_rows[self.insert_call.sql] = copy_insert(calls, engine, CALL_ROW_COLUMNS)
            self.copy_rows[self.insert_key.sql] = copy_insert(keys, engine, KEY_INSERT_COLUMNS)
            self.copy_rows[self.insert_event_at.sql] = copy_insert(events, engine)
        # PostgreSQL: the calls rows a transaction updates, sent as one statement (``flush``).
        self.update_calls = unnest_update(calls, ("rollout_id", "model_call_id"), engine) if postgres else None

    def held_keys(self, count: int) -> Statement:
        """``held_keys_statement`` on this transaction's engine."""
        return held_keys_statement(self._engine, count)

    def held_count(self, count: int) -> Statement:
        """``held_keys_statement(..., counted=True)`` on this transaction's engine."""
        return held_keys_statement(self._engine, count, counted=True)


_HELD_KEYS: dict[tuple[str, str, str, int, bool], Statement] = {}


def held_keys_statement(engine: Engine, count: int, *, counted: bool = False) -> Statement:
    """Which of ``count`` staging keys (binds ``k0`` ... ) hold a record, and their event's seq:
    rows of (staging_key, event_seq); ``counted``: one row, how many of them do (a key bound
    twice counts once).  Compiled once per count and driver for the process (about 1.4 ms for
    64 keys: a store opened per job must not pay it on its first cut)."""
    dialect = engine.dialect
    cache_key = (dialect.name, dialect.driver, dialect.paramstyle, count, counted)
    statement = _HELD_KEYS.get(cache_key)
    if statement is None:
        keys = schema.staged_keys
        wanted: list[sa.BindParameter[str]] = [sa.bindparam(name, type_=sa.String) for name in _BIND_NAMES[:count]]
        columns = (sa.func.count(),) if counted else (keys.c.staging_key, keys.c.event_seq)
        query = sa.select(*columns).select_from(keys).where(keys.c.staging_key.in_(wanted))
        statement = _HELD_KEYS[cache_key] = Statement(query, engine)  # the same text whichever thread is first
    return statement


def held_keys_binds(staging_keys: Sequence[str]) -> Iterator[tuple[int, dict[str, str], list[str]]]:
    """``staging_keys`` without repeats, as (count, binds, the keys bound) for
    ``held_keys_statement``: at most ``KEYS_PER_STATEMENT`` keys a statement, in statements of
    1, 2, 4, ... keys (the last key repeated): a call cut again and again names one key more
    each time, and compiling a statement per count cost ~2 ms a cut."""
    wanted = list(dict.fromkeys(staging_keys))
    for start in range(0, len(wanted), KEYS_PER_STATEMENT):
        part = wanted[start : start + KEYS_PER_STATEMENT]
        size = 1 << (len(part) - 1).bit_length()
        yield size, dict(zip(_BIND_NAMES[:size], part + part[-1:] * (size - len(part)), strict=True)), part


KEY_INSERT_COLUMNS = ("staging_key", "event_seq", "rollout_id", "model_call_id", "digest")
KEYS_PER_STATEMENT = 256  # staging keys one ``held_keys_statement`` asks about
_BIND_NAMES = tuple(f"k{index}" for index in range(KEYS_PER_STATEMENT))


def unnest_insert(table: sa.Table, engine: Engine) -> tuple[str, tuple[str, ...]]:
    """PostgreSQL: INSERT of many rows of ``table`` in one statement, one array parameter per
    column (``unnest``), and the column names in the order the arrays go."""
    names = tuple(column.name for column in table.c)
    # Binary parameters (``%b``): an array of bytea in text form is escaped byte by byte.
    arrays = ", ".join(f"%({name})b::{table.c[name].type.compile(dialect=engine.dialect)}[]" for name in names)
    return f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({arrays})", names


def unnest_update(table: sa.Table, keys: tuple[str, ...], engine: Engine) -> tuple[str, tuple[str, ...]]:
    """PostgreSQL: UPDATE of many rows of ``table`` (found by the columns ``keys``) in one
    statement, every other column set from one array parameter per column (``unnest``), and
    the column names in the order the arrays go (the table's).  Each row is named once."""
    names = tuple(column.name for column in table.c)
    arrays = ", ".join(f"%({name})b::{table.c[name].type.compile(dialect=engine.dialect)}[]" for name in names)
    sets = ", ".join(f"{name} = v.{name}" for name in names if name not in keys)
    where = " AND ".join(f"{table.name}.{name} = v.{name}" for name in keys)
    return f"UPDATE {table.name} SET {sets} FROM unnest({arrays}) AS v({', '.join(names)}) WHERE {where}", names


# Each column type's binary COPY form (``copy_insert``); the length of a VARCHAR(n) is still
# checked by the server as it receives the value.
_COPY_TYPES = {"BIGINT": "int8", "INTEGER": "int4", "VARCHAR": "text", "FLOAT": "float8", "BYTEA": "bytea"}


def copy_insert(
    table: sa.Table, engine: Engine, names: tuple[str, ...] | None = None
) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """PostgreSQL: ``COPY`` of many rows of ``table`` in binary form (``_PipelinedCursor.copy_row``):
    the statement, the column names in the order each row gives its values (``names``, else
    the table's), and their types."""
    names = tuple(column.name for column in table.c) if names is None else names
    types = tuple(_COPY_TYPES[table.c[name].type.compile(dialect=engine.dialect).split("(")[0]] for name in names)
    return f"COPY {table.name} ({', '.join(names)}) FROM STDIN (FORMAT BINARY)", names, types


def _binds_in_order(statement: sa.sql.ClauseElement, engine: Engine, names: tuple[str, ...]) -> bool:
    """Whether the dialect binds ``statement``'s parameters by position, in exactly ``names``'s order."""
    order = getattr(statement.compile(dialect=engine.dialect), "positiontup", None)
    return order is not None and tuple(order) == names


def stage_lookup_statement(engine: Engine, *, next_seq: bool = False) -> Statement:
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


def receipt_lookup_statement(engine: Engine) -> Statement:
    """Everything recording a cut receipt reads, in one statement (one row always): the seq of
    the receipt of that inventory if one stands, the receipts stream's fence and its last version."""
    events, rollouts, receipts = schema.events, schema.rollouts, schema.cut_receipts
    rollout_id: sa.BindParameter[str] = sa.bindparam("rollout_id")
    model_call_id: sa.BindParameter[str] = sa.bindparam("model_call_id")
    one = sa.select(sa.literal_column("1").label("one")).subquery("one")
    standing = (
        sa.select(receipts.c.event_seq)
        .where(
            receipts.c.checkpoint_id == sa.bindparam("checkpoint_id"),
            receipts.c.inventory_digest == sa.bindparam("inventory_digest"),
        )
        .scalar_subquery()
    )
    last_version = (
        sa.select(sa.func.max(events.c.stream_version))
        .where(events.c.rollout_id == rollout_id, events.c.model_call_id == model_call_id)
        .scalar_subquery()
    )
    joined = one.outerjoin(rollouts, rollouts.c.rollout_id == rollout_id)
    picked = [standing.label("standing"), rollouts.c.fenced, rollouts.c.fence_seq, last_version.label("last_version")]
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
    """PostgreSQL: ``stage_lookup_statement`` for many streams at once (arrays of rollouts, calls and
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


def new_stream_values(new: NewEvent, writer: Writer, recorded_at: float) -> dict[str, Any] | None:
    """The parameters of ``_stage_new_stream_sql`` for ``new`` (a record opening its stream):
    the rows ``append`` would write for it, folded the same way, the seq left to the statement.
    None if ``new`` adds other keys than its own or withdraws any (not a plain record)."""
    event_row = stored_event_row(new, 1, writer, recorded_at)
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


_NEW_EVENT_PARAMS = tuple(f"e_{name}" for name in EVENT_INSERT_COLUMNS)
_NEW_CALL_PARAMS = tuple(f"c_{name}" for name in CALL_ROW_COLUMNS)
