"""The command line's listings against its ``--json`` on the same store: ``keys``, ``rollouts`` and
``versions`` of an 8,000-record store (2,000 rollouts of 4 chained calls, two policy versions).

Each round runs every command twice through the installed script, once as a table and once with
``--json``, in alternating order, stdout into a file (what a pipe or a redirect sees: the table as
plain text, not a terminal's); it reports each command's per-round ratio table/JSON as median,
min and max.  Target (issue 24): a table costs at most 2x its JSON.  The whole process is timed
(start-up and imports included), as a user waits for it.

    python tools/bench_cli_tables.py [--records 8000] [--rounds 5] [--json]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _bench_common import parser, print_table, temp_dir

from store import StagedCallRecord, StageEntry, compute_chain_hash, hash_token_ids, open_store

COMMANDS = ("keys", "rollouts", "versions")
CALLS = 4  # chained calls per rollout
TARGET = 2.0
SCRIPT = Path(sys.executable).with_name("staging-store")


def _rollout(index: int) -> list[StagedCallRecord]:
    records, history, parent, chain = [], [], None, None
    for call in range(CALLS):
        ids = [100 + index % 50, 200 + call, *range(300, 316)]  # 2 carried tokens, 16 generated
        record = StagedCallRecord.from_components(
            rollout_id=f"rollout-{index:05d}",
            model_call_id=f"c{call}",
            parent_call_id=parent,
            mode="token_in" if parent else "text",
            prev_len=len(history),
            weight_version=1 + call // 2,
            token_ids_delta=ids,
            token_mask_delta=[0.0, 0.0] + [1.0] * 16,
            generation_log_probs_delta=[0.0, 0.0] + [-0.25] * 16,
            chain_hash=compute_chain_hash(chain, ids),
            cumulative_hash=hash_token_ids([*history, *ids]),
        )
        records.append(record)
        history, parent, chain = [*history, *ids], record.model_call_id, record.chain_hash
    return records


def build(path: str, records: int) -> None:
    with open_store(path, durability="normal") as store:
        batch: list[StageEntry] = []
        for index in range(records // CALLS):
            batch += [StageEntry(record) for record in _rollout(index)]
            if len(batch) >= 512:
                results = store.stage_all(batch)
                assert all(result.ok for result in results)
                batch = []
        if batch:
            assert all(result.ok for result in store.stage_all(batch))


def timed(arguments: list[str], out: str) -> float:
    started = time.perf_counter()
    with open(out, "wb") as sink:
        done = subprocess.run([str(SCRIPT), *arguments], stdout=sink, stderr=subprocess.PIPE, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return seconds


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rounds = 2 if args.quick else args.rounds
    records = 800 if args.quick else args.records
    results: dict[str, dict[str, list[float]]] = {c: {"table": [], "json": [], "ratio": []} for c in COMMANDS}
    with temp_dir(args.dir) as folder:
        store = os.path.join(folder, "store.db")
        build(store, records)
        out = os.path.join(folder, "out")
        for number in range(rounds):
            for command in COMMANDS:
                order = ("table", "json") if number % 2 == 0 else ("json", "table")
                seconds = {}
                for kind in order:
                    seconds[kind] = timed([command, store, *(["--json"] if kind == "json" else [])], out)
                results[command]["table"].append(seconds["table"])
                results[command]["json"].append(seconds["json"])
                results[command]["ratio"].append(seconds["table"] / seconds["json"])
    if args.json:
        import json

        print(json.dumps({"records": records, "rounds": rounds, "results": results}, indent=2))
        return
    print(f"{records} records ({records // CALLS} rollouts of {CALLS} calls), {rounds} rounds, stdout to a file")
    rows = []
    for command in COMMANDS:
        r = results[command]
        ratios = r["ratio"]
        rows.append(
            [
                command,
                f"{statistics.median(r['table']):.3f}",
                f"{statistics.median(r['json']):.3f}",
                f"{statistics.median(ratios):.2f}",
                f"{min(ratios):.2f}",
                f"{max(ratios):.2f}",
            ]
        )
    print_table(["command", "table s (median)", "--json s (median)", "ratio median", "min", "max"], rows)
    for command in COMMANDS:
        ratio = statistics.median(results[command]["ratio"])
        verdict = "ok" if ratio <= TARGET else "MISSED"
        print(f"TARGET {command}: table <= {TARGET:.0f}x --json: {ratio:.2f}x {verdict}")


if __name__ == "__main__":
    main()
