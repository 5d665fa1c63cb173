"""The checks a staged event passes inside the write transaction.

Shared by ``Store`` (staging, withdrawing keys) and log shipping (events arriving from another
store), so both apply the same rules, fences included.
"""

from __future__ import annotations

from store.append.new_event import NewEvent
from store.append.transaction import WriteTransaction
from store.errors import InvalidRecordError
from store.wire.records import StageResult


def stage_event(tx: WriteTransaction, event: NewEvent, digest: str) -> StageResult:
    """Stage a record event under its key, or say why not (an identical re-stage writes nothing)."""
    assert event.staging_key is not None
    if tx.guess_new_stream(event):  # PostgreSQL, a lone stage: written if new, else run again
        return StageResult(ok=True, staging_key=event.staging_key)
    refusal = stage_refusal(tx, event, digest)
    if refusal is not None:
        return StageResult(ok=False, error=refusal)
    return StageResult(ok=True, staging_key=event.staging_key)


def stage_refusal(tx: WriteTransaction, event: NewEvent, digest: str) -> str | None:
    """``stage_event`` without its result (a ship's hundreds of records a batch): None once the
    record is staged (or was, identically), else why it was refused."""
    assert event.staging_key is not None
    # One read: even an identical re-stage of a retired capture key is refused here.
    lookup = tx.stage_lookup(event.rollout_id, event.model_call_id, event.staging_key)
    existing = lookup.key
    if existing is not None:
        same_call = (existing.rollout_id, existing.model_call_id) == (event.rollout_id, event.model_call_id)
        if same_call and existing.digest == digest:
            return None
        return (
            f"staging key {event.staging_key!r} already holds a different record "
            f"({existing.rollout_id}/{existing.model_call_id}, digest {existing.digest[:16]}...)"
        )
    tx.append(event, lookup)
    return None


def owned_key(tx: WriteTransaction, key: str, rollout_id: str, model_call_id: str) -> bool:
    """Whether ``key`` is live; a live key that holds another call's record is refused."""
    state = tx.key(key)
    if state is not None and (state.rollout_id, state.model_call_id) != (rollout_id, model_call_id):
        raise InvalidRecordError(
            f"{key!r} holds a record of {state.rollout_id}/{state.model_call_id}; "
            f"{rollout_id}/{model_call_id} cannot withdraw it"
        )
    return state is not None
