"""Benchmark: what the write lock's lease costs a PostgreSQL store's writers.

The write path takes the store's write lock with ``pg_try_advisory_xact_lock`` (at once when
it is free and no one queues), else through ``store_write_lock`` (migration 0010: a wait that
looks at the holder each second), and marks the grant time with a shared advisory lock
(``store.log.postgres.write_begin_sql``).  The baseline is the lock as taken before the lease:
one ``pg_advisory_xact_lock`` under ``lock_timeout``, in the same statement.  Each block stages
records of ``--tokens`` tokens (default 1,024), one durable ``stage`` at a time, from each of
``--writers`` processes into one fresh store (a schema), for ``--seconds``; baseline and lease
blocks alternate, ``--rounds`` of each.  Printed: records/s of each block, and the median, min
and max of the per-round ratios (lease / baseline).

    STORE_BENCH_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/db \\
        .venv/bin/python tools/bench_write_lock.py [--writers 1,8] [--seconds 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sqlalchemy as sa
from bench_pg_writers import _records

import store.log.postgres as postgres
from store import open_store

SCHEMA = "bench_lock"


def _plain_write_begin_sql(lock_id: int) -> tuple[str, str]:
    """The write lock as taken before the lease: one blocking advisory lock under lock_timeout."""
    limits = postgres.WAIT_LIMITS
    head = (
        f"SELECT set_config('statement_timeout', '{round(limits.statement * 1000)}', true), "
        f"set_config('idle_in_transaction_session_timeout', '{round(limits.idle_in_transaction * 1000)}', true), "
        f"set_config('lock_timeout', '{round(limits.lock * 1000)}', true), "
    )
    lock = f"pg_advisory_xact_lock({lock_id})"
    return (
        f"{head}set_config('synchronous_commit', 'on', true), {lock}",
        f"{head}set_config('synchronous_commit', 'off', true), {lock}",
    )


def _writer(side: str, index: int, target: str, tokens: int, seconds: float, start: Any, results: Any) -> None:
    if side == "baseline":
        postgres.write_begin_sql = _plain_write_begin_sql  # type: ignore[assignment]
    records = _records(index, tokens, 6000, f"w{index}")
    store = open_store(target)
    start.wait()
    began, done = time.monotonic(), 0
    while time.monotonic() < began + seconds and done < len(records):
        assert store.stage(records[done]).ok
        done += 1
    results.put((done, time.monotonic() - began))
    store.close()


def block(side: str, url: str, writers: int, tokens: int, seconds: float) -> float:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as connection:
        connection.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    engine.dispose()
    target = f"{url}{'&' if '?' in url else '?'}schema={SCHEMA}"
    open_store(target).close()  # migrated (store_write_lock made) before the clock
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    processes = [
        context.Process(target=_writer, args=(side, index, target, tokens, seconds, start, results))
        for index in range(writers)
    ]
    for process in processes:
        process.start()
    time.sleep(1.5 + writers * 0.1)
    start.set()
    finished = [results.get(timeout=seconds + 120) for _ in processes]
    for process in processes:
        process.join(60)
    return sum(done for done, _ in finished) / max(took for _, took in finished)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", default="1,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    url = os.environ.get("STORE_BENCH_POSTGRES_URL")
    if not url:
        print("set STORE_BENCH_POSTGRES_URL", file=sys.stderr)
        return 2
    for writers in [int(count) for count in args.writers.split(",")]:
        ratios = []
        for round_index in range(args.rounds):
            baseline = block("baseline", url, writers, args.tokens, args.seconds)
            lease = block("lease", url, writers, args.tokens, args.seconds)
            ratios.append(lease / baseline)
            print(
                f"{writers} writers, round {round_index + 1}: baseline {baseline:.0f}/s, lease {lease:.0f}/s",
                flush=True,
            )
        print(
            f"{writers} writers: lease / baseline median {statistics.median(ratios):.3f}x "
            f"(min {min(ratios):.3f}x, max {max(ratios):.3f}x, {len(ratios)} rounds)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
