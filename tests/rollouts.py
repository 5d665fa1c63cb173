"""Builders of real staged rollouts for the rebuild and terminal tests: records, manifests, receipts."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
from factories import make_record

from store import CallRecord, RolloutReceipt, StagedCallRecord

S = TypeVar("S", bound=msgspec.Struct)


def tampered(struct: S, **changes: Any) -> S:
    """A copy with fields replaced *without* validation: what a corrupted or forged value looks like."""
    forged = copy.copy(struct)
    for name, value in changes.items():
        msgspec.structs.force_setattr(forged, name, value)
    return forged


def manifest_row(
    record: StagedCallRecord,
    *,
    staging_key: str | None = None,
    admitted_at: float | None = None,
    capture_key: str | None = None,
    response_id: str | None = None,
    output_fingerprint: str | None = None,
    continuation_fingerprint: str | None = None,
    fingerprint_version: int = 0,
) -> CallRecord:
    """The ledger row Gym writes for a staged call (coords + mode + response id + admission time)."""
    return CallRecord(
        schema_version=record.schema_version,
        capture_key=capture_key,
        model_call_id=record.model_call_id,
        parent_call_id=record.parent_call_id,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        extras_digest=record.extras_digest,
        staging_key=staging_key or record.staging_key,
        mode=record.mode,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
        response_id=response_id or f"resp-{record.model_call_id}",
        admitted_at=admitted_at,
        output_fingerprint=output_fingerprint,
        continuation_fingerprint=continuation_fingerprint,
        fingerprint_version=fingerprint_version,
    )


def receipt_for(
    rows: Sequence[CallRecord], terminal: str, *, rollout_id: str = "rollout-1", **fields: Any
) -> RolloutReceipt:
    schema = rows[0].schema_version if rows else 2
    return RolloutReceipt(
        schema_version=schema,  # type: ignore[arg-type]
        rollout_id=rollout_id,
        terminal_model_call_id=terminal,
        manifest=list(rows),
        terminal_selection="declared",
        **fields,
    )


class Rollout:
    """Stages calls of one rollout with make_record, each child extending its parent's exact tokens."""

    def __init__(self, rollout_id: str = "rollout-1", schema_version: int = 2) -> None:
        self.rollout_id = rollout_id
        self.schema_version = schema_version
        self.records: list[StagedCallRecord] = []
        self.tokens: dict[str, list[int]] = {}
        self.by_id: dict[str, StagedCallRecord] = {}

    def call(
        self,
        call_id: str,
        *,
        parent: str | None = None,
        prompt: Sequence[int] = (1, 2),
        generated: Sequence[int] = (3,),
        weight_version: int = 7,
        extras: dict[str, Any] | None = None,
        capture_key: str | None = None,
    ) -> StagedCallRecord:
        prefix = self.tokens[parent] if parent is not None else []
        record = make_record(
            rollout_id=capture_key or self.rollout_id,
            model_call_id=call_id,
            prompt=prompt,
            generated=generated,
            parent_call_id=parent,
            parent_chain_hash=self.by_id[parent].chain_hash if parent is not None else None,
            prefix=prefix,
            weight_version=weight_version,
            extras=extras,
            schema_version=self.schema_version,
        )
        self.records.append(record)
        self.by_id[call_id] = record
        self.tokens[call_id] = [*prefix, *prompt, *generated]
        return record

    def rows(self, **per_call: dict[str, Any]) -> list[CallRecord]:
        return [manifest_row(record, **per_call.get(record.model_call_id, {})) for record in self.records]

    def receipt(self, terminal: str, **per_call: dict[str, Any]) -> RolloutReceipt:
        return receipt_for(self.rows(**per_call), terminal, rollout_id=self.rollout_id)


def branched() -> tuple[RolloutReceipt, list[StagedCallRecord]]:
    """root -> {sibling, main}; the receipt declares ``main`` terminal; snapshots in manifest order."""
    rollout = Rollout()
    rollout.call("root", prompt=[10, 11], generated=[12], weight_version=3)
    rollout.call("sibling", parent="root", prompt=[30], generated=[31, 32], weight_version=99)
    rollout.call("main", parent="root", prompt=[20], generated=[21], weight_version=4)
    return rollout.receipt("main"), list(rollout.records)
