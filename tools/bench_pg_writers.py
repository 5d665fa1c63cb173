"""Benchmark: how staging scales with writers -- 1, 4, 16 and 64 processes at once -- in each fleet layout.

Every writer is a process of its own with its own store (a fleet's workers), staging records of
``--tokens`` tokens (default 1,024), one ``stage`` at a time, durably, for ``--seconds`` each
run; the table gives the records/s of all writers together.  Layouts:

* ``one store``      -- every writer stages into one PostgreSQL store (one schema): one ordered
  log, so one write lock; its writers take turns;
* ``schema each``    -- every writer has a PostgreSQL store of its own (a schema each, one
  database): no lock is shared (a group of writers per schema sits between the two);
* ``sqlite each``    -- every writer stages into a SQLite store on local disk (what a worker
  ships from later);
* ``raw psycopg``    -- for scale: every writer inserts the same stored bytes into one plain
  table of the store's ``events`` shape with psycopg, one INSERT and COMMIT per record
  (synchronous_commit on): what the server gives writers that share nothing but a table.

One run (the machine is shared: read the figures as a shape, not as a machine's rate).

    STORE_BENCH_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/db \\
        .venv/bin/python tools/bench_pg_writers.py [--writers 1,4,16,64] [--seconds S] [--tokens T] [--json]
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import psycopg
import sqlalchemy as sa
from _bench_common import Report, make_columns, parser, temp_dir
from bench_staging import raw_row

from store import StagedCallRecord, compute_chain_hash, hash_token_ids, open_store
from store.log import schema as store_schema

LAYOUTS = ("one store", "schema each", "sqlite each", "raw psycopg")


def _records(seed: int, tokens: int, count: int, prefix: str) -> list[StagedCallRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for index in range(count):
        columns = make_columns(rng, tokens)
        ids = columns.ids
        records.append(
            StagedCallRecord.from_components(
                rollout_id=f"{prefix}-{index}",
                model_call_id="call-0",
                parent_call_id=None,
                mode="text",
                prev_len=0,
                weight_version=1,
                token_ids_delta=ids,
                token_mask_delta=columns.mask,
                generation_log_probs_delta=columns.logprobs,
                chain_hash=compute_chain_hash(None, ids),
                cumulative_hash=hash_token_ids(ids),
            )
        )
    return records


def _writer(
    layout: str, index: int, where: str, tokens: int, seconds: float, count: int, start: Any, results: Any
) -> None:
    """One writer process: open its store (or connection), wait for the start, stage for
    ``seconds`` (or until its ``count`` records, made before the start, are all staged)."""
    records = _records(index, tokens, count, f"w{index}")
    if layout == "raw psycopg":
        connection = psycopg.connect(where)
        rows = [_raw_row(record) for record in records]
        sql = f"INSERT INTO raw_events ({', '.join(_RAW_COLUMNS)}) VALUES ({', '.join(['%s'] * len(_RAW_COLUMNS))})"
        start.wait()
        began, done = time.monotonic(), 0
        while time.monotonic() < began + seconds and done < len(rows):
            connection.execute(sql, rows[done])
            connection.commit()
            done += 1
        results.put((done, time.monotonic() - began))
        connection.close()
        return
    if layout == "one store":
        store = open_store(where)
    elif layout == "schema each":
        store = open_store(where, schema=f"writer_{index}")
    else:
        store = open_store(os.path.join(where, f"worker-{index}.db"))
    start.wait()
    began, done = time.monotonic(), 0
    while time.monotonic() < began + seconds and done < len(records):
        assert store.stage(records[done]).ok  # each a new record: every stage appends
        done += 1
    results.put((done, time.monotonic() - began))
    store.close()


_RAW_COLUMNS = ("rollout_id", "model_call_id", "stream_version", "kind", "staging_key", "writer_pid", "recorded_at")
_RAW_COLUMNS += ("body", "token_ids", "token_mask", "log_probs", "checksum")


def _raw_row(record: StagedCallRecord) -> tuple[Any, ...]:
    """The row the store keeps for ``record`` (``bench_staging.raw_row``'s bytes)."""
    key, body, ids, mask, lps, checksum = raw_row(record)
    head = (record.rollout_id, record.model_call_id, 1, "call_completed", key, os.getpid(), time.time())
    return (*head, body, ids, mask, lps, checksum)


def _prepare(layout: str, url: str, folder: str, writers: int) -> str:
    """The place the writers of ``layout`` write, made (and migrated) before the clock."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as connection:
        for name in [f"writer_{index}" for index in range(64)] + ["bench_one", "bench_raw"]:
            connection.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    if layout == "raw psycopg":
        with engine.begin() as connection:
            connection.exec_driver_sql('CREATE SCHEMA "bench_raw"')
            table = store_schema.events.to_metadata(sa.MetaData(), schema="bench_raw", name="raw_events")
            table.create(connection)
        engine.dispose()
        return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3Dbench_raw".replace(
            "postgresql+psycopg://", "postgresql://"
        )
    engine.dispose()
    if layout == "one store":
        target = f"{url}{'&' if '?' in url else '?'}schema=bench_one"
        open_store(target).close()
        return target
    if layout == "schema each":
        for index in range(writers):
            open_store(url, schema=f"writer_{index}").close()
        return url
    for index in range(writers):
        open_store(os.path.join(folder, f"worker-{index}.db")).close()
    return folder


def run(layout: str, url: str, folder: str, writers: int, tokens: int, seconds: float) -> float:
    where = _prepare(layout, url, folder, writers)
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    count = 8000 // writers + 200  # more than a writer stages in the run (a shorter run is counted as it was)
    processes = [
        context.Process(target=_writer, args=(layout, index, where, tokens, seconds, count, start, results))
        for index in range(writers)
    ]
    for process in processes:
        process.start()
    time.sleep(2.0 + writers * 0.1)  # every writer made its records and opened its store
    start.set()
    finished = [results.get(timeout=seconds + 180) for _ in processes]
    for process in processes:
        process.join(60)
    return sum(done for done, _ in finished) / max(took for _, took in finished)


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--writers", default="1,4,16,64", help="writer counts (default 1,4,16,64)")
    p.add_argument("--seconds", type=float, default=None, help="seconds each run stages (default 4; --quick 1)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per record (default 1,024)")
    args = p.parse_args()
    url = os.environ.get("STORE_BENCH_POSTGRES_URL") or os.environ.get("STORE_TEST_POSTGRES_URL")
    if not url:
        print("set STORE_BENCH_POSTGRES_URL (or STORE_TEST_POSTGRES_URL) to a PostgreSQL database", file=sys.stderr)
        return 2
    counts = [int(part) for part in args.writers.split(",")]
    seconds = args.seconds or (1.0 if args.quick else 4.0)
    report = Report("pg_writers", {"writers": counts, "seconds": seconds, "tokens": args.tokens})
    results: dict[str, dict[int, float]] = {layout: {} for layout in LAYOUTS}
    with temp_dir(args.dir) as folder:
        for writers in counts:
            for layout in LAYOUTS:
                results[layout][writers] = run(layout, url, folder, writers, args.tokens, seconds)
    report.results = {layout: {str(n): rate for n, rate in rates.items()} for layout, rates in results.items()}
    report.table(
        f"records/s of all writers together ({args.tokens} tokens a record, {seconds:g} s a run, one run)",
        ["layout", *(f"{n} writer{'s' if n > 1 else ''}" for n in counts)],
        [[layout, *(f"{results[layout][n]:.0f}" for n in counts)] for layout in LAYOUTS],
    )
    report.notes.append("the machine is shared: one run, not alternating rounds")
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
