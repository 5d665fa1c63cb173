"""Fences and deletion, run inside the log's write transaction (wire-contract 6.5).

* ``retire``: a ``rollout_retired`` fence; later writes for the capture key are refused
  (``WriteTransaction.check_fence``).  Its staged records stay readable.
* ``forget``: ``rollout_forgotten`` removes the fence.
* ``delete``: the one physical removal.  ``rollout_deleted`` is appended with what an audit
  needs to explain the gap (sequence range, counts, a combined checksum), then the capture
  key's other events and projection rows go, in the same transaction.  The tombstone is
  newer than every removed event, so the log's highest sequence number never goes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
import xxhash
from sqlalchemy.engine import Engine

from store.append.new_event import NewEvent
from store.append.transaction import WriteTransaction
from store.log import schema
from store.log.engine import Statement
from store.log.events import RECORD_KINDS, EventKind, FenceBody, TombstoneBody
from store.projections.fold import ROLLOUT_STREAM
from store.wire.records import RolloutRemoval

_TOMBSTONE_DOMAIN = b"staging-store-tombstone-1"
# Kinds are matched by prefix so one compiled statement serves each scope.
_RETENTION_PATTERN = "rollout_%"  # fences and tombstones: never removed
_LEDGER_PATTERN = "ledger_%"
_ZERO: sa.ColumnClause[int] = sa.literal_column("0")  # inline: the compiled statements bind only named parameters


class RetentionStatements:
    """The statements of retire/forget/delete, compiled once for the store's dialect."""

    def __init__(self, engine: Engine) -> None:
        events, keys, calls = schema.events, schema.staged_keys, schema.calls
        removable = sa.not_(events.c.kind.like(sa.bindparam("retention")))
        stored_bytes = (
            sa.func.length(events.c.body)
            + sa.func.coalesce(sa.func.length(events.c.token_ids), _ZERO)
            + sa.func.coalesce(sa.func.length(events.c.token_mask), _ZERO)
            + sa.func.coalesce(sa.func.length(events.c.log_probs), _ZERO)
        )
        self.any_event = Statement(
            sa.select(sa.func.min(events.c.seq)).where(events.c.rollout_id == sa.bindparam("rollout_id"), removable),
            engine,
        )
        self.any_ledger = Statement(
            sa.select(sa.func.min(events.c.seq)).where(
                events.c.rollout_id == sa.bindparam("rollout_id"), events.c.kind.like(sa.bindparam("ledger"))
            ),
            engine,
        )
        columns = (events.c.seq, events.c.kind, events.c.staging_key, events.c.checksum, stored_bytes)
        self.removable = Statement(
            sa.select(*columns)
            .where(events.c.rollout_id == sa.bindparam("rollout_id"), removable)
            .order_by(events.c.seq),
            engine,
        )
        self.removable_ledger = Statement(
            sa.select(*columns)
            .where(events.c.rollout_id == sa.bindparam("rollout_id"), events.c.kind.like(sa.bindparam("ledger")))
            .order_by(events.c.seq),
            engine,
        )
        self.delete_events = Statement(
            sa.delete(events).where(
                events.c.rollout_id == sa.bindparam("rollout_id"),
                events.c.seq < sa.bindparam("before"),
                removable,
            ),
            engine,
        )
        self.delete_ledger = Statement(
            sa.delete(events).where(
                events.c.rollout_id == sa.bindparam("rollout_id"),
                events.c.seq < sa.bindparam("before"),
                events.c.kind.like(sa.bindparam("ledger")),
            ),
            engine,
        )
        self.delete_key = Statement(
            sa.delete(keys).where(
                keys.c.staging_key == sa.bindparam("staging_key"),
                keys.c.rollout_id == sa.bindparam("rollout_id"),
            ),
            engine,
        )
        self.delete_calls = Statement(sa.delete(calls).where(calls.c.rollout_id == sa.bindparam("rollout_id")), engine)
        # The complete-record transport's rows of the capture key (its tokens_* events go with the rest).
        self.delete_token_tables = [
            Statement(sa.delete(table).where(table.c.rollout_id == sa.bindparam("rollout_id")), engine)
            for table in (schema.token_entries, schema.token_rollouts)
        ]


@dataclass(frozen=True)
class _Removed:
    seqs: list[int]
    records: int
    stored_bytes: int
    checksum: bytes
    keys: list[str]


def exists(tx: WriteTransaction, sql: RetentionStatements, rollout_id: str, *, ledger_only: bool) -> bool:
    """Whether the capture key has anything a retire or delete acts on (in that scope)."""
    if ledger_only:
        row = tx.run(sql.any_ledger, {"rollout_id": rollout_id, "ledger": _LEDGER_PATTERN}).fetchone()
    else:
        row = tx.run(sql.any_event, {"rollout_id": rollout_id, "retention": _RETENTION_PATTERN}).fetchone()
    return row is not None and row[0] is not None


def retire(
    tx: WriteTransaction, sql: RetentionStatements, keys: Sequence[str], *, ledger_only: bool = False
) -> RolloutRemoval:
    """Fence every key (a fence on a key not yet written guards its first late write too);
    ``removed`` names the keys that had something, ``absent`` the others.  Retiring a
    retired key writes nothing."""
    removed: list[str] = []
    absent: list[str] = []
    for key in keys:
        state = tx.rollout(key)
        (removed if exists(tx, sql, key, ledger_only=ledger_only) else absent).append(key)
        if state is None or not state.fenced:
            tx.append(NewEvent(EventKind.ROLLOUT_RETIRED, key, ROLLOUT_STREAM, FenceBody()))
    return RolloutRemoval(removed=removed, absent=absent)


def forget(tx: WriteTransaction, keys: Sequence[str]) -> RolloutRemoval:
    """Remove the fences; ``absent`` names keys that had none (nothing written for them)."""
    removed, absent = [], []
    for key in keys:
        state = tx.rollout(key)
        if state is not None and state.fenced:
            tx.append(NewEvent(EventKind.ROLLOUT_FORGOTTEN, key, ROLLOUT_STREAM, FenceBody()))
            removed.append(key)
        else:
            absent.append(key)
    return RolloutRemoval(removed=removed, absent=absent)


def delete(
    tx: WriteTransaction, sql: RetentionStatements, keys: Sequence[str], *, ledger_only: bool = False
) -> RolloutRemoval:
    """Remove each key's events (or only its ledger rows), its projection rows and its fence,
    leaving a tombstone.  A key with nothing to remove and no fence is ``absent``."""
    removed, absent = [], []
    for key in keys:
        gone = _removable(tx, sql, key, ledger_only)
        state = tx.rollout(key)
        if not gone.seqs and (state is None or not state.fenced):
            absent.append(key)
            continue
        body = TombstoneBody(
            first_seq=gone.seqs[0] if gone.seqs else 0,
            last_seq=gone.seqs[-1] if gone.seqs else 0,
            events=len(gone.seqs),
            records=gone.records,
            stored_bytes=gone.stored_bytes,
            checksum=gone.checksum,
            ledger_only=ledger_only,
        )
        tombstone = tx.append(NewEvent(EventKind.ROLLOUT_DELETED, key, ROLLOUT_STREAM, body))
        if ledger_only:
            tx.run(sql.delete_ledger, {"rollout_id": key, "before": tombstone, "ledger": _LEDGER_PATTERN})
        else:
            tx.run(sql.delete_events, {"rollout_id": key, "before": tombstone, "retention": _RETENTION_PATTERN})
            for staging_key in gone.keys:
                tx.run(sql.delete_key, {"staging_key": staging_key, "rollout_id": key})
            tx.run(sql.delete_calls, {"rollout_id": key})
            for statement in sql.delete_token_tables:
                tx.run(statement, {"rollout_id": key})
        removed.append(key)
    return RolloutRemoval(removed=removed, absent=absent)


def _removable(tx: WriteTransaction, sql: RetentionStatements, key: str, ledger_only: bool) -> _Removed:
    if ledger_only:
        rows = tx.run(sql.removable_ledger, {"rollout_id": key, "ledger": _LEDGER_PATTERN}).fetchall()
    else:
        rows = tx.run(sql.removable, {"rollout_id": key, "retention": _RETENTION_PATTERN}).fetchall()
    hasher = xxhash.xxh3_128(_TOMBSTONE_DOMAIN)
    seqs, keys, records, stored = [], [], 0, 0
    for seq, kind, staging_key, checksum, size in rows:
        seqs.append(int(seq))
        hasher.update(int(seq).to_bytes(8, "big") + bytes(checksum))
        stored += int(size or 0)
        if kind in _RECORD_KIND_VALUES:
            records += 1
            keys.append(staging_key)
    return _Removed(seqs, records, stored, hasher.digest(), sorted(set(keys)))


_RECORD_KIND_VALUES = frozenset(kind.value for kind in RECORD_KINDS)
