"""What a ship did: ``ShipReport`` and the ``ShipProblem`` that stopped it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShipProblem:
    """Why shipping stopped at one event of the source.

    ``code``: ``conflict`` (the target holds a different record under the key, the key
    belongs to another call, or the inventory has another cut receipt), ``refused`` (the
    target's write checks refused the event), ``corrupt`` (the source event failed its
    checksum, digest or decoding), ``diverged`` (the target's resume point for this store id is
    past this store's last event, or its event there is another: this store lost events it had
    shipped, or another store with the same id ships there; nothing was shipped, and
    ``source_seq``/``origin_seq`` are 0).
    """

    code: str
    reason: str
    source_seq: int
    origin_store_id: str
    origin_seq: int
    staging_key: str | None
    rollout_id: str | None
    model_call_id: str | None

    def __str__(self) -> str:
        return f"{self.code}: source event {self.source_seq} ({self.origin_store_id}:{self.origin_seq}): {self.reason}"


@dataclass(frozen=True)
class ShipReport:
    """``ok`` when every source event up to ``last_seq`` (the source's last) reached the target.

    ``read``: source events this run took care of (``appended`` + ``present``);
    ``appended``: events written to the target; ``present``: events the target already had
    (shipped before, or an identical record or receipt already there), written nothing.
    A ship stops at its first problem; the events before it stay shipped and a later
    ship resumes after them.

    A ship goes up to the source's last event when it began (events staged meanwhile wait
    for the next ship), and no further than its ``limit`` or ``deadline``: ``remaining`` counts
    the source's events up to that last one it did not reach, ``stopped`` says why
    (``"limit"``, ``"deadline"``, ``"stopped"``: a follower asked to stop; None: it was not
    cut short).  ``ok`` says only that nothing went wrong.
    """

    ok: bool
    source_store_id: str
    target_store_id: str
    read: int
    appended: int
    present: int
    last_seq: int
    problems: tuple[ShipProblem, ...] = ()
    remaining: int = 0
    stopped: str | None = None

    def summary(self) -> str:
        head = (
            f"shipped {self.source_store_id} -> {self.target_store_id}: {self.read} event(s) read, "
            f"{self.appended} appended, {self.present} already present; shipped up to source event {self.last_seq}"
        )
        if self.stopped is not None and self.remaining:
            head += f"; stopped ({self.stopped}) with {self.remaining} event(s) left to ship"
        elif self.stopped == "stopped":
            head += "; stopped on request"
        if self.ok:
            return head
        return "\n".join([head + "; stopped at a problem", *(f"  {problem}" for problem in self.problems)])
