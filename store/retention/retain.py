"""``Store.retain``: keep exactly a checkpoint's retain set of a capture key's staged records.

A commit (wire-contract 5.2) lists the staging keys the framework must keep: every ledger
row's key and the cut keys of the one cut kept per episode.  Every other live key of the
capture keys in scope is withdrawn with a ``keys_cleared`` event (reason ``retention``), one
per call, even on a retired capture key (a fence stops the dead attempt, not the framework's
own cleanup).  The records stay in the log, so lineage audits and continuations still read
them; ``Store.delete`` is what gives space back.

The cut keys of a call still decoding on a live capture key are never withdrawn: its next
cut's receipt names them again (its durable prefix is built on them), so withdrawing them
would acknowledge keys that no longer fetch.  A retain set computed before that call's
latest cut is a race, not the framework's intent.  A call a crash left unfinished looks the
same in the log: its cut keys go once its capture key is retired (a restore retires it).

The same holds across attempts: a call that continued a cut builds its own cuts on the cut's
keys (its durable prefix starts with them), so a key named by the continuation of an
unfinished call, on a capture key that is not retired, stays even when its own capture key
is retired and the retain set leaves it out.  The calls that continue a call are found by
``ix_calls_continues``, and so are the calls continuing those.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from store.append.new_event import NewEvent
from store.append.transaction import WriteTransaction
from store.log import schema
from store.log.engine import Statement
from store.log.events import RECORD_KINDS, EventKind, KeysClearedBody
from store.projections.fold import TERMINAL_STATES
from store.wire.codec import from_json
from store.wire.records import GenerationCutContinuation, RolloutRemoval

RETENTION_REASON = "retention"


class RetainStatements:
    def __init__(self, engine: Engine) -> None:
        events, calls = schema.events, schema.calls
        self.record_keys = Statement(
            sa.select(events.c.model_call_id, events.c.staging_key, events.c.kind)
            .where(events.c.rollout_id == sa.bindparam("rollout_id"), events.c.staging_key.is_not(None))
            .order_by(events.c.seq),
            engine,
        )
        self.continuers = Statement(
            sa.select(calls.c.rollout_id, calls.c.model_call_id, calls.c.state).where(
                calls.c.continues_rollout_id == sa.bindparam("rollout_id"),
                calls.c.continues_model_call_id == sa.bindparam("model_call_id"),
            ),
            engine,
        )


_RECORD_KIND_VALUES = frozenset(kind.value for kind in RECORD_KINDS)


def _still_decoding(tx: WriteTransaction, rollout_id: str, model_call_id: str) -> bool:
    call = tx.call(rollout_id, model_call_id)
    return call is not None and call.state not in TERMINAL_STATES


def _retired(tx: WriteTransaction, rollout_id: str) -> bool:
    fence = tx.rollout(rollout_id)
    return fence is not None and fence.fenced


def _built_on(tx: WriteTransaction, sql: RetainStatements, source: tuple[str, str]) -> set[str]:
    """The keys that unfinished calls continuing ``source`` (or continuing such a call), on
    capture keys that are not retired, name in their continuations."""
    named: set[str] = set()
    seen, frontier = {source}, [source]
    while frontier:
        rollout_id, model_call_id = frontier.pop()
        params = {"rollout_id": rollout_id, "model_call_id": model_call_id}
        for continuer_rollout, continuer_call, state in tx.run(sql.continuers, params).fetchall():
            stream = (continuer_rollout, continuer_call)
            if stream in seen:
                continue
            seen.add(stream)
            frontier.append(stream)
            if state not in TERMINAL_STATES and not _retired(tx, continuer_rollout):
                named.update(_continuation_keys(tx, stream))
    return named


def _continuation_keys(tx: WriteTransaction, stream: tuple[str, str]) -> tuple[str, ...]:
    """The staging keys of the cut the call's latest admission continued (the calls row's ``continues``)."""
    admissions = [body for kind, body in tx.stream_bodies(*stream) if kind is EventKind.CALL_ADMITTED]
    cut = admissions[-1].generation_cut if admissions else None
    return () if cut is None else from_json(cut, GenerationCutContinuation).staging_keys


def retain(
    tx: WriteTransaction, sql: RetainStatements, keep: Sequence[str], capture_keys: Sequence[str] | None
) -> RolloutRemoval:
    """Withdraw every live key of the capture keys in scope that ``keep`` does not name.

    The scope is ``capture_keys``, or else the capture keys owning a key of ``keep``.
    ``removed`` lists the withdrawn staging keys; ``absent`` the kept keys that hold nothing.
    """
    kept = set(keep)
    absent: list[str] = []
    scope: list[str] = list(capture_keys) if capture_keys is not None else []
    for key in keep:
        state = tx.key(key)
        if state is None:
            absent.append(key)
        elif capture_keys is None and state.rollout_id not in scope:
            scope.append(state.rollout_id)
    removed: list[str] = []
    for rollout_id in scope:
        retired = _retired(tx, rollout_id)
        by_call: dict[str, list[str]] = {}
        for call_id, staging_key, kind in tx.run(sql.record_keys, {"rollout_id": rollout_id}).fetchall():
            if kind not in _RECORD_KIND_VALUES or staging_key in kept:
                continue
            state = tx.key(staging_key)
            owned = state is not None and (state.rollout_id, state.model_call_id) == (rollout_id, call_id)
            calls_keys = by_call.setdefault(call_id, [])
            if owned and staging_key not in calls_keys:
                calls_keys.append(staging_key)
        for call_id, keys in by_call.items():
            if keys and (retired or not _still_decoding(tx, rollout_id, call_id)):
                built_on = _built_on(tx, sql, (rollout_id, call_id))
                withdrawn = [key for key in keys if key not in built_on]
                if withdrawn:
                    body = KeysClearedBody(staging_keys=withdrawn, reason=RETENTION_REASON)
                    tx.append(NewEvent(EventKind.KEYS_CLEARED, rollout_id, call_id, body, past_fence=True))
                    removed += withdrawn
    return RolloutRemoval(removed=removed, absent=absent)
