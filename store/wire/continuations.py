"""What a continuation must be: each rule stated once, for ``begin_call`` and the audit alike.

A continuation (wire-contract 3.3, 4.5, 5.6) names the staged chunks of a cut call.  The
worker admits it (``begin_call``) and the audit re-checks every admitted one from the log;
both ask these functions, so admission refuses exactly what the audit would report, and
never admits a call that leaves a store unable to pass its audit.  Each broken rule is a
``Refusal``: a code (``CaptureError.code`` at admission) and a message naming what differed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

# Event kinds by value (the log's ``EventKind``; the wire layer sits below the log).
PREFIX_STAGED = "prefix_staged"
CHUNK_STAGED = "chunk_staged"
CALL_COMPLETED = "call_completed"


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ChunkFacts:
    """What the rules read of one staged chunk a continuation names (no token column)."""

    staging_key: str
    rollout_id: str  # the capture key of the call that staged it
    model_call_id: str
    kind: str  # the event kind's value
    generated: int  # mask 1.0 positions
    weight_version: int
    parent_call_id: str | None
    prev_len: int


def own_attempt(capture_key: str, source_capture_key: str) -> Refusal | None:
    """A call continues a cut of an earlier attempt, never of its own capture key."""
    if source_capture_key == capture_key:
        return Refusal(
            "own_attempt",
            f"it continues a cut of its own attempt {source_capture_key!r}, not an earlier one "
            "(a replacement captures under the next attempt's key: capture_key(rollout, attempt + 1))",
        )
    return None


def token_count_within_limit(count: int, limit: int) -> Refusal | None:
    """No cut acknowledges, and no continuation restores, more tokens than the call may generate."""
    if count > limit:
        return Refusal(
            "output_limit",
            f"it holds {count} generated tokens, more than the call's output limit {limit}",
        )
    return None


def chunk_kind_fits(kind: str, index: int, count: int) -> bool:
    """First the cumulative prefix (or a finished call's terminal record, alone), then chunks."""
    if index == 0:
        return kind == PREFIX_STAGED or (kind == CALL_COMPLETED and count == 1)
    return kind == CHUNK_STAGED


def chunk_problems(
    *,
    staging_keys: Sequence[str],
    generation_token_count: int,
    chunks: Sequence[ChunkFacts | None],
    owners: Collection[tuple[str, str]],
    parent_call_id: str | None,
    prev_len: int,
    chains_from_parent: bool | None,
) -> list[Refusal]:
    """Whether the named chunks are the cut a call after ``parent_call_id`` at ``prev_len`` may continue.

    ``chunks`` has one entry per key (None: no record under it); ``owners`` are the cut call and
    the calls it continued; ``chains_from_parent`` says whether the first chunk chained from the
    continuing call's parent chain hash (None: not known).
    """
    refusals: list[Refusal] = []
    present: list[ChunkFacts] = []
    for index, (key, chunk) in enumerate(zip(staging_keys, chunks, strict=True)):
        if chunk is None:
            refusals.append(Refusal("keys", f"the cut names key {key!r}, which holds no staged record"))
            continue
        owner = (chunk.rollout_id, chunk.model_call_id)
        if owner not in owners:
            refusals.append(
                Refusal(
                    "source_call",
                    f"the cut's key {key!r} holds a record of {owner[0]}/{owner[1]}, "
                    "not of the cut call or a call it continued",
                )
            )
        if not chunk_kind_fits(chunk.kind, index, len(staging_keys)):
            refusals.append(
                Refusal("chunk_kind", f"the cut's key {key!r} holds a {chunk.kind} record, wrong at place {index}")
            )
        present.append(chunk)
    if len(present) < len(staging_keys):
        return refusals
    generated = sum(chunk.generated for chunk in present)
    if generated != generation_token_count:
        refusals.append(
            Refusal(
                "token_count",
                f"the cut's chunks hold {generated} generated tokens, the continuation names {generation_token_count}",
            )
        )
    versions = [chunk.weight_version for chunk in present]
    if versions != sorted(versions):
        refusals.append(Refusal("policy_version", f"the cut's chunk policy versions {versions} decrease"))
    first = present[0]
    if (first.parent_call_id, first.prev_len) != (parent_call_id, prev_len):
        refusals.append(
            Refusal(
                "lineage",
                f"the cut was taken after {first.parent_call_id!r} at {first.prev_len}, "
                f"the call continues after {parent_call_id!r} at {prev_len}",
            )
        )
    elif chains_from_parent is False:
        refusals.append(
            Refusal("parent_chain", "the cut chained from other parent tokens than the call continues (chain hash)")
        )
    return refusals
