"""The replacement of a cut call, built from its acknowledgement and the store (wire-contract 5.6).

A worker continuing a cut needs the admission the cut call had (parent, prev_len, mode, the
parent's chain hash and tokens) under the next attempt's capture key, with the continuation
the acknowledgement names.  All of it is in the store: the cut's first chunk names the parent
and its length, and the parent's records give its chain hash and tokens, each link checked by
its chain hash.  ``RolloutTokenCapture.continue_cut`` admits what this builds.
"""

from __future__ import annotations

from store.errors import GenerationCutError, StoreClosedError, StoreError
from store.queries.reads import CallInfo
from store.store import Store
from store.wire.columns import TokenIds
from store.wire.cut_records import GenerationCutPrefixAck, capture_key
from store.wire.digest import compute_chain_hash
from store.wire.records import CaptureAdmission, StagedCallSnapshot

# A lineage deeper than this is refused rather than walked (a cycle in damaged projections).
_MAX_DEPTH = 100_000


def replacement_admission(store: Store, ack: GenerationCutPrefixAck, attempt: int | None) -> CaptureAdmission:
    """The admission of attempt ``attempt`` (default: the ack's attempt + 1) continuing ``ack``'s cut."""
    if not isinstance(ack, GenerationCutPrefixAck):
        raise GenerationCutError(f"continue_cut needs a GenerationCutPrefixAck, got {type(ack).__name__}")
    if ack.disposition != "durable_prefix":
        raise GenerationCutError(
            f"the cut of {ack.rollout_id}/{ack.model_call_id} is a durable_failure: nothing to continue, "
            "decode the call again",
            "no_cut",
        )
    attempt = ack.attempt_index + 1 if attempt is None else attempt
    if type(attempt) is not int or attempt <= ack.attempt_index:
        raise GenerationCutError(
            f"the replacement's attempt must be after the cut's attempt {ack.attempt_index}, got {attempt!r}",
            "own_attempt",
        )
    continuation = ack.continuation()
    try:
        first = store.fetch([continuation.staging_keys[0]])[0]
        parent_chain, prefix = _parent_of(store, ack.rollout_id, first)
    except StoreClosedError:
        raise
    except GenerationCutError:
        raise
    except StoreError as exc:
        raise GenerationCutError(f"cannot read the cut's lineage back from the store: {exc}", "unreadable") from exc
    if first.mode == "text":
        return CaptureAdmission(
            rollout_id=capture_key(ack.rollout_id, attempt),
            model_call_id=ack.model_call_id,
            mode="text",
            generation_cut=continuation,
        )
    return CaptureAdmission(
        rollout_id=capture_key(ack.rollout_id, attempt),
        model_call_id=ack.model_call_id,
        parent_call_id=first.parent_call_id,
        prev_len=first.prev_len,
        mode="token_in",
        required_prefix_token_ids=prefix,
        parent_chain_hash=parent_chain,
        generation_cut=continuation,
    )


def _parent_of(store: Store, rollout_id: str, record: StagedCallSnapshot) -> tuple[str | None, TokenIds]:
    """The chain hash ``record`` chained from and the tokens before it (root first)."""
    if record.parent_call_id is None:
        return None, TokenIds.coerce([])
    calls = _family_calls(store, rollout_id)
    parts: list[TokenIds] = []
    child = record
    parent_chain: str | None = None
    for _ in range(_MAX_DEPTH):
        if child.parent_call_id is None:
            break
        parent, snapshot = _chained_parent(store, calls, child)
        if parent_chain is None:
            parent_chain = parent.chain_hash
        parts.append(snapshot.columns.token_ids)
        child = snapshot
    else:
        raise GenerationCutError(f"the lineage of {record.rollout_id}/{record.model_call_id} does not end", "lineage")
    return parent_chain, TokenIds.concat(parts[::-1])


def _family_calls(store: Store, rollout_id: str) -> list[CallInfo]:
    """Every completed call of the rollout's attempts (a parent may be any attempt's)."""
    lineage = store.lineage(rollout_id)
    keys = [] if lineage is None else list(lineage.attempts)
    return [info for key in keys for info in store.calls(key) if info.state == "completed"]


def _chained_parent(
    store: Store, calls: list[CallInfo], child: StagedCallSnapshot
) -> tuple[CallInfo, StagedCallSnapshot]:
    """The completed call whose record ``child`` chains from: same id, its length, and its chain
    hash extended by ``child``'s tokens is ``child``'s chain hash (an attempt's copy of the
    same call is told apart by that hash)."""
    ids = child.columns.token_ids
    for info in calls:
        if (
            info.model_call_id == child.parent_call_id
            and info.cum_len == child.prev_len
            and info.chain_hash is not None
            and compute_chain_hash(info.chain_hash, ids) == child.chain_hash
        ):
            snapshot = store.fetch([f"{info.rollout_id}/{info.model_call_id}"])[0]
            return info, snapshot
    raise GenerationCutError(
        f"the parent {child.parent_call_id!r} that {child.rollout_id}/{child.model_call_id} chains from "
        "is not a completed call of the rollout in this store",
        "lineage",
    )
