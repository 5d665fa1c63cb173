"""Replay: rebuild every projection from the log and compare it with the live tables."""

from __future__ import annotations

import gc
import operator
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.errors import CorruptRecordError
from store.log import schema
from store.log.engine import Backend, driver_errors, storage_error
from store.log.events import RECORD_KINDS, TOKEN_KINDS, WORKER_KINDS, EventKind, TokenPutBody
from store.projections.fold import (
    CALL_ROW_COLUMNS,
    ROLLOUT_KINDS,
    CallState,
    Event,
    KeyState,
    RolloutState,
    WorkerState,
    affects_call,
    fold_call,
    fold_keys,
    fold_receipt,
    fold_rollout,
    fold_worker,
    staged_key_row,
    worker_key,
)
from store.projections.tokens import TokenRolloutState, fold_token_rollout, token_entry_row
from store.queries.integrity import undecodable_text, verified_event

_MAX_DIFFERENCES = 50


@dataclass(frozen=True)
class ReplayDifference:
    """One projection row that differs: ``live`` or ``rebuilt`` is None when the row is missing there."""

    table: str
    key: tuple[Any, ...]
    live: dict[str, Any] | None
    rebuilt: dict[str, Any] | None

    def __str__(self) -> str:
        if self.live is None:
            return f"{self.table}{self.key}: missing from the live table"
        if self.rebuilt is None:
            return f"{self.table}{self.key}: live row has no event behind it"
        fields = sorted(k for k in self.rebuilt if self.live.get(k) != self.rebuilt.get(k))
        return f"{self.table}{self.key}: differs in {', '.join(fields)}"


@dataclass(frozen=True)
class ReplayReport:
    """``ok`` is true when the projections rebuilt from the log equal the live ones."""

    ok: bool
    events: int
    differences: tuple[ReplayDifference, ...]
    differences_total: int
    repaired: bool = False
    # The events (by sequence number) that could not be read or decoded, and why: a log
    # that is not fully readable is never reported healthy, whatever the projections say.
    undecodable: tuple[tuple[int, str], ...] = ()

    def summary(self) -> str:
        if self.ok:
            return f"replayed {self.events} events: every projection matches the log"
        lines = [f"replayed {self.events} events: {self.differences_total} projection row(s) differ"]
        if self.undecodable:
            lines.append(f"  {len(self.undecodable)} event(s) could not be decoded and were left out of the replay")
            lines += [f"  {reason}" for _, reason in self.undecodable[:_MAX_DIFFERENCES]]
        lines += [f"  {difference}" for difference in self.differences]
        if self.repaired:
            lines.append("  the live projections were replaced by the rebuilt ones")
        return "\n".join(lines)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a pass over the whole log.

    The pass builds many small acyclic objects (freed by reference counting) while its
    projection dictionaries grow; the collector would walk those dictionaries again and
    again for nothing (a quarter of a replay's time).  It is re-enabled on the way out.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class UnreadableRow:
    """A row of the log the driver could not even read (text that is not UTF-8)."""

    seq: int
    reason: str


# Rows fetched per round trip: a few MB of token columns at most, whatever the log's size.
ROWS_PER_FETCH = 64


# SQLite's rows are read on the raw driver cursor (SQLAlchemy's row processing was a large
# share of a replay); PostgreSQL's go through SQLAlchemy, whose server-side cursor streams.
_EVENT_COLUMNS = tuple(column.name for column in schema.events.c)
_SQLITE_ROWS_AFTER = f"SELECT {', '.join(_EVENT_COLUMNS)} FROM {schema.events.name} WHERE seq > ? ORDER BY seq"


def stored_rows(connection: sa.Connection) -> Iterator[Mapping[Any, Any] | UnreadableRow]:
    """Every row of the log in sequence order, streamed; a row the driver cannot read is
    yielded as ``UnreadableRow`` and the scan goes on after it."""
    events = schema.events
    after: int | None = None
    raw = connection.dialect.name == "sqlite"
    while True:
        query = sa.select(*events.c).order_by(events.c.seq).execution_options(yield_per=ROWS_PER_FETCH)
        if after is not None:
            query = query.where(events.c.seq > after)
        try:
            if raw:
                for values in _sqlite_rows(connection, -1 if after is None else after):
                    after = values["seq"]
                    yield values
                return
            for row in connection.execute(query):
                after = row.seq
                yield row._mapping
            return
        except driver_errors(connection.engine) as exc:
            if not undecodable_text(exc):
                raise
        # The failing batch lost its rows: read on one row at a time up to the unreadable one.
        after = yield from _rows_one_by_one(connection, after)
        if after is None:
            return


def _sqlite_rows(connection: sa.Connection, after: int) -> Iterator[dict[str, Any]]:
    """The log's rows after ``after`` on the raw sqlite3 cursor of the connection's transaction."""
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        # sqlite3 steps the statement row by row as the cursor is iterated: bounded memory.
        for row in cursor.execute(_SQLITE_ROWS_AFTER, (after,)):
            yield dict(zip(_EVENT_COLUMNS, row, strict=True))
    finally:
        cursor.close()


def _rows_one_by_one(
    connection: sa.Connection, after: int | None
) -> Generator[Mapping[Any, Any] | UnreadableRow, None, int | None]:
    """Rows after ``after`` one at a time, up to and including the first unreadable one;
    returns its sequence number (None when the log ends first)."""
    events = schema.events
    while True:
        next_seq = sa.select(sa.func.min(events.c.seq))
        if after is not None:
            next_seq = next_seq.where(events.c.seq > after)
        seq = connection.execute(next_seq).scalar()
        if seq is None:
            return None
        try:
            row = connection.execute(sa.select(*events.c).where(events.c.seq == seq)).one()
        except driver_errors(connection.engine) as exc:
            if not undecodable_text(exc):
                raise
            yield UnreadableRow(seq, f"event {seq} holds text that is not UTF-8 (the file is damaged)")
            return int(seq)
        yield row._mapping
        after = int(seq)


def verified_events(connection: sa.Connection, undecodable: list[tuple[int, str]]) -> Iterator[Event]:
    """The log in sequence order, each event checked; a damaged or unreadable one is left out
    and named in ``undecodable`` (sequence number, reason)."""
    for row in stored_rows(connection):
        if isinstance(row, UnreadableRow):
            undecodable.append((row.seq, row.reason))
            continue
        try:
            yield verified_event(row)
        except CorruptRecordError as exc:
            undecodable.append((row["seq"], str(exc)))


def rebuild(connection: sa.Connection, undecodable: list[tuple[int, str]] | None = None) -> tuple[int, Folded]:
    """Fold the whole log, in sequence order, into projection rows (undecodable events left out)."""
    skipped: list[tuple[int, str]] = [] if undecodable is None else undecodable
    folded = Folded()
    fold = folded.fold
    count = 0
    for event in verified_events(connection, skipped):
        count += 1
        fold(event)
    return count + len(skipped), folded


# Which projections an event kind touches, decided once per kind (a set lookup per event
# instead of a call into each fold that returns "nothing to do").
_CALL_KINDS = frozenset(kind for kind in EventKind if affects_call(kind))
_KEY_KINDS = RECORD_KINDS | {EventKind.KEYS_CLEARED}
_KEYS_CLEARED = EventKind.KEYS_CLEARED
# ``Folded.fold`` tests them in turn: keys are folded with calls, the others are disjoint.
assert _KEY_KINDS <= _CALL_KINDS and not (_CALL_KINDS & (ROLLOUT_KINDS | WORKER_KINDS))


class Folded:
    """The projections rebuilt from the log by the same folds the write path runs."""

    __slots__ = ("calls", "keys", "receipts", "rollouts", "token_entries", "token_rollouts", "workers")

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], CallState] = {}
        # staged_keys rows as the live table holds them, by primary key: a KeyState per key
        # only to turn it back into this row was a share of every pass.
        self.keys: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.receipts: dict[tuple[str, str], int] = {}
        self.rollouts: dict[str, RolloutState] = {}
        self.workers: dict[int, WorkerState] = {}
        self.token_rollouts: dict[str, TokenRolloutState] = {}
        self.token_entries: dict[tuple[str, str], tuple[Any, ...]] = {}  # rows by primary key

    def fold(self, event: Event) -> None:
        """Fold one event into every projection it touches."""
        kind = event.kind
        if kind in _CALL_KINDS:
            stream = (event.rollout_id, event.model_call_id)
            calls = self.calls
            calls[stream] = fold_call(calls.get(stream), event)
            if kind in RECORD_KINDS:
                row = staged_key_row(event)
                self.keys[(row[0],)] = row
            elif kind is _KEYS_CLEARED:
                keys = self.keys
                for key in fold_keys(event)[1]:
                    keys.pop((key,), None)
        elif kind is EventKind.CUT_RECEIPT:
            receipt = fold_receipt(event)
            if receipt is not None:
                self.receipts[receipt[0]] = receipt[1]
        elif kind in ROLLOUT_KINDS:
            folded = fold_rollout(self.rollouts.get(event.rollout_id), event)
            if folded is not None:
                self.rollouts[event.rollout_id] = folded
        elif kind in WORKER_KINDS:
            worker = worker_key(event)
            if worker is not None:
                self.workers[worker] = fold_worker(self.workers.get(worker), event)
        elif kind in TOKEN_KINDS:
            self._fold_tokens(event)

    def _fold_tokens(self, event: Event) -> None:
        """A transport event: its rollout's row, and a put's entry row (the first put of a call;
        the append writes no other)."""
        new_entry = True
        if event.kind is EventKind.TOKENS_PUT:
            body = event.body
            assert isinstance(body, TokenPutBody)
            key = (event.rollout_id, body.model_call_id)
            new_entry = key not in self.token_entries
            if new_entry:
                self.token_entries[key] = token_entry_row(event)
        current = self.token_rollouts.get(event.rollout_id)
        self.token_rollouts[event.rollout_id] = fold_token_rollout(current, event, new_entry=new_entry)

    def row_tuples(self, table: sa.Table) -> dict[tuple[Any, ...], tuple[Any, ...]]:
        """One table's rebuilt rows as tuples in column order (the live tables' form); its
        folded states are released as it goes."""
        name = table.name
        if name == "staged_keys":
            keys, self.keys = self.keys, {}
            return keys  # already rows by primary key
        if name == "calls":
            calls, self.calls = self.calls, {}
            return {stream: state.row_values() for stream, state in calls.items()}
        ordered = operator.itemgetter(*_column_names(table))
        if name == "cut_receipts":
            return {ident: ordered(receipt_row(ident, seq)) for ident, seq in self.receipts.items()}
        if name == "rollouts":
            return {(key,): ordered(state.to_row()) for key, state in self.rollouts.items()}
        if name == "token_rollouts":
            return {(key,): state.row_values() for key, state in self.token_rollouts.items()}
        if name == "token_entries":
            entries, self.token_entries = self.token_entries, {}
            return entries
        assert name == "workers", name
        return {(key,): ordered(state.to_row()) for key, state in self.workers.items()}


# staged_keys and calls rows are built as tuples (``staged_key_row``, ``row_values``): the
# tables' columns must be in that order.
assert [column.name for column in schema.staged_keys.c] == ["staging_key", *KeyState.__dataclass_fields__]
assert tuple(column.name for column in schema.calls.c) == CALL_ROW_COLUMNS
assert tuple(column.name for column in schema.token_rollouts.c) == tuple(TokenRolloutState.__dataclass_fields__)


def key_row(key: str, state: KeyState) -> dict[str, Any]:
    return {"staging_key": key, **state.__dict__}


def receipt_row(ident: tuple[str, str], seq: int) -> dict[str, Any]:
    return {"checkpoint_id": ident[0], "inventory_digest": ident[1], "event_seq": seq}


_PRIMARY_KEYS = {
    "calls": ("rollout_id", "model_call_id"),
    "staged_keys": ("staging_key",),
    "cut_receipts": ("checkpoint_id", "inventory_digest"),
    "rollouts": ("rollout_id",),
    "workers": ("join_seq",),
    "token_rollouts": ("rollout_id",),
    "token_entries": ("rollout_id", "model_call_id"),
}

# The comparison holds each projection row as a tuple in column order (what the driver's
# cursor returns): a whole table then compares with one dictionary equality, in C, and
# mappings are made only for the rows that differ.
RowTables = dict[str, dict[tuple[Any, ...], tuple[Any, ...]]]


def _column_names(table: sa.Table) -> list[str]:
    return [column.name for column in table.c]


def as_mappings(table: sa.Table, rows: dict[tuple[Any, ...], tuple[Any, ...]]) -> list[dict[str, Any]]:
    names = _column_names(table)
    return [dict(zip(names, row, strict=True)) for row in rows.values()]


def live_tables(connection: sa.Connection) -> RowTables:
    tables: RowTables = {}
    for table in schema.PROJECTION_TABLES:
        names = _column_names(table)
        indices = [names.index(name) for name in _PRIMARY_KEYS[table.name]]
        rows = table_rows(connection, table)
        if connection.dialect.name != "sqlite":  # PostgreSQL's driver may hand bytea back as a memoryview
            rows = (tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in rows)
        if len(indices) == 1:
            (index,) = indices
            tables[table.name] = {(row[index],): row for row in rows}
        else:
            key_of = operator.itemgetter(*indices)
            tables[table.name] = {key_of(row): row for row in rows}
    return tables


def table_rows(connection: sa.Connection, table: sa.Table) -> Iterator[tuple[Any, ...]]:
    """Every row of ``table`` as a tuple in column order (SQLite: on the raw driver cursor)."""
    if connection.dialect.name != "sqlite":
        yield from (tuple(row) for row in connection.execute(sa.select(*table.c)))
        return
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        yield from cursor.execute(f"SELECT {', '.join(column.name for column in table.c)} FROM {table.name}")
    finally:
        cursor.close()


def compare(live: RowTables, rebuilt: RowTables) -> list[ReplayDifference]:
    differences: list[ReplayDifference] = []
    for table in schema.PROJECTION_TABLES:
        rebuilt_rows, live_rows = rebuilt.get(table.name, {}), live.get(table.name, {})
        if rebuilt_rows == live_rows:  # the common case, decided in one comparison
            continue
        names = _column_names(table)
        # Only the differing keys are sorted (by repr, for a stable report): most rows match.
        differing = [key for key, row in rebuilt_rows.items() if live_rows.get(key) != row]
        differing += [key for key in live_rows if key not in rebuilt_rows]
        for key in sorted(differing, key=repr):
            differences.append(
                ReplayDifference(
                    table.name, key, _mapping(names, live_rows.get(key)), _mapping(names, rebuilt_rows.get(key))
                )
            )
    return differences


def _mapping(names: list[str], row: tuple[Any, ...] | None) -> dict[str, Any] | None:
    return None if row is None else dict(zip(names, row, strict=True))


def replay(engine: Engine, backend: Backend, *, repair: bool = False) -> ReplayReport:
    """Rebuild the projections from one snapshot of the log and compare them with the live rows.

    A check reads a snapshot without the write lock (SQLite: a deferred read transaction on
    the WAL; PostgreSQL: repeatable read, read only), so writers carry on while it folds.
    Only a repair takes the write lock, so the rows it replaces are the ones it compared.
    """
    try:
        with engine.connect() as connection, paused_gc():
            connection.exec_driver_sql(backend.begin_write_sql if repair else backend.begin_snapshot_sql)
            undecodable: list[tuple[int, str]] = []
            count, folded = rebuild(connection, undecodable)
            rebuilt = {table.name: folded.row_tuples(table) for table in schema.PROJECTION_TABLES}
            differences = compare(live_tables(connection), rebuilt)
            repaired = False
            if repair and undecodable:
                # Rows rebuilt without those events would be wrong: repair nothing.
                raise CorruptRecordError(_refusal(undecodable))
            if repair and differences:
                for table in schema.PROJECTION_TABLES:
                    connection.execute(sa.delete(table))
                    rows = as_mappings(table, rebuilt[table.name])
                    if rows:
                        connection.execute(sa.insert(table), rows)
                repaired = True
            connection.commit()
    except driver_errors(engine) as exc:
        raise storage_error("replaying the log", exc) from exc
    return ReplayReport(
        ok=not differences and not undecodable,
        events=count,
        differences=tuple(differences[:_MAX_DIFFERENCES]),
        differences_total=len(differences),
        repaired=repaired,
        undecodable=tuple(undecodable),
    )


def _refusal(undecodable: list[tuple[int, str]]) -> str:
    reason = undecodable[0][1]
    more = f" (and {len(undecodable) - 1} more)" if len(undecodable) > 1 else ""
    return f"replay cannot repair from a log it cannot fully read: {reason}{more}; nothing was repaired"
