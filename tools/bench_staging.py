"""Benchmark: durable staging (SQLite, durability="full") against raw sqlite3 inserting the same bytes.

The disk's fsync time on this kind of machine flips between ~0.3 ms and ~4 ms several times
a second, so long runs of one variant then another measure the disk, not the code.  Each
round therefore runs short alternating blocks (``--block`` transactions each, default 32),
every block on a fresh file, the order flipped every round, and the ratio is taken per round;
the report gives the median, min and max of the per-round ratios and the fsync time measured
between blocks.

Pairs (each ratio = store records/s over raw records/s in the same round):

* ``store x1``  vs ``raw 1/txn``   -- one thread calls ``Store.stage``; raw: BEGIN IMMEDIATE, one INSERT, COMMIT;
* ``store x16`` vs ``raw 16/txn``  -- 16 threads stage concurrently (group commit); raw: 16 rows per transaction;
* ``floor x1``  vs ``raw 1/txn``   -- for scale: the store's own statements for each record (its one lookup,
  then the event, calls and key inserts) through raw sqlite3 on the store's schema, no Python
  around them (the most this schema could reach).

Raw rows hold the bytes the store keeps for each record (packed columns, msgpack body, xxh3
checksum), encoded before the clock starts, at the store's pragmas (WAL, synchronous=FULL).

Targets (issue 11): store x1 >= 0.85x raw 1/txn; store x16 >= 0.70x raw 16/txn (median of rounds).

    .venv/bin/python tools/bench_staging.py [--quick] [--json] [--rounds R] [--block B]
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, make_columns, parser, temp_dir

from store import StagedCallRecord, compute_chain_hash, hash_token_ids, open_store
from store.columns import encode_floats, encode_ids, encode_mask, event_checksum
from store.events import encode_body, record_body
from store.log import _stage_lookup
from store.projections import generated_spans

TOKENS = 4_096
THREADS = 16
TARGET_1 = 0.85
# The store's own read per stage (fence, key, calls row, stream version), compiled for SQLite.
STAGE_LOOKUP = _stage_lookup(sa.create_engine("sqlite://"))
TARGET_MANY = 0.70
WEIGHT_VERSION = 7

RawRow = tuple[str, bytes, bytes, bytes, bytes, bytes]


def build_records(count: int, seed: int) -> list[StagedCallRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for index in range(count):
        columns = make_columns(rng, TOKENS)
        records.append(
            StagedCallRecord.from_components(
                rollout_id=f"rollout-{index:06d}",
                model_call_id="call-0",
                parent_call_id=None,
                mode="text",
                prev_len=0,
                weight_version=WEIGHT_VERSION,
                token_ids_delta=columns.ids,
                token_mask_delta=columns.mask,
                generation_log_probs_delta=columns.logprobs,
                chain_hash=compute_chain_hash(None, columns.ids),
                cumulative_hash=hash_token_ids(columns.ids),
            )
        )
    return records


def raw_row(record: StagedCallRecord) -> RawRow:
    """The bytes the store keeps for ``record``: body, three packed columns, checksum."""
    columns = record.columns
    body = encode_body(record_body(record, generated_spans(columns.token_mask, record.weight_version)))
    ids, mask, lps = encode_ids(columns.token_ids), encode_mask(columns.token_mask), encode_floats(columns.log_probs)
    return record.staging_key, body, ids, mask, lps, floor_checksum(record, body, ids, mask, lps)


def floor_checksum(record: StagedCallRecord, body: bytes, ids: bytes, mask: bytes, lps: bytes) -> bytes:
    """The event checksum of the row ``run_store_schema_floor`` inserts (its fixed version, pid and time)."""
    return event_checksum(
        {
            "rollout_id": record.rollout_id,
            "model_call_id": record.model_call_id,
            "stream_version": 1,
            "kind": "call_completed",
            "staging_key": record.staging_key,
            "writer_pid": 1,
            "recorded_at": 0.0,
            "body": body,
            "token_ids": ids,
            "token_mask": mask,
            "log_probs": lps,
        }
    )


# --- variants: each returns elapsed seconds and extra facts ----------------------------------


def run_store_schema_floor(path: str, records: list[StagedCallRecord], rows: list[RawRow]) -> float:
    """The store's per-record statements and commit, driven by raw sqlite3 (no store code)."""
    open_store(path).close()  # create and migrate the schema
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA synchronous = FULL")
    try:
        start = time.perf_counter()
        for record, (key, body, ids, mask, lps, checksum) in zip(records, rows, strict=True):
            stream = (record.rollout_id, record.model_call_id)
            connection.execute("BEGIN IMMEDIATE")
            lookup = {"rollout_id": stream[0], "model_call_id": stream[1], "staging_key": key}
            connection.execute(STAGE_LOOKUP.sql, STAGE_LOOKUP.params(lookup)).fetchone()
            seq = connection.execute(
                "INSERT INTO events (rollout_id, model_call_id, stream_version, kind, staging_key, writer_pid, "
                "recorded_at, body, token_ids, token_mask, log_probs, checksum) "
                "VALUES (?, ?, 1, 'call_completed', ?, 1, 0.0, ?, ?, ?, ?, ?) RETURNING seq",
                (*stream, key, body, ids, mask, lps, checksum),
            ).fetchone()[0]
            connection.execute(
                "INSERT INTO calls (rollout_id, model_call_id, stream_version, state, mode, prev_len, cum_len, "
                "generated_tokens, chain_hash, cumulative_hash, oldest_version, newest_version, version_spans, "
                "last_seq) VALUES (?, ?, 1, 'completed', 'text', 0, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    *stream,
                    record.cum_len,
                    record.generated_token_count,
                    record.chain_hash,
                    record.cumulative_hash,
                    f"{record.weight_version:020d}",
                    f"{record.weight_version:020d}",
                    b"\x90",
                    seq,
                ),
            )
            connection.execute("INSERT INTO staged_keys VALUES (?, ?, ?, ?, ?)", (key, seq, *stream, record.digest))
            connection.execute("COMMIT")
        elapsed = time.perf_counter() - start
    finally:
        connection.close()
    return elapsed


def raw_connection(path: str) -> sqlite3.Connection:
    """The store's pragmas (WAL, synchronous=FULL, auto_vacuum as a new store file) on a one-table file."""
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA busy_timeout = 60000")
    connection.execute("PRAGMA auto_vacuum = INCREMENTAL")
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = FULL")
    connection.execute("PRAGMA journal_size_limit = 16777216")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS staged (staging_key TEXT PRIMARY KEY, body BLOB NOT NULL, "
        "token_ids BLOB, token_mask BLOB, log_probs BLOB, checksum BLOB NOT NULL)"
    )
    return connection


_INSERT = "INSERT INTO staged VALUES (?, ?, ?, ?, ?, ?)"


def run_raw(path: str, rows: list[RawRow], batch: int) -> float:
    connection = raw_connection(path)
    try:
        start = time.perf_counter()
        for offset in range(0, len(rows), batch):
            connection.execute("BEGIN IMMEDIATE")
            if batch == 1:
                connection.execute(_INSERT, rows[offset])
            else:
                connection.executemany(_INSERT, rows[offset : offset + batch])
            connection.execute("COMMIT")
        elapsed = time.perf_counter() - start
        staged = connection.execute("SELECT count(*) FROM staged").fetchone()[0]
    finally:
        connection.close()
    if staged != len(rows):
        raise AssertionError(f"raw: {staged} rows stored, {len(rows)} expected")
    return elapsed


def fsync_seconds(folder: str, samples: int = 16) -> float:
    """Median time of one 4 KiB write + fsync in ``folder`` (the disk's current mood)."""
    path = os.path.join(folder, "fsync-probe")
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for index in range(samples):
            os.pwrite(fd, b"x" * 4096, index * 4096)
            start = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.remove(path)
    return statistics.median(times)


def _count_batches(store: Any) -> list[int]:
    """Record the size of every group-commit batch (instruments this store instance only)."""
    sizes: list[int] = []
    log = getattr(store, "_log", None)
    original = getattr(log, "_write_batch", None)
    if original is None:  # the store's internals changed: report no batch sizes
        return sizes

    def counting(batch: list[Any]) -> None:
        sizes.append(len(batch))
        original(batch)

    log._write_batch = counting
    return sizes


def run_store(path: str, records: list[StagedCallRecord], threads: int) -> tuple[float, list[int]]:
    store = open_store(path, durability="full")
    failures: list[str] = []
    try:
        batches = _count_batches(store)
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

            workers = [
                threading.Thread(target=worker, args=(records[index::threads],), name=f"stager-{index}")
                for index in range(threads)
            ]
            for thread in workers:
                thread.start()
            barrier.wait()
            start = time.perf_counter()
            for thread in workers:
                thread.join()
            elapsed = time.perf_counter() - start
    finally:
        store.close()
    if failures:
        raise AssertionError(f"store: {len(failures)} records refused, e.g. {failures[0]}")
    connection = sqlite3.connect(path)
    try:
        staged = connection.execute("SELECT count(*) FROM staged_keys").fetchone()[0]
    finally:
        connection.close()
    if staged != len(records):
        raise AssertionError(f"store: {staged} keys staged, {len(records)} expected")
    return elapsed, batches


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 15; 3 with --quick)")
    p.add_argument("--block", type=int, default=None, help="transactions per block (default 32; 8 with --quick)")
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    block = args.block or (8 if args.quick else 32)

    records = build_records(block * THREADS, args.seed)
    rows = [raw_row(record) for record in records]
    one_records, one_rows = records[:block], rows[:block]
    bytes_per_record = statistics.fmean(sum(len(part) for part in row[1:]) for row in rows)

    raw1, raw_many, store1, store_many, floor1 = (
        "raw 1/txn",
        f"raw {THREADS}/txn",
        "store x1",
        f"store x{THREADS}",
        "floor x1",
    )
    batches: list[int] = []

    def store_block(path: str, part: list[StagedCallRecord], threads: int) -> float:
        seconds, sizes = run_store(path, part, threads)
        if threads > 1:
            batches.extend(sizes)
        return seconds

    variants: dict[str, Callable[[str], float]] = {
        store1: lambda path: store_block(path, one_records, 1),
        raw1: lambda path: run_raw(path, one_rows, 1),
        floor1: lambda path: run_store_schema_floor(path, one_records, one_rows),
        store_many: lambda path: store_block(path, records, THREADS),
        raw_many: lambda path: run_raw(path, rows, THREADS),
    }
    counts = {store1: block, raw1: block, floor1: block, store_many: block * THREADS, raw_many: block * THREADS}
    groups = [(store1, raw1, floor1), (store_many, raw_many)]
    elapsed: dict[str, list[float]] = {name: [] for name in variants}
    fsyncs: list[float] = []
    with temp_dir(args.dir) as folder:
        for index in range(rounds):
            for group in groups:
                order = group if index % 2 == 0 else tuple(reversed(group))
                for name in order:
                    fsyncs.append(fsync_seconds(folder))
                    path = os.path.join(folder, f"{name.replace(' ', '_').replace('/', '_')}-r{index}.db")
                    elapsed[name].append(variants[name](path))
                    for suffix in ("", "-wal", "-shm"):
                        if os.path.exists(path + suffix):
                            os.remove(path + suffix)

    def ratios(name: str, base: str) -> list[float]:
        """Per round: (name records/s) / (base records/s)."""
        return [b / s for s, b in zip(elapsed[name], elapsed[base], strict=True)]

    report = Report(
        "bench_staging",
        params={
            "rounds": rounds,
            "transactions_per_block": block,
            "tokens_per_record": TOKENS,
            "stored_bytes_per_record": round(bytes_per_record),
            "durability": "full (WAL, synchronous=FULL)",
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
    for name, base in ((store1, raw1), (store_many, raw_many), (floor1, raw1)):
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
        f"fsync of 4 KiB, sampled before every block: median {statistics.median(ms):.3f} ms, "
        f"min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms"
    )
    if batches:
        common = Counter(batches).most_common(3)
        report.notes.append(
            f"{store_many}: group-commit batch mean {statistics.fmean(batches):.1f}, most common sizes "
            + ", ".join(f"{size}: {seen}" for size, seen in common)
        )
    report.notes.append("floor x1 = the store's own statements through raw sqlite3 (for scale, no target)")
    one = statistics.median(ratios(store1, raw1))
    many = statistics.median(ratios(store_many, raw_many))
    report.targets.append(Target("staging_1_stager_vs_raw_1_per_txn", one, ">=", TARGET_1))
    report.targets.append(Target(f"staging_{THREADS}_stagers_vs_raw_{THREADS}_per_txn", many, ">=", TARGET_MANY))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
