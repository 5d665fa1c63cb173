"""``Store.linearize``: a rollout's receipt and snapshots rebuilt from the log, then 6.1/6.2.

The manifest (the store holds no capture ledger yet) is built from the calls projection and
the terminal events: one ``CallRecord`` per call that completed, from the newest attempt that
completed it, with its admission time from its admission event (for terminal selection, 6.3).
Lineage fields come from the projection and commitments from the terminal record, so a
projection that disagrees with the record it folded fails as ``wrong_<field>``.  A continued
call's terminal record holds the whole delta (carry, restored tokens, new tokens), so it
linearizes exactly like the same call decoded without interruption.
"""

from __future__ import annotations

from dataclasses import dataclass

from store.errors import CorruptRecordError, InvalidRecordError, RebuildError, ReceiptVerificationError
from store.lineage.family import FamilyCall, family_calls, resolve_rollout
from store.lineage.tree import Admission, admissions
from store.log.events import Span
from store.queries.reads import Reader
from store.rebuild.terminal import select_terminal_call
from store.rebuild.verify import LinearizedRollout, verify_and_linearize_all
from store.wire.records import CallRecord, RolloutReceipt, StagedCallSnapshot, default_staging_key


@dataclass(frozen=True)
class RolloutRecords:
    """What a rollout's linearization is rebuilt from, and the projection's spans of each call."""

    receipt: RolloutReceipt
    snapshots: list[StagedCallSnapshot]
    spans: dict[str, tuple[Span, ...]]  # model call id -> delta positions per policy version


def _terminal_rows(calls: list[FamilyCall]) -> tuple[list[FamilyCall], list[str]]:
    """The newest completed row of each call (in commit order), and calls whose newest row failed."""
    completed: dict[str, FamilyCall] = {}
    newest: dict[str, FamilyCall] = {}
    for call in calls:  # oldest attempt first
        newest[call.state.model_call_id] = call
        if call.state.state == "completed":
            completed[call.state.model_call_id] = call
    failed = [call_id for call_id, call in newest.items() if call.state.state == "failed"]
    return sorted(completed.values(), key=lambda call: call.state.last_seq), failed


def _manifest_row(
    rollout_id: str, call: FamilyCall, snapshot: StagedCallSnapshot, admission: Admission | None
) -> CallRecord:
    state = call.state
    key = default_staging_key(call.capture_key, state.model_call_id)
    try:
        if state.cum_len is None or state.prev_len is None or state.chain_hash is None or state.cumulative_hash is None:
            raise InvalidRecordError("its lengths or hashes are missing")
        return CallRecord(
            schema_version=snapshot.schema_version,
            capture_key=None if call.capture_key == rollout_id else call.capture_key,
            model_call_id=state.model_call_id,
            parent_call_id=state.parent_call_id,
            prev_len=state.prev_len,
            delta_len=state.cum_len - state.prev_len,
            cum_len=state.cum_len,
            weight_version=snapshot.weight_version,
            digest=snapshot.digest,
            extras_digest=snapshot.extras_digest,
            staging_key=key,
            mode=state.mode,  # type: ignore[arg-type]  # CallRecord checks it is text or token_in
            chain_hash=state.chain_hash,
            cumulative_hash=state.cumulative_hash,
            response_id=key,  # the store never sees the served envelope id; the key is as unique
            admitted_at=None if admission is None else admission.admitted_at,
        )
    except InvalidRecordError as exc:
        raise CorruptRecordError(
            f"the calls row of {call.capture_key}/{state.model_call_id} makes no manifest row ({exc}); "
            "replay(repair=True) rebuilds it"
        ) from exc


def rollout_records(reader: Reader, rollout_id: str) -> RolloutRecords:
    """The rollout's receipt (terminal chosen by 6.3) and one snapshot per manifest row, from the log.

    ``capture_poisoned`` when a call's newest attempt failed capture; ``empty_manifest`` when no
    call completed; a 6.3 outcome (``ambiguous_terminal``, ...) as a ``RebuildError`` code when
    no terminal call can be selected.
    """
    with reader.pinned("reading a rollout"):  # one connection for the four reads below
        bare = resolve_rollout(reader, rollout_id)
        calls = family_calls(reader, bare)
        rows, failed = _terminal_rows(calls)
        if failed:
            raise ReceiptVerificationError("capture_poisoned", f"rollout {bare!r}: capture failed for calls {failed}")
        if not rows:
            raise ReceiptVerificationError("empty_manifest", f"rollout {bare!r} has no completed call")
        keys = [default_staging_key(call.capture_key, call.state.model_call_id) for call in rows]
        snapshots = [chunk.snapshot for chunk in reader.fetch_with_spans(keys, verify_digests=False, contiguous=True)]
        admitted = admissions(reader, bare, {call.capture_key for call in rows})
    manifest = [
        _manifest_row(bare, call, snapshot, admitted.get((call.capture_key, call.state.model_call_id)))
        for call, snapshot in zip(rows, snapshots, strict=True)
    ]
    selection = select_terminal_call(manifest)
    if selection.terminal_model_call_id is None:
        raise RebuildError(selection.reason, f"rollout {bare!r}: no terminal call can be selected")
    receipt = RolloutReceipt(
        schema_version=manifest[0].schema_version,
        rollout_id=bare,
        terminal_model_call_id=selection.terminal_model_call_id,
        manifest=manifest,
        terminal_selection="heuristic",
        terminal_attribution_reason=selection.reason,
    )
    return RolloutRecords(receipt, snapshots, {call.state.model_call_id: call.state.spans for call in rows})


def linearize_rollout(reader: Reader, rollout_id: str) -> LinearizedRollout:
    """Every publishable chain of the rollout, verified (digests re-hashed once, by the verifier)."""
    records = rollout_records(reader, rollout_id)
    return verify_and_linearize_all(records.receipt, records.snapshots)
