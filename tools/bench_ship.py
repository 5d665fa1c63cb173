"""Benchmark: ``Store.ship`` of a worker's SQLite log into PostgreSQL, vs a raw psycopg COPY.

A SQLite store of N records of ``--tokens`` tokens (default 1,024) is shipped into a fresh
schema of a PostgreSQL store (each round its own schema).  The baseline reads the same stored
rows from the SQLite file with raw ``sqlite3`` and writes them with one binary psycopg ``COPY``
into a fresh table of the same columns, each column kept as the store's events table keeps it
(its packed token columns out of line, uncompressed), one durable commit (the server's
``synchronous_commit``, as a ship's batches): the cost of moving those bytes.  Two more lines
for reference: the same COPY into PostgreSQL's default column storage (which tries pglz on
every token column), and a floor for a ship -- that COPY with the store's unique index, its
write lock held and every row's checksum and record's digest checked.  Each round runs all
four back to back, in an order that rotates; events/s and the per-round ratios are reported
as median, min and max.  Target (issue 23): ship >= 0.6x the COPY's events/s at 1,024 tokens.

``--ships K``: instead, K worker stores (N records each) shipped at once by K processes into
one target store, against one process shipping one of them, alternating per round; the
aggregate events/s of the K ships over the lone ship's (what a fleet's shippers gain, with
one write lock on the target).

    STORE_BENCH_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/db \\
        .venv/bin/python tools/bench_ship.py [--records N] [--tokens T] [--rounds R] [--ships K] [--quick] [--json]

(``STORE_TEST_POSTGRES_URL`` is used when ``STORE_BENCH_POSTGRES_URL`` is not set; the
program creates and drops its own schemas there.)
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _bench_common import Report, Target, fmt_seconds, parser, temp_dir
from bench_audit import build_store

from store import open_store
from store.log.checksum import event_checksum
from store.log.events import RECORD_KINDS, EventKind, decode_body
from store.wire.digest import stored_record_digest

TARGET_RATIO = 0.6
_COLUMNS = (
    "rollout_id, model_call_id, stream_version, kind, staging_key, writer_pid, recorded_at, "
    "body, token_ids, token_mask, log_probs, checksum, writer_host, store_id"
)

_TYPES = [
    *("text", "text", "int4", "varchar", "text", "int4", "float8"),
    *("bytea", "bytea", "bytea", "bytea", "bytea", "text", "varchar"),
]


def _conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def ship_once(source_path: str, url: str, schema: str) -> tuple[float, int]:
    """Seconds of one ship into a new schema (opening and migrating the target not timed)."""
    with open_store(source_path) as source, open_store(url, schema=schema) as target:
        start = time.perf_counter()
        report = source.ship(target)
        took = time.perf_counter() - start
    assert report.ok and report.present == 0, report.summary()
    return took, report.appended


def _ship_into(source_path: str, url: str, schema: str, ready: Any, go: Any) -> tuple[float, float, int]:
    """One of K shippers: open both stores, wait for the others, ship; (start, end, events)."""
    with open_store(source_path) as source, open_store(url, schema=schema) as target:
        ready.put(1)
        go.wait()
        start = time.perf_counter()
        report = source.ship(target)
        end = time.perf_counter()
    assert report.ok and report.present == 0, report.summary()
    return start, end, report.appended


def ships_at_once(paths: list[str], url: str, schema: str) -> tuple[float, int]:
    """Seconds from the first ship's start to the last one's end, and the events, of K ships at once."""
    with open_store(url, schema=schema):
        pass  # created and migrated before the clock
    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    ready, go = manager.Queue(), manager.Event()
    with context.Pool(len(paths)) as pool:
        pending = [pool.apply_async(_ship_into, (path, url, schema, ready, go)) for path in paths]
        for _ in paths:
            ready.get(timeout=120)
        go.set()
        results = [item.get(timeout=600) for item in pending]
    manager.shutdown()
    return max(end for _, end, _ in results) - min(start for start, _, _ in results), sum(n for _, _, n in results)


def fleet_rounds(paths: list[str], url: str, count: int) -> dict[str, Any]:
    lone: list[float] = []
    together: list[float] = []
    ratios: list[float] = []
    for index in range(count + 1):
        schemas = (f"bench_lone_{index}", f"bench_fleet_{index}")
        try:
            if index % 2:
                fleet = ships_at_once(paths, url, schemas[1])
                lone_run = ship_once(paths[0], url, schemas[0])
            else:
                lone_run = ship_once(paths[0], url, schemas[0])
                fleet = ships_at_once(paths, url, schemas[1])
        finally:
            for schema in schemas:
                drop_schema(url, schema)
        if index == 0:
            continue
        (lone_s, lone_n), (fleet_s, fleet_n) = lone_run, fleet
        lone.append(lone_n / lone_s)
        together.append(fleet_n / fleet_s)
        ratios.append(together[-1] / lone[-1])
    return {
        "lone_ship_events_per_s": _spread(lone),
        "ships_at_once_events_per_s": _spread(together),
        "ratio": _spread(ratios),
        "rounds": count,
    }


def _shown_spread(spread: dict[str, float]) -> str:
    return f"{spread['median']:.0f} ({spread['min']:.0f}-{spread['max']:.0f})"


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def store_storage(url: str) -> dict[str, str]:
    """How a store's events table keeps each column (``pg_attribute.attstorage``): the baseline's
    table is made to keep them the same way (the store keeps its packed token columns out of
    line without trying to compress them, revision 0009)."""
    schema = "bench_storage"
    try:
        with open_store(url, schema=schema):
            pass
        with psycopg.connect(_conninfo(url), autocommit=True) as connection:
            rows = connection.execute(
                "SELECT attname, attstorage FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0",
                (f'"{schema}".events',),
            ).fetchall()
    finally:
        drop_schema(url, schema)
    return {str(name): str(storage) for name, storage in rows}


_NAMES = tuple(name.strip() for name in _COLUMNS.split(","))
_STORAGE_NAMES = {"p": "PLAIN", "e": "EXTERNAL", "m": "MAIN", "x": "EXTENDED"}


def copy_once(
    source_path: str, url: str, schema: str, storage: dict[str, str] | None = None, *, floor: bool = False
) -> tuple[float, int]:
    """Seconds of a raw read of the log's rows and one COPY of them into a fresh table, its columns
    kept as ``storage`` says (None: PostgreSQL's defaults).  ``floor``: also the work a ship
    cannot skip -- the store's write lock held, each row's checksum and each record's digest
    checked -- into a table with the store's unique stream-version index."""
    with psycopg.connect(_conninfo(url), autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
        connection.execute(
            f'CREATE TABLE "{schema}".events (seq bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, '
            "rollout_id text, model_call_id text, stream_version int, kind varchar(32), staging_key text, "
            "writer_pid int, recorded_at double precision, body bytea, token_ids bytea, token_mask bytea, "
            "log_probs bytea, checksum bytea, writer_host text, store_id varchar(36))"
        )
        for column, kept in (storage or {}).items():
            if column in _NAMES and kept in _STORAGE_NAMES:
                kind = _STORAGE_NAMES[kept]
                connection.execute(f'ALTER TABLE "{schema}".events ALTER COLUMN {column} SET STORAGE {kind}')
        if floor:
            connection.execute(f'ALTER TABLE "{schema}".events ADD UNIQUE (rollout_id, model_call_id, stream_version)')
    start = time.perf_counter()
    rows = 0
    reader = sqlite3.connect(source_path)
    try:
        with psycopg.connect(_conninfo(url)) as connection:
            if floor:
                connection.execute("SELECT pg_advisory_xact_lock(4242)")
            statement = f'COPY "{schema}".events ({_COLUMNS}) FROM STDIN (FORMAT BINARY)'
            with connection.cursor() as cursor, cursor.copy(statement) as copy:
                copy.set_types(_TYPES)
                for row in reader.execute(f"SELECT {_COLUMNS} FROM events ORDER BY seq"):
                    if floor:
                        _check(row)
                    copy.write_row(row)
                    rows += 1
            connection.commit()
    finally:
        reader.close()
    return time.perf_counter() - start, rows


def _check(row: tuple[Any, ...]) -> None:
    """The floor's checks of one row: its checksum, and a record's digest from its stored bytes."""
    values = dict(zip(_NAMES, row, strict=True))
    assert event_checksum(values) == values["checksum"]
    kind = EventKind(values["kind"])
    if kind in RECORD_KINDS:
        body = decode_body(kind, values["body"])
        fast = stored_record_digest(body, values["token_ids"], values["token_mask"], values["log_probs"])
        assert fast is not None and fast[0] == body.digest


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(_conninfo(url), autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def rounds(source_path: str, url: str, count: int) -> dict[str, Any]:
    """Per round, in an order that rotates: the ship, the COPY into a table kept as the store
    keeps its own (the target), the COPY into PostgreSQL's default column storage, and the
    floor (that COPY plus the lock and the checks a ship cannot skip)."""
    storage = store_storage(url)
    runs: dict[str, Any] = {
        "ship": lambda schema: ship_once(source_path, url, schema),
        "copy": lambda schema: copy_once(source_path, url, schema, storage),
        "copy_default_storage": lambda schema: copy_once(source_path, url, schema),
        "floor": lambda schema: copy_once(source_path, url, schema, storage, floor=True),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    ratios: dict[str, list[float]] = {name: [] for name in runs if name != "ship"}
    names = list(runs)
    for index in range(count + 1):  # round 0 warms the caches and is not counted
        order = names[index % len(names) :] + names[: index % len(names)]
        measured: dict[str, tuple[float, int]] = {}
        for name in order:
            schema = f"bench_{name}_{index}"
            try:
                measured[name] = runs[name](schema)
            finally:
                drop_schema(url, schema)
        assert len({events for _, events in measured.values()}) == 1, measured
        if index == 0:
            continue
        for name, (seconds, events) in measured.items():
            rates[name].append(events / seconds)
        for name in ratios:
            ratios[name].append(rates["ship"][-1] / rates[name][-1])
    return {
        "events_per_s": {name: _spread(values) for name, values in rates.items()},
        "ship_over": {name: _spread(values) for name, values in ratios.items()},
        "rounds": count,
    }


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--records", type=int, default=None, help="records of 4,096 tokens (default 2,000; --quick 300)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick 3)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per record (default 1,024)")
    p.add_argument("--ships", type=int, default=None, help="K shippers at once against one (see the module note)")
    args = p.parse_args()
    url = os.environ.get("STORE_BENCH_POSTGRES_URL") or os.environ.get("STORE_TEST_POSTGRES_URL")
    if not url:
        print("set STORE_BENCH_POSTGRES_URL (or STORE_TEST_POSTGRES_URL) to a PostgreSQL database", file=sys.stderr)
        return 2
    records = args.records or (300 if args.quick else 2_000)
    count = args.rounds or (3 if args.quick else 5)
    tokens = args.tokens
    report = Report("ship", {"records": records, "tokens": tokens, "rounds": count})
    if args.ships:
        return _fleet(args, url, records, count, tokens, report)
    with temp_dir(args.dir) as folder:
        path = os.path.join(folder, "worker.db")
        started = time.perf_counter()
        build_store(path, records, args.seed, tokens)
        report.notes.append(f"built the source store in {fmt_seconds(time.perf_counter() - started)}")
        result = rounds(path, url, count)
    report.results = result
    rates, ratios = result["events_per_s"], result["ship_over"]
    report.table(
        f"{records} records x {tokens} tokens, SQLite -> PostgreSQL (events/s, median (min-max) of {count} rounds)",
        ["what", "events/s", "Store.ship over it"],
        [
            ["Store.ship", _shown_spread(rates["ship"]), ""],
            ["raw sqlite3 read + psycopg COPY", _shown_spread(rates["copy"]), _shown_ratio(ratios["copy"])],
            [
                "  the same, PostgreSQL's default column storage",
                _shown_spread(rates["copy_default_storage"]),
                _shown_ratio(ratios["copy_default_storage"]),
            ],
            [
                "  the same + lock, checksum and digest checks (floor)",
                _shown_spread(rates["floor"]),
                _shown_ratio(ratios["floor"]),
            ],
        ],
    )
    report.targets.append(Target(f"ship_vs_copy_{records}x{tokens}", ratios["copy"]["median"], ">=", TARGET_RATIO))
    report.emit(args.json)
    return 0


def _shown_ratio(spread: dict[str, float]) -> str:
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


def _fleet(args: Any, url: str, records: int, count: int, tokens: int, report: Report) -> int:
    report.params["ships"] = args.ships
    with temp_dir(args.dir) as folder:
        paths = [os.path.join(folder, f"worker-{index}.db") for index in range(args.ships)]
        for index, path in enumerate(paths):
            build_store(path, records, args.seed + index, tokens, prefix=f"worker{index}")
        result = fleet_rounds(paths, url, count)
    report.results = result
    lone, together, ratio = result["lone_ship_events_per_s"], result["ships_at_once_events_per_s"], result["ratio"]
    report.table(
        f"{args.ships} worker stores x {records} records x {tokens} tokens into one PostgreSQL store "
        f"(events/s, median (min-max) of {count} rounds)",
        ["what", "events/s"],
        [
            ["one ship", f"{lone['median']:.0f} ({lone['min']:.0f}-{lone['max']:.0f})"],
            [
                f"{args.ships} ships at once (total)",
                f"{together['median']:.0f} ({together['min']:.0f}-{together['max']:.0f})",
            ],
            ["ratio", f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"],
        ],
    )
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
