"""Benchmark: the complete-record transport (``TokenTransport``) against NeMo Gym 0.7.0's own file
store (``TokenCaptureStore``: JSONL, fsync per put) on Gym's own cycle, and a short SIGKILL soak.

The cycle is what Gym's serving path and trajectory builder do with a rollout: ``put`` each call's
``TokenEntry`` (awaited, durable when it returns), ``freeze`` the rollout, ``drop`` the snapshot
consumed (conditional on its id and version).  Both sides run the same entries (Gym's own
``TokenEntry``, stamped as Gym's capture stamps them) through their async API, with ``K``
rollouts cycling concurrently in one event loop (``--concurrency``, default 1 and 16).

Each round runs one block of each side, every block on a fresh folder (Gym) or a fresh store
(the transport; SQLite, durability "full", unless ``--postgres URL``), the order flipped every
round; the ratio (transport cycles/s over Gym cycles/s) is taken per round and the report gives
its median, min and max.  The disk's fsync time swings several-fold within a second on this kind
of machine: short alternating blocks measure both sides on the same disk.

The soak (``--soak`` runs, default 3, each bounded): a writer process cycles through the
transport and is SIGKILLed after a number of acknowledged lines; a fresh client then reads back
every acknowledged put, freeze and drop (``tests/transport_worker.py``).

Target (issue 32): the transport >= 2x Gym's file store (median of the per-round ratios) at each
concurrency, and nothing acknowledged lost in the soak.

    .venv/bin/python tools/bench_gym_transport.py [--quick] [--json] [--rounds R] [--block B]
        [--concurrency K ...] [--calls C] [--soak N] [--postgres URL]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the soak's writer and its check

from _bench_common import Report, Target, parser, temp_dir
from nemo_gym.token_id_capture.store import TokenCaptureStore
from transport_worker import lost, make_entry, run_writer

from store import TokenTransport

TARGET_RATIO = 2.0


async def _cycles(sink: Any, tag: str, rollouts: int, concurrency: int, entries: list[list[Any]]) -> float:
    """Seconds for ``rollouts`` put -> freeze -> drop cycles, ``concurrency`` at a time."""

    async def lane(index: int) -> None:
        for cycle in range(index, rollouts, concurrency):
            rollout_id = f"{tag}-{cycle}"
            for entry in entries[cycle]:
                await sink.put(entry.model_copy(update={"rollout_id": rollout_id}))
            snapshot = await sink.freeze(rollout_id)
            if not await sink.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version):
                raise AssertionError(f"the drop of {rollout_id} failed")

    start = time.perf_counter()
    await asyncio.gather(*(lane(index) for index in range(concurrency)))
    return time.perf_counter() - start


def _reset_postgres(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP SCHEMA IF EXISTS bench_gym_transport CASCADE")
    engine.dispose()


def _block(side: str, folder: str, postgres: str | None, rollouts: int, concurrency: int, entries: list[Any]) -> float:
    """Cycles per second of one block on a fresh store (or folder)."""
    if side == "gym":
        path = os.path.join(folder, f"gym-{time.monotonic_ns()}")
        seconds = asyncio.run(_cycles(TokenCaptureStore(path), "g", rollouts, concurrency, entries))
        return rollouts / seconds
    if postgres is not None:
        _reset_postgres(postgres)
        transport = TokenTransport.open(postgres, schema="bench_gym_transport", pool_size=2)
    else:
        transport = TokenTransport.open(os.path.join(folder, f"store-{time.monotonic_ns()}.db"))
    try:
        seconds = asyncio.run(_cycles(transport, "s", rollouts, concurrency, entries))
    finally:
        transport.close_now()
    return rollouts / seconds


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds of alternating blocks (default 9, quick 3)")
    p.add_argument("--block", type=int, default=None, help="rollouts cycled per block (default 48, quick 16)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="rollouts cycling at once")
    p.add_argument("--calls", type=int, default=3, help="entries put per rollout")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens per entry (half as many generated)")
    p.add_argument("--soak", type=int, default=None, help="SIGKILL soak runs (default 3, quick 1; 0: none)")
    p.add_argument("--postgres", default=None, help="run the transport on this PostgreSQL URL (schema of its own)")
    options = p.parse_args()
    rounds = options.rounds or (3 if options.quick else 9)
    block = options.block or (16 if options.quick else 48)
    soaks = options.soak if options.soak is not None else (1 if options.quick else 3)
    entries = [
        [
            make_entry("x", f"call-{call}", seed=cycle * 10 + call, tokens=options.tokens)
            for call in range(options.calls)
        ]
        for cycle in range(block)
    ]
    report = Report(
        "bench_gym_transport",
        params={
            "rounds": rounds,
            "block": block,
            "calls": options.calls,
            "tokens": options.tokens,
            "concurrency": options.concurrency,
            "transport": "postgresql" if options.postgres else "sqlite (durability full)",
            "soak_runs": soaks,
        },
    )
    rows = []
    with temp_dir(options.dir) as folder:
        for concurrency in options.concurrency:
            ratios, gym_rates, store_rates = [], [], []
            for round_index in range(rounds):
                order = ("gym", "store") if round_index % 2 == 0 else ("store", "gym")
                rates = {side: _block(side, folder, options.postgres, block, concurrency, entries) for side in order}
                gym_rates.append(rates["gym"])
                store_rates.append(rates["store"])
                ratios.append(rates["store"] / rates["gym"])
            median = statistics.median(ratios)
            rows.append(
                [
                    concurrency,
                    f"{statistics.median(gym_rates):.1f}",
                    f"{statistics.median(store_rates):.1f}",
                    f"{median:.2f}x",
                    f"{min(ratios):.2f}x",
                    f"{max(ratios):.2f}x",
                ]
            )
            report.results[f"x{concurrency}"] = {
                "ratios": ratios,
                "gym_cycles_per_s": gym_rates,
                "store_cycles_per_s": store_rates,
            }
            report.targets.append(
                Target(
                    f"transport x{concurrency} over Gym's file store (median per-round ratio)",
                    median,
                    ">=",
                    TARGET_RATIO,
                )
            )
        report.table(
            "put -> freeze -> drop cycles per second (medians), and the per-round ratio store/gym",
            ["rollouts at once", "gym cycles/s", "store cycles/s", "median", "min", "max"],
            rows,
        )
        losses: list[str] = []
        acknowledged = 0
        for run in range(soaks):
            url = options.postgres or os.path.join(folder, f"soak-{run}.db")  # PostgreSQL: its public schema
            lines = run_writer(url, f"soak{run}", acks=120)
            acknowledged += len(lines)
            losses += lost(url, lines)
        report.results["soak"] = {"runs": soaks, "acknowledged_lines": acknowledged, "lost": losses}
        if soaks:
            report.table(
                "SIGKILL soak: a writer killed after 120 acknowledged lines, read back by a fresh client",
                ["runs", "acknowledged lines", "lost"],
                [[soaks, acknowledged, len(losses)]],
            )
            report.targets.append(Target("acknowledged lines lost under SIGKILL", len(losses), "<=", 0, unit=""))
    report.emit(options.json)


if __name__ == "__main__":
    main()
