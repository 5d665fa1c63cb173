"""The policy checkpoint coordinator (wire-contract 8) with real worker processes.

Workers are ``tests/coordinator_worker.py`` processes; a lost one is SIGKILLed, so the
coordinator sees its connection drop without a goodbye, as with a crash.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from coordinator_helpers import WorkerProcess, records_about, wait_for, workers

from store.coordinator import Coordinator, CoordinatorUnavailableError, WorkerClient

CHECKPOINT = "ck-1"


@pytest.fixture
def socket_path(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(tmp_path, "policy.sock")


@pytest.fixture
def caplog_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="store.coordinator")
    return caplog


def coordinator(socket_path: str, expected: int) -> Coordinator:
    return Coordinator(socket_path, expected_workers=expected).start()


@pytest.fixture
def two(socket_path: str) -> Iterator[tuple[Coordinator, list[WorkerProcess]]]:
    with coordinator(socket_path, 2) as coord, workers(socket_path, 2) as procs:
        yield coord, procs


def restore_record(cut: object = None) -> dict[str, object]:
    cuts = [] if cut is None else [{"model_call_id": "c1", "continuation": cut}]
    return {
        "rollout_id": "r",
        "attempt": 0,
        "rows": [{"model_call_id": "c0", "staging_key": "r/c0"}],
        "generation_cuts": cuts,
    }


# --- the seed PR's three: workers logged by pid ---------------------------------------------------


def test_workers_are_logged_by_pid_as_they_join_and_a_lost_one_as_a_warning(
    socket_path: str, caplog_info: pytest.LogCaptureFixture
) -> None:
    with coordinator(socket_path, 3) as coord, workers(socket_path, 3) as procs:
        joins = [r for r in caplog_info.records if r.name == "store.coordinator" and "joined" in r.getMessage()]
        assert [r.levelno for r in joins] == [logging.INFO] * 3
        assert sorted(r.worker_pid for r in joins) == sorted(p.pid for p in procs)  # type: ignore[attr-defined]
        for count, record in enumerate(joins, start=1):
            pid = record.worker_pid  # type: ignore[attr-defined]
            assert record.getMessage() == f"Policy worker [{pid}] joined as worker {count - 1} ({count}/3 connected)"
            assert (record.connected, record.expected) == (count, 3)  # type: ignore[attr-defined]

        lost = procs[1]
        lost.kill()
        warnings = wait_for(lambda: records_about(caplog_info, lost.pid, [logging.WARNING]))
        assert len(warnings) == 1
        warning = warnings[0]
        assert warning.getMessage() == (
            f"Policy worker [{lost.pid}] lost without notice (2/3 workers remain); no open checkpoint is affected"
        )
        assert (warning.connected, warning.expected, warning.blocked_checkpoint) == (2, 3, None)  # type: ignore[attr-defined]
        assert [r.levelno for r in records_about(caplog_info, lost.pid)] == [logging.INFO, logging.WARNING]
        assert sorted(coord.status()["workers"]) == sorted(p.pid for p in procs if p is not lost)


def test_a_worker_lost_during_a_checkpoint_is_logged_as_blocking_its_commit(
    two: tuple[Coordinator, list[WorkerProcess]], caplog_info: pytest.LogCaptureFixture
) -> None:
    coord, (a, b) = two
    assert a.ok("control", action="prepare", checkpoint_id=CHECKPOINT, timeout=5)["ready"] is True
    b.kill()
    warning = wait_for(lambda: records_about(caplog_info, b.pid, [logging.WARNING]))[0]
    assert warning.getMessage() == (
        f"Policy worker [{b.pid}] lost without notice (1/2 workers remain); "
        f"open checkpoint '{CHECKPOINT}' can no longer commit until resume"
    )
    assert (warning.connected, warning.expected, warning.blocked_checkpoint) == (1, 2, CHECKPOINT)  # type: ignore[attr-defined]
    assert coord.status()["blockers"] == ["policy-workers-unreported:1", "policy-worker-lost"]
    error = a.error("control", action="commit", checkpoint_id=CHECKPOINT)
    assert (error["status"], error["code"]) == (409, "checkpoint_not_ready")
    assert "no longer ready" in error["detail"]


def test_a_worker_that_stops_cleanly_is_not_reported_as_lost(
    two: tuple[Coordinator, list[WorkerProcess]], caplog_info: pytest.LogCaptureFixture
) -> None:
    coord, (a, b) = two
    b.stop()
    stopped = wait_for(lambda: [r for r in records_about(caplog_info, b.pid) if "stopped" in r.getMessage()])
    assert [(r.levelno, r.getMessage()) for r in stopped] == [
        (logging.INFO, f"Policy worker [{b.pid}] stopped (1/2 connected)")
    ]
    assert [r for r in caplog_info.records if r.levelno >= logging.WARNING] == []
    assert list(coord.status()["workers"]) == [a.pid]


# --- wire-contract section 9: the policy coordinator tests ---------------------------------------


def test_prepare_closes_every_worker_and_waits_for_all_of_them(socket_path: str) -> None:
    with coordinator(socket_path, 3) as coord, workers(socket_path, 2) as (a, b):
        answer: dict[str, object] = {}
        preparing = threading.Thread(target=lambda: answer.update(coord.prepare(CHECKPOINT, timeout=20)))
        preparing.start()
        for worker in (a, b):
            assert wait_for(lambda w=worker: w.ok("state")["accepting"] is False)
            error = worker.error("begin", capture_key="r", model_call_id="late")
            assert (error["status"], error["code"]) == (503, "admission_closed")
        assert preparing.is_alive()  # still waiting for the third worker
        with workers(socket_path, 1):
            preparing.join(timeout=15)
        assert answer == {"checkpoint_id": CHECKPOINT, "ready": True, "blockers": [], "reported": 3, "expected": 3}


def test_commit_leaves_out_undelivered_calls_on_every_worker(two: tuple[Coordinator, list[WorkerProcess]]) -> None:
    _coord, (a, b) = two
    for worker, delivered, held in ((a, "c1", "c2"), (b, "c3", "c4")):
        for call in (delivered, held):
            worker.ok("begin", capture_key="r", model_call_id=call, staging_key=f"r/{call}")
        worker.ok("deliver", capture_key="r", model_call_id=delivered)
    assert a.ok("control", action="prepare", checkpoint_id=CHECKPOINT)["ready"] is True
    committed = b.ok("control", action="commit", checkpoint_id=CHECKPOINT)
    assert [row["model_call_id"] for row in committed["rows"]] == ["c1", "c3"]
    assert committed["staging_keys"] == ["r/c1", "r/c3"]


def test_a_restored_cut_is_claimed_by_exactly_one_worker_and_returned_if_unclaimed(
    two: tuple[Coordinator, list[WorkerProcess]],
) -> None:
    _coord, (a, b) = two
    a.ok("control", action="restore", records=[restore_record({"digest": "d1"})])
    claims = [w.ok("begin", capture_key="r-a1", model_call_id="c1")["continuation"] for w in (a, b)]
    assert claims == [{"digest": "d1"}, None]
    assert a.ok("return_cut", capture_key="r-a1", model_call_id="c1") is True
    assert b.ok("state")["restored_targets"] == ["r-a1/c1"]  # offered again
    assert b.ok("begin", capture_key="r-a1", model_call_id="c1")["continuation"] == {"digest": "d1"}
    a.ok("control", action="retire", rollout_id="r", attempt=1)  # retired while b holds it
    assert b.ok("return_cut", capture_key="r-a1", model_call_id="c1") is False
    assert a.ok("state")["restored_targets"] == []


def test_a_worker_lost_while_closed_blocks_the_checkpoint_until_resume(socket_path: str) -> None:
    with coordinator(socket_path, 2) as coord, workers(socket_path, 2) as (a, b):
        assert a.ok("control", action="prepare", checkpoint_id=CHECKPOINT)["ready"] is True
        b.kill()
        assert wait_for(lambda: coord.status()["lost_worker"])
        assert coord.status()["blockers"] == ["policy-workers-unreported:1", "policy-worker-lost"]
        assert a.error("control", action="commit", checkpoint_id=CHECKPOINT)["code"] == "checkpoint_not_ready"
        a.ok("control", action="resume")
        assert (coord.status()["blockers"], coord.status()["lost_worker"]) == ([], False)
        with workers(socket_path, 1):  # uvicorn's replacement
            assert a.ok("control", action="prepare", checkpoint_id="ck-2")["ready"] is True
            assert a.ok("control", action="commit", checkpoint_id="ck-2")["rows"] == []


def test_a_worker_that_joins_during_a_checkpoint_closes_at_once(socket_path: str) -> None:
    with coordinator(socket_path, 2) as coord, workers(socket_path, 1) as (a,):
        prepared = a.ok("control", action="prepare", checkpoint_id=CHECKPOINT, timeout=0.05)
        assert prepared["blockers"] == ["policy-workers-unreported:1"]
        with workers(socket_path, 1) as (late,):
            state = late.ok("state")
            assert (state["accepting"], state["checkpoint"], state["generation"]) == (False, CHECKPOINT, 1)
            assert late.error("begin", capture_key="r", model_call_id="c1")["code"] == "admission_closed"
            assert wait_for(lambda: coord.status()["blockers"] == [])  # it reported at once
            assert a.ok("control", action="commit", checkpoint_id=CHECKPOINT)["checkpoint_id"] == CHECKPOINT


def test_a_retired_attempt_is_refused_on_every_worker_and_one_that_joins_later_until_forget(
    two: tuple[Coordinator, list[WorkerProcess]], socket_path: str
) -> None:
    _coord, (a, b) = two
    a.ok("begin", capture_key="r-a2", model_call_id="c1")
    assert a.ok("control", action="retire", rollout_id="r", attempt=2) == {"retired": "r-a2", "stopped": 1}
    with workers(socket_path, 1) as (late,):
        for worker in (a, b, late):
            error = worker.error("begin", capture_key="r-a2", model_call_id="c2")
            assert (error["status"], error["code"]) == (409, "attempt_retired")
            worker.ok("begin", capture_key="r-a3", model_call_id="c2")  # other attempts are fine
        b.ok("control", action="forget", rollout_id="r", attempt=2)
        for worker in (a, b, late):
            worker.ok("begin", capture_key="r-a2", model_call_id="c3")


def test_worker_control_routes_forward_to_the_coordinator(two: tuple[Coordinator, list[WorkerProcess]]) -> None:
    _coord, (a, b) = two
    status = b.ok("control", action="status")
    assert sorted(int(pid) for pid in status["workers"]) == sorted([a.pid, b.pid])
    assert (status["connected"], status["expected"], status["accepting"]) == (2, 2, True)
    assert a.ok("control", action="prepare", checkpoint_id=CHECKPOINT)["ready"] is True
    assert b.ok("control", action="status")["checkpoint"] == CHECKPOINT
    with pytest.raises(CoordinatorUnavailableError) as raised:
        WorkerClient().control("status")  # never connected
    assert (raised.value.status, raised.value.code) == (503, "checkpoint_coordinator_unavailable")


def test_a_worker_shuts_down_when_its_coordinator_is_gone(socket_path: str) -> None:
    coord = coordinator(socket_path, 1)
    with workers(socket_path, 1) as (worker,):
        coord.close()
        assert worker.exit_code() == -signal.SIGTERM


def test_restore_across_workers_imports_once_and_offers_the_cut_to_every_worker(
    two: tuple[Coordinator, list[WorkerProcess]],
) -> None:
    coord, (a, b) = two
    restored = a.ok("control", action="restore", records=[restore_record({"digest": "d1"})])
    assert restored == {"restored": {"r-a1": {"rows": 1, "cut": "c1"}}}
    assert coord.status()["restored"] == {"r-a1": [{"model_call_id": "c0", "staging_key": "r/c0", "capture_key": "r"}]}
    for worker in (a, b):
        state = worker.ok("state")
        assert (state["restored_pending"], state["restored_targets"]) == (["r-a1"], ["r-a1/c1"])
        assert state["retired"] == ["r"]  # the restored episode's earlier attempt


def test_restore_refuses_workers_that_have_served_calls(two: tuple[Coordinator, list[WorkerProcess]]) -> None:
    coord, (a, b) = two
    b.ok("begin", capture_key="other", model_call_id="c1")
    error = a.error("control", action="restore", records=[restore_record()])
    assert (error["status"], error["code"]) == (409, "restore_refused")
    assert "served" in error["detail"]
    assert coord.status()["restored"] == {}


def test_worker_messages_carry_what_the_checkpoint_writer_carries(two: tuple[Coordinator, list[WorkerProcess]]) -> None:
    _coord, (a, b) = two
    carried = {"low": -math.inf, "high": math.inf, "nan": math.nan, "big": 2**70, "neg": -(2**70)}
    a.ok("control", action="restore", records=[restore_record(carried)])
    received = b.ok("begin", capture_key="r-a1", model_call_id="c1")["continuation"]
    assert math.isnan(received.pop("nan"))
    assert received == {"low": -math.inf, "high": math.inf, "big": 2**70, "neg": -(2**70)}
    assert isinstance(received["big"], int)


def test_a_message_that_cannot_be_sent_or_is_never_answered_is_a_typed_unavailable_error(socket_path: str) -> None:
    import socket as socket_module

    with pytest.raises(CoordinatorUnavailableError) as refused:
        WorkerClient.connect(socket_path, shutdown_on_loss=False)  # nobody listens
    assert (refused.value.status, refused.value.code) == (503, "checkpoint_coordinator_unavailable")
    silent = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    silent.bind(socket_path)
    silent.listen(1)  # accepts connections, never answers
    try:
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailableError, match="did not answer 'register' in time") as unanswered:
            WorkerClient.connect(socket_path, message_timeout=0.2, shutdown_on_loss=False)
        assert time.monotonic() - started < 2
        assert unanswered.value.status == 503
    finally:
        silent.close()


def test_restore_is_refused_after_a_worker_left_even_if_its_replacement_is_fresh(socket_path: str) -> None:
    with coordinator(socket_path, 2) as coord, workers(socket_path, 2) as (_a, b):
        b.kill()
        assert wait_for(lambda: coord.status()["connected"] == 1)
        with workers(socket_path, 1) as (fresh,):
            error = fresh.error("control", action="restore", records=[restore_record()])
            assert (error["status"], error["code"]) == (409, "restore_refused")
            assert "left" in error["detail"]


def test_a_restored_attempt_any_worker_started_is_no_longer_pending(
    two: tuple[Coordinator, list[WorkerProcess]], socket_path: str
) -> None:
    coord, (a, b) = two
    a.ok("control", action="restore", records=[restore_record({"digest": "d1"})])
    assert b.ok("begin", capture_key="r-a1", model_call_id="c2")["continuation"] is None  # not the cut's call
    assert a.ok("state")["restored_pending"] == []
    assert coord.status()["restored_pending"] == []
    with workers(socket_path, 1) as (late,):
        assert late.ok("state")["restored_pending"] == []
        assert late.ok("state")["restored_targets"] == ["r-a1/c1"]  # its cut is still unclaimed


def test_a_reopen_does_not_make_a_started_restored_attempt_pending_again(
    two: tuple[Coordinator, list[WorkerProcess]],
) -> None:
    coord, (a, b) = two
    a.ok("control", action="restore", records=[restore_record()])
    a.ok("begin", capture_key="r-a1", model_call_id="c1")
    a.ok("deliver", capture_key="r-a1", model_call_id="c1")
    assert b.ok("control", action="prepare", checkpoint_id=CHECKPOINT)["ready"] is True
    b.ok("control", action="resume")
    for worker in (a, b):
        assert worker.ok("state")["restored_pending"] == []
    assert coord.status()["restored_pending"] == []
