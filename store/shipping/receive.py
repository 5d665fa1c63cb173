"""The target side of a ship: one batch of source events in one write transaction.

Each event goes through the checks staging runs in the write transaction (``stage_event`` for
records, ``owned_key`` for withdrawn keys, the receipt lookup for cut receipts), then
``WriteTransaction.append``, which folds it into the projections as if staged here.  A
check added to those paths (retention's fences) applies to shipped events too.  The
resume point and the events' identities are written in the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.append import token_rules
from store.append.new_event import NewEvent
from store.append.staging_rules import owned_key, stage_refusal
from store.append.statements import copy_insert, receipt_lookup_statement, unnest_insert
from store.append.transaction import COPY_MIN_ROWS, WriteTransaction
from store.errors import EntryConflictError, RolloutDroppedError, RolloutFrozenError, StoreError
from store.log import schema
from store.log.engine import Statement
from store.log.events import (
    RECORD_KINDS,
    WORKER_KINDS,
    CutReceiptBody,
    EventKind,
    KeysClearedBody,
    TombstoneBody,
    WorkerBody,
    decode_body,
)
from store.projections.fold import ROLLOUT_KINDS
from store.retention import removal
from store.retention.removal import RetentionStatements
from store.retention.retain import RETENTION_REASON
from store.shipping.identity import EventOrigin
from store.shipping.source import Shippable, SourceEvent, Unshippable, Unverified


class ResumePointMoved(Exception):
    """A ship started from the shipper's own resume point (``ship_log(start=)``) found the target's
    elsewhere: lower (the target lacks events the shipper thought it held: restored, recreated,
    a lagging standby) or higher (another shipper of this store id moved it: a forked worker's,
    or another store with the same id).  The batch is rolled back; a ship from the target's own
    resume point, checked against this store's log first, goes on from there."""

    def __init__(self, expected: int, found: int | None) -> None:
        super().__init__(f"the target's resume point is {found}, not {expected}")
        self.expected = expected
        self.found = found


class LogDiverged(Exception):
    """The target's resume point for this source is past the source's last event, or the source's
    event there is not the one the target was sent (its checksum differs): the source lost
    events it had shipped (a power loss, a restored backup), or another store with the same id
    (a copy of one store file) ships into the target.  Nothing is shipped: its events would
    reuse seqs the target skips, or mix a second history into the first."""


class Refused(Exception):
    """The target refused source event ``source_seq`` by raising: the batch is rolled back."""

    def __init__(self, source_seq: int, error: StoreError) -> None:
        super().__init__(str(error))
        self.source_seq = source_seq
        self.error = error


@dataclass
class Received:
    """What one batch did in the target."""

    appended: int = 0
    present: int = 0
    last_seq: int | None = None  # the source's resume point after the batch (None: unchanged)
    last_checksum: bytes | None = None  # the source's checksum of its event at last_seq
    # Every source event up to here is in the target after the batch: its resume point, which
    # another ship of the same source (a forked worker's) may have moved past this batch.
    shipped_through: int | None = None
    conflict: tuple[int, str] | None = None  # (source seq, reason): stopped there
    unshippable: Unshippable | None = None  # an unverified item that failed verification: stopped there
    events: list[dict[str, Any]] = field(default_factory=list)


class ShipStatements:
    """The bookkeeping statements, compiled once for the target's dialect."""

    def __init__(self, engine: Engine) -> None:
        sources, shipped = schema.ship_sources, schema.shipped_events
        self.resume_point = Statement(
            sa.select(sources.c.last_seq, sources.c.last_checksum).where(
                sources.c.source_store_id == sa.bindparam("source_store_id")
            ),
            engine,
        )
        self.insert_source = Statement(
            sa.insert(sources).values(
                source_store_id=sa.bindparam("source_store_id"),
                last_seq=sa.bindparam("last_seq"),
                last_checksum=sa.bindparam("last_checksum"),
            ),
            engine,
        )
        self.update_source = Statement(
            sa.update(sources)
            .where(sources.c.source_store_id == sa.bindparam("b_source_store_id"))
            .values(last_seq=sa.bindparam("last_seq"), last_checksum=sa.bindparam("last_checksum")),
            engine,
        )
        self.shipped_in = Statement(
            sa.select(shipped.c.origin_seq).where(
                shipped.c.origin_store_id == sa.bindparam("origin_store_id"),
                shipped.c.origin_seq >= sa.bindparam("low"),
                shipped.c.origin_seq <= sa.bindparam("high"),
            ),
            engine,
        )
        events, receipts = schema.events, schema.cut_receipts
        self.receipt_body = Statement(
            sa.select(events.c.body)
            .select_from(receipts.join(events, events.c.seq == receipts.c.event_seq))
            .where(
                receipts.c.checkpoint_id == sa.bindparam("checkpoint_id"),
                receipts.c.inventory_digest == sa.bindparam("inventory_digest"),
            ),
            engine,
        )
        self.receipt_lookup = receipt_lookup_statement(engine)
        self.target_seq = Statement(
            sa.select(shipped.c.event_seq).where(
                shipped.c.origin_store_id == sa.bindparam("origin_store_id"),
                shipped.c.origin_seq == sa.bindparam("origin_seq"),
            ),
            engine,
        )
        self.retention = RetentionStatements(engine)
        self.insert_shipped = Statement(sa.insert(shipped).values({c: sa.bindparam(c.name) for c in shipped.c}), engine)
        postgres = engine.dialect.name == "postgresql"
        self.insert_shipped_many = unnest_insert(shipped, engine) if postgres else None
        self.copy_shipped = copy_insert(shipped, engine) if postgres else None


@dataclass(frozen=True)
class ResumePoint:
    """Where the target's copy of a source ends: its last seq, and the source's checksum of its
    event there (None: written before revision 0012, or nothing shipped)."""

    seq: int
    checksum: bytes | None


NOTHING_SHIPPED = ResumePoint(0, None)


def resume_point(tx: WriteTransaction, statements: ShipStatements, source_store_id: str) -> ResumePoint:
    row = tx.run(statements.resume_point, {"source_store_id": source_store_id}).fetchone()
    return NOTHING_SHIPPED if row is None else ResumePoint(int(row[0]), _checksum(row[1]))


def _checksum(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def receive(
    tx: WriteTransaction,
    statements: ShipStatements,
    source_store_id: str,
    target_store_id: str,
    items: list[Shippable],
    resume_at: int | None = None,
    ours: Callable[[int, bytes | None], bool] | None = None,
) -> Received:
    """Apply ``items`` (in source order) in the target's write transaction; a batch of many goes
    out as COPY on PostgreSQL (``WriteTransaction.bulk``), a small one (a cut's receipt) as
    statements sent with the COMMIT (a COPY waits for the server twice).

    ``resume_at``: where the shipper's last batch left the target's resume point.  A lower one
    raises ``ResumePointMoved`` (the target lost events); a higher one (another shipper of
    this store id went ahead: a forked worker's, another process on the same file) is checked
    with ``ours(seq, checksum)``, whether this source's event at that seq is the one the target
    was sent: ``LogDiverged`` if not, else the events up to it are skipped, as they are without
    ``resume_at`` (the ship checked the resume point against its log when it read it).
    An ``Unverified`` item is verified just before its turn: the batch stops at the first that
    fails (``Received.unshippable``), the ones before it commit."""
    if len(items) < COPY_MIN_ROWS:
        return _receive(tx, statements, source_store_id, target_store_id, items, resume_at, ours)
    with tx.bulk():
        return _receive(tx, statements, source_store_id, target_store_id, items, resume_at, ours)


def _receive(
    tx: WriteTransaction,
    statements: ShipStatements,
    source_store_id: str,
    target_store_id: str,
    items: list[Shippable],
    resume_at: int | None,
    ours: Callable[[int, bytes | None], bool] | None,
) -> Received:
    received = Received()
    # One round trip (PostgreSQL) for every read the batch makes before its first append: the
    # resume point, which identities are here already, the receipts' lookups, the records'
    # stage lookups and the events' seqs.  What is read for an event the resume point or a
    # shipped identity then skips is not used.
    here, by_origin = _own_events(target_store_id, items)
    reads: list[tuple[Statement, dict[str, Any]]] = [(statements.resume_point, {"source_store_id": source_store_id})]
    for origin_id, seqs in by_origin.items():
        reads.append((statements.shipped_in, {"origin_store_id": origin_id, "low": min(seqs), "high": max(seqs)}))
    receipts = list(dict.fromkeys(inventory for item in items if (inventory := _receipt_inventory(item)) is not None))
    reads.extend(
        (
            statements.receipt_lookup,
            {"checkpoint_id": checkpoint, "inventory_digest": digest, "rollout_id": rollout, "model_call_id": call},
        )
        for checkpoint, digest, rollout, call in receipts
    )
    # The first half of the unverified items is verified while the server runs those reads (the
    # rest as its turn comes, while the events before it stream to the server).
    checked: dict[int, SourceEvent | Unshippable] = {}

    def verify_ahead() -> None:
        for ahead in items[: len(items) // 2]:
            if isinstance(ahead, Unverified):
                result = checked[ahead.source_seq] = ahead.verify()
                if isinstance(result, Unshippable):
                    return

    found = _read_ahead(tx, items, reads, verify_ahead)
    known = None if not found[0] else int(found[0][0][0])
    if resume_at is not None and (known or 0) != resume_at:
        if known is None or known < resume_at or ours is None:
            raise ResumePointMoved(resume_at, known)
        if not ours(known, _checksum(found[0][0][1])):
            raise LogDiverged(
                f"the target's resume point for store {source_store_id} moved to {known}, past this "
                "shipper's, at an event that is not this store's"
            )
    for origin_id, rows in zip(by_origin, found[1 : 1 + len(by_origin)], strict=True):
        here.update((origin_id, int(row[0])) for row in rows)
    # Each receipt's lookup (whether one of its inventory stands, its stream's fence and last
    # version), by inventory; dropped once anything since could have changed it.
    receipt_rows = {
        inventory[:2]: rows[0] for inventory, rows in zip(receipts, found[1 + len(by_origin) :], strict=True)
    }
    for shippable in items:
        if isinstance(shippable, Unverified):
            verified = checked.pop(shippable.source_seq, None) or shippable.verify()
            if isinstance(verified, Unshippable):
                received.unshippable = verified
                break
            item = verified
        else:
            item = shippable
        if known is not None and item.source_seq <= known:
            continue  # another ship of the same source committed it first
        origin = (item.origin.store_id, item.origin.seq)
        if origin in here:
            received.present += 1
        else:
            try:
                outcome = _apply(tx, statements, target_store_id, item, received.events, receipt_rows)
            except StoreError as exc:
                raise Refused(item.source_seq, exc) from exc
            if receipt_rows:
                _forget_stale(receipt_rows, item)
            if isinstance(outcome, str):
                received.conflict = (item.source_seq, outcome)
                break
            if outcome is None:
                received.present += 1
            else:
                received.appended += 1
            received.events.append({"origin_store_id": origin[0], "origin_seq": origin[1], "event_seq": outcome})
            here.add(origin)
        received.last_seq = item.source_seq
        received.last_checksum = None if item.event.stored_checksum is None else item.event.stored_checksum[1]
    if received.events:
        tx.run_many(
            statements.insert_shipped,
            received.events,
            unnest=statements.insert_shipped_many,
            copy=statements.copy_shipped,
        )
    if received.last_seq is not None:
        values: dict[str, Any] = {"last_seq": received.last_seq, "last_checksum": received.last_checksum}
        if known is None:
            tx.run(statements.insert_source, {"source_store_id": source_store_id, **values})
        else:
            tx.run(statements.update_source, {"b_source_store_id": source_store_id, **values})
    marks = [seq for seq in (known, received.last_seq) if seq is not None]
    received.shipped_through = max(marks) if marks else None
    return received


def _forget_stale(receipt_rows: dict[tuple[str, str], Any], item: SourceEvent) -> None:
    """Drop the receipt lookups an applied event could have made stale: every one after an event
    of a rollout's own (a fence, a tombstone: the receipts stream's fence) or a worker's (it ran
    statements of its own), those of its checkpoint after a receipt (its stream's version)."""
    event = item.event
    if event.kind in ROLLOUT_KINDS or event.kind in WORKER_KINDS or item.joined is not None:
        receipt_rows.clear()
    elif event.kind is EventKind.CUT_RECEIPT:
        for inventory in [inventory for inventory in receipt_rows if inventory[0] == event.model_call_id]:
            del receipt_rows[inventory]


def _receipt_inventory(item: Shippable) -> tuple[str, str, str, str] | None:
    if isinstance(item, Unverified):  # its body as read (verified later): for the lookup only
        if item.row.get("kind") != EventKind.CUT_RECEIPT.value or not isinstance(item.row.get("body"), bytes):
            return None
        try:
            body = decode_body(EventKind.CUT_RECEIPT, item.row["body"])
        except (TypeError, ValueError, msgspec.DecodeError):
            return None  # it fails verification: the batch stops there
    elif item.event.kind is EventKind.CUT_RECEIPT:
        body = item.event.body
    else:
        return None
    if not isinstance(body, CutReceiptBody):
        return None
    _, rollout_id, model_call_id, _ = item_names(item)
    if not (isinstance(rollout_id, str) and isinstance(model_call_id, str)):
        return None  # it fails verification: the batch stops there
    return body.checkpoint_id, body.inventory_digest, rollout_id, model_call_id


def item_names(item: Shippable) -> tuple[EventKind | None, Any, Any, Any]:
    """An item's kind, rollout, call and staging key (an unverified one's as read)."""
    if isinstance(item, Unverified):
        row = item.row
        kind = _KINDS.get(row.get("kind"))  # type: ignore[arg-type]
        return kind, row.get("rollout_id"), row.get("model_call_id"), row.get("staging_key")
    event = item.event
    return event.kind, event.rollout_id, event.model_call_id, event.staging_key


_KINDS = {kind.value: kind for kind in EventKind}


def _read_ahead(
    tx: WriteTransaction,
    items: list[Shippable],
    reads: list[tuple[Statement, dict[str, Any]]],
    meanwhile: Callable[[], object],
) -> list[list[Any]]:
    """``reads``'s rows, read in the round trip of the batch's lookups and seqs (one for all).
    A lookup is only a hint: one an append does not match (an unverified item's columns that
    fail verification) is never used."""
    streams: list[tuple[str, str, str | None]] = []
    for item in items:
        kind, rollout_id, model_call_id, staging_key = item_names(item)
        if not (isinstance(rollout_id, str) and isinstance(model_call_id, str)):
            continue
        if kind in RECORD_KINDS and isinstance(staging_key, str):
            streams.append((rollout_id, model_call_id, staging_key))
    return tx.read_ahead(streams, len(items), reads, meanwhile)


def _own_events(target_store_id: str, items: list[Shippable]) -> tuple[set[tuple[str, int]], dict[str, list[int]]]:
    """The target's own events among ``items`` (shipped back: here already), and the origin
    seqs of the others, by origin store (``shipped_in`` finds which of them are here)."""
    here: set[tuple[str, int]] = set()
    by_origin: dict[str, list[int]] = {}
    for item in items:
        if item.origin.store_id == target_store_id:
            here.add((target_store_id, item.origin.seq))  # an event of the target's own, shipped back
        else:
            by_origin.setdefault(item.origin.store_id, []).append(item.origin.seq)
    return here, by_origin


def _apply(
    tx: WriteTransaction,
    statements: ShipStatements,
    target_store_id: str,
    item: SourceEvent,
    batch: list[dict[str, Any]],
    receipt_rows: dict[tuple[str, str], Any] | None = None,
) -> int | str | None:
    """Append one event as staging would: its seq, None if nothing was needed, or a conflict's reason.

    ``receipt_seqs``: the receipts' seqs here read ahead, by inventory (an entry is used once:
    a receipt this batch appends makes it stale)."""
    new = item.event
    before = tx.appended
    if new.kind is EventKind.ROLLOUT_DELETED:
        # The source removed the capture key: remove it here too, under a tombstone of the
        # target's own (it names the target's events), as Store.delete would.
        body = new.body
        assert isinstance(body, TombstoneBody)
        removal.delete(tx, statements.retention, [new.rollout_id], ledger_only=body.ledger_only)
        return tx.last_seq if tx.appended > before else None
    if item.joined is not None and isinstance(new.body, WorkerBody):
        # A worker's leave names its join by seq: the join's seq in this store.
        joined = _target_seq(tx, statements, target_store_id, item.joined, batch)
        body = msgspec.structs.replace(new.body, joined_seq=joined)
        new = NewEvent(
            new.kind, new.rollout_id, new.model_call_id, body, recorded_at=new.recorded_at, written_by=new.written_by
        )
    if new.kind in RECORD_KINDS:
        assert item.digest is not None
        refusal = stage_refusal(tx, new, item.digest)
        if refusal is not None:
            return refusal
    elif new.kind is EventKind.KEYS_CLEARED:
        body = new.body
        assert isinstance(body, KeysClearedBody)
        live = [key for key in body.staging_keys if owned_key(tx, key, new.rollout_id, new.model_call_id)]
        if live:
            cleared = KeysClearedBody(staging_keys=live, reason=body.reason)
            # Retention's own cleanup passes a fence at its origin (Store.retain): here too.
            past_fence = body.reason == RETENTION_REASON
            tx.append(
                NewEvent(
                    new.kind,
                    new.rollout_id,
                    new.model_call_id,
                    cleared,
                    recorded_at=new.recorded_at,
                    past_fence=past_fence,
                    written_by=new.written_by,
                )
            )
    elif new.kind is EventKind.CUT_RECEIPT:
        body = new.body
        assert isinstance(body, CutReceiptBody)
        row = None if receipt_rows is None else receipt_rows.pop((body.checkpoint_id, body.inventory_digest), None)
        if row is not None:  # read ahead with the batch's other reads
            seq, lookup = tx.receipt_looked_up(new, row)
        else:
            seq, lookup = tx.receipt_lookup(new, body.checkpoint_id, body.inventory_digest)
        if seq is None:
            tx.append(new, lookup)
        elif _receipt_here(tx, statements, body) != body.receipt:
            return (
                f"checkpoint {body.checkpoint_id!r} already has another receipt for inventory "
                f"{body.inventory_digest[:16]}... in the target"
            )
    elif new.kind is EventKind.TOKENS_PUT:
        # The transport's rules, as its put applies them: an identical entry here writes nothing.
        try:
            token_rules.put_entry(tx, new)
        except (EntryConflictError, RolloutFrozenError, RolloutDroppedError) as refused:
            return str(refused)
    else:  # admissions and failures are appended as they come, as the capture appends them
        tx.append(new)
    return tx.last_seq if tx.appended > before else None


def _target_seq(
    tx: WriteTransaction,
    statements: ShipStatements,
    target_store_id: str,
    origin: EventOrigin,
    batch: list[dict[str, Any]],
) -> int | None:
    """The seq here of the event with identity ``origin`` (None: it never arrived).

    ``batch`` holds the identities this batch appended so far (written when it commits).
    """
    if origin.store_id == target_store_id:
        return origin.seq
    for shipped in batch:
        if (shipped["origin_store_id"], shipped["origin_seq"]) == (origin.store_id, origin.seq):
            return int(shipped["event_seq"]) if shipped["event_seq"] is not None else None
    values = {"origin_store_id": origin.store_id, "origin_seq": origin.seq}
    row = tx.run(statements.target_seq, values).fetchone()
    return None if row is None else int(row[0])


def _receipt_here(tx: WriteTransaction, statements: ShipStatements, body: CutReceiptBody) -> bytes | None:
    """The receipt bytes the target returned for this inventory (None if its event is unreadable)."""
    values = {"checkpoint_id": body.checkpoint_id, "inventory_digest": body.inventory_digest}
    row = tx.run(statements.receipt_body, values).fetchone()
    try:
        stored = decode_body(EventKind.CUT_RECEIPT, bytes(row[0]))
    except (TypeError, ValueError, msgspec.DecodeError):
        return None
    return bytes(stored.receipt)
