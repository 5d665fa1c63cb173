"""Hosts lost in the middle of a write to a PostgreSQL store, their network gone before their
processes: the other hosts stage on, blocked at most a lease.

Two hosts stage into one store without pause (``pg_fleet``); three more are lost one after
another: one holding the write lock inside its pipeline (no Sync sent) with an idle connection
beside it, one inside a ship's COPY, one simply staging.  Each loses its link first (deleted:
nothing it sends arrives, and no FIN or RST comes when it dies) and its processes are killed
only once the server has ended its sessions.  Before the lease, the session of such a holder
stayed ``active`` in ``ClientRead`` until TCP gave up -- in the issue, 16 min 45 s -- and every
other writer got ``LockTimeoutError`` every 15 s; its idle session stayed two hours.

Every wait limit is the store's default (``WAIT_LIMITS``): the bounds are the documented ones.
Skipped, with the reason, where network namespaces cannot be made or no server can run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import netns_hosts
import pg_cluster
import pytest
from pg_fleet import Fleet

from store.log.postgres import WAIT_LIMITS

REASON = netns_hosts.why_not() or pg_cluster.why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

LIMITS = WAIT_LIMITS
# A holder is ended at most two looks after its lease is over; a second for ending its session
# and for the stagers' own work on a 2-core machine shared with other work.
BLOCKED_AT_MOST = LIMITS.lease + 2 * LIMITS.lock_check + 1.0
# The server's keepalives (``silent_peer`` after it last heard from the host), and a few seconds
# for the test's own polling on a loaded machine.
IDLE_ENDED_WITHIN = LIMITS.silent_peer + 3.0
# A write that lost its link with data unacknowledged: the server's tcp_user_timeout; one with
# nothing unacknowledged: its keepalives, or a waiting writer at its lease.
WRITER_ENDED_WITHIN = max(LIMITS.tcp_user_timeout, LIMITS.silent_peer) + 3.0


@pytest.fixture
def fleet(pg_template: Path) -> Iterator[Fleet]:
    with netns_hosts.hosts() as made:
        fleet = Fleet(made, pg_template, stagers=2, losses=3)
        try:
            yield fleet
        finally:
            fleet.close()


def test_hosts_lost_mid_write_block_the_others_at_most_a_lease(fleet: Fleet) -> None:
    fleet.wait_for_acks(5)
    pipeline = fleet.lose("pipeline", idle=True)
    copy = fleet.lose("copy")
    staging = fleet.lose("staging")
    fleet.wait_for_acks(max(len(stager.acks) for stager in fleet.stagers) + 5)  # still staging
    fleet.stop()
    print(fleet.summary())  # the figures (pytest -s)

    assert fleet.errors() == []  # no LockTimeoutError, no error at all
    for loss in (pipeline, copy):
        # Stopped mid-write with no Sync: active, waiting on its client; no server timeout applies.
        assert loss.writer_state == ("active", "ClientRead"), loss
        assert loss.holding_at is not None and loss.writer_ended_at is not None, loss
        blocked = loss.writer_ended_at - loss.holding_at
        assert blocked < BLOCKED_AT_MOST, (loss.place, blocked)
        assert blocked > LIMITS.lease - 0.5, (loss.place, blocked)  # ended by its lease, not before
        # The stagers were blocked (every stage waited for it), then went on.
        assert fleet.longest_gap(loss.holding_at, loss.writer_ended_at + 1.0) < BLOCKED_AT_MOST
    assert pipeline.idle_ended_at is not None
    assert pipeline.idle_ended_at - pipeline.unplugged_at < IDLE_ENDED_WITHIN, pipeline
    assert staging.writer_ended_at is not None
    assert staging.writer_ended_at - staging.unplugged_at < WRITER_ENDED_WITHIN, staging
    assert fleet.longest_stage() < BLOCKED_AT_MOST
    assert fleet.lost() == []
    held = {str(row[0]) for row in fleet.server.execute("SELECT staging_key FROM staged_keys")}
    assert not any(key.startswith("held-") for key in held)  # the stopped writes rolled back
