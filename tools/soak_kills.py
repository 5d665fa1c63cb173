"""Soak the store with SIGKILLs at deterministic failpoints and print what survived.

    python tools/soak_kills.py [--kills 300] [--backend sqlite|postgresql] [--url URL] [--seed 1]

Each run forks a worker (``tests/kill_worker.py``: four stager threads, so batches form,
and a thread serving generation cuts over live calls) with one failpoint armed
(``before_commit``, ``after_commit``, ``mid_batch`` or ``mid_cut``, chosen with how many hits
to survive by the seed), lets it die with SIGKILL, reopens the store and checks every key and
cut receipt the worker acknowledged, that no partial record is visible, that the projections
equal a replay and that sequence numbers only grow (``tests/kill_harness.py``).  All runs share
one store, so later runs start from whatever the earlier kills left.  At the end every
acknowledgement of every run is checked again.

Prints one line per ``--progress`` kills and the totals; exits 1 if anything acknowledged was
lost or misreported, any partial record was visible, or any check failed.  PostgreSQL needs
``--url`` (the database is emptied first) or ``STORE_TEST_POSTGRES_URL``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the worker and the checks live with the tests

from conftest import reset_postgres  # noqa: E402
from kill_harness import FAILPOINTS, KillLoop  # noqa: E402

# How many hits to survive, drawn uniformly below these: a worker staging 60 records per
# thread hits each commit failpoint about 90 times, mid_batch about 200, mid_cut about 28.
SKIP_LIMITS = {"before_commit": 60, "after_commit": 60, "mid_batch": 150, "mid_cut": 20}
RECORDS = 60  # per stager thread and run


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="soak-kills-", dir=args.dir) as workdir:
        url = store_url(args, Path(workdir))
        loop = KillLoop(url, Path(workdir), replay_every=args.replay_every, ack_early=args.ack_early)
        started = time.monotonic()
        try:
            while loop.totals.kills < args.kills and loop.totals.runs < args.kills * 2:
                failpoint = rng.choice(FAILPOINTS)
                loop.kill_once(failpoint, rng.randrange(SKIP_LIMITS[failpoint]), RECORDS)
                if args.progress and loop.totals.runs % args.progress == 0:
                    print(f"[{time.monotonic() - started:7.1f} s] {loop.totals.summary()}", flush=True)
            loop.check_all()
        finally:
            loop.close()
    totals = loop.totals
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps({**asdict(totals), "backend": args.backend, "seed": args.seed, "seconds": elapsed}))
    else:
        for problem in totals.problems[:50]:
            print("PROBLEM", problem)
        print(f"backend {args.backend}, seed {args.seed}, {elapsed:.0f} s")
        print("TOTALS", totals.summary())
        print("RESULT", "PASS: nothing lost or misreported" if totals.ok else f"FAIL: {len(totals.problems)} problems")
    return 0 if totals.ok and totals.kills >= args.kills else 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=300, help="kills to survive (default 300)")
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--url", default=None, help="PostgreSQL URL (emptied first!); SQLite uses a temporary file")
    parser.add_argument("--seed", type=int, default=1, help="chooses the failpoints and their skipped hits")
    parser.add_argument("--replay-every", type=int, default=10, help="replay the log after every Nth kill")
    parser.add_argument("--progress", type=int, default=25, help="print the totals every N runs (0: never)")
    parser.add_argument("--dir", default=None, help="folder for the SQLite store and the workers' reports")
    parser.add_argument("--json", action="store_true", help="print the totals as JSON")
    parser.add_argument(
        "--ack-early", action="store_true", help="self-check: workers acknowledge before staging, so the soak must FAIL"
    )
    return parser.parse_args()


def store_url(args: argparse.Namespace, workdir: Path) -> str:
    if args.backend == "sqlite":
        return str(workdir / "soak.db")
    url = args.url or os.environ.get("STORE_TEST_POSTGRES_URL")
    if not url:
        sys.exit("--backend postgresql needs --url postgresql://... or STORE_TEST_POSTGRES_URL")
    reset_postgres(url)
    return url


if __name__ == "__main__":
    sys.exit(main())
