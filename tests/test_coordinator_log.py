"""Worker events in the store's log and the ``workers`` projection: which worker process (pid)
staged which calls, and which calls were in flight on a worker that was lost."""

from __future__ import annotations

import os

import pytest
from coordinator_helpers import wait_for, workers

from store import InvalidRecordError, Store
from store.coordinator import Coordinator
from store.log.events import EventKind


def test_workers_projection_shows_who_staged_what_and_what_a_lost_worker_left_in_flight(
    store: Store, store_url: str, tmp_path: os.PathLike[str]
) -> None:
    socket_path = os.path.join(tmp_path, "policy.sock")
    with (
        Coordinator(socket_path, expected_workers=2, store=store) as coord,
        workers(socket_path, 2, store_url) as (
            a,
            b,
        ),
    ):
        a.ok("stage", rollout_id="r", model_call_id="c1")
        a.ok("admit", rollout_id="r", model_call_id="c2")  # still decoding when a is killed
        b.ok("admit", rollout_id="r", model_call_id="c3")
        b.ok("stage", rollout_id="r", model_call_id="c3")
        assert b.ok("control", action="prepare", checkpoint_id="ck-1")["ready"] is True
        b.stop()
        a.kill()
        assert wait_for(lambda: sorted(w.state for w in store.workers()) == ["lost", "stopped"])
        assert coord.status()["blockers"] == ["policy-workers-unreported:2", "policy-worker-lost"]
    by_pid = {worker.pid: worker for worker in store.workers()}
    lost, stopped = by_pid[a.pid], by_pid[b.pid]
    assert (lost.state, lost.staged_calls, lost.in_flight_calls) == ("lost", (("r", "c1"),), (("r", "c2"),))
    assert (lost.blocked_checkpoint, lost.expected) == ("ck-1", 2)
    assert (stopped.state, stopped.staged_calls, stopped.in_flight_calls) == ("stopped", (("r", "c3"),), ())
    assert stopped.blocked_checkpoint == "ck-1"  # left while admission was closed: 8.2's lost_worker
    tree = store.lineage("r")  # the lineage names the worker that admitted each call
    assert tree is not None
    assert {call.model_call_id: call.worker_pid for call in tree.calls} == {"c1": None, "c2": a.pid, "c3": b.pid}
    kinds = [event.kind for event in _worker_events(store)]
    assert sorted(kinds) == sorted(
        [EventKind.WORKER_JOINED, EventKind.WORKER_JOINED, EventKind.WORKER_STOPPED, EventKind.WORKER_LOST]
    )
    report = store.replay()
    assert report.ok, report.summary()


def test_a_damaged_workers_row_is_found_and_repaired_by_replay(store: Store) -> None:
    joined = store.record_worker("worker_joined", 4242, index=0, connected=1, expected=2)
    store.record_worker("worker_lost", 4242, index=0, joined_seq=joined, connected=0, expected=2, checkpoint_id="ck")
    [worker] = store.workers()
    assert (worker.pid, worker.state, worker.join_seq, worker.blocked_checkpoint) == (4242, "lost", joined, "ck")
    import sqlalchemy as sa

    from store.log import schema

    with store._engine.begin() as connection:
        connection.execute(sa.update(schema.workers).values(state="connected"))
    report = store.replay(repair=True)
    assert not report.ok and [d.table for d in report.differences] == ["workers"]
    assert store.replay().ok
    assert store.workers()[0].state == "lost"


@pytest.mark.parametrize(
    ("kind", "fields", "message"),
    [
        ("worker_gone", {}, "unknown worker event"),
        ("worker_joined", {"pid": -1}, "pid must be an integer"),
        ("worker_lost", {"joined_seq": 0}, "joined_seq must be a positive integer"),
        ("worker_lost", {"checkpoint_id": ""}, "checkpoint_id must be a non-empty string"),
    ],
)
def test_bad_worker_events_are_refused_and_nothing_is_written(
    store: Store, kind: str, fields: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"pid": 4242, "index": 0, "connected": 1, "expected": 2, **fields}
    with pytest.raises(InvalidRecordError, match=message):
        store.record_worker(kind, **arguments)  # type: ignore[arg-type]
    assert store.workers() == []
    assert store.replay().events == 0


def _worker_events(store: Store) -> list[object]:
    import sqlalchemy as sa

    from store.log import schema
    from store.queries.integrity import verified_event

    with store._engine.connect() as connection:
        rows = connection.execute(sa.select(*schema.events.c).order_by(schema.events.c.seq)).all()
    return [e for e in (verified_event(row._mapping) for row in rows) if e.kind.value.startswith("worker_")]


def test_a_register_close_loop_adds_a_bounded_number_of_worker_events(
    store: Store, store_url: str, tmp_path: os.PathLike[str]
) -> None:
    """Issue 33 item 10: every register and every close appended an event, so a connect loop grew
    the store without bound.  Now a process has one join recorded per window (its leave with it),
    and a join left out has no leave recorded either; another process is still recorded."""
    import socket

    from store.coordinator import framing

    socket_path = os.path.join(tmp_path, "policy.sock")
    with Coordinator(socket_path, expected_workers=2, store=store, register_timeout=2) as coord:
        for _ in range(200):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path)
            sock.sendall(framing.encode({"id": 0, "kind": "register", "body": {"pid": os.getpid()}}))
            assert framing.read_frame(sock, body_timeout=5, idle_timeout=5)["ok"] is True
            sock.close()
        assert wait_for(lambda: coord.status()["connected"] == 0)
        kinds = [event.kind for event in _worker_events(store)]  # type: ignore[attr-defined]
        assert kinds == [EventKind.WORKER_JOINED, EventKind.WORKER_LOST], f"{len(kinds)} events for 200 connects"
        with workers(socket_path, 1, store_url) as (other,):  # another process: its own join is recorded
            assert wait_for(lambda: other.pid in {w.pid for w in store.workers()})
            other.stop()
        assert wait_for(lambda: len(_worker_events(store)) == 4)
    assert {w.pid: w.state for w in store.workers()} == {os.getpid(): "lost", other.pid: "stopped"}
    assert store.replay().ok
