"""The call tree of a rollout across its attempts: parents, continuations, states, lengths, versions.

Read from the calls projection and one pass over the rollout's admission events (checksums
verified): those give each call's admission time and, for a continued call, the cut it
resumed (the checkpoint and staging keys its continuation named, from which attempt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from store.errors import CorruptRecordError, InvalidRecordError
from store.lineage.family import (
    FamilyCall,
    attempt_owners,
    bound_family_clause,
    capture_keys,
    family_calls,
    family_params,
    resolve_rollout,
    split_capture_key,
)
from store.log import schema
from store.log.events import AdmissionBody, EventKind
from store.projections.fold import TERMINAL_STATES
from store.queries.integrity import describe, verified_event
from store.queries.reads import Reader, StagedKeyInfo, VersionSpan, plain_rows
from store.wire.codec import from_json
from store.wire.cut_records import GENERATION_CUT_KEY_PREFIX
from store.wire.records import GenerationCutContinuation


@dataclass(frozen=True)
class ResumedCut:
    """The cut a continued call resumed: the source call, its attempt, checkpoint and staging keys."""

    capture_key: str
    attempt: int
    model_call_id: str
    checkpoint_id: str | None  # None when the cut acknowledged the call's terminal record
    staging_keys: tuple[str, ...]
    generation_token_count: int


@dataclass(frozen=True)
class LineageCall:
    """One call of a rollout's tree, as one attempt captured it."""

    capture_key: str
    attempt: int
    model_call_id: str
    parent_call_id: str | None
    state: str
    mode: str | None
    prev_len: int | None
    cum_len: int | None
    generated_tokens: int
    admitted_version: int | None
    oldest_version: int | None
    newest_version: int | None
    version_spans: tuple[VersionSpan, ...]
    admitted_at: float | None
    resumes: ResumedCut | None
    resumed_by: str | None  # the capture key of the attempt that continued this call, if any
    worker_pid: int | None = None  # the process (policy worker) that admitted it, per the log's writer pid
    # The call's capture key is retired (a fence is in place).  An unfinished call of a retired
    # attempt shows the state "retired": it can never finish, its late writes are refused.
    retired: bool = False


@dataclass(frozen=True)
class RolloutLineage:
    """A rollout's calls over every attempt (oldest attempt first, commit order within one)."""

    rollout_id: str
    attempts: tuple[str, ...]
    calls: tuple[LineageCall, ...]

    def roots(self) -> list[LineageCall]:
        return [call for call in self.calls if call.parent_call_id is None]

    def children(self, model_call_id: str) -> list[LineageCall]:
        return [call for call in self.calls if call.parent_call_id == model_call_id]

    def latest(self, model_call_id: str) -> LineageCall | None:
        """The newest attempt's row of a call."""
        rows = [call for call in self.calls if call.model_call_id == model_call_id]
        return rows[-1] if rows else None


@dataclass(frozen=True)
class RolloutSummary:
    """One rollout in ``rollouts()``: its attempts and its calls by their newest state."""

    rollout_id: str
    attempts: tuple[str, ...]
    calls: int
    completed: int
    failed: int
    fenced: tuple[str, ...] = ()  # the attempts whose capture key is retired (late writes refused)


@dataclass(frozen=True, slots=True)
class Admission:
    """A call's newest admission: when, and the continuation it carried."""

    admitted_at: float
    continuation: GenerationCutContinuation | None
    writer_pid: int


_FAMILY_ADMISSIONS = (  # built once (see bound_family_clause)
    sa.select(*schema.events.c)
    .where(
        bound_family_clause(schema.events.c.rollout_id),
        schema.events.c.kind == EventKind.CALL_ADMITTED.value,
    )
    .order_by(schema.events.c.seq)
)


def admissions(reader: Reader, rollout_id: str, keys: set[str]) -> dict[tuple[str, str], Admission]:
    """(capture key, call) -> its newest admission, for the capture keys ``keys`` of one rollout."""
    found: dict[tuple[str, str], Admission] = {}
    with reader.connection("reading admissions") as connection:
        for row in plain_rows(connection, _FAMILY_ADMISSIONS, family_params(rollout_id)):
            if row["rollout_id"] not in keys:
                continue
            event = verified_event(row)
            body = event.body
            if not isinstance(body, AdmissionBody):
                raise CorruptRecordError(f"{describe(row)} is not an admission")
            found[(event.rollout_id, event.model_call_id)] = Admission(
                float(row["recorded_at"]), _continuation(body, row), int(row["writer_pid"])
            )
    return found


def _continuation(body: AdmissionBody, row: Any) -> GenerationCutContinuation | None:
    if body.generation_cut is None:
        return None
    try:
        return from_json(bytes(body.generation_cut), GenerationCutContinuation)
    except InvalidRecordError as exc:
        raise CorruptRecordError(f"{describe(row)} holds a continuation that no longer decodes: {exc}") from exc


def _checkpoint(continuation: GenerationCutContinuation) -> str | None:
    """The checkpoint of the cut resumed: its newest chunk key names it (a terminal record's key names none)."""
    if not continuation.staging_keys:
        return None
    key = continuation.staging_keys[-1]
    head = f"{GENERATION_CUT_KEY_PREFIX}/"
    tail = f"/{continuation.source_capture_key}/{continuation.source_model_call_id}/"
    if not key.startswith(head) or tail not in key:
        return None
    return key[len(head) : key.rindex(tail)] or None


def _resumed(continuation: GenerationCutContinuation | None, present: set[str]) -> ResumedCut | None:
    if continuation is None:
        return None
    source = split_capture_key(continuation.source_capture_key, present)
    return ResumedCut(
        capture_key=continuation.source_capture_key,
        attempt=source.attempt,
        model_call_id=continuation.source_model_call_id,
        checkpoint_id=_checkpoint(continuation),
        staging_keys=tuple(continuation.staging_keys),
        generation_token_count=continuation.generation_token_count,
    )


def fenced_keys(reader: Reader, keys: set[str]) -> set[str]:
    """The capture keys among ``keys`` that are retired (the rollouts projection's fences)."""
    rollouts = schema.rollouts
    query = sa.select(rollouts.c.rollout_id).where(rollouts.c.rollout_id.in_(sorted(keys)), rollouts.c.fenced != 0)
    with reader.connection("reading fences") as connection:
        return {row[0] for row in connection.execute(query)}


def _lineage_call(
    call: FamilyCall, admission: Admission | None, resumed_by: str | None, present: set[str], retired: bool
) -> LineageCall:
    state = call.state
    unfinished = state.state not in TERMINAL_STATES
    return LineageCall(
        capture_key=call.capture_key,
        attempt=call.attempt,
        model_call_id=state.model_call_id,
        parent_call_id=state.parent_call_id,
        state="retired" if retired and unfinished else state.state,
        mode=state.mode,
        prev_len=state.prev_len,
        cum_len=state.cum_len,
        generated_tokens=state.generated_tokens,
        admitted_version=state.admitted_version,
        oldest_version=state.oldest_version,
        newest_version=state.newest_version,
        version_spans=tuple(VersionSpan(*span) for span in state.spans),
        admitted_at=None if admission is None else admission.admitted_at,
        resumes=None if admission is None else _resumed(admission.continuation, present),
        resumed_by=resumed_by,
        worker_pid=None if admission is None else admission.writer_pid,
        retired=retired,
    )


def lineage(reader: Reader, rollout_id: str) -> RolloutLineage | None:
    """The call tree of ``rollout_id`` (an attempt's capture key names its rollout), or None if unknown."""
    bare = resolve_rollout(reader, rollout_id)
    calls = family_calls(reader, bare)
    if not calls:
        return None
    keys = {call.capture_key for call in calls}
    found = admissions(reader, bare, keys)
    resumed_by = {
        (call.state.continues_rollout_id, call.state.continues_model_call_id): call.capture_key
        for call in calls
        if call.state.continues_rollout_id is not None
    }
    present = keys | {bare}
    retired = fenced_keys(reader, keys)
    return RolloutLineage(
        rollout_id=bare,
        attempts=tuple(dict.fromkeys(call.capture_key for call in calls)),
        calls=tuple(
            _lineage_call(
                call,
                found.get((call.capture_key, call.state.model_call_id)),
                resumed_by.get((call.capture_key, call.state.model_call_id)),
                present,
                call.capture_key in retired,
            )
            for call in calls
        ),
    )


_FENCED = sa.select(schema.rollouts.c.rollout_id).where(schema.rollouts.c.fenced != 0)


def rollouts(reader: Reader) -> list[RolloutSummary]:
    """Every rollout (attempts grouped under it), sorted by id, with its calls by newest state."""
    present = attempt_owners(reader)
    calls = schema.calls
    query = sa.select(calls.c.rollout_id, calls.c.model_call_id, calls.c.state)
    newest: dict[str, dict[str, tuple[int, str]]] = {}
    attempts: dict[str, dict[int, str]] = {}
    with reader.connection("reading rollouts") as connection:
        for key, model_call_id, state in connection.execution_options(yield_per=1000).execute(query):
            where = split_capture_key(key, present)
            attempts.setdefault(where.rollout_id, {})[where.attempt] = key
            per_call = newest.setdefault(where.rollout_id, {})
            if model_call_id not in per_call or per_call[model_call_id][0] <= where.attempt:
                per_call[model_call_id] = (where.attempt, state)
        fenced = {row[0] for row in connection.execute(_FENCED)}
    summaries = []
    for rollout_id in sorted(newest):
        states = [state for _, state in newest[rollout_id].values()]
        keys = tuple(attempts[rollout_id][index] for index in sorted(attempts[rollout_id]))
        summaries.append(
            RolloutSummary(
                rollout_id=rollout_id,
                attempts=keys,
                calls=len(states),
                completed=states.count("completed"),
                failed=states.count("failed"),
                fenced=tuple(key for key in keys if key in fenced),
            )
        )
    return summaries


def staged_keys(reader: Reader, rollout_id: str | None = None) -> list[StagedKeyInfo]:
    """Every live staging key, or those of ``rollout_id``'s calls over every attempt."""
    keys = reader.keys()
    if rollout_id is None:
        return keys
    bare = resolve_rollout(reader, rollout_id)
    present = attempt_owners(reader)
    return [key for key in keys if split_capture_key(key.rollout_id, present).rollout_id == bare]


def rollout_ids(reader: Reader) -> list[str]:
    """Every rollout id (attempts grouped under it), sorted: the projection's distinct keys only."""
    present = capture_keys(reader)
    owners = attempt_owners(reader, present)
    return sorted({split_capture_key(key, owners).rollout_id for key in present})
