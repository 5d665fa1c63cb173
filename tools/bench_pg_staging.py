"""Benchmark: durable staging on PostgreSQL against raw psycopg inserting the same stored bytes.

Each round runs short alternating blocks, every block in a fresh schema (created before the
clock starts, dropped after), the order flipped every round; ratios are taken per round and
reported as median, min and max.

Pairs (each ratio = store records/s over raw records/s in the same round):

* ``store x1``  vs ``raw 1/txn``  -- one thread calls ``Store.stage``; raw: one INSERT, then COMMIT;
* ``store x16`` vs ``raw 16/txn`` -- 16 threads stage concurrently (group commit); raw: one
  ``executemany`` of 16 rows (psycopg sends it as one pipeline), then COMMIT.

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
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _bench_common import Report, Target, parser
from bench_staging import THREADS, TOKENS, _count_batches, build_records, raw_row

from store import StagedCallRecord, open_store, schema
from store.columns import event_checksum

TARGET_1 = 0.7
TARGET_MANY = 0.5
_COLUMNS = (
    "rollout_id",
    "model_call_id",
    "stream_version",
    "kind",
    "staging_key",
    "writer_pid",
    "recorded_at",
    "body",
    "token_ids",
    "token_mask",
    "log_probs",
    "checksum",
)
EventRow = tuple[Any, ...]


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


def run_raw(url: str, name: str, rows: list[EventRow], batch: int) -> float:
    create_raw_table(url, name)
    insert = f'INSERT INTO "{name}".events ({", ".join(_COLUMNS)}) VALUES ({", ".join(["%s"] * len(_COLUMNS))})'
    with psycopg.connect(conninfo(url)) as connection:
        connection.execute("SET synchronous_commit = on")
        connection.commit()
        with connection.cursor() as cursor:
            start = time.perf_counter()
            for offset in range(0, len(rows), batch):
                if batch == 1:
                    cursor.execute(insert, rows[offset])
                else:
                    cursor.executemany(insert, rows[offset : offset + batch])
                connection.commit()
            elapsed = time.perf_counter() - start
            stored = cursor.execute(f'SELECT count(*) FROM "{name}".events').fetchone()
        connection.rollback()
    if stored is None or stored[0] != len(rows):
        raise AssertionError(f"raw: {stored} rows stored, {len(rows)} expected")
    return elapsed


def run_store(url: str, name: str, records: list[StagedCallRecord], threads: int) -> tuple[float, list[int]]:
    open_store(url, schema=name).close()  # create and migrate the schema before the clock starts
    store = open_store(url, schema=name, durability="full")
    failures: list[str] = []
    try:
        batches = _count_batches(store)
        store.staged_keys("warm-up")  # the reader's connection, as a running store has it
        if threads == 1:
            start = time.perf_counter()
            for record in records:
                result = store.stage(record)
                if not result.ok:
                    failures.append(result.error or "?")
            elapsed = time.perf_counter() - start
        else:
            barrier = threading.Barrier(threads + 1)

            def worker(part: list[StagedCallRecord]) -> None:
                barrier.wait()
                for record in part:
                    result = store.stage(record)
                    if not result.ok:
                        failures.append(result.error or "?")

            workers = [threading.Thread(target=worker, args=(records[i::threads],)) for i in range(threads)]
            for thread in workers:
                thread.start()
            barrier.wait()
            start = time.perf_counter()
            for thread in workers:
                thread.join()
            elapsed = time.perf_counter() - start
        staged = len(store.staged_keys())
    finally:
        store.close()
    if failures:
        raise AssertionError(f"store: {len(failures)} records refused, e.g. {failures[0]}")
    if staged != len(records):
        raise AssertionError(f"store: {staged} keys staged, {len(records)} expected")
    return elapsed, batches


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 9; 3 with --quick)")
    p.add_argument("--block", type=int, default=None, help="transactions per block (default 48; 8 with --quick)")
    args = p.parse_args()
    url = os.environ.get("STORE_BENCH_POSTGRES_URL") or os.environ.get("STORE_TEST_POSTGRES_URL")
    if not url:
        print("set STORE_BENCH_POSTGRES_URL (or STORE_TEST_POSTGRES_URL) to a PostgreSQL database", file=sys.stderr)
        return 2
    rounds = args.rounds or (3 if args.quick else 9)
    block = args.block or (8 if args.quick else 48)

    records = build_records(block * THREADS, args.seed)
    rows = [event_row(record) for record in records]
    one_records, one_rows = records[:block], rows[:block]
    bytes_per_record = statistics.fmean(sum(len(value) for value in row if isinstance(value, bytes)) for row in rows)

    raw1, raw_many, store1, store_many = "raw 1/txn", f"raw {THREADS}/txn", "store x1", f"store x{THREADS}"
    batches: list[int] = []

    def store_block(name: str, part: list[StagedCallRecord], threads: int) -> float:
        seconds, sizes = run_store(url, name, part, threads)
        if threads > 1:
            batches.extend(sizes)
        return seconds

    variants: dict[str, Callable[[str], float]] = {
        store1: lambda name: store_block(name, one_records, 1),
        raw1: lambda name: run_raw(url, name, one_rows, 1),
        store_many: lambda name: store_block(name, records, THREADS),
        raw_many: lambda name: run_raw(url, name, rows, THREADS),
    }
    counts = {store1: block, raw1: block, store_many: block * THREADS, raw_many: block * THREADS}
    groups = [(store1, raw1), (store_many, raw_many)]
    elapsed: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds + 1):  # round 0 warms the server and the caches; not counted
        for group in groups:
            order = group if index % 2 == 0 else tuple(reversed(group))
            for name in order:
                schema_name = f"bench_pg_{name.replace(' ', '_').replace('/', '_')}_{os.getpid()}_{index}"
                try:
                    seconds = variants[name](schema_name)
                finally:
                    drop_schema(url, schema_name)
                if index:
                    elapsed[name].append(seconds)

    def ratios(name: str, base: str) -> list[float]:
        return [b / s for s, b in zip(elapsed[name], elapsed[base], strict=True)]

    report = Report(
        "bench_pg_staging",
        params={
            "rounds": rounds,
            "transactions_per_block": block,
            "tokens_per_record": TOKENS,
            "stored_bytes_per_record": round(bytes_per_record),
            "durability": "full (synchronous_commit = on)",
        },
    )
    report.table(
        f"Records/s per variant (median over {rounds} rounds of {block}-transaction blocks)",
        ["variant", "rec/s median", "rec/s min", "rec/s max"],
        [
            [name, *(f"{counts[name] / pick(elapsed[name]):,.0f}" for pick in (statistics.median, max, min))]
            for name in variants
        ],
    )
    table = []
    for name, base in ((store1, raw1), (store_many, raw_many)):
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
    if batches:
        common = Counter(batches).most_common(3)
        report.notes.append(
            f"{store_many}: group-commit batch mean {statistics.fmean(batches):.1f}, most common sizes "
            + ", ".join(f"{size}: {seen}" for size, seen in common)
        )
    one = statistics.median(ratios(store1, raw1))
    many = statistics.median(ratios(store_many, raw_many))
    report.targets.append(Target("pg_staging_1_stager_vs_raw_1_per_txn", one, ">=", TARGET_1))
    report.targets.append(Target(f"pg_staging_{THREADS}_stagers_vs_raw_{THREADS}_per_txn", many, ">=", TARGET_MANY))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
