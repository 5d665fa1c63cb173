"""What ``retire``, ``forget`` and ``delete`` would do to capture keys, read without writing.

The command line's ``--dry-run`` lists it before an irreversible delete.  It counts what
``removal.delete`` removes (every event of the key but its fences and tombstones) and reads the
fence from the rollouts projection, the two facts ``removal`` decides ``removed``/``absent`` by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import sqlalchemy as sa

from store.log import schema
from store.log.events import RECORD_KINDS
from store.queries.reads import Reader

Action = Literal["retire", "forget", "delete"]
_CHUNK = 500  # keys per IN list (SQLite's bound on bound parameters is far above it)
_RECORD_KINDS = sorted(kind.value for kind in RECORD_KINDS)
_ZERO: sa.ColumnClause[int] = sa.literal_column("0")


@dataclass(frozen=True, slots=True)
class RemovalPreview:
    """One capture key as ``retire``/``forget``/``delete`` would find it now."""

    capture_key: str
    events: int  # what a delete removes: staged tokens, admissions, failures, ledger rows
    records: int  # of those, staged records
    stored_bytes: int
    fenced: bool  # retired: late writes are refused

    def outcome(self, action: Action) -> Literal["removed", "absent"]:
        """Where the action's ``RolloutRemoval`` would list the key."""
        if action == "retire":
            held = self.events > 0
        elif action == "forget":
            held = self.fenced
        else:
            held = self.events > 0 or self.fenced
        return "removed" if held else "absent"


def removal_preview(reader: Reader, keys: Sequence[str]) -> list[RemovalPreview]:
    """A ``RemovalPreview`` per key, in the order given; one read snapshot for all of them."""
    events, rollouts = schema.events, schema.rollouts
    size = (
        sa.func.length(events.c.body)
        + sa.func.coalesce(sa.func.length(events.c.token_ids), _ZERO)
        + sa.func.coalesce(sa.func.length(events.c.token_mask), _ZERO)
        + sa.func.coalesce(sa.func.length(events.c.log_probs), _ZERO)
    )
    is_record = sa.case((events.c.kind.in_(_RECORD_KINDS), 1), else_=0)
    counts: dict[str, tuple[int, int, int]] = {}
    fenced: set[str] = set()
    with reader.pinned("previewing a removal"), reader.connection("previewing a removal") as connection:
        for start in range(0, len(keys), _CHUNK):
            part = list(keys[start : start + _CHUNK])
            query = (
                sa.select(events.c.rollout_id, sa.func.count(), sa.func.sum(is_record), sa.func.sum(size))
                .where(events.c.rollout_id.in_(part), sa.not_(events.c.kind.like("rollout_%")))
                .group_by(events.c.rollout_id)
            )
            for key, count, records, stored in connection.execute(query):
                counts[key] = (int(count), int(records or 0), int(stored or 0))
            fences = sa.select(rollouts.c.rollout_id).where(rollouts.c.rollout_id.in_(part), rollouts.c.fenced != 0)
            fenced.update(row[0] for row in connection.execute(fences))
    return [RemovalPreview(key, *counts.get(key, (0, 0, 0)), fenced=key in fenced) for key in keys]
