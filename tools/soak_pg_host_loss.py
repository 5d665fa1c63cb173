"""Soak: hosts lost one after another in the middle of writes to one PostgreSQL store, while
other hosts stage without pause.

    sudo .venv/bin/python tools/soak_pg_host_loss.py [--losses 9] [--stagers 2]

Each loss is a fresh host (a network namespace, ``tests/netns_hosts.py``) that writes straight
into the store (``tests/pg_fleet.py``): in turn, one that holds the write lock inside its
pipeline (no Sync sent) with an idle connection beside it, one inside a ship's COPY, and one
that is simply staging.  Its link is deleted first; its processes are killed once the server
has ended its sessions.  The server is one of this run's own (``tests/pg_cluster.py``), every
process runs with the store's default wait limits.  At the end: per loss, how long its
sessions lasted; the stages acknowledged, lost (acknowledged, yet not in the store) and
failed; the longest a stage of the other hosts took.  Exit status 1 if any stage failed or any
acknowledged one is lost.  Needs root, iproute2 and PostgreSQL's server binaries.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import netns_hosts
import pg_cluster
from pg_fleet import PLACES, Fleet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", type=int, default=9)
    parser.add_argument("--stagers", type=int, default=2)
    args = parser.parse_args()
    reason = netns_hosts.why_not() or pg_cluster.why_not()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="soak-pg-host-loss-"))
    try:
        template = pg_cluster.make_template(folder)
        with netns_hosts.hosts() as made:
            fleet = Fleet(made, template, stagers=args.stagers, losses=args.losses)
            try:
                fleet.wait_for_acks(5)
                for index in range(args.losses):
                    place = PLACES[index % len(PLACES)]
                    fleet.lose(place, idle=place == "pipeline")
                    print(f"loss {index + 1}/{args.losses}: {place}", flush=True)
                fleet.stop()
                print(fleet.summary())
                blocked = [
                    loss.writer_ended_at - loss.holding_at
                    for loss in fleet.losses
                    if loss.holding_at is not None and loss.writer_ended_at is not None
                ]
                if blocked:
                    print(
                        f"lock held by a lost host: {min(blocked):.2f}-{max(blocked):.2f} s over {len(blocked)} holders"
                    )
                failed = bool(fleet.errors()) or bool(fleet.lost())
                for error in fleet.errors()[:10]:
                    print("ERROR", error)
            finally:
                fleet.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
