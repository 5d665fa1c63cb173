"""Resolving a continuation from the log (wire-contract 5.6): the staged chunks a replacement
call continues, checked against the rules of ``store.wire.continuations`` and folded into the
cumulative prefix snapshot the call restores."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store.errors import GenerationCutError, StoreClosedError, StoreError, UnknownKeyError
from store.log.events import EventKind, Span
from store.projections.fold import generated_spans
from store.queries.reads import StoredChunk
from store.store import Store
from store.wire import continuations
from store.wire.columns import FloatColumn, TokenIds
from store.wire.digest import EMPTY_EXTRAS_DIGEST, compute_chain_hash, hash_token_columns, staging_digest_and_columns
from store.wire.records import (
    CaptureAdmission,
    GenerationCutContinuation,
    StagedCallBaseSnapshot,
    trusted_snapshot,
)

log = logging.getLogger("store.cuts")


@dataclass(frozen=True)
class ResolvedCut:
    snapshot: StagedCallBaseSnapshot
    spans: list[Span]


def resolve_continuation(
    store: Store,
    admission: CaptureAdmission,
    continuation: GenerationCutContinuation,
    prefix: TokenIds,
    current_version: int,
) -> ResolvedCut:
    """Fold the staged chunks named by the continuation into the cumulative prefix snapshot.

    Every refusal is a ``GenerationCutError`` whose ``code`` names the check (the rules the
    audit holds every admitted continuation to come from ``store.wire.continuations``).
    """
    refuse(continuations.own_attempt(admission.rollout_id, continuation.source_capture_key))
    keys = list(continuation.staging_keys)
    try:
        # Each chunk's own digest is not re-hashed: the digest of their concatenation is
        # checked against the continuation below, and checksums guard the stored bytes.
        fetched = store.fetch_chunks(keys)
    except StoreClosedError:
        raise
    except UnknownKeyError as exc:
        raise GenerationCutError(f"cannot resolve the generation cut: {exc}", "keys") from exc
    except StoreError as exc:  # damaged or unreadable: a refused continuation, so the worker regenerates
        raise GenerationCutError(f"cannot resolve the generation cut: {exc}", "unreadable") from exc
    if len(fetched) != len(keys) or not fetched:
        raise GenerationCutError(
            "cannot resolve the generation cut: the staged chunk count does not match its keys", "keys"
        )
    source = (continuation.source_capture_key, continuation.source_model_call_id)
    lineage = [source] if all(_owner(chunk) == source for chunk in fetched) else _lineage(store, source)
    first = fetched[0].snapshot
    first_ids = first.columns.token_ids
    refusals = continuations.chunk_problems(
        staging_keys=keys,
        generation_token_count=continuation.generation_token_count,
        chunks=[_facts(key, chunk) for key, chunk in zip(keys, fetched, strict=True)],
        owners=lineage,
        parent_call_id=admission.parent_call_id,
        prev_len=admission.prev_len,
        chains_from_parent=compute_chain_hash(admission.parent_chain_hash, first_ids) == first.chain_hash,
    )
    if refusals:
        log.warning("cut %s refused: %s", keys, "; ".join(refusal.message for refusal in refusals))
        refuse(refusals[0])
    check_chunk_identity(store, continuation, fetched, lineage)
    if hash_token_columns(prefix, first_ids) != first.cumulative_hash:
        raise GenerationCutError(
            f"the replacement's parent tokens ({len(prefix)} prefix_token_ids) are not the tokens the cut "
            f"was built on: the cumulative hash of prefix + cut differs from its first chunk's",
            "cumulative_hash",
        )
    chunks = [chunk.snapshot for chunk in fetched]
    versions = [chunk.weight_version for chunk in chunks]
    if versions[-1] > current_version:
        raise GenerationCutError(
            f"the cut's policy version {versions[-1]} is newer than the current rollout version {current_version}",
            "policy_version",
        )
    columns = [chunk.columns for chunk in chunks]
    if any(_carries(c.token_mask) for c in columns[1:]):
        raise GenerationCutError("only the first chunk of a cut may carry prompt (mask 0.0) tokens", "chunk_kind")
    ids = TokenIds.concat([c.token_ids for c in columns])
    mask = FloatColumn.concat([c.token_mask for c in columns])
    lps = FloatColumn.concat([c.log_probs for c in columns])
    fields: dict[str, Any] = {
        "schema_version": admission.schema_version,
        "rollout_id": continuation.source_capture_key,
        "model_call_id": continuation.source_model_call_id,
        "parent_call_id": admission.parent_call_id,
        "mode": admission.mode,
        "prev_len": admission.prev_len,
        "delta_len": len(ids),
        "cum_len": admission.prev_len + len(ids),
        "weight_version": versions[0],
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": compute_chain_hash(admission.parent_chain_hash, ids),
        "cumulative_hash": hash_token_columns(prefix, ids),
    }
    try:
        digest, packed = staging_digest_and_columns(
            digest_version=2,
            extras_digest_version=1,
            token_ids_delta=ids,
            token_mask_delta=mask,
            generation_log_probs_delta=lps,
            **fields,
        )
    except (ValueError, TypeError) as exc:
        raise GenerationCutError(f"the resolved cut does not form a valid record: {exc}", "unreadable") from exc
    if digest != continuation.digest:
        log.warning("cut %s: rebuilt digest %s, continuation digest %s", keys, digest, continuation.digest)
        raise GenerationCutError(
            f"the digest of the staged cut, rebuilt from its {len(keys)} chunk(s), is {digest[:16]}..., "
            f"the continuation names {continuation.digest[:16]}...",
            "digest",
        )
    snapshot = trusted_snapshot(StagedCallBaseSnapshot, digest, packed, **fields)
    spans = _restored_spans(fetched)
    newest = max((version for _, _, version in spans), default=versions[0])
    if newest > current_version:
        raise GenerationCutError(
            f"the cut holds tokens of policy version {newest}, "
            f"newer than the current rollout version {current_version}",
            "policy_version",
        )
    return ResolvedCut(snapshot, spans)


def refuse(refusal: continuations.Refusal | None) -> None:
    """Raise a rule's refusal as the ``GenerationCutError`` of its code (nothing when it holds)."""
    if refusal is not None:
        raise GenerationCutError(refusal.message, refusal.code)


def _facts(key: str, chunk: StoredChunk) -> continuations.ChunkFacts:
    snapshot = chunk.snapshot
    return continuations.ChunkFacts(
        staging_key=key,
        rollout_id=snapshot.rollout_id,
        model_call_id=snapshot.model_call_id,
        kind=chunk.kind.value,
        generated=snapshot.generated_token_count,
        weight_version=snapshot.weight_version,
        parent_call_id=snapshot.parent_call_id,
        prev_len=snapshot.prev_len,
    )


def _carries(mask: FloatColumn) -> bool:
    """Whether a mask has a carry (0.0) position; a stored carry-then-generation mask says so by its shape."""
    carry = mask.stored_carry()
    return bool(carry) if carry is not None else bool(mask.zero_one_flags()[0].any())


def check_chunk_identity(
    store: Store,
    continuation: GenerationCutContinuation,
    fetched: Sequence[StoredChunk],
    lineage: Sequence[tuple[str, str]] | None = None,
) -> None:
    """Each chunk is a record of the cut call, or of a call it continued (oldest first), and of
    the kind its place needs: first the cumulative prefix (for a cut that had finished, possibly
    the terminal record alone), then generation-only chunks.  A digest proves the tokens, not
    whose they are."""
    source = (continuation.source_capture_key, continuation.source_model_call_id)
    if lineage is None:
        lineage = [source] if all(_owner(chunk) == source for chunk in fetched) else _lineage(store, source)
    position = 0
    for index, (key, chunk) in enumerate(zip(continuation.staging_keys, fetched, strict=True)):
        owner = _owner(chunk)
        if owner not in lineage[position:]:
            raise GenerationCutError(
                f"chunk {key!r} is a record of {owner[0]}/{owner[1]}, not of the cut call "
                f"{source[0]}/{source[1]} or a call it continued, in order",
                "source_call",
            )
        position = list(lineage).index(owner, position)
        expected = {EventKind.CHUNK_STAGED} if index else {EventKind.PREFIX_STAGED}
        if len(fetched) == 1 and continuation.terminal_finish_reason is not None:
            expected.add(EventKind.CALL_COMPLETED)  # a finished cut may name the call's terminal record
        if chunk.kind not in expected:
            wanted = " or ".join(sorted(kind.value for kind in expected))
            raise GenerationCutError(
                f"chunk {key!r} of the cut is a {chunk.kind.value} record, not {wanted}", "chunk_kind"
            )


def _owner(chunk: StoredChunk) -> tuple[str, str]:
    return chunk.snapshot.rollout_id, chunk.snapshot.model_call_id


def _lineage(store: Store, source: tuple[str, str]) -> list[tuple[str, str]]:
    """The source call and the calls it continued, oldest first (from the calls projection)."""
    chain = [source]
    info = store.call(*source)
    while info is not None and info.continues is not None and info.continues not in chain:
        chain.append(info.continues)
        info = store.call(*info.continues)
    return chain[::-1]


def _restored_spans(fetched: Sequence[StoredChunk]) -> list[Span]:
    """Per-token policy versions of the concatenated chunks, as their events recorded them.

    A record's spans are in its call's delta positions, which are the positions in the
    concatenation; spans that do not fit their chunk fall back to the chunk's stamp.
    """
    spans: list[Span] = []
    offset = 0
    for chunk in fetched:
        snapshot, recorded = chunk.snapshot, chunk.spans
        end = offset + snapshot.delta_len
        if recorded and all(offset <= start < stop <= end for start, stop, _ in recorded):
            spans += recorded
        else:
            spans += generated_spans(snapshot.columns.token_mask, snapshot.weight_version, offset)
        offset = end
    return spans
