"""Losing a whole host: workers on simulated host A (a network namespace with its own tmpfs)
serve cuts in the replicated domain into a PostgreSQL replica of the test's own; host A is then
destroyed (every process SIGKILLed, its tmpfs unmounted, its namespace deleted) and a worker on
host B continues, from the replica alone, every call whose receipt said ``replicated``,
token-exact against an uninterrupted run, the replica's audit clean.  And: host A's link to the
replica is cut mid-run (the cut says ``durable_failure`` within the bound) and mended (the
acknowledgements resume by themselves).

Skipped, with the reason, where network namespaces cannot be made (not root, no ``ip``) or no
PostgreSQL server can run.  ``tools/soak_host_loss.py`` repeats the host loss many times.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import netns_hosts
import pg_cluster
import pytest
import replica_helpers as rh

from store import GenerationCutReceipt, from_json, open_store

REASON = netns_hosts.why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

NCALLS = 4
WAIT = 1.5  # the workers' replica_wait


def replica_cluster(template: Path, hosts: netns_hosts.Hosts, count: int) -> pg_cluster.Cluster:
    """A server listening on loopback and on the root end of each host's link, trusting them."""
    addresses = ",".join(["127.0.0.1", *(hosts.address(index) for index in range(count))])
    server = pg_cluster.Cluster(template, {"listen_addresses": addresses})
    with open(server.data / "pg_hba.conf", "a") as hba:
        hba.write(f"host all all {hosts.network} trust\n")
    return server


@pytest.fixture
def fleet(pg_template: Path) -> Iterator[tuple[netns_hosts.Hosts, pg_cluster.Cluster]]:
    with netns_hosts.hosts() as made:
        made.add(0)
        made.add(1)
        server = replica_cluster(pg_template, made, 2)
        try:
            server.start()
            yield made, server
        finally:
            server.remove()


def replica_url(server: pg_cluster.Cluster, host: netns_hosts.Host) -> str:
    return f"postgresql://postgres@{host.replica_address}:{server.port}/postgres?sslmode=disable&connect_timeout=2"


def serve(host: netns_hosts.Host, server: pg_cluster.Cluster, rollout: str) -> subprocess.Popen[str]:
    worker = host.spawn(
        ["serve", str(host.folder / f"{rollout}.db"), replica_url(server, host), rollout, str(NCALLS), str(WAIT)]
    )
    netns_hosts.answer(worker, "READY")
    return worker


def cut(worker: subprocess.Popen[str], name: str) -> tuple[GenerationCutReceipt, str]:
    line = netns_hosts.command(worker, f"cut {name}", "RECEIPT ")
    _, text, domain = line.split(" ")
    return from_json(text.encode(), GenerationCutReceipt), domain


def decode(worker: subprocess.Popen[str], upto: int) -> None:
    netns_hosts.command(worker, f"decode {upto}", "OK")


def dispositions(receipt: GenerationCutReceipt) -> list[str]:
    return [ack.disposition for ack in receipt.prefixes]


def test_host_loss_continues_every_replicated_call_on_another_host(
    fleet: tuple[netns_hosts.Hosts, pg_cluster.Cluster], tmp_path: Path
) -> None:
    hosts, server = fleet
    host_a, host_b = hosts.hosts
    rollouts = ["ra", "rb"]
    workers = {rollout: serve(host_a, server, rollout) for rollout in rollouts}  # two workers on host A
    for worker in workers.values():
        decode(worker, 5)
    receipts = {rollout: cut(worker, "checkpoint-1") for rollout, worker in workers.items()}
    for receipt, domain in receipts.values():
        assert domain == "replicated" and dispositions(receipt) == ["durable_prefix"] * NCALLS
    for worker in workers.values():
        decode(worker, 9)  # decoded after the cut: lost with the host
    assert (host_a.folder / "ra.db").exists()
    pids = host_a.pids()
    assert len(pids) >= 2

    hosts.destroy(host_a)
    assert not (host_a.folder / "ra.db").exists()  # the local stores went with the host
    for worker in workers.values():
        assert worker.returncode is not None

    continued = {}
    for rollout in rollouts:
        replacement = host_b.spawn(["continue", replica_url(server, host_b), rollout, *map(str, range(1, NCALLS + 1))])
        out, err = replacement.communicate(timeout=60)
        assert replacement.returncode == 0, err[-3000:]
        finals = [line.split(" ", 2) for line in out.splitlines() if line.startswith("FINAL ")]
        continued[rollout] = {int(call): rh.final_from_json(text) for _, call, text in finals}
    for rollout in rollouts:
        with open_store(tmp_path / f"reference-{rollout}.db") as reference_store:
            reference = rh.uninterrupted(reference_store, range(1, NCALLS + 1), rollout)
        assert continued[rollout] == reference
    with open_store(server.url()) as replica:
        report = replica.audit()
        assert report.ok, report
        for rollout, (receipt, _) in receipts.items():
            assert replica.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
            for ack in receipt.prefixes:
                assert replica.call(f"{rollout}-a1", ack.model_call_id) is not None


def test_a_cut_link_gives_durable_failure_then_acknowledgements_resume(
    fleet: tuple[netns_hosts.Hosts, pg_cluster.Cluster],
) -> None:
    hosts, server = fleet
    host_a = hosts.hosts[0]
    worker = serve(host_a, server, "rp")
    decode(worker, 3)
    first, domain = cut(worker, "checkpoint-1")
    assert domain == "replicated" and dispositions(first) == ["durable_prefix"] * NCALLS

    hosts.partition(host_a)
    decode(worker, 6)
    started = time.monotonic()
    second, domain = cut(worker, "checkpoint-2")
    took = time.monotonic() - started
    assert dispositions(second) == ["durable_failure"] * NCALLS
    assert took < WAIT + 2.0, took  # the bound, plus the local commits

    hosts.mend(host_a)
    decode(worker, 8)
    resumed = None
    deadline = time.monotonic() + 40
    attempt = 3
    while time.monotonic() < deadline:  # no intervention: each later cut tries again
        receipt, _ = cut(worker, f"checkpoint-{attempt}")
        attempt += 1
        if dispositions(receipt) == ["durable_prefix"] * NCALLS:
            resumed = receipt
            break
    assert resumed is not None, "acknowledgements did not resume after the link came back"
    assert [ack.prefix_token_count for ack in resumed.prefixes] == [8] * NCALLS
    assert netns_hosts.command(worker, "exit", "BYE") == "BYE"
    with open_store(server.url()) as replica:
        assert replica.audit().ok
        # No receipt in the replica says durable_prefix for a prefix the replica lacks.
        for receipt in replica.cut_receipts():
            keys = [key for ack in receipt.prefixes if ack.disposition == "durable_prefix" for key in ack.staging_keys]
            assert len(replica.fetch(keys)) == len(keys)
        # The failed cut's receipt followed with a later ship: it names no prefix as durable.
        assert replica.cut_domain(second.checkpoint_id, second.inventory_digest) == "replicated"
