"""Soak: many host losses in a row, each continued on another host from the replica alone.

    sudo .venv/bin/python tools/soak_host_loss.py [--rounds 20] [--calls 4] [--seed 1]

Each round makes a fresh host A (a network namespace with its own tmpfs, ``tests/netns_hosts.py``)
whose worker stages rollout ``s<round>`` into a local SQLite store in the replicated domain (the
replica: one PostgreSQL server of this run's own, ``tests/pg_cluster.py``, kept for the whole
soak), decodes a random number of tokens, serves one to three cuts (some with host A's link cut,
which must say ``durable_failure``), decodes past the last cut, and is destroyed: its processes
SIGKILLed, its tmpfs unmounted, its namespace deleted.  A worker on host B then continues every
call from the replica alone and its final records are compared, token for token, with an
uninterrupted run.  At the end: the replica's audit, and every receipt the replica keeps
checked to name only prefixes the replica holds.  Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import netns_hosts
import pg_cluster
import replica_helpers as rh

from store import GenerationCutReceipt, UnknownKeyError, from_json, open_store

WAIT = 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    reason = netns_hosts.why_not() or pg_cluster.why_not()
    if reason is not None:
        print(f"cannot soak here: {reason}")
        return 2
    chance = random.Random(args.seed)
    calls = range(1, args.calls + 1)
    template = pg_cluster.make_template(Path(tempfile.mkdtemp(prefix="store-soak-pg-")))
    server = pg_cluster.Cluster(template, {"listen_addresses": "*"})
    tally = {"rounds": 0, "continued": 0, "from_older_cut": 0, "failures_said": 0, "mismatches": 0}
    started = time.monotonic()
    with netns_hosts.hosts() as hosts:
        with open(server.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {hosts.network} trust\n")
        host_b = hosts.add(1)
        server.start()
        try:
            for round_index in range(args.rounds):
                rollout = f"s{round_index}"
                host_a = hosts.add(0)
                url_a = f"postgresql://postgres@{host_a.replica_address}:{server.port}/postgres?connect_timeout=2"
                worker = host_a.spawn(
                    ["serve", str(host_a.folder / "w.db"), url_a, rollout, str(args.calls), str(WAIT)]
                )
                netns_hosts.answer(worker, "READY")
                decoded, durable_at = 0, 0
                for cut_index in range(chance.randint(1, 3)):
                    decoded = min(rh.TOTAL - 1, decoded + chance.randint(1, 4))
                    netns_hosts.command(worker, f"decode {decoded}", "OK")
                    cut_away = cut_index > 0 and chance.random() < 0.4
                    if cut_away:
                        hosts.partition(host_a)
                    line = netns_hosts.command(worker, f"cut {rollout}-ckpt-{cut_index}", "RECEIPT ")
                    receipt = from_json(line.split(" ")[1].encode(), GenerationCutReceipt)
                    said = {ack.disposition for ack in receipt.prefixes}
                    if cut_away:
                        tally["failures_said"] += 1
                        assert said == {"durable_failure"}, f"round {round_index}: a cut link said {said}"
                        hosts.mend(host_a)  # the dead worker's link: mended or not, the host goes
                    elif said == {"durable_prefix"}:
                        durable_at = decoded
                netns_hosts.command(worker, f"decode {min(rh.TOTAL, decoded + 3)}", "OK")
                hosts.destroy(host_a)
                url_b = f"postgresql://postgres@{host_b.replica_address}:{server.port}/postgres?connect_timeout=2"
                replacement = host_b.spawn(["continue", url_b, rollout, *map(str, calls)])
                out, err = replacement.communicate(timeout=120)
                if replacement.returncode != 0:
                    if durable_at == 0 and "no_cut" in err:
                        continue  # nothing was acknowledged: nothing to continue
                    raise RuntimeError(f"round {round_index}: the replacement failed: {err[-2000:]}")
                finals = {
                    int(call): rh.final_from_json(text)
                    for _, call, text in (line.split(" ", 2) for line in out.splitlines() if line.startswith("FINAL "))
                }
                with open_store(Path(tempfile.mkdtemp()) / "reference.db") as reference_store:
                    reference = rh.uninterrupted(reference_store, calls, rollout)
                tally["mismatches"] += sum(finals.get(call) != reference[call] for call in calls)
                tally["continued"] += len(finals)
                tally["from_older_cut"] += durable_at < decoded
                tally["rounds"] += 1
            with open_store(server.url()) as replica:
                report = replica.audit()
                false_promises = 0
                for receipt in replica.cut_receipts():
                    for ack in receipt.prefixes:
                        if ack.disposition != "durable_prefix":
                            continue
                        try:
                            replica.fetch(list(ack.staging_keys))
                        except UnknownKeyError:
                            false_promises += 1
        finally:
            server.remove()
    took = time.monotonic() - started
    print(
        f"{tally['rounds']} host losses in {took:.0f} s: {tally['continued']} calls continued on host B, "
        f"{tally['mismatches']} not token-exact, {tally['failures_said']} cuts with the link cut said "
        f"durable_failure, {tally['from_older_cut']} rounds continued from an older cut; "
        f"replica audit {'clean' if report.ok else report.summary()}, {false_promises} false durable_prefix"
    )
    return 0 if report.ok and tally["mismatches"] == 0 and false_promises == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
