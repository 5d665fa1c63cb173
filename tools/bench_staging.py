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
* ``store x64`` vs ``raw 64/txn``  -- the same with 64 threads and 64 rows per transaction;
* ``floor x1``, ``floor 16/txn``, ``floor 64/txn`` vs the raw variant of the same batch size -- for scale:
  the store's own statements for each record (its one lookup, then the event, calls and key inserts)
  through raw sqlite3 on the store's schema, from one thread, no Python around them (the most this
  schema could reach);
* ``small ...`` -- the 1-stager pair and floor again with 256-token records (per-record overhead);
* ``..., taking turns per transaction`` -- for scale, the 1-stager pairs and floors again with the store,
  the floor and raw sqlite3 alternating every transaction (each on its own fresh file), so all meet
  the same disk;
* latency (16 stagers): every ``stage()`` call's time against the median time raw sqlite3 takes
  to commit one 16-row batch of the same bytes, same round: median and p99 of the stage times;
* ``--growth N``: ``store x1`` on a store already holding N staged records (filled once, before the
  rounds, by raw inserts of real stored rows through the store's own statements) against
  ``store x1`` on an empty store, each round against the same ``raw 1/txn`` block.

Raw rows hold the bytes the store keeps for each record (packed columns, msgpack body, xxh3
checksum), encoded before the clock starts, at the store's pragmas (WAL, synchronous=FULL).

Targets (issue 11, medians of the per-round ratios): store x1 >= 0.85x raw 1/txn; store x16 >= 0.70x
raw 16/txn; store x64 >= 0.65x raw 64/txn; small records >= 0.70x; 16-stager latency median <= 3x and
p99 <= 6x the raw batch; growth (grown over empty) >= 0.90x.

    .venv/bin/python tools/bench_staging.py [--quick] [--json] [--rounds R] [--block B] [--growth N]
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

import msgspec
import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, fsync_seconds, make_columns, parser, temp_dir

from store import StagedCallRecord, compute_chain_hash, hash_token_ids, open_store
from store.append.statements import stage_lookup_statement
from store.log.checksum import event_checksum
from store.log.events import encode_body, record_body
from store.projections.fold import generated_spans
from store.wire.columns import encode_floats, encode_ids, encode_mask

TOKENS = 4_096
SMALL_TOKENS = 256
THREADS = 16
MANY_THREADS = 64
TARGET_1 = 0.85
TARGET_64 = 0.65
TARGET_SMALL = 0.70
TARGET_LATENCY_MEDIAN = 3.0
TARGET_LATENCY_P99 = 6.0
TARGET_GROWTH = 0.90
FILL_TEMPLATES = 64  # distinct records the growth fill repeats under new capture keys
FILL_BATCH = 2_000  # rows per fill transaction
# The store's own read per stage (fence, key, calls row, stream version), compiled for SQLite.
STAGE_LOOKUP = stage_lookup_statement(sa.create_engine("sqlite://"))
TARGET_MANY = 0.70
WEIGHT_VERSION = 7

RawRow = tuple[str, bytes, bytes, bytes, bytes, bytes]


def build_records(count: int, seed: int, tokens: int = TOKENS, prefix: str = "rollout") -> list[StagedCallRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for index in range(count):
        columns = make_columns(rng, tokens)
        records.append(
            StagedCallRecord.from_components(
                rollout_id=f"{prefix}-{index:06d}",
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


def run_store_schema_floor(path: str, records: list[StagedCallRecord], rows: list[RawRow], batch: int = 1) -> float:
    """The store's per-record statements, ``batch`` records per commit, driven by raw sqlite3 from
    one thread (no store code, no threads: what a group-commit batch of that size could reach)."""
    connection = floor_connection(path)
    try:
        start = time.perf_counter()
        for index, (record, row) in enumerate(zip(records, rows, strict=True)):
            if index % batch == 0:
                connection.execute("BEGIN IMMEDIATE")
            floor_statements(connection, record, row)
            if index % batch == batch - 1 or index == len(records) - 1:
                connection.execute("COMMIT")
        elapsed = time.perf_counter() - start
    finally:
        connection.close()
    return elapsed


def floor_connection(path: str) -> sqlite3.Connection:
    """A new store file (schema created and migrated by the store), opened by raw sqlite3."""
    open_store(path).close()
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA synchronous = FULL")
    return connection


def floor_statements(connection: sqlite3.Connection, record: StagedCallRecord, row: RawRow) -> None:
    """One record's statements as the store runs them: its lookup, then the event, calls and key inserts."""
    key, body, ids, mask, lps, checksum = row
    stream = (record.rollout_id, record.model_call_id)
    lookup = {"rollout_id": stream[0], "model_call_id": stream[1], "staging_key": key}
    connection.execute(STAGE_LOOKUP.sql, STAGE_LOOKUP.params(lookup)).fetchone()
    seq = connection.execute(
        "INSERT INTO events (rollout_id, model_call_id, stream_version, kind, staging_key, writer_pid, "
        "recorded_at, body, token_ids, token_mask, log_probs, checksum) "
        "VALUES (?, ?, 1, 'call_completed', ?, 1, 0.0, ?, ?, ?, ?, ?) RETURNING seq",
        (*stream, key, body, ids, mask, lps, checksum),
    ).fetchone()[0]
    _insert_floor_projections(connection, record, stream, key, seq)


def _insert_floor_projections(
    connection: sqlite3.Connection, record: StagedCallRecord, stream: tuple[str, str], key: str, seq: int
) -> None:
    """The calls and staged_keys rows of one staged record (as the store's fold writes them)."""
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


def run_raw(path: str, rows: list[RawRow], batch: int, commits: list[float] | None = None) -> float:
    """Raw inserts, ``batch`` rows per transaction; ``commits`` gets each transaction's time."""
    connection = raw_connection(path)
    clock = time.perf_counter
    try:
        start = clock()
        for offset in range(0, len(rows), batch):
            began = clock()
            connection.execute("BEGIN IMMEDIATE")
            if batch == 1:
                connection.execute(_INSERT, rows[offset])
            else:
                connection.executemany(_INSERT, rows[offset : offset + batch])
            connection.execute("COMMIT")
            if commits is not None:
                commits.append(clock() - began)
        elapsed = clock() - start
        staged = connection.execute("SELECT count(*) FROM staged").fetchone()[0]
    finally:
        connection.close()
    if staged != len(rows):
        raise AssertionError(f"raw: {staged} rows stored, {len(rows)} expected")
    return elapsed


def _count_batches(store: Any) -> list[int]:
    """Record the size of every group-commit batch (instruments this store instance only)."""
    sizes: list[int] = []
    log = getattr(store, "_log", None)
    original = getattr(log, "_write_batch", None)
    if original is None:  # the store's internals changed: report no batch sizes
        return sizes

    def counting(batch: list[Any]) -> None:
        try:
            original(batch)
        finally:
            sizes.append(len(batch))  # after: callers that queue while a batch runs join it

    log._write_batch = counting
    return sizes


def run_store(
    path: str, records: list[StagedCallRecord], threads: int, latencies: list[float] | None = None
) -> tuple[float, list[int]]:
    """Stage ``records`` from ``threads`` threads; ``latencies`` gets every ``stage()`` call's time."""
    store = open_store(path, durability="full")
    failures: list[str] = []
    clock = time.perf_counter
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
                times = []
                barrier.wait()
                for record in part:
                    began = clock()
                    result = store.stage(record)
                    times.append(clock() - began)
                    if not result.ok:
                        failures.append(result.error or "?")
                if latencies is not None:
                    latencies.extend(times)  # list.extend is atomic under the GIL

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
    if staged < len(records):  # a grown store holds its fill too
        raise AssertionError(f"store: {staged} keys staged, {len(records)} expected")
    return elapsed, batches


def fill_store(path: str, count: int, tokens: int, seed: int) -> None:
    """A store holding ``count`` staged records, written fast: each row is a template record's
    stored bytes (body re-encoded with the row's own capture key, a checksum of the row as
    stored) inserted through the store's own statements in large unsynced transactions."""
    open_store(path).close()
    templates = build_records(FILL_TEMPLATES, seed + 1, tokens, prefix="template")
    prepared = []
    for record in templates:
        columns = record.columns
        body = record_body(record, generated_spans(columns.token_mask, record.weight_version))
        packed = (encode_ids(columns.token_ids), encode_mask(columns.token_mask), encode_floats(columns.log_probs))
        prepared.append((record, body, packed))
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("PRAGMA journal_mode = DELETE")
        connection.execute("PRAGMA journal_mode = OFF")  # a fill: a crash here just means filling again
        connection.execute("PRAGMA synchronous = OFF")
        for offset in range(0, count, FILL_BATCH):
            connection.execute("BEGIN IMMEDIATE")
            for index in range(offset, min(count, offset + FILL_BATCH)):
                record, body, (ids, mask, lps) = prepared[index % FILL_TEMPLATES]
                stream = (f"grown-{index:07d}", record.model_call_id)
                key = f"{stream[0]}/{stream[1]}"
                row: dict[str, Any] = {
                    "rollout_id": stream[0],
                    "model_call_id": stream[1],
                    "stream_version": 1,
                    "kind": "call_completed",
                    "staging_key": key,
                    "writer_pid": 1,
                    "recorded_at": float(index),
                    "body": encode_body(msgspec.structs.replace(body, rollout_id=stream[0])),
                    "token_ids": ids,
                    "token_mask": mask,
                    "log_probs": lps,
                }
                row["checksum"] = event_checksum(row)
                seq = connection.execute(
                    "INSERT INTO events (rollout_id, model_call_id, stream_version, kind, staging_key, writer_pid, "
                    "recorded_at, body, token_ids, token_mask, log_probs, checksum) "
                    "VALUES (:rollout_id, :model_call_id, :stream_version, :kind, :staging_key, :writer_pid, "
                    ":recorded_at, :body, :token_ids, :token_mask, :log_probs, :checksum) RETURNING seq",
                    row,
                ).fetchone()[0]
                _insert_floor_projections(connection, record, stream, key, seq)
            connection.execute("COMMIT")
        connection.execute("PRAGMA journal_mode = WAL")
    finally:
        connection.close()
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the fill's writeback is over before any block is timed
    finally:
        os.close(descriptor)


def run_interleaved(
    folder: str, records: list[StagedCallRecord], rows: list[RawRow], flip: bool
) -> tuple[float, float]:
    """1 stager, its floor and raw 1/txn taking turns transaction by transaction (fresh files),
    so all three meet the same moods of the disk.  Returns store and floor records/s over raw."""
    paths = [os.path.join(folder, f"interleaved-{name}.db") for name in ("store", "floor", "raw")]
    store = open_store(paths[0], durability="full")
    floor = floor_connection(paths[1])
    raw = raw_connection(paths[2])
    clock = time.perf_counter
    spent = [0.0, 0.0, 0.0]  # store, floor, raw
    try:
        for index, (record, row) in enumerate(zip(records, rows, strict=True)):
            for turn in (0, 1, 2) if (index % 2 == 0) != flip else (2, 1, 0):
                began = clock()
                if turn == 0:
                    if not store.stage(record).ok:
                        raise AssertionError(f"store refused {record.staging_key}")
                elif turn == 1:
                    floor.execute("BEGIN IMMEDIATE")
                    floor_statements(floor, record, row)
                    floor.execute("COMMIT")
                else:
                    raw.execute("BEGIN IMMEDIATE")
                    raw.execute(_INSERT, row)
                    raw.execute("COMMIT")
                spent[turn] += clock() - began
    finally:
        store.close()
        floor.close()
        raw.close()
    for path in paths:
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
    return spent[2] / spent[0], spent[2] / spent[1]


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (p99 of 512 calls: the 6th largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 15; 3 with --quick)")
    p.add_argument("--block", type=int, default=None, help="transactions per block (default 32; 8 with --quick)")
    p.add_argument(
        "--growth", type=int, default=0, help="also measure store x1 on a store holding this many records (0: skip)"
    )
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    block = args.block or (8 if args.quick else 32)

    records = build_records(block * MANY_THREADS, args.seed)
    rows = [raw_row(record) for record in records]
    one_records, one_rows = records[:block], rows[:block]
    mid_records, mid_rows = records[: block * THREADS], rows[: block * THREADS]
    small_records = build_records(block, args.seed + 2, SMALL_TOKENS, prefix="small")
    small_rows = [raw_row(record) for record in small_records]
    bytes_per_record = statistics.fmean(sum(len(part) for part in row[1:]) for row in rows)
    small_bytes = statistics.fmean(sum(len(part) for part in row[1:]) for row in small_rows)

    raw1, floor1, store1 = "raw 1/txn", "floor x1", "store x1"
    raw_mid, store_mid, floor_mid = f"raw {THREADS}/txn", f"store x{THREADS}", f"floor {THREADS}/txn"
    raw_many, store_many, floor_many = f"raw {MANY_THREADS}/txn", f"store x{MANY_THREADS}", f"floor {MANY_THREADS}/txn"
    small_raw, small_floor, small_store = "small raw 1/txn", "small floor x1", "small store x1"
    grown, empty, growth_raw = "grown store x1", "empty store x1", "growth raw 1/txn"
    batches: dict[str, list[int]] = {store_mid: [], store_many: []}
    latencies: list[list[float]] = []  # per round: every stage() time of the 16-stager block
    commits: list[list[float]] = []  # per round: every transaction time of the raw 16-row block

    def store_block(path: str, part: list[StagedCallRecord], threads: int, name: str) -> float:
        times: list[float] | None = None
        if name == store_mid:
            times = []
            latencies.append(times)
        seconds, sizes = run_store(path, part, threads, times)
        if threads > 1:
            batches[name].extend(sizes)
        return seconds

    def raw_mid_block(path: str) -> float:
        times: list[float] = []
        commits.append(times)
        return run_raw(path, mid_rows, THREADS, times)

    variants: dict[str, Callable[[str, int], float]] = {
        store1: lambda path, _: store_block(path, one_records, 1, store1),
        raw1: lambda path, _: run_raw(path, one_rows, 1),
        floor1: lambda path, _: run_store_schema_floor(path, one_records, one_rows),
        store_mid: lambda path, _: store_block(path, mid_records, THREADS, store_mid),
        raw_mid: lambda path, _: raw_mid_block(path),
        floor_mid: lambda path, _: run_store_schema_floor(path, mid_records, mid_rows, THREADS),
        store_many: lambda path, _: store_block(path, records, MANY_THREADS, store_many),
        raw_many: lambda path, _: run_raw(path, rows, MANY_THREADS),
        floor_many: lambda path, _: run_store_schema_floor(path, records, rows, MANY_THREADS),
        small_store: lambda path, _: store_block(path, small_records, 1, small_store),
        small_raw: lambda path, _: run_raw(path, small_rows, 1),
        small_floor: lambda path, _: run_store_schema_floor(path, small_records, small_rows),
    }
    counts = {name: block for name in variants}
    counts.update({name: block * THREADS for name in (store_mid, raw_mid, floor_mid)})
    counts.update({name: block * MANY_THREADS for name in (store_many, raw_many, floor_many)})
    groups = [
        (store1, raw1, floor1),
        (store_mid, raw_mid, floor_mid),
        (store_many, raw_many, floor_many),
        (small_store, small_raw, small_floor),
    ]
    elapsed: dict[str, list[float]] = {}
    fsyncs: list[float] = []
    interleaved: dict[str, list[tuple[float, float]]] = {store1: [], small_store: []}
    with temp_dir(args.dir) as folder:
        if args.growth:
            grown_path = os.path.join(folder, "grown.db")
            began = time.perf_counter()
            fill_store(grown_path, args.growth, TOKENS, args.seed)
            fill_seconds = time.perf_counter() - began
            fresh = build_records(block * rounds, args.seed + 3, prefix="after")
            fresh_rows = [raw_row(record) for record in fresh]
            variants[grown] = lambda _, index: run_store(grown_path, fresh[index * block : (index + 1) * block], 1)[0]
            variants[empty] = lambda path, index: run_store(path, fresh[index * block : (index + 1) * block], 1)[0]
            variants[growth_raw] = lambda path, index: run_raw(path, fresh_rows[index * block : (index + 1) * block], 1)
            counts.update({grown: block, empty: block, growth_raw: block})
            groups.append((grown, empty, growth_raw))
        elapsed = {name: [] for name in variants}
        for index in range(rounds):
            for group in groups:
                order = group if index % 2 == 0 else tuple(reversed(group))
                for name in order:
                    fsyncs.append(fsync_seconds(folder))
                    path = os.path.join(folder, f"{name.replace(' ', '_').replace('/', '_')}-r{index}.db")
                    elapsed[name].append(variants[name](path, index))
                    for suffix in ("", "-wal", "-shm"):
                        if os.path.exists(path + suffix):
                            os.remove(path + suffix)
            interleaved[store1].append(run_interleaved(folder, one_records, one_rows, index % 2 == 1))
            interleaved[small_store].append(run_interleaved(folder, small_records, small_rows, index % 2 == 1))

    def ratios(name: str, base: str) -> list[float]:
        """Per round: (name records/s) / (base records/s)."""
        return [b / s for s, b in zip(elapsed[name], elapsed[base], strict=True)]

    params: dict[str, Any] = {
        "rounds": rounds,
        "transactions_per_block": block,
        "tokens_per_record": TOKENS,
        "stored_bytes_per_record": round(bytes_per_record),
        "small_tokens_per_record": SMALL_TOKENS,
        "small_stored_bytes_per_record": round(small_bytes),
        "durability": "full (WAL, synchronous=FULL)",
    }
    if args.growth:
        params["growth_records"] = args.growth
        params["growth_fill_seconds"] = round(fill_seconds, 1)
    report = Report("bench_staging", params=params)
    report.table(
        f"Records/s per variant (median over {rounds} rounds of {block}-transaction blocks)",
        ["variant", "rec/s median", "rec/s min", "rec/s max"],
        [
            [name, *(f"{counts[name] / pick(elapsed[name]):,.0f}" for pick in (statistics.median, max, min))]
            for name in variants
        ],
    )
    table = []
    medians: dict[str, float] = {}

    def add_ratio(key: str, per_round: list[float]) -> None:
        medians[key] = statistics.median(per_round)
        report.results[key] = {
            "median": medians[key],
            "min": min(per_round),
            "max": max(per_round),
            "per_round": per_round,
        }
        shown = " ".join(f"{r:.2f}" for r in per_round)
        table.append([key, f"{medians[key]:.3f}x", f"{min(per_round):.3f}x", f"{max(per_round):.3f}x", shown])

    pairs = [(store1, raw1), (store_mid, raw_mid), (store_many, raw_many)]
    pairs += [(floor1, raw1), (floor_mid, raw_mid), (floor_many, raw_many)]
    pairs += [(small_store, small_raw), (small_floor, small_raw)]
    if args.growth:
        pairs += [(grown, growth_raw), (empty, growth_raw)]
    for name, base in pairs:
        add_ratio(f"{name} / {base}", ratios(name, base))
    if args.growth:
        add_ratio(f"{grown} / {empty}", ratios(grown, empty))
    for name, floor, base in ((store1, floor1, raw1), (small_store, small_floor, small_raw)):
        add_ratio(f"{name} / {base}, taking turns per transaction", [pair[0] for pair in interleaved[name]])
        add_ratio(f"{floor} / {base}, taking turns per transaction", [pair[1] for pair in interleaved[name]])
    raw_batch = [statistics.median(times) for times in commits]
    add_ratio(
        f"{store_mid} stage() median / raw {THREADS}-row commit median",
        [statistics.median(times) / batch for times, batch in zip(latencies, raw_batch, strict=True)],
    )
    add_ratio(
        f"{store_mid} stage() p99 / raw {THREADS}-row commit median",
        [percentile(times, 0.99) / batch for times, batch in zip(latencies, raw_batch, strict=True)],
    )
    add_ratio(  # for scale: the disk's own tail, what no write path can go below
        f"raw {THREADS}-row commit p99 / raw {THREADS}-row commit median",
        [percentile(times, 0.99) / statistics.median(times) for times in commits],
    )
    report.table("Per-round ratios (same round)", ["pair", "median", "min", "max", "rounds"], table)
    ms = sorted(value * 1000 for value in fsyncs)
    report.results["fsync_ms"] = {"median": statistics.median(ms), "min": ms[0], "max": ms[-1]}
    report.notes.append(
        f"fsync of 4 KiB, sampled before every block: median {statistics.median(ms):.3f} ms, "
        f"min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms"
    )
    pooled = [value * 1000 for times in latencies for value in times]
    report.notes.append(
        f"{store_mid} stage() over all rounds: median {statistics.median(pooled):.2f} ms, "
        f"p99 {percentile(pooled, 0.99):.2f} ms; raw {THREADS}-row commit median "
        f"{statistics.median([v * 1000 for times in commits for v in times]):.2f} ms"
    )
    for name, sizes in batches.items():
        if sizes:
            common = Counter(sizes).most_common(3)
            report.notes.append(
                f"{name}: group-commit batch mean {statistics.fmean(sizes):.1f}, most common sizes "
                + ", ".join(f"{size}: {seen}" for size, seen in common)
            )
    report.notes.append(
        "floor = the store's own statements through raw sqlite3 from one thread, same records per commit "
        "(for scale, no target)"
    )
    many_name = f"staging_{MANY_THREADS}_stagers_vs_raw_{MANY_THREADS}_per_txn"
    latency = f"{store_mid} stage() %s / raw {THREADS}-row commit median"
    targets = [
        ("staging_1_stager_vs_raw_1_per_txn", f"{store1} / {raw1}", ">=", TARGET_1),
        (f"staging_{THREADS}_stagers_vs_raw_{THREADS}_per_txn", f"{store_mid} / {raw_mid}", ">=", TARGET_MANY),
        (many_name, f"{store_many} / {raw_many}", ">=", TARGET_64),
        ("staging_small_records_vs_raw_1_per_txn", f"{small_store} / {small_raw}", ">=", TARGET_SMALL),
        ("staging_latency_median_vs_raw_batch", latency % "median", "<=", TARGET_LATENCY_MEDIAN),
        ("staging_latency_p99_vs_raw_batch", latency % "p99", "<=", TARGET_LATENCY_P99),
    ]
    if args.growth:
        targets.append(("staging_growth_grown_vs_empty", f"{grown} / {empty}", ">=", TARGET_GROWTH))
    for target, key, op, value in targets:
        report.targets.append(Target(target, medians[key], op, value))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
