"""A store write that takes the write lock and then stops in the middle, with no Sync sent: in
the pipeline (its lookups read, its event's insert still waiting) or inside the COPY a ship's
batch streams its events with.  Its server session then stays ``active``, waiting on its client
(``ClientRead``), holding the lock: what a host lost or frozen mid-write leaves (not a test
module; ``test_pg_faults.py`` and ``pg_host_worker.py`` use it).
"""

from __future__ import annotations

from collections.abc import Callable

from factories import make_record

from store import Store
from store.append.staging_rules import stage_event
from store.append.transaction import WriteTransaction
from store.log.events import EventKind

PLACES = ("pipeline", "copy")


def hold_mid_write(store: Store, place: str, holding: Callable[[], None], stop: Callable[[], object]) -> object:
    """Write one record on ``store``, stopping after the lock is taken and a statement (or the
    COPY) is under way: ``holding()`` is called there, then ``stop()`` (which blocks as long as
    the test wants) before the write goes on.  Returns what the write returns; raises its error."""
    if place not in PLACES:
        raise ValueError(f"place must be one of {PLACES}, got {place!r}")
    record = make_record(rollout_id=f"held-{place}")

    def work(tx: WriteTransaction) -> object:
        event = store._record_event(record, None, EventKind.CALL_COMPLETED, None, None)
        if place == "copy":
            with tx.bulk():  # a ship's batch: events stream with COPY as they are appended
                result = stage_event(tx, event, record.digest)  # the lookups read, then the COPY opens
                holding()
                stop()
            return result
        result = stage_event(tx, event, record.digest)  # its lookups read (a flush, not a Sync)
        holding()
        stop()
        return result

    return store._write(work)
