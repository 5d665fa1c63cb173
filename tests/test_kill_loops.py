"""Kill loops: workers die with SIGKILL at deterministic failpoints (``store.failpoints``),
and whatever they acknowledged before dying is in the store, whole and verified.

``tools/soak_kills.py`` runs the same loop for hundreds of kills.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import kill_worker
import pytest
import sqlalchemy as sa
from kill_harness import FAILPOINTS, REPO, Ack, KillLoop

from store import ConfigurationError, open_store
from store import failpoints as failpoints_module
from store.log.engine import resolve_url
from store.log.schema import cut_receipts, events, staged_keys

# Hits to survive before dying: the first hit, and later ones, when batches and cuts are under way.
SKIPS = {"before_commit": (0, 6, 20), "after_commit": (0, 6, 20), "mid_batch": (0, 6, 24), "mid_cut": (0, 2, 6)}
RECORDS = 200  # per stager thread: far more than the skips let a child stage


@pytest.fixture
def kill_loop(store_url: str, tmp_path: Path) -> Iterator[KillLoop]:
    loop = KillLoop(store_url, tmp_path)
    yield loop
    loop.close()


def test_nothing_acknowledged_is_lost_across_kills(kill_loop: KillLoop, store_url: str) -> None:
    # PostgreSQL commits are slower: the first and the last skip only, to keep the test short.
    plan = [
        (failpoint, skip)
        for failpoint in FAILPOINTS
        for skip in (SKIPS[failpoint] if "://" not in store_url else SKIPS[failpoint][::2])
    ]
    for failpoint, skip in plan:
        kill_loop.kill_once(failpoint, skip, RECORDS)
    kill_loop.check_all()
    totals = kill_loop.totals
    assert totals.problems == [], totals.summary()
    assert totals.kills == len(plan), totals.summary()
    # The checks had something to check: records, receipts and prefixes promised by them.
    assert totals.acks_checked > 100 and totals.receipts_checked > 5 and totals.prefixes_restored > 5, totals.summary()


def test_the_kill_loop_catches_an_acknowledgement_sent_before_the_commit(tmp_path: Path) -> None:
    loop = KillLoop(str(tmp_path / "store.db"), tmp_path, ack_early=True)
    try:
        for skip in (3, 12):
            loop.kill_once("before_commit", skip, RECORDS)
    finally:
        loop.close()
    assert loop.totals.kills == 2
    assert loop.totals.lost > 0, loop.totals.summary()


def test_the_kill_loop_catches_a_partial_cut(tmp_path: Path) -> None:
    url = str(tmp_path / "store.db")
    with open_store(url) as store:
        player = kill_worker.CutPlayer(store, "r")
        for _ in range(3):
            player.step()
    engine = sa.create_engine(resolve_url(url))
    with engine.begin() as connection:  # chunks committed without their receipts
        connection.execute(sa.delete(events).where(events.c.kind == "cut_receipt"))
        connection.execute(sa.delete(cut_receipts))
    engine.dispose()
    loop = KillLoop(url, tmp_path)
    with open_store(url) as store:
        loop.check_no_partial(store, since=0)
    loop.close()
    assert loop.totals.partial >= 3, loop.totals.summary()  # three live calls' first chunks at least


def test_the_kill_loop_catches_a_missing_or_misreported_record(tmp_path: Path) -> None:
    url = str(tmp_path / "store.db")
    record = kill_worker.stager_record("k0", 0, 0)
    other = kill_worker.stager_record("k0", 0, 1)
    with open_store(url) as store:
        store.stage(record)
    loop = KillLoop(url, tmp_path)
    with open_store(url) as store:
        loop.check_acks(store, [Ack(record.staging_key, record.rollout_id, record.model_call_id, record.digest)])
        assert loop.totals.problems == []
        loop.check_acks(store, [Ack(record.staging_key, record.rollout_id, record.model_call_id, other.digest)])
        loop.check_acks(store, [Ack(other.staging_key, other.rollout_id, other.model_call_id, other.digest)])
    loop.close()
    assert (loop.totals.misreported, loop.totals.lost) == (1, 1), loop.totals.problems


# --- each failpoint dies where it says ------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from kill_worker import CutPlayer, emit
    from factories import make_record
    from store import open_store

    with open_store(sys.argv[1]) as store:
        if sys.argv[2] == "stage":
            for index in range(3):
                result = store.stage(make_record(model_call_id=f"call-{index}"))
                emit(f"ACK {result.staging_key}")
        else:
            CutPlayer(store, "r").step()
            emit("SERVED")
    """
)


def _die_at(url: str, failpoint: str, skip: int, action: str) -> tuple[list[str], str]:
    env = dict(os.environ, STORE_FAILPOINT=failpoint, STORE_FAILPOINT_SKIP=str(skip))
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, url, action], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert f"FAILPOINT {failpoint} " in proc.stderr
    return proc.stdout.split(), proc.stderr


def _column(url: str, column: sa.Column[str]) -> list[str]:
    engine = sa.create_engine(resolve_url(url))
    with engine.connect() as connection:
        values = connection.execute(sa.select(column)).scalars().all()
    engine.dispose()
    return sorted(values)


@pytest.mark.parametrize(
    ("failpoint", "expected_acks", "expected_staged"),
    [
        # The second stage dies inside its transaction: it is neither acknowledged nor staged.
        ("before_commit", ["ACK", "rollout-1/call-0"], ["rollout-1/call-0"]),
        # The second stage dies after its commit: staged, though its caller was never told.
        ("after_commit", ["ACK", "rollout-1/call-0"], ["rollout-1/call-0", "rollout-1/call-1"]),
    ],
)
def test_a_commit_failpoint_dies_on_its_side_of_the_commit(
    tmp_path: Path, failpoint: str, expected_acks: list[str], expected_staged: list[str]
) -> None:
    url = str(tmp_path / "store.db")
    open_store(url).close()
    acks, _ = _die_at(url, failpoint, 1, "stage")
    assert acks == expected_acks
    assert _column(url, staged_keys.c.staging_key) == expected_staged
    with open_store(url) as store:
        assert [snapshot.staging_key for snapshot in store.fetch(expected_staged)] == expected_staged


def test_mid_cut_dies_before_anything_of_the_cut_is_staged(tmp_path: Path) -> None:
    url = str(tmp_path / "store.db")
    open_store(url).close()
    acks, _ = _die_at(url, "mid_cut", 0, "cut")
    assert acks == []
    assert set(_column(url, events.c.kind)) == {"call_admitted"}  # the calls were admitted; no chunk, no receipt


def test_an_unknown_failpoint_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="not a failpoint"):
        failpoints_module.arm("before_comit")
    with pytest.raises(ConfigurationError, match="non-negative"):
        failpoints_module.arm("before_commit", -1)
    failpoints_module.hit("before_commit")  # still unarmed: an ordinary process never dies here
