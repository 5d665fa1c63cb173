"""Benchmark: durable staging throughput (SQLite, durability="full") against raw sqlite3 inserts.

Variants, each on its own fresh database, all with WAL and ``synchronous=FULL``:

* ``store x1``   -- one thread calls ``Store.stage`` for N pre-built distinct 4,096-token records;
* ``store x16``  -- 16 threads each stage N/16 of them concurrently (the store's group commit);
* ``raw 1/txn``  -- raw ``sqlite3``: BEGIN IMMEDIATE; one INSERT; COMMIT -- per record;
* ``raw 64/txn`` -- raw ``sqlite3``: 64 INSERTs per transaction.

The raw rows hold the same bytes the store keeps for each record (``encode_ids``,
``encode_mask``, ``encode_floats`` of the same columns, the msgpack body and the xxh3
checksum), encoded before the clock starts, under a text primary key.  For scale only (no
target), ``raw plain`` rows hold the record's plain wire columns instead (u64 ids and two
binary32 columns, 16 bytes per token), as a store that does not pack columns would.  Also for
scale, ``raw store-schema 1/txn`` runs the store's own statements for each record (look up
the key and the call, insert the event, the call row and the key) through raw ``sqlite3`` on
the store's schema, with no Python around them: the floor of this design.

Targets (issue): store x1 >= 0.9x raw 1/txn; store x16 >= 0.9x raw 64/txn (records/s, median).

    .venv/bin/python tools/bench_staging.py [--quick] [--json] [--records N] [--repeat R]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, make_columns, parser, temp_dir

from store import StagedCallRecord, compute_chain_hash, hash_token_ids, open_store
from store.columns import encode_floats, encode_ids, encode_mask, event_checksum
from store.events import encode_body, record_body
from store.projections import generated_spans

TOKENS = 4_096
THREADS = 16
RAW_BATCH = 64
TARGET = 0.9
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


def plain_row(record: StagedCallRecord) -> RawRow:
    """The record's plain wire columns (as the staging digest hashes them), unpacked."""
    key, body, _, _, _, _ = raw_row(record)
    columns = record.columns
    ids = columns.token_ids.big_endian().tobytes()
    mask = columns.token_mask.big_endian_f32().tobytes()
    lps = columns.log_probs.big_endian_f32().tobytes()
    return key, body, ids, mask, lps, floor_checksum(record, body, ids, mask, lps)


def run_store_schema_floor(path: str, records: list[StagedCallRecord]) -> tuple[float, dict[str, Any]]:
    """The store's per-record statements and commit, driven by raw sqlite3 (no store code)."""
    open_store(path).close()  # create and migrate the schema
    rows = [raw_row(record) for record in records]
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA synchronous = FULL")
    try:
        start = time.perf_counter()
        for record, (key, body, ids, mask, lps, checksum) in zip(records, rows, strict=True):
            stream = (record.rollout_id, record.model_call_id)
            connection.execute("BEGIN IMMEDIATE")
            connection.execute("SELECT event_seq, digest FROM staged_keys WHERE staging_key = ?", (key,)).fetchone()
            connection.execute("SELECT * FROM calls WHERE rollout_id = ? AND model_call_id = ?", stream).fetchone()
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
    return elapsed, {"transactions": len(records)}


def raw_connection(path: str) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA busy_timeout = 60000")
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = FULL")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS staged (staging_key TEXT PRIMARY KEY, body BLOB NOT NULL, "
        "token_ids BLOB, token_mask BLOB, log_probs BLOB, checksum BLOB NOT NULL)"
    )
    return connection


_INSERT = "INSERT INTO staged VALUES (?, ?, ?, ?, ?, ?)"


def run_raw(path: str, rows: list[RawRow], batch: int) -> tuple[float, dict[str, Any]]:
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
    return elapsed, {"transactions": -(-len(rows) // batch)}


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


def run_store(path: str, records: list[StagedCallRecord], threads: int) -> tuple[float, dict[str, Any]]:
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
    common = Counter(batches).most_common(3)
    facts = {
        "transactions": len(batches) if batches else "?",
        "mean_batch": statistics.fmean(batches) if batches else 0.0,
        "max_batch": max(batches, default=0),
        "common_batch_sizes": {str(size): seen for size, seen in common},
    }
    return elapsed, facts


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=None, help="records per variant (default 1024; 128 with --quick)")
    p.add_argument("--repeat", type=int, default=None, help="repetitions per variant (default 5; 1 with --quick)")
    args = p.parse_args()
    count = args.records or (128 if args.quick else 1024)
    count -= count % THREADS
    repeat = args.repeat or (1 if args.quick else 5)

    records = build_records(count, args.seed)
    rows = [raw_row(record) for record in records]
    plain_rows = [plain_row(record) for record in records]
    bytes_per_record = statistics.fmean(sum(len(part) for part in row[1:]) for row in rows)

    raw1, raw_many, store1, store_many = "raw 1/txn", f"raw {RAW_BATCH}/txn", "store x1", f"store x{THREADS}"
    variants: dict[str, Callable[[str], tuple[float, dict[str, Any]]]] = {
        raw1: lambda path: run_raw(path, rows, 1),
        raw_many: lambda path: run_raw(path, rows, RAW_BATCH),
        store1: lambda path: run_store(path, records, 1),
        store_many: lambda path: run_store(path, records, THREADS),
        "raw plain 1/txn": lambda path: run_raw(path, plain_rows, 1),
        f"raw plain {RAW_BATCH}/txn": lambda path: run_raw(path, plain_rows, RAW_BATCH),
        "raw store-schema 1/txn": lambda path: run_store_schema_floor(path, records),
    }
    # Each store variant runs right next to its raw baseline (order flipped every repetition),
    # so the paired ratio of one repetition sees the same disk: fsync latency here drifts a lot.
    pairs = [(raw1, store1), (raw_many, store_many)]
    scale_pairs = [
        ("raw plain 1/txn", store1),
        (f"raw plain {RAW_BATCH}/txn", store_many),
        ("raw store-schema 1/txn", store1),
    ]
    elapsed: dict[str, list[float]] = {name: [] for name in variants}
    facts: dict[str, dict[str, Any]] = {}
    with temp_dir(args.dir) as folder:
        for rep in range(repeat):
            for pair in [*pairs, *scale_pairs]:
                for name in pair if rep % 2 == 0 else reversed(pair):
                    if pair in scale_pairs and name == pair[1]:
                        continue  # the store variant already ran in its own pair
                    path = os.path.join(folder, f"{name.replace(' ', '_').replace('/', '_')}-r{rep}.db")
                    seconds, extra = variants[name](path)
                    elapsed[name].append(seconds)
                    facts[name] = extra
                    for suffix in ("", "-wal", "-shm"):
                        if os.path.exists(path + suffix):
                            os.remove(path + suffix)

    def paired(store_name: str, raw_name: str) -> float:
        """Median over repetitions of (store records/s) / (raw records/s) of adjacent runs."""
        return statistics.median(r / s for s, r in zip(elapsed[store_name], elapsed[raw_name], strict=True))

    def rate(name: str, pick: Callable[[list[float]], float]) -> float:
        return count / pick(elapsed[name])

    report = Report(
        "bench_staging",
        params={
            "records": count,
            "tokens_per_record": TOKENS,
            "stored_bytes_per_record": round(bytes_per_record),
            "repeat": repeat,
            "durability": "full (WAL, synchronous=FULL)",
        },
    )
    rows_out = []
    for name in variants:
        median_rate, best_rate = rate(name, statistics.median), rate(name, min)
        extra = facts[name]
        batch = f"{extra['mean_batch']:.1f} (max {extra['max_batch']})" if extra.get("max_batch") else ""
        rows_out.append(
            [
                name,
                f"{median_rate:,.0f}",
                f"{best_rate:,.0f}",
                f"{statistics.median(elapsed[name]):.3f} s",
                extra["transactions"],
                batch,
            ]
        )
        report.results[name] = {
            "records_per_s_median": median_rate,
            "records_per_s_best": best_rate,
            "elapsed_s": elapsed[name],
            **extra,
        }
    report.table(
        f"Staging {count} records of {TOKENS} tokens (records/s: median and best of {repeat})",
        ["variant", "rec/s median", "rec/s best", "elapsed median", "transactions", "store batch mean"],
        rows_out,
    )
    one, many = paired(store1, raw1), paired(store_many, raw_many)
    report.results["ratio_1_stager"] = one
    report.results[f"ratio_{THREADS}_stagers"] = many
    report.results["ratio_of_medians_1_stager"] = rate(store1, statistics.median) / rate(raw1, statistics.median)
    report.results[f"ratio_of_medians_{THREADS}_stagers"] = rate(store_many, statistics.median) / rate(
        raw_many, statistics.median
    )
    report.table(
        "Ratios (store records/s over raw records/s)",
        ["pair", "median of paired ratios", "ratio of medians", "per repetition"],
        [
            [
                f"{store_name} / {raw_name}",
                f"{paired(store_name, raw_name):.3f}x",
                f"{rate(store_name, statistics.median) / rate(raw_name, statistics.median):.3f}x",
                " ".join(f"{r / s:.2f}" for s, r in zip(elapsed[store_name], elapsed[raw_name], strict=True)),
            ]
            for raw_name, store_name in pairs
        ],
    )
    for raw_name, store_name in scale_pairs[:2]:
        scale = rate(store_name, statistics.median) / rate(raw_name, statistics.median)
        report.results[f"scale_{store_name}_vs_{raw_name}"] = scale
        report.notes.append(f"for scale, no target: {store_name} / {raw_name} (ratio of medians) = {scale:.3f}x")
    floor = rate("raw store-schema 1/txn", statistics.median) / rate(raw1, statistics.median)
    report.results["floor_store_schema_vs_raw_1_per_txn"] = floor
    report.notes.append(
        f"for scale, no target: raw store-schema 1/txn / {raw1} (ratio of medians) = {floor:.3f}x "
        "(the most any implementation of this schema could reach)"
    )
    report.targets.append(Target("staging_1_stager_vs_raw_1_per_txn", one, ">=", TARGET))
    report.targets.append(Target(f"staging_{THREADS}_stagers_vs_raw_{RAW_BATCH}_per_txn", many, ">=", TARGET))
    batches = facts[store_many].get("common_batch_sizes", {})
    report.notes.append(
        f"{store_many}: most common group-commit batch sizes (size: count, last repetition): "
        + ", ".join(f"{size}: {seen}" for size, seen in batches.items())
    )
    report.notes.append("store batch = records per group-commit transaction (one fsync each)")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
