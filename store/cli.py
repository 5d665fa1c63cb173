"""The ``staging-store`` command: a thin shell over the library."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from store.digest import compute_chain_hash, compute_staging_digest, hash_token_ids
from store.errors import StoreError
from store.records import StagedCallRecord
from store.store import open_store


def _synthetic_rollout(rng: random.Random, rollout_id: str, calls: int, weight_version: int) -> list[StagedCallRecord]:
    """A chain of model calls: each carries new prompt tokens, then generates a reply."""
    records: list[StagedCallRecord] = []
    history: list[int] = []
    parent: StagedCallRecord | None = None
    for index in range(calls):
        prompt = [rng.randrange(1, 150_000) for _ in range(rng.randint(8, 64))]
        generated = [rng.randrange(1, 150_000) for _ in range(rng.randint(16, 256))]
        logprobs = [-rng.random() * 4 for _ in generated]
        ids = prompt + generated
        record = StagedCallRecord.from_components(
            rollout_id=rollout_id,
            model_call_id=f"call-{index}",
            parent_call_id=parent.model_call_id if parent else None,
            mode="token_in" if parent else "text",
            prev_len=len(history),
            weight_version=weight_version,
            token_ids_delta=ids,
            token_mask_delta=[0.0] * len(prompt) + [1.0] * len(generated),
            generation_log_probs_delta=[0.0] * len(prompt) + logprobs,
            chain_hash=compute_chain_hash(parent.chain_hash if parent else None, ids),
            cumulative_hash=hash_token_ids(history + ids),
            extras={"turn": index},
        )
        records.append(record)
        history += ids
        parent = record
    return records


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    path = Path(args.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with open_store(path) as store:
        staged: list[StagedCallRecord] = []
        for rollout in range(args.rollouts):
            for record in _synthetic_rollout(
                rng, f"demo-{args.seed}-{rollout}", args.calls, weight_version=rollout % 3
            ):
                result = store.stage(record)
                if not result.ok:
                    raise StoreError(f"staging {record.staging_key} failed: {result.error}")
                staged.append(record)
        fetched = store.fetch([record.staging_key for record in staged])
        verified = 0
        for original, snapshot in zip(staged, fetched, strict=True):
            if (
                compute_staging_digest(**snapshot.digest_fields()) != original.digest
                or snapshot.digest != original.digest
            ):
                raise StoreError(f"{snapshot.staging_key}: digest does not verify after the round trip")
            verified += 1
        report = store.replay()
    return {
        "store": str(path.resolve()),
        "rollouts": args.rollouts,
        "calls_staged": len(staged),
        "tokens_staged": sum(record.delta_len for record in staged),
        "digests_verified": verified,
        "replay_ok": report.ok,
        "events_in_log": report.events,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _replay(args: argparse.Namespace) -> dict[str, Any]:
    with open_store(args.store) as store:
        report = store.replay(repair=args.repair)
    return {
        "ok": report.ok,
        "events": report.events,
        "differences": [str(d) for d in report.differences],
        "differences_total": report.differences_total,
        "repaired": report.repaired,
        "undecodable": [seq for seq, _ in report.undecodable],
        "summary": report.summary(),
    }


def _calls(args: argparse.Namespace) -> dict[str, Any]:
    with open_store(args.store) as store:
        infos = store.calls(args.rollout)
    return {
        "calls": [
            {
                "rollout_id": info.rollout_id,
                "model_call_id": info.model_call_id,
                "parent_call_id": info.parent_call_id,
                "state": info.state,
                "cum_len": info.cum_len,
                "generated_tokens": info.generated_tokens,
                "oldest_version": info.oldest_version,
                "newest_version": info.newest_version,
                "continues": list(info.continues) if info.continues else None,
            }
            for info in infos
        ]
    }


def _print_human(command: str, result: dict[str, Any]) -> None:
    if command == "demo":
        print(
            f"staged {result['calls_staged']} calls ({result['tokens_staged']} tokens) of "
            f"{result['rollouts']} synthetic rollouts into {result['store']}"
        )
        print(f"fetched them back and verified {result['digests_verified']} digests")
        print(f"replayed {result['events_in_log']} events: projections {'match' if result['replay_ok'] else 'DIFFER'}")
        print(f"done in {result['seconds']} s")
    elif command == "replay":
        print(result["summary"])
    else:
        for call in result["calls"]:
            print(
                f"{call['rollout_id']}/{call['model_call_id']}  parent={call['parent_call_id']}  "
                f"state={call['state']}  tokens={call['cum_len']}  "
                f"versions={call['oldest_version']}..{call['newest_version']}"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="staging-store", description=__doc__)
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print machine-readable JSON")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", parents=[output], help="stage, fetch and verify synthetic rollouts")
    demo.add_argument("--path", default="demo-store/demo.db", help="SQLite file to stage into")
    demo.add_argument("--rollouts", type=int, default=4)
    demo.add_argument("--calls", type=int, default=3, help="model calls per rollout")
    demo.add_argument("--seed", type=int, default=0)

    replay = commands.add_parser("replay", parents=[output], help="rebuild projections from the log and compare")
    replay.add_argument("store", help="SQLite path or database URL")
    replay.add_argument("--repair", action="store_true", help="replace differing projection rows")

    calls = commands.add_parser("calls", parents=[output], help="list calls with lineage and policy versions")
    calls.add_argument("store", help="SQLite path or database URL")
    calls.add_argument("--rollout", help="only this rollout (capture key)")
    return parser


_COMMANDS = {"demo": _demo, "replay": _replay, "calls": _calls}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = _COMMANDS[args.command](args)
    except StoreError as exc:
        print(f"staging-store: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_human(args.command, result)
    if args.command == "replay" and not result["ok"] and not result["repaired"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
