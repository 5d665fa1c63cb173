"""The coordinator's checkpoint state (wire-contract 8.2), without any I/O.

The server holds one ``CheckpointState`` under its lock and turns messages into calls here;
every rule of 8.2 lives in this module so it can be read, and tested, in one place.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from store.coordinator.errors import CheckpointStateError, FrameError
from store.wire.cut_records import capture_key as attempt_key

UNREPORTED = "policy-workers-unreported"
LOST = "policy-worker-lost"
# Bounds on the numbers a frame carries.  A restore retires every earlier attempt of each
# record, so its work grows with the attempts: an attempt is at most MAX_ATTEMPT (an episode
# is restored or retried that many times in a run at most), a restore names at most
# MAX_RESTORE_RECORDS episodes and retires at most MAX_RESTORE_RETIRED attempt keys in all.
MAX_ATTEMPT = 1000
MAX_RESTORE_RECORDS = 65_536
MAX_RESTORE_RETIRED = 262_144
MAX_SERVED = 2**63 - 1


@dataclass
class Worker:
    """One connected worker process."""

    index: int
    pid: int
    report: dict[str, Any] | None = None  # its report for the open checkpoint
    served: int = 0  # calls it has begun, as last reported
    claims: set[str] = field(default_factory=set)  # restored cuts it holds (targets)
    joined_seq: int | None = None  # the worker_joined event in the store's log, if any
    recorded: bool = False  # its join was recorded in the store (``worker_log.EventLimit``): so is its leave


@dataclass
class RestoredCut:
    """A generation cut restored under the next attempt, offered to every worker."""

    capture_key: str
    model_call_id: str
    continuation: Any
    claimed_by: int | None = None

    @property
    def target(self) -> str:
        return f"{self.capture_key}/{self.model_call_id}"


class CheckpointState:
    """Workers, admission, the open checkpoint, retired attempts and restored cuts."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.workers: dict[int, Worker] = {}
        self._indices = itertools.count()
        self.accepting = True
        self.generation = 0
        self.checkpoint: str | None = None
        self.lost_worker = False  # a worker left while admission was closed
        self.worker_left = False  # any worker ever left: restore is refused
        self.retired: set[str] = set()  # capture keys refused on every worker until forget
        self.cuts: dict[str, RestoredCut] = {}
        self.restored_rows: dict[str, list[dict[str, Any]]] = {}  # target capture key -> rows
        self.pending: set[str] = set()  # restored attempts no worker has started yet
        self.started: set[str] = set()

    # --- workers come and go ----------------------------------------------------------------

    def join(self, pid: int) -> Worker:
        worker = Worker(next(self._indices), pid)
        self.workers[worker.index] = worker
        return worker

    def adoption(self) -> dict[str, Any]:
        """What a joining (or replacement) worker adopts."""
        return {
            "accepting": self.accepting,
            "generation": self.generation,
            "checkpoint": self.checkpoint,
            "retired": sorted(self.retired),
            "restored_pending": sorted(self.pending),
            "restored_targets": sorted(cut.target for cut in self.cuts.values() if cut.claimed_by is None),
        }

    def leave(self, index: int) -> Worker | None:
        """Remove a worker whose connection closed; returns it (None if it never registered)."""
        worker = self.workers.pop(index, None)
        if worker is None:
            return None
        if not self.accepting:
            self.lost_worker = True
        self.worker_left = True
        for target in sorted(worker.claims):
            self._give_back(target)
        return worker

    # --- reports and readiness -------------------------------------------------------------

    def record_report(self, index: int, body: Any) -> None:
        worker = self.workers.get(index)
        if worker is None:
            raise CheckpointStateError("the worker is not registered")
        report = check_report(body)
        worker.served = max(worker.served, report["served"])
        if self.checkpoint is not None and report["checkpoint_id"] == self.checkpoint:
            worker.report = report

    def reported(self) -> int:
        return sum(1 for worker in self.workers.values() if worker.report is not None)

    def blockers(self) -> list[str]:
        """Readiness blockers, in 8.2's order; empty when no checkpoint is open or it is ready."""
        if self.checkpoint is None:
            return []
        blockers: list[str] = []
        unreported = self.expected - self.reported()
        if unreported > 0:
            blockers.append(f"{UNREPORTED}:{unreported}")
        if self.lost_worker:
            blockers.append(LOST)
        streaming = {key for w in self.workers.values() if w.report for key in w.report["streaming"]}
        return blockers + sorted(streaming)

    # --- the checkpoint's phases -------------------------------------------------------------

    def prepare(self, checkpoint_id: str) -> None:
        if self.checkpoint is not None and self.checkpoint != checkpoint_id:
            raise CheckpointStateError(f"checkpoint {self.checkpoint!r} is open; resume it before preparing another")
        if self.checkpoint is None:
            self.generation += 1
            for worker in self.workers.values():
                worker.report = None
        self.accepting = False
        self.checkpoint = checkpoint_id

    def commit(self, checkpoint_id: str, snapshots: list[dict[str, Any]]) -> dict[str, Any]:
        """The committed rows: delivered rows of every worker, without calls still undelivered
        on any worker, plus restored cuts no worker consumed."""
        self.require_ready(checkpoint_id)
        undelivered = {(call[0], call[1]) for snap in snapshots for call in snap["undelivered"]}
        rows = {
            (row["capture_key"], row["model_call_id"]): row
            for snap in snapshots
            for row in snap["rows"]
            if (row["capture_key"], row["model_call_id"]) not in undelivered
        }
        cuts = [
            {"capture_key": cut.capture_key, "model_call_id": cut.model_call_id, "continuation": cut.continuation}
            for cut in self.cuts.values()
            if cut.claimed_by is None and cut.capture_key not in self.retired
        ]
        ordered = [rows[key] for key in sorted(rows)]
        keys = {row["staging_key"] for row in ordered if row.get("staging_key")}
        return {"checkpoint_id": checkpoint_id, "rows": ordered, "generation_cuts": cuts, "staging_keys": sorted(keys)}

    def require_ready(self, checkpoint_id: str) -> None:
        if self.checkpoint != checkpoint_id:
            raise CheckpointStateError(f"checkpoint {checkpoint_id!r} is not open (open: {self.checkpoint!r})")
        blockers = self.blockers()
        if blockers:
            raise CheckpointStateError(
                f"checkpoint {checkpoint_id!r} is no longer ready: {', '.join(blockers)}", code="checkpoint_not_ready"
            )

    def resume(self) -> None:
        self.accepting = True
        self.checkpoint = None
        self.lost_worker = False
        for worker in self.workers.values():
            worker.report = None

    # --- retired attempts --------------------------------------------------------------------

    def retire(self, key: str) -> None:
        if self.checkpoint is not None:
            raise CheckpointStateError(
                f"attempt {key!r} cannot be retired while checkpoint {self.checkpoint!r} is open"
            )
        self.retired.add(key)
        self.pending.discard(key)
        for target in [t for t, cut in self.cuts.items() if cut.capture_key == key]:
            del self.cuts[target]  # a retired attempt's cut is never offered again

    def forget(self, key: str) -> None:
        self.retired.discard(key)

    # --- restore and restored cuts ---------------------------------------------------------

    def restore(self, records: Any, served: int) -> dict[str, Any]:
        """Install each record under its next attempt; refused once a worker has left or served."""
        if self.worker_left:
            raise CheckpointStateError(
                "restore is refused: a worker has left since the server started", code="restore_refused"
            )
        if served or any(worker.served for worker in self.workers.values()):
            raise CheckpointStateError("restore is refused: a worker has already served calls", code="restore_refused")
        if self.checkpoint is not None:
            raise CheckpointStateError(f"restore is refused while checkpoint {self.checkpoint!r} is open")
        installed = [_restored_record(record) for record in _records(records)]
        restored: dict[str, Any] = {}
        for target, earlier, rows, cut in installed:
            self.restored_rows[target] = rows
            if cut is not None:
                self.cuts[cut.target] = cut
            self.pending.add(target)
            self.retired.update(earlier)
            restored[target] = {"rows": len(rows), "cut": None if cut is None else cut.model_call_id}
        return {"restored": restored}

    def claim(self, index: int, key: str, model_call_id: str) -> tuple[Any, bool]:
        """The cut for the call if this worker is first to claim it; and whether this claim
        started a restored attempt (it is then no longer pending anywhere)."""
        worker = self.workers.get(index)
        if worker is None:  # it left (its connection closed) while this claim was on its way
            raise CheckpointStateError("the worker is not registered")
        if key in self.retired:
            raise CheckpointStateError(f"attempt {key!r} is retired", code="attempt_retired")
        newly_started = key in self.pending
        self.pending.discard(key)
        self.started.add(key)
        cut = self.cuts.get(f"{key}/{model_call_id}")
        if cut is None or cut.claimed_by is not None:
            return None, newly_started
        cut.claimed_by = index
        worker.claims.add(cut.target)
        return cut.continuation, newly_started

    def return_cut(self, index: int, key: str, model_call_id: str) -> bool:
        target = f"{key}/{model_call_id}"
        worker = self.workers.get(index)
        if worker is None or target not in worker.claims:
            raise CheckpointStateError(f"this worker holds no restored cut for {target!r}")
        worker.claims.discard(target)
        return self._give_back(target)

    def _give_back(self, target: str) -> bool:
        cut = self.cuts.get(target)
        if cut is None:
            return False  # retired meanwhile: dropped, never offered again
        cut.claimed_by = None
        return True


def check_report(body: Any) -> dict[str, Any]:
    """A worker's report, checked: ``{checkpoint_id, served, rows, undelivered, streaming}``."""
    if not isinstance(body, dict):
        raise FrameError("a report must be a JSON object")
    checkpoint_id = body.get("checkpoint_id")
    served = body.get("served", 0)
    rows, undelivered, streaming = body.get("rows", []), body.get("undelivered", []), body.get("streaming", [])
    if checkpoint_id is not None and not isinstance(checkpoint_id, str):
        raise FrameError("report checkpoint_id must be a string or null")
    if not isinstance(served, int) or isinstance(served, bool) or not 0 <= served <= MAX_SERVED:
        raise FrameError(f"report served must be an integer in 0..{MAX_SERVED}")
    if not (isinstance(rows, list) and all(_is_row(row) for row in rows)):
        raise FrameError("report rows must be objects with capture_key, model_call_id and staging_key")
    if not (isinstance(undelivered, list) and all(_is_pair(call) for call in undelivered)):
        raise FrameError("report undelivered must be [capture_key, model_call_id] pairs")
    if not (isinstance(streaming, list) and all(isinstance(key, str) for key in streaming)):
        raise FrameError("report streaming must be a list of capture keys")
    return {
        "checkpoint_id": checkpoint_id,
        "served": served,
        "rows": rows,
        "undelivered": undelivered,
        "streaming": streaming,
    }


def _is_row(row: Any) -> bool:
    return (
        isinstance(row, dict)
        and isinstance(row.get("capture_key"), str)
        and isinstance(row.get("model_call_id"), str)
        and isinstance(row.get("staging_key"), (str, type(None)))
    )


def _is_pair(call: Any) -> bool:
    return isinstance(call, list) and len(call) == 2 and all(isinstance(part, str) for part in call)


def _records(records: Any) -> list[Any]:
    if not isinstance(records, list) or not records:
        raise FrameError("restore needs a non-empty list of records")
    if len(records) > MAX_RESTORE_RECORDS:
        raise FrameError(
            f"restore names {len(records)} records; at most {MAX_RESTORE_RECORDS} per restore (split it)", status=413
        )
    # Counted before any key is made: each record retires its attempt and every earlier one.
    retiring = sum(_attempt_of(record) + 1 for record in records)
    if retiring > MAX_RESTORE_RETIRED:
        raise FrameError(
            f"restore would retire {retiring} attempts; at most {MAX_RESTORE_RETIRED} per restore (split it)",
            status=413,
        )
    return records


def _attempt_of(record: Any) -> int:
    if not isinstance(record, dict):
        raise FrameError("a restore record must be a JSON object")
    attempt = record.get("attempt")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt < MAX_ATTEMPT:
        raise FrameError(f"a restore record needs an attempt in 0..{MAX_ATTEMPT - 1} (the next attempt is restored)")
    return attempt


def _restored_record(record: Any) -> tuple[str, list[str], list[dict[str, Any]], RestoredCut | None]:
    """(target capture key, the attempts it retires, rows stamped with their staging attempt, cut).

    A record is installed under the next attempt; it and every earlier attempt are retired."""
    if not isinstance(record, dict):
        raise FrameError("a restore record must be a JSON object")
    rollout_id, attempt = record.get("rollout_id"), _attempt_of(record)
    if not isinstance(rollout_id, str) or not rollout_id:
        raise FrameError("a restore record needs a rollout_id")
    source, target = attempt_key(rollout_id, attempt), attempt_key(rollout_id, attempt + 1)
    earlier = [attempt_key(rollout_id, n) for n in range(attempt + 1)]
    rows = record.get("rows", [])
    if not (
        isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r.get("model_call_id"), str) for r in rows)
    ):
        raise FrameError("restore record rows must be objects with a model_call_id")
    stamped = [{**row, "capture_key": row.get("capture_key") or source} for row in rows]
    cuts = record.get("generation_cuts", [])
    if not isinstance(cuts, list) or len(cuts) > 1:
        raise FrameError(f"a restore record holds at most one generation cut ({rollout_id!r} has {len(cuts)})")
    if not cuts:
        return target, earlier, stamped, None
    cut = cuts[0]
    if not (isinstance(cut, dict) and isinstance(cut.get("model_call_id"), str)):
        raise FrameError("a generation cut needs a model_call_id")
    return target, earlier, stamped, RestoredCut(target, cut["model_call_id"], cut.get("continuation"))
