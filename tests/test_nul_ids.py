"""An id or key holding a NUL character: one refusal, the same on SQLite and PostgreSQL, before
anything is written.

PostgreSQL cannot store a NUL in a text column: such an id used to fail there with the driver's
text (``DataError: PostgreSQL text fields cannot contain NUL (0x00) bytes``, as a bare
``StorageError``) while SQLite staged, retired and found it.  Now every entry point that takes
an id or key refuses it with an ``InvalidRecordError`` naming the argument and the position,
on both backends.  A free text (a failure's reason, kept in its event's body) may hold one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from capture_helpers import raw_event_count
from factories import make_record
from rollouts import Rollout, manifest_row

from store import CaptureLedgerCommit, InvalidRecordError, StageEntry, Store
from store.log.events import EventKind

NUL = "r\x00x"


def _child_with_parent(parent_call_id: str) -> Any:
    root = make_record(rollout_id="p0", model_call_id="c0")
    return make_record(
        rollout_id="p0",
        model_call_id="c1",
        parent_call_id=parent_call_id,
        parent_chain_hash=root.chain_hash,
        prefix=[10, 11, 12, 20, 21],
    )


def _ledger_commit(store: Store) -> CaptureLedgerCommit:
    staged = Rollout(NUL).call("c0", prompt=[1], generated=[50, 51])
    return CaptureLedgerCommit(
        rollout_id=NUL,
        record=manifest_row(staged, admitted_at=1.0),
        staging_chain=(staged.staging_key,),
        request_items=[{"role": "user", "content": "hi"}],
        response_items=[{"role": "assistant", "content": "hello"}],
    )


ENTRY_POINTS: dict[str, Callable[[Store], object]] = {
    "stage rollout_id": lambda s: s.stage(make_record(rollout_id=NUL)),
    "stage model_call_id": lambda s: s.stage(make_record(model_call_id=NUL)),
    "stage parent_call_id": lambda s: s.stage(_child_with_parent("c\x000")),
    "stage staging_key": lambda s: s.stage(
        make_record(rollout_id="k"), staging_key="generation-cut/ck\x00/k/call-1/0", kind=EventKind.PREFIX_STAGED
    ),
    "stage_all": lambda s: s.stage_all([StageEntry(record=make_record(rollout_id=NUL))]),
    "stage_all acknowledged": lambda s: s.stage_all([StageEntry(record=make_record())], acknowledged=[NUL]),
    "fetch": lambda s: s.fetch([NUL]),
    "fetch_chunks": lambda s: s.fetch_chunks([NUL]),
    "call": lambda s: s.call(NUL, "c"),
    "call model_call_id": lambda s: s.call("r", NUL),
    "calls": lambda s: s.calls(NUL),
    "staged_keys": lambda s: s.staged_keys(NUL),
    "version_spans": lambda s: s.version_spans(NUL, "c"),
    "version_tokens": lambda s: s.version_tokens(NUL),
    "rollout_versions": lambda s: s.rollout_versions(NUL),
    "lineage": lambda s: s.lineage(NUL),
    "linearize": lambda s: s.linearize(NUL),
    "record_admission": lambda s: s.record_admission(NUL, "c", None),  # type: ignore[arg-type]
    "record_failure": lambda s: s.record_failure(NUL, "c", "why"),
    "clear_keys": lambda s: s.clear_keys("r", "c", [NUL], "why"),
    "completion": lambda s: s.completion(NUL, "c"),
    "cut_receipt": lambda s: s.cut_receipt(NUL, "d"),
    "cut_receipts checkpoint_id": lambda s: s.cut_receipts(checkpoint_id=NUL),
    "cut_receipts rollout_id": lambda s: s.cut_receipts(rollout_id=NUL),
    "cut_domain": lambda s: s.cut_domain(NUL, "d"),
    "latest_cut": lambda s: s.latest_cut(NUL, "c"),
    "retire": lambda s: s.retire([NUL]),
    "forget": lambda s: s.forget([NUL]),
    "delete": lambda s: s.delete([NUL]),
    "retain": lambda s: s.retain([NUL]),
    "retain capture_keys": lambda s: s.retain(["k"], capture_keys=[NUL]),
    "ledger record": lambda s: s.ledger().record(_ledger_commit(s)),
    "ledger record_failure": lambda s: s.ledger().record_failure(NUL, "c", "why"),
    "ledger retire": lambda s: s.ledger().retire([NUL]),
    "ledger delete": lambda s: s.ledger().delete([NUL]),
    "ledger manifest": lambda s: s.ledger().manifest(NUL),
    "ledger admit": lambda s: s.ledger().admit(NUL, "c", [{"role": "user", "content": "hi"}]),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_id_holding_a_nul_is_refused_alike_before_anything_is_written(store: Store, entry: str) -> None:
    assert store.stage(make_record()).ok
    before = raw_event_count(store)
    with pytest.raises(InvalidRecordError, match="NUL character"):
        ENTRY_POINTS[entry](store)
    assert raw_event_count(store) == before, "a refusal must not write to the log"
    assert store.replay().ok  # the projections match the log: nothing half-written either


def test_a_reason_may_hold_a_nul(store: Store) -> None:
    """A failure's reason is free text, kept in its event's body (bytes on both backends)."""
    store.record_failure("r0", "c0", "decoder said \x00")
    store.ledger().record_failure("r0", "c0", "poison \x00 row")
    assert store.replay().ok
