"""Workers by pid in the process log (wire-contract 8.3) and in the store's log.

The lines follow uvicorn's ``Child process [<pid>] died``; the fields the contract asks for
(pid, index, connected, expected, the checkpoint that can no longer commit) are also on
each record as attributes, for handlers that want them without parsing the message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from store.coordinator.state import Worker

if TYPE_CHECKING:
    from store.store import Store

LOG = logging.getLogger("store.coordinator")


def log_join(worker: Worker, connected: int, expected: int) -> None:
    fields = {"worker_pid": worker.pid, "worker_index": worker.index, "connected": connected, "expected": expected}
    LOG.info(
        "Policy worker [%d] joined as worker %d (%d/%d connected)",
        worker.pid,
        worker.index,
        connected,
        expected,
        extra=fields,
    )


def log_leave(worker: Worker, *, said_goodbye: bool, remaining: int, expected: int, blocked: str | None) -> None:
    """A clean stop is an INFO line; a connection dropped without a goodbye is a WARNING."""
    fields = {
        "worker_pid": worker.pid,
        "worker_index": worker.index,
        "connected": remaining,
        "expected": expected,
        "blocked_checkpoint": blocked,
    }
    if said_goodbye:
        consequence = "" if blocked is None else f"; checkpoint {blocked!r} cannot commit until resume"
        LOG.info(
            "Policy worker [%d] stopped (%d/%d connected)%s", worker.pid, remaining, expected, consequence, extra=fields
        )
        return
    consequence = (
        f"open checkpoint {blocked!r} can no longer commit until resume"
        if blocked is not None
        else "no open checkpoint is affected"
    )
    LOG.warning(
        "Policy worker [%d] lost without notice (%d/%d workers remain); %s",
        worker.pid,
        remaining,
        expected,
        consequence,
        extra=fields,
    )


def record(
    store: Store | None, kind: str, worker: Worker, *, connected: int, expected: int, checkpoint: str | None
) -> int | None:
    """Append a worker event to the store's log (its sequence number); a failing store is
    logged and never stops the coordinator."""
    if store is None:
        return None
    try:
        return store.record_worker(
            kind,
            worker.pid,
            index=worker.index,
            joined_seq=worker.joined_seq,
            connected=connected,
            expected=expected,
            checkpoint_id=checkpoint,
        )
    except Exception:
        LOG.exception("could not log %s of policy worker [%d] in the store", kind, worker.pid)
        return None
