"""A rollout and its attempts: which capture keys belong to one rollout, and their calls rows.

A worker that restarts a rollout captures attempt ``a`` under the capture key
``{rollout}-a{a}`` (``capture_key``).  The lineage views group those keys back under the
bare rollout id, because a trainer trains on the rollout, whichever attempt staged each
call.  A key of that shape counts as an attempt only when its rollout is itself known to the
store: it has a calls row, or a row of the ``rollouts`` table (a fence, ledger counts, a
deletion).  A restore retires every earlier attempt of the rollout it installs, so a
replacement whose attempt 0 left nothing durable (no call staged) still names its rollout
through attempt 0's fence.  Otherwise the key is a rollout of its own (an id that merely
ends in ``-a1``).
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from dataclasses import dataclass

import sqlalchemy as sa

from store.log import schema
from store.projections.fold import CallState
from store.queries.reads import Reader, plain_rows

_ATTEMPT_KEY = re.compile(r"^(.+)-a([1-9][0-9]*)$", re.S)


@dataclass(frozen=True, slots=True)
class Attempt:
    """Where one capture key belongs: its rollout and its attempt index."""

    rollout_id: str
    attempt: int


def split_capture_key(key: str, rollouts: Container[str]) -> Attempt:
    """The rollout and attempt of ``key``, given the capture keys present in the store."""
    match = _ATTEMPT_KEY.match(key)
    if match is not None and match.group(1) in rollouts:
        return Attempt(match.group(1), int(match.group(2)))
    return Attempt(key, 0)


def family_clause(rollout_id: str) -> sa.ColumnElement[bool]:
    """Rows of ``rollout_id`` and of every key that may be one of its attempts (an index range)."""
    column = schema.calls.c.rollout_id
    return sa.or_(column == rollout_id, sa.and_(column >= f"{rollout_id}-a", column < f"{rollout_id}-b"))


def bound_family_clause(column: sa.Column[str]) -> sa.ColumnElement[bool]:
    """``family_clause`` with its values bound at execution (``family_params``): the statement
    is built once, not on every read of a rollout."""
    return sa.or_(
        column == sa.bindparam("family_rollout"),
        sa.and_(column >= sa.bindparam("family_low"), column < sa.bindparam("family_high")),
    )


def family_params(rollout_id: str) -> dict[str, str]:
    return {"family_rollout": rollout_id, "family_low": f"{rollout_id}-a", "family_high": f"{rollout_id}-b"}


_FAMILY_CALLS = (
    sa.select(*schema.calls.c).where(bound_family_clause(schema.calls.c.rollout_id)).order_by(schema.calls.c.last_seq)
)


def capture_keys(reader: Reader) -> set[str]:
    """Every capture key that has a calls row."""
    query = sa.select(schema.calls.c.rollout_id).distinct()
    with reader.connection("reading rollouts") as connection:
        return {row[0] for row in connection.execute(query)}


def attempt_owners(reader: Reader, calls_keys: set[str] | None = None) -> set[str]:
    """The keys a ``{key}-aN`` capture key may be an attempt of: those with a calls row
    (``calls_keys``, read here if not given) and those with a ``rollouts`` row."""
    query = sa.select(schema.rollouts.c.rollout_id)
    with reader.connection("reading rollouts") as connection:
        known = {row[0] for row in connection.execute(query)}
    return known | (capture_keys(reader) if calls_keys is None else calls_keys)


def _known(reader: Reader, key: str) -> bool:
    """Whether ``key`` has a calls row or a ``rollouts`` row (``attempt_owners`` of one key)."""
    calls, rollouts = schema.calls.c.rollout_id, schema.rollouts.c.rollout_id
    query = sa.select(sa.or_(sa.exists().where(calls == key), sa.exists().where(rollouts == key)))
    with reader.connection("reading a rollout") as connection:
        return bool(connection.execute(query).scalar())


def resolve_rollout(reader: Reader, rollout_id: str) -> str:
    """The bare rollout of ``rollout_id``: a later attempt's capture key names its rollout."""
    match = _ATTEMPT_KEY.match(rollout_id)
    if match is None:
        return rollout_id
    return match.group(1) if _known(reader, match.group(1)) else rollout_id


@dataclass(frozen=True, slots=True)
class FamilyCall:
    """One calls row with the attempt that wrote it."""

    attempt: int
    state: CallState

    @property
    def capture_key(self) -> str:
        return self.state.rollout_id


def family_calls(reader: Reader, rollout_id: str) -> list[FamilyCall]:
    """The calls rows of every attempt of ``rollout_id`` (bare), oldest attempt first, then commit order."""
    with reader.connection("reading a rollout's calls") as connection:
        states = [CallState.from_row(row) for row in plain_rows(connection, _FAMILY_CALLS, family_params(rollout_id))]
    present = {state.rollout_id for state in states}
    if rollout_id not in present and states and _known(reader, rollout_id):
        present.add(rollout_id)  # fenced or counted, with no calls row: its attempts are still its own
    found = []
    for state in states:
        where = split_capture_key(state.rollout_id, present)  # as rollouts() groups them
        if where.rollout_id == rollout_id:
            found.append(FamilyCall(where.attempt, state))
    found.sort(key=lambda call: call.attempt)  # stable: commit order within an attempt
    return found


def all_calls(reader: Reader) -> Iterator[tuple[str, FamilyCall]]:
    """Every calls row with its bare rollout, streamed (one row at a time from the driver)."""
    present = attempt_owners(reader)
    calls = schema.calls
    query = sa.select(*calls.c).order_by(calls.c.last_seq)
    with reader.connection("reading calls") as connection:
        for row in connection.execution_options(yield_per=1000).execute(query):
            state = CallState.from_row(row)
            where = split_capture_key(state.rollout_id, present)
            yield where.rollout_id, FamilyCall(where.attempt, state)


def continued_calls(reader: Reader, rollout_id: str | None = None) -> set[tuple[str, str]]:
    """(capture key, call) of calls a later attempt continued: their tokens live on in the continuation.

    Read from the projection's ``continues`` columns alone (one small query).
    """
    calls = schema.calls
    query = sa.select(calls.c.continues_rollout_id, calls.c.continues_model_call_id).where(
        calls.c.continues_rollout_id.is_not(None), calls.c.continues_model_call_id.is_not(None)
    )
    if rollout_id is not None:
        query = query.where(family_clause(rollout_id))
    with reader.connection("reading continuations") as connection:
        return {(row[0], row[1]) for row in connection.execute(query)}
