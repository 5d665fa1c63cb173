"""Replay: rebuild every projection from the log and compare it with the live tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store import schema
from store.engine import Backend, driver_errors, storage_error
from store.events import EventKind, decode_body
from store.projections import CallState, Event, KeyState, affects_call, fold_call, fold_keys, fold_receipt

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

    def summary(self) -> str:
        if self.ok:
            return f"replayed {self.events} events: every projection matches the log"
        lines = [f"replayed {self.events} events: {self.differences_total} projection row(s) differ"]
        lines += [f"  {difference}" for difference in self.differences]
        if self.repaired:
            lines.append("  the live projections were replaced by the rebuilt ones")
        return "\n".join(lines)


Tables = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def rebuild(connection: sa.Connection) -> tuple[int, Tables]:
    """Fold the whole log, in sequence order, into projection rows."""
    events = schema.events
    query = sa.select(
        events.c.seq,
        events.c.kind,
        events.c.rollout_id,
        events.c.model_call_id,
        events.c.stream_version,
        events.c.staging_key,
        events.c.body,
    ).order_by(events.c.seq)
    calls: dict[tuple[str, str], CallState] = {}
    keys: dict[str, KeyState] = {}
    receipts: dict[tuple[str, str], int] = {}
    count = 0
    for row in connection.execute(query.execution_options(yield_per=1000)):
        count += 1
        kind = EventKind(row.kind)
        event = Event(
            row.seq,
            kind,
            row.rollout_id,
            row.model_call_id,
            row.stream_version,
            row.staging_key,
            decode_body(kind, bytes(row.body)),
        )
        if affects_call(kind):
            stream = (event.rollout_id, event.model_call_id)
            calls[stream] = fold_call(calls.get(stream), event)
        added, removed = fold_keys(event)
        for key in removed:
            keys.pop(key, None)
        keys.update(added)
        receipt = fold_receipt(event)
        if receipt is not None:
            receipts[receipt[0]] = receipt[1]
    return count, {
        "calls": {stream: state.to_row() for stream, state in calls.items()},
        "staged_keys": {(key,): {"staging_key": key, **state.__dict__} for key, state in keys.items()},
        "cut_receipts": {
            ident: {"checkpoint_id": ident[0], "inventory_digest": ident[1], "event_seq": seq}
            for ident, seq in receipts.items()
        },
    }


_PRIMARY_KEYS = {
    "calls": ("rollout_id", "model_call_id"),
    "staged_keys": ("staging_key",),
    "cut_receipts": ("checkpoint_id", "inventory_digest"),
}


def live_tables(connection: sa.Connection) -> Tables:
    tables: Tables = {}
    for table in schema.PROJECTION_TABLES:
        key_columns = _PRIMARY_KEYS[table.name]
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for row in connection.execute(sa.select(*table.c)):
            values = {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in row._mapping.items()}
            rows[tuple(values[k] for k in key_columns)] = values
        tables[table.name] = rows
    return tables


def compare(live: Tables, rebuilt: Tables) -> list[ReplayDifference]:
    differences: list[ReplayDifference] = []
    for table, rebuilt_rows in rebuilt.items():
        live_rows = live.get(table, {})
        for key in sorted(set(live_rows) | set(rebuilt_rows), key=repr):
            live_row, rebuilt_row = live_rows.get(key), rebuilt_rows.get(key)
            if live_row != rebuilt_row:
                differences.append(ReplayDifference(table, key, live_row, rebuilt_row))
    return differences


def replay(engine: Engine, backend: Backend, *, repair: bool = False) -> ReplayReport:
    """Rebuild the projections from one snapshot of the log and compare them with the live rows.

    A check reads a snapshot without the write lock (SQLite: a deferred read transaction on
    the WAL; PostgreSQL: repeatable read, read only), so writers carry on while it folds.
    Only a repair takes the write lock, so the rows it replaces are the ones it compared.
    """
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(backend.begin_write_sql if repair else backend.begin_snapshot_sql)
            count, rebuilt = rebuild(connection)
            differences = compare(live_tables(connection), rebuilt)
            repaired = False
            if repair and differences:
                for table in schema.PROJECTION_TABLES:
                    connection.execute(sa.delete(table))
                    rows = list(rebuilt[table.name].values())
                    if rows:
                        connection.execute(sa.insert(table), rows)
                repaired = True
            connection.commit()
    except driver_errors(engine) as exc:
        raise storage_error("replaying the log", exc) from exc
    return ReplayReport(
        ok=not differences,
        events=count,
        differences=tuple(differences[:_MAX_DIFFERENCES]),
        differences_total=len(differences),
        repaired=repaired,
    )
