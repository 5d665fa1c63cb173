"""Benchmark: retention (issue 8) -- delete and compaction, and the cost of fences on staging.

* ``delete``: a SQLite store of R rollouts x 8 calls x 4,096 tokens (default R = 1,000), staged
  one rollout per transaction.  The bytes those records occupy on disk are the compacted file's
  growth when they were staged (the store is compacted before and after staging them).  Then
  ``Store.delete`` of all R rollouts (in calls of up to 4,096 ids) and ``Store.compact()`` are
  timed, and the bytes that went back to the file system (database + -wal, before the delete
  vs after the compaction) are reported as a fraction of the bytes the records occupied.
  The tombstones' own count of the removed events' stored bytes is shown for scale.
* ``fences``: durable ``stage()`` of 4,096-token records into two stores, one with 10,000
  retired capture keys (other ids than those staged) and one without, alternating record by
  record (the order flips every record); per round of B records each, the ratio of records/s
  (fenced / plain) is reported as median/min/max over the rounds.  ``--durability normal``
  takes the fsync out of each stage, so the fence check's share is larger (a harder test).

Targets (issue): >= 90% of the deleted records' bytes back after compaction; staging with
10,000 fences >= 0.95x staging without (median of rounds).

    .venv/bin/python tools/bench_retention.py [--quick] [--json] [--rollouts R] [--rounds N] [--block B]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, make_columns, parser, temp_dir

from store import StagedCallRecord, StageEntry, compute_chain_hash, hash_token_ids, open_store
from store.retention.compact import store_file_bytes

TOKENS = 4_096
CALLS = 8
FENCES = 10_000
SPACE_TARGET = 0.90
FENCE_TARGET = 0.95
MAX_IDS = 4_096


def rollout_records(rng: np.random.Generator, rollout_id: str, calls: int = CALLS) -> list[StagedCallRecord]:
    """A chain of ``calls`` calls, each carrying its parent's tokens' tail and 4,096 tokens of its own."""
    records: list[StagedCallRecord] = []
    cumulative: list[int] = []
    parent: StagedCallRecord | None = None
    for index in range(calls):
        columns = make_columns(rng, TOKENS)
        ids = [int(i) for i in columns.ids]
        record = StagedCallRecord.from_components(
            rollout_id=rollout_id,
            model_call_id=f"c{index}",
            parent_call_id=None if parent is None else parent.model_call_id,
            mode="text" if parent is None else "token_in",
            prev_len=len(cumulative),
            weight_version=7,
            token_ids_delta=columns.ids,
            token_mask_delta=columns.mask,
            generation_log_probs_delta=columns.logprobs,
            chain_hash=compute_chain_hash(None if parent is None else parent.chain_hash, ids),
            cumulative_hash=hash_token_ids([*cumulative, *ids]),
        )
        cumulative += ids
        records.append(record)
        parent = record
    return records


def bench_delete(report: Report, folder: str, rollouts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path = os.path.join(folder, "delete.db")
    with open_store(path) as store:
        keep = rollout_records(rng, "keep")
        store.stage_all([StageEntry(record) for record in keep])
        store.compact()
        empty = store_file_bytes(path)
        ids = [f"rollout-{index:06d}" for index in range(rollouts)]
        start = time.perf_counter()
        for rollout_id in ids:
            store.stage_all([StageEntry(record) for record in rollout_records(rng, rollout_id)])
        staged_s = time.perf_counter() - start
        store.compact()
        full = store_file_bytes(path)
        occupied = full - empty
        start = time.perf_counter()
        stored_bytes = 0
        for batch in range(0, len(ids), MAX_IDS):
            removal = store.delete(ids[batch : batch + MAX_IDS])
            assert not removal.absent
        delete_s = time.perf_counter() - start
        start = time.perf_counter()
        compacted = store.compact()
        compact_s = time.perf_counter() - start
        after = store_file_bytes(path)
        reclaimed = full - after
        audit = store.audit()
        assert audit.ok, audit.summary()
        assert len(store.fetch([record.staging_key for record in keep])) == CALLS
        with store._engine.connect() as connection:  # the tombstones' own byte count, for scale
            from sqlalchemy import text

            from store.log.events import EventKind, decode_body

            for (body,) in connection.execute(
                text("SELECT body FROM events WHERE kind = :k"), {"k": EventKind.ROLLOUT_DELETED.value}
            ):
                stored_bytes += decode_body(EventKind.ROLLOUT_DELETED, bytes(body)).stored_bytes
    fraction = reclaimed / occupied
    report.table(
        f"delete of {rollouts} rollouts x {CALLS} calls x {TOKENS} tokens (SQLite, durability=full)",
        ["measure", "value"],
        [
            ["staging (one rollout per stage_all)", f"{staged_s:.2f} s"],
            ["delete (one call per 4,096 ids)", f"{delete_s:.3f} s ({delete_s / rollouts * 1e3:.3f} ms/rollout)"],
            ["compact (incremental vacuum + WAL truncate)", f"{compact_s:.3f} s"],
            ["bytes the records occupy (file growth)", f"{occupied:,}"],
            ["stored bytes the tombstones count", f"{stored_bytes:,}"],
            ["file bytes before delete / after compact", f"{full:,} / {after:,}"],
            ["bytes back to the file system", f"{reclaimed:,} ({fraction:.1%})"],
            ["CompactReport.reclaimed (db + the delete's -wal)", f"{compacted.reclaimed:,}"],
        ],
    )
    report.results["delete"] = {
        "rollouts": rollouts,
        "delete_s": delete_s,
        "compact_s": compact_s,
        "occupied_bytes": occupied,
        "tombstone_stored_bytes": stored_bytes,
        "reclaimed_bytes": reclaimed,
        "fraction": fraction,
    }
    report.targets.append(Target("bytes back after delete + compact", fraction, ">=", SPACE_TARGET))


def bench_fences(report: Report, folder: str, rounds: int, block: int, seed: int, durability: str) -> None:
    rng = np.random.default_rng(seed + 1)
    fenced_path, plain_path = os.path.join(folder, "fenced.db"), os.path.join(folder, "plain.db")
    records = {
        name: [rollout_records(rng, f"{name}-{i:06d}", calls=1)[0] for i in range(rounds * block)]
        for name in ("fenced", "plain")
    }
    with (
        open_store(fenced_path, durability=durability) as fenced,
        open_store(plain_path, durability=durability) as plain,
    ):
        keys = [f"retired-{index:06d}" for index in range(FENCES)]
        for batch in range(0, FENCES, MAX_IDS):
            fenced.retire(keys[batch : batch + MAX_IDS])
        plain.stage(rollout_records(rng, "warm", calls=1)[0])  # both stores warm and non-empty
        fenced.stage(rollout_records(rng, "warm", calls=1)[0])
        ratios = []
        rates: dict[str, list[float]] = {"fenced": [], "plain": []}
        stores = {"fenced": fenced, "plain": plain}
        for round_index in range(rounds):
            # Records alternate between the stores one by one (the order flips every record),
            # so background load and WAL checkpoints fall on both alike.
            spent = {"fenced": 0.0, "plain": 0.0}
            for index in range(round_index * block, (round_index + 1) * block):
                for name in ("fenced", "plain") if index % 2 else ("plain", "fenced"):
                    start = time.perf_counter()
                    stores[name].stage(records[name][index])
                    spent[name] += time.perf_counter() - start
            for name, seconds in spent.items():
                rates[name].append(block / seconds)
            ratios.append(spent["plain"] / spent["fenced"])
    report.table(
        f"stage() of {TOKENS}-token records (durability={durability}), {FENCES:,} fences vs none "
        f"({rounds} rounds of {block}, alternating record by record)",
        ["store", "median records/s", "min", "max"],
        [[name, f"{statistics.median(v):.1f}", f"{min(v):.1f}", f"{max(v):.1f}"] for name, v in rates.items()],
    )
    median = statistics.median(ratios)
    report.results["fences"] = {"median": median, "min": min(ratios), "max": max(ratios), "ratios": ratios}
    report.notes.append(
        f"fenced/plain ratio per round: median {median:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}"
    )
    report.targets.append(
        Target(f"staging with {FENCES:,} fences / without (median of rounds)", median, ">=", FENCE_TARGET)
    )


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=None, help="rollouts to delete (default 1,000; --quick 50)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds of the fence comparison")
    p.add_argument("--block", type=int, default=None, help="records staged per store per round")
    p.add_argument("--durability", default="full", choices=["full", "normal"], help="of the fence comparison")
    p.add_argument("--skip-delete", action="store_true", help="run only the fence comparison")
    args = p.parse_args()
    rollouts = args.rollouts or (50 if args.quick else 1_000)
    rounds = args.rounds or (4 if args.quick else 10)
    block = args.block or (20 if args.quick else 60)
    report = Report(
        "bench_retention",
        {
            "rollouts": rollouts,
            "calls": CALLS,
            "tokens": TOKENS,
            "fences": FENCES,
            "rounds": rounds,
            "block": block,
            "durability": args.durability,
        },
    )
    with temp_dir(args.dir) as folder:
        bench_fences(report, folder, rounds, block, args.seed, args.durability)
        if not args.skip_delete:
            bench_delete(report, folder, rollouts, args.seed)
    report.emit(args.json)
    return 0 if all(target.passed for target in report.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
