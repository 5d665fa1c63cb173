"""Policy workers in the store's log: the ``worker_*`` events the coordinator appends, and the
``workers`` projection read back with the calls each worker process staged or left in flight.

Calls are tied to a worker by the log's ``writer_pid``: a worker process opens the store
itself, so every event it appends carries its pid.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.append.new_event import NewEvent
from store.errors import InvalidRecordError
from store.log import schema
from store.log.engine import driver_errors, storage_error
from store.log.events import RECORD_KINDS, EventKind, WorkerBody
from store.projections.fold import WORKERS_STREAM

_KINDS = {
    "worker_joined": EventKind.WORKER_JOINED,
    "worker_stopped": EventKind.WORKER_STOPPED,
    "worker_lost": EventKind.WORKER_LOST,
}
_TERMINAL = (EventKind.CALL_COMPLETED.value, EventKind.CALL_FAILED.value)
_STAGING = tuple(kind.value for kind in RECORD_KINDS)
Call = tuple[str, str]


@dataclass(frozen=True)
class PolicyWorker:
    """A policy worker process as the log saw it: ``state`` is connected, stopped or lost.

    ``staged_calls`` are the calls it staged records for while registered; ``in_flight_calls``
    the calls it admitted that had not completed or failed when it left (or by now).
    ``blocked_checkpoint`` is the open checkpoint its leaving kept from committing.
    """

    pid: int
    index: int
    state: str
    expected: int
    join_seq: int
    left_seq: int | None
    blocked_checkpoint: str | None
    staged_calls: tuple[Call, ...]
    in_flight_calls: tuple[Call, ...]


def worker_event(
    kind: str,
    pid: int,
    *,
    index: int,
    joined_seq: int | None,
    connected: int,
    expected: int,
    checkpoint_id: str | None,
) -> NewEvent:
    """The event for a worker joining, stopping or being lost; every field checked first."""
    event_kind = _KINDS.get(kind)
    if event_kind is None:
        raise InvalidRecordError(f"unknown worker event {kind!r} (expected one of {sorted(_KINDS)})")
    for name, value in (("pid", pid), ("index", index), ("connected", connected), ("expected", expected)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            raise InvalidRecordError(f"worker event {name} must be an integer in [0, 2**31), got {value!r}")
    if joined_seq is not None and (not isinstance(joined_seq, int) or isinstance(joined_seq, bool) or joined_seq < 1):
        raise InvalidRecordError(f"worker event joined_seq must be a positive integer or None, got {joined_seq!r}")
    if checkpoint_id is not None and (not isinstance(checkpoint_id, str) or not checkpoint_id):
        raise InvalidRecordError(
            f"worker event checkpoint_id must be a non-empty string or None, got {checkpoint_id!r}"
        )
    body = WorkerBody(
        pid=pid, index=index, expected=expected, connected=connected, joined_seq=joined_seq, checkpoint_id=checkpoint_id
    )
    return NewEvent(event_kind, WORKERS_STREAM, str(pid), body)


def policy_workers(engine: Engine) -> list[PolicyWorker]:
    """Every worker in the ``workers`` projection, in join order, with its calls from the log."""
    workers, events = schema.workers, schema.events
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.select(*workers.c).order_by(workers.c.join_seq)).all()
            result = []
            for row in rows:
                end = row.left_seq if row.left_seq is not None else 2**62
                written = connection.execute(
                    sa.select(events.c.rollout_id, events.c.model_call_id, events.c.kind)
                    .where(events.c.writer_pid == row.pid, events.c.seq > row.join_seq, events.c.seq < end)
                    .order_by(events.c.seq)
                ).all()
                staged = list(dict.fromkeys((r.rollout_id, r.model_call_id) for r in written if r.kind in _STAGING))
                admitted = list(
                    dict.fromkeys(
                        (r.rollout_id, r.model_call_id) for r in written if r.kind == EventKind.CALL_ADMITTED.value
                    )
                )
                finished = _finished(connection, admitted, end)
                result.append(
                    PolicyWorker(
                        row.pid,
                        row.worker_index,
                        row.state,
                        row.expected,
                        row.join_seq,
                        row.left_seq,
                        row.blocked_checkpoint,
                        tuple(staged),
                        tuple(c for c in admitted if c not in finished),
                    )
                )
            connection.rollback()
    except driver_errors(engine) as exc:
        raise storage_error("reading the policy workers", exc) from exc
    return result


def _finished(connection: sa.Connection, calls: list[Call], end: int) -> set[Call]:
    """Those of ``calls`` that completed or failed before sequence number ``end`` (by any writer)."""
    events = schema.events
    done: set[Call] = set()
    for rollout_id in {call[0] for call in calls}:
        rows = connection.execute(
            sa.select(events.c.model_call_id).where(
                events.c.rollout_id == rollout_id, events.c.kind.in_(_TERMINAL), events.c.seq < end
            )
        ).all()
        done.update((rollout_id, r.model_call_id) for r in rows)
    return done
