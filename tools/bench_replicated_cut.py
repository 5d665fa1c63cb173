"""Benchmark: what the replicated durability domain costs, against the local one, in one run.

(a) A cut of 64 live calls (``serve_generation_cut``) by a worker whose store is a local SQLite
    file: acknowledged locally (``domain="local"``) against acknowledged once in a PostgreSQL
    replica (``domain="replicated"``, the replica a fresh schema).  Each call has decoded
    ``--tokens`` tokens (the first cut stages each call's cumulative prefix), then 64 more (the
    second cut stages generation-only chunks).  Goal (issue 25): replicated <= 2x local.
    Floors, each added to the local cut: the bare PostgreSQL cost of the same bytes (one raw
    psycopg transaction inserting 65 rows of the cut's chunk sizes, then COMMIT), and the same 64
    records staged in one ``stage_all`` straight into a PostgreSQL store (the target's own write
    path: the checks and projections a ship applies too).
(b) Staging throughput: ``--records`` terminal records of 1,024 tokens staged one at a time,
    ``replicate_terminal=True`` against the local domain; by one thread, then by 8 threads
    (whose waits share the shipper's batches).

Alternating blocks (local first in even rounds, replicated first in odd ones), fresh files and
a fresh schema each round; per-round ratios, median (min-max).  Needs a PostgreSQL server:

    STORE_BENCH_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/DB .venv/bin/python tools/bench_replicated_cut.py
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import replica_helpers as rh
from factories import make_record

from store import StageEntry, open_store

CALLS = 64


def cut_times(path: str, tokens: int, replica: str | None) -> tuple[float, float, list[int]]:
    """Seconds of the first and second cut of 64 live calls, and the first cut's chunk sizes."""
    options = {} if replica is None else {"replica": replica, "domain": "replicated", "replica_wait": 30.0}
    with open_store(path, **options) as store:  # type: ignore[arg-type]
        capture = rh.capture_on(store)
        root = rh.stage_root(capture)
        live = {call: rh.admit(capture, root, call, limit=tokens + 64) for call in range(1, CALLS + 1)}
        ids = np.arange(tokens, dtype=np.uint64) + 1000
        logprobs = np.full(tokens, -0.5)
        for active in live.values():
            capture.observe(active, ids.tolist(), logprobs.tolist())  # type: ignore[arg-type]
        if replica is not None:
            assert store.replicate(wait=60.0)  # the admissions are in the replica before the clock starts
        started = time.perf_counter()
        first = capture.serve_generation_cut(rh.inventory("checkpoint-1", live))
        first_s = time.perf_counter() - started
        assert {ack.disposition for ack in first.prefixes} == {"durable_prefix"}
        for active in live.values():
            capture.observe(active, ids[:64].tolist(), logprobs[:64].tolist())  # type: ignore[arg-type]
        started = time.perf_counter()
        second = capture.serve_generation_cut(rh.inventory("checkpoint-2", live))
        second_s = time.perf_counter() - started
        assert {ack.disposition for ack in second.prefixes} == {"durable_prefix"}
        sizes = [
            len(snapshot.token_ids_delta) for snapshot in store.fetch([a.staging_keys[-1] for a in first.prefixes])
        ]
        capture.close()
    return first_s, second_s, sizes


def floor_seconds(url: str, sizes: list[int]) -> float:
    """One raw transaction: 65 rows of the cut's byte sizes (ids, mask, log-probs) and COMMIT."""
    rows = [(os.urandom(8 * n), os.urandom(4 * n), os.urandom(4 * n)) for n in [*sizes, 0]]
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=False) as connection:
        connection.execute("CREATE TEMP TABLE floor_rows (ids bytea, mask bytea, lp bytea)")
        connection.commit()
        started = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.executemany("INSERT INTO floor_rows VALUES (%s, %s, %s)", rows)
        connection.commit()
        return time.perf_counter() - started


def store_floor_seconds(replica: str, sizes: list[int]) -> float:
    """The same records staged straight into a PostgreSQL store, in one ``stage_all``: the target's
    own write path (its checks and projections), which any design keeping them pays."""
    records = [
        StageEntry(make_record(rollout_id=f"f{i}", model_call_id="c0", generated=range(1, n + 1)))
        for i, n in enumerate(sizes)
    ]
    with open_store(replica) as target:
        started = time.perf_counter()
        target.stage_all(records)
        return time.perf_counter() - started


def staging_rate(path: str, records: int, replica: str | None, threads: int = 1) -> float:
    """Terminal records of 1,024 tokens staged one at a time by each of ``threads`` threads: records/s."""
    options = {} if replica is None else {"replica": replica, "domain": "replicated", "replicate_terminal": True}
    made = [make_record(rollout_id=f"b{i}", model_call_id="c0", generated=range(1, 1021)) for i in range(records)]
    with open_store(path, **options) as store:  # type: ignore[arg-type]
        if replica is not None:
            assert store.replicate(wait=60.0)

        def stage_share(index: int) -> None:
            for record in made[index::threads]:
                store.stage(record)

        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(stage_share, range(threads)))
        return records / (time.perf_counter() - started)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--records", type=int, default=200)
    args = parser.parse_args()
    url = os.environ.get("STORE_BENCH_POSTGRES_URL")
    if not url:
        print("set STORE_BENCH_POSTGRES_URL to a database of your own")
        return 2
    first_ratio, second_ratio, floor_ratio, stage_ratio = [], [], [], []
    local_ms, replicated_ms, floor_ms, rates = [], [], [], []
    store_floor_ratio: list[float] = []
    store_floor_ms: list[float] = []
    threaded_ratio: list[float] = []
    threaded_rates: list[tuple[float, float]] = []
    folder = tempfile.mkdtemp(prefix="bench-replicated-")
    try:
        for round_index in range(args.rounds):
            schema = f"bench_{os.getpid()}_{round_index}"
            replica = f"{url}?schema={schema}"
            blocks: list[tuple[str, Callable[[], tuple[float, float, list[int]]]]] = [
                ("local", functools.partial(cut_times, f"{folder}/l{round_index}.db", args.tokens, None)),
                ("replicated", functools.partial(cut_times, f"{folder}/r{round_index}.db", args.tokens, replica)),
            ]
            if round_index % 2:
                blocks.reverse()
            got = {name: run() for name, run in blocks}
            (l1, l2, sizes), (r1, r2, _) = got["local"], got["replicated"]
            floor = floor_seconds(url, sizes)
            store_floor = store_floor_seconds(f"{url}?schema={schema}f", sizes)
            store_floor_ratio.append((l1 + store_floor) / l1)
            store_floor_ms.append(store_floor * 1e3)
            first_ratio.append(r1 / l1)
            second_ratio.append(r2 / l2)
            floor_ratio.append((l1 + floor) / l1)
            local_ms.append(l1 * 1e3)
            replicated_ms.append(r1 * 1e3)
            floor_ms.append(floor * 1e3)
            stage_blocks: list[tuple[str, Callable[[], float]]] = [
                ("local", functools.partial(staging_rate, f"{folder}/sl{round_index}.db", args.records, None)),
                (
                    "replicated",
                    functools.partial(staging_rate, f"{folder}/sr{round_index}.db", args.records, replica + "s"),
                ),
            ]
            if round_index % 2:
                stage_blocks.reverse()
            rate = {name: run() for name, run in stage_blocks}
            stage_ratio.append(rate["replicated"] / rate["local"])
            rates.append((rate["local"], rate["replicated"]))
            threaded: list[tuple[str, Callable[[], float]]] = [
                ("local", functools.partial(staging_rate, f"{folder}/tl{round_index}.db", args.records, None, 8)),
                (
                    "replicated",
                    functools.partial(staging_rate, f"{folder}/tr{round_index}.db", args.records, replica + "t", 8),
                ),
            ]
            if round_index % 2:
                threaded.reverse()
            rate = {name: run() for name, run in threaded}
            threaded_ratio.append(rate["replicated"] / rate["local"])
            threaded_rates.append((rate["local"], rate["replicated"]))
            with psycopg.connect(url) as connection:
                connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                connection.execute(f'DROP SCHEMA IF EXISTS "{schema}s" CASCADE')
                connection.execute(f'DROP SCHEMA IF EXISTS "{schema}f" CASCADE')
                connection.execute(f'DROP SCHEMA IF EXISTS "{schema}t" CASCADE')
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = statistics.median
    print(f"{args.rounds} rounds, {CALLS} live calls of {args.tokens} tokens, then 64 more each")
    print(f"first cut:  local {med(local_ms):.1f} ms, replicated {med(replicated_ms):.1f} ms")
    print(f"first cut   replicated / local: {summary(first_ratio)}   goal <= 2x")
    print(f"second cut  replicated / local: {summary(second_ratio)}   goal <= 2x")
    print(
        f"floor: a raw PostgreSQL transaction of the same rows {med(floor_ms):.1f} ms; "
        f"(local + floor) / local: {summary(floor_ratio)}"
    )
    print(
        f"floor: the same records in one stage_all straight into a PostgreSQL store {med(store_floor_ms):.1f} ms; "
        f"(local + that) / local: {summary(store_floor_ratio)}"
    )
    print(
        f"staging {args.records} terminal records of 1,024 tokens: local {med(r[0] for r in rates):.0f}/s, "
        f"replicate_terminal {med(r[1] for r in rates):.0f}/s; replicated / local: {summary(stage_ratio)}"
    )
    print(
        f"the same from 8 threads: local {med(r[0] for r in threaded_rates):.0f}/s, "
        f"replicate_terminal {med(r[1] for r in threaded_rates):.0f}/s; replicated / local: {summary(threaded_ratio)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
