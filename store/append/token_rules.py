"""The rules a complete-record transport write passes inside the write transaction.

Shared by ``store.transport`` (Gym's sink) and log shipping (a ``tokens_put`` arriving from
another store), so both apply them, fences included.
"""

from __future__ import annotations

from store.append.new_event import NewEvent
from store.append.transaction import WriteTransaction
from store.errors import EntryConflictError, RolloutDroppedError, RolloutFencedError, RolloutFrozenError
from store.log.events import TokenPutBody
from store.projections.tokens import TokenRolloutState


def put_entry(tx: WriteTransaction, event: NewEvent) -> bool:
    """Append a ``tokens_put`` event: True once written, False when the identical entry (same
    payload digest) is there already.  A different entry for the call raises
    ``EntryConflictError``, a dropped rollout ``RolloutDroppedError``, a frozen one
    ``RolloutFrozenError`` (the fence is strict: checked here, under the write lock), a retired
    capture key ``RolloutFencedError``."""
    body = event.body
    assert isinstance(body, TokenPutBody)
    rollout_id, call_id = event.rollout_id, body.model_call_id
    state, digest = lookup(tx, rollout_id, call_id)
    refuse_dropped(rollout_id, state)
    if digest is not None:
        if digest == body.payload_digest:
            return False
        raise EntryConflictError(
            f"rollout {rollout_id!r} already holds a different entry for call {call_id!r}; nothing was written"
        )
    refuse_frozen(rollout_id, state, "put")
    tx.append(event)
    return True


def lookup(tx: WriteTransaction, rollout_id: str, model_call_id: str) -> tuple[TokenRolloutState | None, str | None]:
    """The rollout's transport row and the payload digest of the call's entry (one read); a
    retired capture key is refused here, before anything is decided."""
    state, (fenced, fence_seq), digest = tx.token_lookup(rollout_id, model_call_id)
    if fenced:
        raise RolloutFencedError(rollout_id, fence_seq)
    return state, digest


def refuse_dropped(rollout_id: str, state: TokenRolloutState | None) -> None:
    if state is not None and state.dropped:
        raise RolloutDroppedError(
            f"rollout {rollout_id!r} was dropped (its snapshot {state.snapshot_id} retired); nothing was written"
        )


def refuse_frozen(rollout_id: str, state: TokenRolloutState | None, what: str) -> None:
    if state is not None and state.frozen:
        raise RolloutFrozenError(
            f"rollout {rollout_id!r} is frozen (snapshot {state.snapshot_id}, version {state.version}); "
            f"{what}() after the freeze is refused and nothing was written"
        )
