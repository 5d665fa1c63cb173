"""Benchmark: durable staging on PostgreSQL against raw psycopg inserting the same stored bytes.

Each round opens every variant in a fresh schema (created before the clock starts, dropped
after) and runs short blocks alternating A B B A ..., so the disk's fsync moods hit each
variant alike; ratios are taken per round and reported as median, min and max, with the
fdatasync time sampled before each round.

Pairs (each ratio = store records/s over raw records/s in the same round):

* ``store x1``  vs ``raw 1/txn``  -- one thread calls ``Store.stage``; raw: one INSERT, then COMMIT;
* ``store x16`` vs ``raw 16/txn`` -- 16 threads stage concurrently (group commit); raw: one
  ``executemany`` of 16 rows (psycopg sends it as one pipeline), then COMMIT;
* ``floor x1``  vs ``raw 1/txn``  -- for scale: the store's own statements for a lone stage of a
  new stream (BEGIN, advisory lock, the guarded event + calls + key statement, COMMIT: one wait)
  through raw psycopg in one pipeline per transaction, parameters built before the clock: what
  this schema allows;
* ``lookup x1`` vs ``raw 1/txn``  -- the same with the statements a stage sends when it reads first
  (advisory lock, its lookup with the event's nextval -- one wait -- then the event, calls and key
  inserts and COMMIT -- another wait): the floor before lone stages guessed a new stream.

The raw side inserts, for every record, the very row the store keeps in its ``events`` table
(msgpack body, packed ids, mask and log-probs, xxh3 checksum, encoded before the clock starts)
into a table of the same shape (the store's own ``events`` definition: identity key and its
unique index), with psycopg's default adaptation (bytes go as binary parameters, as in the
store) and prepared statements, on the same server with ``synchronous_commit = on``: every
commit on both sides waits for the WAL flush.

Targets (issue 12): store x1 >= 0.7x raw 1/txn; store x16 >= 0.5x raw 16/txn (median of rounds).

    STORE_BENCH_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/db \\
        .venv/bin/python tools/bench_pg_staging.py [--rounds R] [--block B] [--quick] [--json]
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _bench_common import Report, Target, fsync_seconds, parser
from bench_staging import THREADS, TOKENS, _count_batches, build_records, raw_row

from store import StagedCallRecord, open_store
from store.append.new_event import EVENT_INSERT_COLUMNS, NewEvent, Writer
from store.append.statements import WriteStatements, new_stream_values
from store.log import schema
from store.log.checksum import event_checksum
from store.log.engine import postgresql_backend
from store.log.events import EventKind, record_body
from store.projections.fold import Event, fold_call, generated_spans

TARGET_1 = 0.7
TARGET_MANY = 0.5
_COLUMNS = EVENT_INSERT_COLUMNS
EventRow = tuple[Any, ...]
_STORE_ID = str(uuid.uuid4())


def conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def event_row(record: StagedCallRecord) -> EventRow:
    """The ``events`` row the store writes for ``record`` (its stored bytes and checksum)."""
    key, body, ids, mask, lps, _ = raw_row(record)
    values: dict[str, Any] = {
        "rollout_id": record.rollout_id,
        "model_call_id": record.model_call_id,
        "stream_version": 1,
        "kind": "call_completed",
        "staging_key": key,
        "writer_pid": os.getpid(),
        "recorded_at": time.time(),
        "body": body,
        "token_ids": ids,
        "token_mask": mask,
        "log_probs": lps,
    }
    values["checksum"] = event_checksum(values)
    values["writer_host"] = socket.gethostname()  # the provenance the store keeps (not checksummed)
    values["store_id"] = _STORE_ID
    return tuple(values[name] for name in _COLUMNS)


def create_raw_table(url: str, name: str) -> None:
    """A schema holding one table defined exactly as the store's ``events``."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{name}"')
            table = schema.events.to_metadata(sa.MetaData(), schema=name)
            table.create(connection)
    finally:
        engine.dispose()


def drop_schema(url: str, name: str) -> None:
    with psycopg.connect(conninfo(url), autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


class RawSide:
    """Raw psycopg on one connection, inserting into a fresh table of the events' shape."""

    def __init__(self, url: str, name: str, batch: int) -> None:
        create_raw_table(url, name)
        self.name, self.batch, self.rows = name, batch, 0
        self.insert = (
            f'INSERT INTO "{name}".events ({", ".join(_COLUMNS)}) VALUES ({", ".join(["%s"] * len(_COLUMNS))})'
        )
        self.connection = psycopg.connect(conninfo(url))
        self.connection.execute("SET synchronous_commit = on")
        self.connection.commit()
        self.cursor = self.connection.cursor()

    def run(self, rows: list[EventRow]) -> float:
        start = time.perf_counter()
        for offset in range(0, len(rows), self.batch):
            if self.batch == 1:
                self.cursor.execute(self.insert, rows[offset])
            else:
                self.cursor.executemany(self.insert, rows[offset : offset + self.batch])
            self.connection.commit()
        elapsed = time.perf_counter() - start
        self.rows += len(rows)
        return elapsed

    def close(self) -> None:
        stored = self.cursor.execute(f'SELECT count(*) FROM "{self.name}".events').fetchone()
        self.connection.close()
        if stored is None or stored[0] != self.rows:
            raise AssertionError(f"raw: {stored} rows stored, {self.rows} expected")


class StoreSide:
    """``Store.stage`` from ``threads`` threads into a fresh schema of a store."""

    def __init__(self, url: str, name: str, threads: int) -> None:
        open_store(url, schema=name).close()  # create and migrate the schema before the clock starts
        self.store = open_store(url, schema=name, durability="full")
        self.store.staged_keys("warm-up")  # the reader's connection, as a running store has it
        self.threads, self.staged = threads, 0
        self.batches = _count_batches(self.store)
        self.failures: list[str] = []

    def _stage(self, part: list[StagedCallRecord]) -> None:
        for record in part:
            result = self.store.stage(record)
            if not result.ok:
                self.failures.append(result.error or "?")

    def run(self, records: list[StagedCallRecord]) -> float:
        self.staged += len(records)
        if self.threads == 1:
            start = time.perf_counter()
            self._stage(records)
            return time.perf_counter() - start
        barrier = threading.Barrier(self.threads + 1)

        def worker(part: list[StagedCallRecord]) -> None:
            barrier.wait()
            self._stage(part)

        workers = [threading.Thread(target=worker, args=(records[i :: self.threads],)) for i in range(self.threads)]
        for thread in workers:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in workers:
            thread.join()
        return time.perf_counter() - start

    def close(self) -> None:
        try:
            staged = len(self.store.staged_keys())
        finally:
            self.store.close()
        if self.failures:
            raise AssertionError(f"store: {len(self.failures)} records refused, e.g. {self.failures[0]}")
        if staged != self.staged:
            raise AssertionError(f"store: {staged} keys staged, {self.staged} expected")


FloorParams = tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]


def floor_params(record: StagedCallRecord, row: EventRow) -> FloorParams:
    """The parameters of the store's statements for one stage (lookup, event, calls, key), seq left to fill."""
    event = dict(zip(_COLUMNS, row, strict=True))
    body = record_body(record, generated_spans(record.columns.token_mask, record.weight_version))
    folded = Event(0, EventKind.CALL_COMPLETED, record.rollout_id, record.model_call_id, 1, record.staging_key, body)
    call = fold_call(None, folded).to_row()
    lookup = {"rollout_id": record.rollout_id, "model_call_id": record.model_call_id, "staging_key": record.staging_key}
    key = {
        "staging_key": record.staging_key,
        "rollout_id": record.rollout_id,
        "model_call_id": record.model_call_id,
        "digest": record.digest,
    }
    return lookup, event, call, key


class _RawStatementsSide:
    """A raw psycopg connection to a fresh store schema (created and migrated by the store),
    the store's compiled statements and its write lock: what both floors send their statements
    with.  ``close`` checks that every stage wrote its key."""

    def __init__(self, url: str, name: str) -> None:
        open_store(url, schema=name).close()  # the store's schema, migrated
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        self.statements = WriteStatements(engine)
        engine.dispose()
        self.lock = postgresql_backend(name).begin_write_sql
        self.connection = psycopg.connect(conninfo(url), autocommit=True, options=f"-c search_path={name}")
        self.connection.execute("SET synchronous_commit = on")
        self.name, self.rows = name, 0

    def close(self) -> None:
        stored = self.connection.execute("SELECT count(*) FROM staged_keys").fetchone()
        self.connection.close()
        if stored is None or stored[0] != self.rows:
            raise AssertionError(f"floor: {stored} keys stored, {self.rows} expected")


class LookupFloorSide(_RawStatementsSide):
    """For scale: the statements of a stage that reads first, through raw psycopg in one
    pipeline per transaction (BEGIN, advisory lock, the lookup with the event's nextval -- one
    wait -- then the event, calls and key inserts and COMMIT -- one wait), parameters built
    before the clock."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, name)
        assert self.statements.stage_lookup_seq is not None
        # The stage's lookup with its event's nextval, as the store sends it.
        self.lookup = self.statements.stage_lookup_seq

    def run(self, stages: list[FloorParams]) -> float:
        sql, connection = self.statements, self.connection
        start = time.perf_counter()
        for lookup, event, call, key in stages:
            cursor = connection.cursor()
            with connection.pipeline():
                cursor.execute("BEGIN")
                cursor.execute(self.lock)
                seq = cursor.execute(self.lookup.sql, self.lookup.params(lookup)).fetchone()[-1]  # type: ignore[index]
                cursor.execute(sql.insert_event_at.sql, sql.insert_event_at.params({**event, "seq": seq}))
                cursor.execute(sql.insert_call.sql, sql.insert_call.params({**call, "last_seq": seq}))
                cursor.execute(sql.insert_key.sql, sql.insert_key.params({**key, "event_seq": seq}))
                cursor.execute("COMMIT")
        elapsed = time.perf_counter() - start
        self.rows += len(stages)
        return elapsed


def guessed_params(record: StagedCallRecord, row: EventRow) -> dict[str, Any]:
    """The parameters of the store's guarded new-stream statement for ``record`` (its event
    row's pid and time, so the same bytes as the raw side's row)."""
    body = record_body(record, generated_spans(record.columns.token_mask, record.weight_version))
    kind, key = EventKind.CALL_COMPLETED, record.staging_key
    new = NewEvent(kind, record.rollout_id, record.model_call_id, body, key, record.columns)
    event = dict(zip(_COLUMNS, row, strict=True))
    writer = Writer(event["writer_pid"], event["writer_host"], event["store_id"])
    values = new_stream_values(new, writer, event["recorded_at"])
    assert values is not None and values["e_checksum"] == event["checksum"]
    return values


class FloorSide(_RawStatementsSide):
    """For scale: the store's own statements for a lone stage of a new stream through raw
    psycopg in one pipeline per transaction (BEGIN, advisory lock, the guarded event + calls +
    key statement, COMMIT: one wait), parameters built before the clock."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, name)
        self.sql = self.statements.stage_new
        assert self.sql is not None

    def run(self, stages: list[dict[str, Any]]) -> float:
        connection, sql = self.connection, self.sql
        assert sql is not None
        start = time.perf_counter()
        for values in stages:
            cursor, guarded = connection.cursor(), connection.cursor()  # the store's two cursors
            with connection.pipeline():
                cursor.execute("BEGIN")
                cursor.execute(self.lock)
                guarded.execute(sql, values)
                cursor.execute("COMMIT")
            if guarded.fetchone() is None:
                raise AssertionError("floor: the guarded statement wrote nothing")
        elapsed = time.perf_counter() - start
        self.rows += len(stages)
        return elapsed


def schema_name(variant: str, index: int) -> str:
    return f"bench_pg_{variant.replace(' ', '_').replace('/', '_')}_{os.getpid()}_{index}"


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds, each in fresh schemas (default 9; 3 with --quick)")
    p.add_argument("--block", type=int, default=None, help="transactions per block (default 8; 4 with --quick)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per variant per round (default 4; 2 with --quick)")
    args = p.parse_args()
    url = os.environ.get("STORE_BENCH_POSTGRES_URL") or os.environ.get("STORE_TEST_POSTGRES_URL")
    if not url:
        print("set STORE_BENCH_POSTGRES_URL (or STORE_TEST_POSTGRES_URL) to a PostgreSQL database", file=sys.stderr)
        return 2
    rounds = args.rounds or (3 if args.quick else 9)
    block = args.block or (4 if args.quick else 8)
    blocks = args.blocks or (2 if args.quick else 4)

    records = build_records(block * blocks * THREADS, args.seed)
    rows = [event_row(record) for record in records]
    bytes_per_record = statistics.fmean(sum(len(value) for value in row if isinstance(value, bytes)) for row in rows)

    lookup_stages = [floor_params(record, row) for record, row in zip(records, rows, strict=True)]
    floor_stages = [guessed_params(record, row) for record, row in zip(records, rows, strict=True)]

    raw1, raw_many, store1, store_many = "raw 1/txn", f"raw {THREADS}/txn", "store x1", f"store x{THREADS}"
    floor1, lookup1 = "floor x1", "lookup x1"
    threads = {store1: 1, store_many: THREADS}
    batch_of = {raw1: 1, raw_many: THREADS}
    per_block = {store1: block, raw1: block, floor1: block, lookup1: block}
    per_block.update({store_many: block * THREADS, raw_many: block * THREADS})
    groups: list[tuple[str, ...]] = [(store1, raw1, floor1, lookup1), (store_many, raw_many)]
    elapsed: dict[str, list[float]] = {name: [] for name in per_block}
    batches: list[int] = []
    fsyncs: list[float] = []
    for index in range(rounds + 1):  # round 0 warms the server and the caches; not counted
        for group in groups:
            fsyncs.append(fsync_seconds(samples=8, data_only=True))
            names = {name: schema_name(name, index) for name in group}
            sides: dict[str, StoreSide | RawSide | FloorSide | LookupFloorSide] = {}
            spent = dict.fromkeys(group, 0.0)
            try:
                for name in group:
                    if name in threads:
                        sides[name] = StoreSide(url, names[name], threads[name])
                    elif name == floor1:
                        sides[name] = FloorSide(url, names[name])
                    elif name == lookup1:
                        sides[name] = LookupFloorSide(url, names[name])
                    else:
                        sides[name] = RawSide(url, names[name], batch_of[name])
                for turn in range(blocks):
                    # A B B A ...: each variant meets the disk's moods as often as the other.
                    order = group if (turn + index) % 2 == 0 else tuple(reversed(group))
                    for name in order:
                        span = slice(turn * per_block[name], (turn + 1) * per_block[name])
                        side = sides[name]
                        if isinstance(side, StoreSide):
                            spent[name] += side.run(records[span])
                        elif isinstance(side, FloorSide):
                            spent[name] += side.run(floor_stages[span])
                        elif isinstance(side, LookupFloorSide):
                            spent[name] += side.run(lookup_stages[span])
                        else:
                            spent[name] += side.run(rows[span])
                for side in sides.values():
                    if isinstance(side, StoreSide) and side.threads > 1 and index:
                        batches.extend(side.batches)
            finally:
                for side in sides.values():
                    side.close()
                for name in group:
                    drop_schema(url, names[name])
            if index:
                for name in group:
                    elapsed[name].append(spent[name])
    counts = {name: per_block[name] * blocks for name in per_block}

    def ratios(name: str, base: str) -> list[float]:
        return [b / s for s, b in zip(elapsed[name], elapsed[base], strict=True)]

    report = Report(
        "bench_pg_staging",
        params={
            "rounds": rounds,
            "transactions_per_block": block,
            "blocks_per_variant_per_round": blocks,
            "tokens_per_record": TOKENS,
            "stored_bytes_per_record": round(bytes_per_record),
            "durability": "full (synchronous_commit = on)",
        },
    )
    report.table(
        f"Records/s per variant (median over {rounds} rounds of {blocks} alternating {block}-transaction blocks)",
        ["variant", "rec/s median", "rec/s min", "rec/s max"],
        [
            [name, *(f"{counts[name] / pick(elapsed[name]):,.0f}" for pick in (statistics.median, max, min))]
            for name in per_block
        ],
    )
    table = []
    pairs = ((store1, raw1), (store_many, raw_many), (floor1, raw1), (lookup1, raw1), (store1, floor1))
    for name, base in pairs:
        per_round = ratios(name, base)
        key = f"{name} / {base}"
        report.results[key] = {
            "median": statistics.median(per_round),
            "min": min(per_round),
            "max": max(per_round),
            "per_round": per_round,
        }
        table.append(
            [
                key,
                f"{statistics.median(per_round):.3f}x",
                f"{min(per_round):.3f}x",
                f"{max(per_round):.3f}x",
                " ".join(f"{r:.2f}" for r in per_round),
            ]
        )
    report.table("Per-round ratios (store over raw, same round)", ["pair", "median", "min", "max", "rounds"], table)
    ms = sorted(value * 1000 for value in fsyncs)
    report.results["fsync_ms"] = {"median": statistics.median(ms), "min": ms[0], "max": ms[-1]}
    report.notes.append(
        f"fdatasync of 4 KiB on the WAL's disk, sampled before each group of a round: median "
        f"{statistics.median(ms):.3f} ms, min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms"
    )
    if batches:
        common = Counter(batches).most_common(3)
        report.notes.append(
            f"{store_many}: group-commit batch mean {statistics.fmean(batches):.1f}, most common sizes "
            + ", ".join(f"{size}: {seen}" for size, seen in common)
        )
    one = statistics.median(ratios(store1, raw1))
    many = statistics.median(ratios(store_many, raw_many))
    report.notes.append(
        f"{floor1} = the store's own statements for a lone stage of a new stream through raw psycopg, one "
        f"pipeline per transaction, no store code; {lookup1} = the same for a stage that reads first "
        "(for scale, no target)"
    )
    report.targets.append(Target("pg_staging_1_stager_vs_raw_1_per_txn", one, ">=", TARGET_1))
    report.targets.append(Target(f"pg_staging_{THREADS}_stagers_vs_raw_{THREADS}_per_txn", many, ">=", TARGET_MANY))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
