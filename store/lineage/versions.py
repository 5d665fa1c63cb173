"""Policy-version views: tokens per version, the oldest version of each rollout, staleness.

Answered from the calls projection's version spans (which delta positions each policy
version generated), never from token columns.  Counted tokens are generated tokens (mask
1.0); carried prompt tokens belong to no version.  A call that a later attempt continued
is left out: the continuation's spans already cover the tokens it restored, so nothing is
counted twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import sqlalchemy as sa

from store.errors import InvalidRecordError
from store.lineage.family import (
    FamilyCall,
    all_calls,
    attempt_owners,
    continued_calls,
    family_calls,
    resolve_rollout,
    split_capture_key,
)
from store.log import schema
from store.log.schema import version_key
from store.projections.fold import CallState
from store.queries.reads import Reader

U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class RolloutVersions:
    """Generated tokens of one rollout (every attempt) per policy version, and its oldest and newest."""

    rollout_id: str
    tokens_by_version: dict[int, int]
    oldest_version: int | None
    newest_version: int | None

    @property
    def generated_tokens(self) -> int:
        return sum(self.tokens_by_version.values())


@dataclass(frozen=True)
class StaleCall:
    """A call holding tokens generated more than ``max_lag`` versions behind the current one."""

    rollout_id: str
    capture_key: str
    model_call_id: str
    state: str
    oldest_version: int
    stale_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class StaleReport:
    """``stale(current_version, max_lag)``: the stale calls and their stale token counts."""

    current_version: int
    max_lag: int
    calls: list[StaleCall] = field(default_factory=list)

    @property
    def stale_tokens(self) -> int:
        return sum(call.stale_tokens for call in self.calls)


def _count(spans: Iterable[tuple[int, int, int]], into: Counter[int]) -> None:
    for start, end, version in spans:
        into[version] += end - start


def _versions(rollout_id: str, counts: Counter[int]) -> RolloutVersions:
    tokens = {version: counts[version] for version in sorted(counts) if counts[version]}
    return RolloutVersions(rollout_id, tokens, min(tokens, default=None), max(tokens, default=None))


def _counted(call: FamilyCall, continued: set[tuple[str, str]]) -> bool:
    return (call.capture_key, call.state.model_call_id) not in continued


def rollout_versions(reader: Reader, rollout_id: str | None = None) -> list[RolloutVersions]:
    """Per rollout, sorted by id (or only ``rollout_id``): generated tokens per version, oldest and newest version."""
    if rollout_id is not None:
        bare = resolve_rollout(reader, rollout_id)
        counts: Counter[int] = Counter()
        continued = continued_calls(reader, bare)
        calls = family_calls(reader, bare)
        for call in calls:
            if _counted(call, continued):
                _count(call.state.spans, counts)
        return [_versions(bare, counts)] if calls else []
    continued = continued_calls(reader)
    per_rollout: dict[str, Counter[int]] = {}
    for bare, call in all_calls(reader):
        counts = per_rollout.setdefault(bare, Counter())
        if _counted(call, continued):
            _count(call.state.spans, counts)
    return [_versions(bare, per_rollout[bare]) for bare in sorted(per_rollout)]


def version_tokens(reader: Reader, rollout_id: str | None = None) -> dict[int, int]:
    """Generated tokens per policy version, store-wide or of one rollout, ascending by version."""
    total: Counter[int] = Counter()
    for versions in rollout_versions(reader, rollout_id):
        total.update(versions.tokens_by_version)
    return {version: total[version] for version in sorted(total)}


def check_version(name: str, value: object) -> int:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise InvalidRecordError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


def stale(reader: Reader, current_version: int, max_lag: int) -> StaleReport:
    """Calls with tokens of a version older than ``current_version - max_lag``, with their counts."""
    current = check_version("current_version", current_version)
    lag = check_version("max_lag", max_lag)
    report = StaleReport(current, lag)
    if current <= lag:
        return report  # no version is more than max_lag behind
    threshold = current - lag  # versions below it are stale
    continued = continued_calls(reader)
    calls = schema.calls
    query = (
        sa.select(*calls.c)
        .where(calls.c.oldest_version.is_not(None), calls.c.oldest_version < version_key(threshold))
        .order_by(calls.c.last_seq)
    )
    states: list[CallState] = []
    with reader.connection("reading stale calls") as connection:
        states = [CallState.from_row(row) for row in connection.execute(query)]
    if not states:
        return report
    present = attempt_owners(reader)
    for state in states:
        if (state.rollout_id, state.model_call_id) in continued:
            continue
        stale_tokens = sum(end - start for start, end, version in state.spans if version < threshold)
        if not stale_tokens:
            continue
        report.calls.append(
            StaleCall(
                rollout_id=split_capture_key(state.rollout_id, present).rollout_id,
                capture_key=state.rollout_id,
                model_call_id=state.model_call_id,
                state=state.state,
                oldest_version=min(version for _, _, version in state.spans),
                stale_tokens=stale_tokens,
                generated_tokens=state.generated_tokens,
            )
        )
    return report
