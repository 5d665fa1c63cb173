"""Soak: plant corruption in a small store and count what every read of it reports.

Two campaigns over the store of ``tests/corruption_helpers.populate`` (records staged directly
and through a capture: admissions, a cut chunk and its receipt, terminal records, a failure):

* columns: every damage of ``event_damages`` to every stored column of every event, one at a
  time through raw SQL, on SQLite (and PostgreSQL with ``--postgres URL``);
* file: ``--trials`` copies of the SQLite file with 1-3 random bytes flipped at random offsets.

After each plant every read is judged: the right answer, a ``StoreError`` (found), or a
violation (another key's record, another receipt or completion, a raw exception).  Prints
totals; exits 1 if anything was misreported.

    .venv/bin/python tools/soak_corruption.py [--trials 2000] [--seed 1] [--postgres URL] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sqlite3
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from corruption_helpers import (  # the shared probe lives with the tests
    Damage,
    event_damages,
    event_rows,
    flipper,
    is_sqlite,
    judge_event_damage,
    populate,
    probe,
    run_file_trials,
    sample_file,
    set_value,
)

from store import open_store


def column_campaign(url: str, raw_url: str) -> dict[str, Any]:
    """Every damage to every column of every event; returns counts and the violations seen."""
    totals: Counter[str] = Counter()
    violations: list[str] = []
    engine = sa.create_engine(raw_url, isolation_level="AUTOCOMMIT")
    try:
        with open_store(url) as store, engine.connect() as raw:
            expected = populate(store)
            for row in event_rows(raw):
                for damage in [*event_damages(row, is_sqlite(raw)), Damage("seq", "moved", value=row["seq"] + 1000)]:
                    set_value(raw, "events", damage.column, damage.sql, damage.value, "seq", row["seq"])
                    outcome = probe(store, expected)
                    totals["planted"] += 1
                    totals["found"] += outcome.found
                    totals["a read raised CorruptRecordError"] += any(outcome.corrupt(n) for n in outcome.detected)
                    problems = judge_event_damage(outcome, row, damage, expected)
                    violations += [f"event {row['seq']} {damage.column} {damage.label}: {p}" for p in problems]
                    moved = row["seq"] + 1000 if damage.column == "seq" else row["seq"]
                    set_value(raw, "events", damage.column, ":value", row[damage.column], "seq", moved)
    finally:
        engine.dispose()
    return {**totals, "misreported": len(violations), "violations": violations[:20]}


def file_campaign(trials: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="soak-corruption-") as folder:
        data, expected = sample_file(Path(folder))
        result = run_file_trials(
            data, expected, Path(folder), flipper(random.Random(seed)), trials, keep_unnoticed=True
        )
        pristine = logical_content(data, Path(folder))
        same = sum(logical_content(damaged, Path(folder)) == pristine for damaged in result.unnoticed)
    return {
        "planted": result.planted,
        "opened": result.opened,
        "found": result.found,
        "unnoticed": len(result.unnoticed),
        "unnoticed with every stored value intact (free space, padding)": same,
        "lost answers (nothing found where something exists)": result.lost,
        "misreported": len(result.violations),
        "violations": result.violations[:20],
    }


def logical_content(data: bytes, folder: Path) -> list[str] | None:
    """Every table's rows as SQL text (None if SQLite cannot read them all)."""
    path = folder / "content.db"
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        leftover.unlink(missing_ok=True)
    path.write_bytes(data)
    connection = sqlite3.connect(path)
    try:
        return list(connection.iterdump())
    except (sqlite3.Error, UnicodeDecodeError):
        return None
    finally:
        connection.close()


def reset_postgres(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        for table in ("events", "staged_keys", "calls", "cut_receipts", "alembic_version"):
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table} CASCADE")
    engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000, help="random-flip trials on the SQLite file")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--postgres", default=None, help="also run the column campaign on this (emptied!) database")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.getLogger("store").setLevel(logging.ERROR)  # the sample's failed call logs a warning
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="soak-corruption-") as folder:
        path = f"{folder}/columns.db"
        results["columns sqlite"] = column_campaign(path, f"sqlite:///{path}")
    if args.postgres:
        raw_url = args.postgres.replace("postgresql://", "postgresql+psycopg://", 1)
        reset_postgres(raw_url)
        results["columns postgresql"] = column_campaign(args.postgres, raw_url)
    results["file sqlite"] = file_campaign(args.trials, args.seed)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, totals in results.items():
            counts = ", ".join(f"{k} {v}" for k, v in totals.items() if k != "violations")
            print(f"{name}: {counts}")
            for violation in totals["violations"]:
                print(f"  {violation}")
    return 1 if any(totals["misreported"] for totals in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
