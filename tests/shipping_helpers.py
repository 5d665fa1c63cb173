"""Checks that a ship's target reads like its source (shared by the shipping tests and the state machine)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sqlalchemy as sa

from store import EventOrigin, ReceiptVerificationError, Store


def staged_keys(store: Store) -> dict[str, tuple[str, str, str]]:
    """Every live staging key with its call and digest (raw SQL)."""
    with store._engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT staging_key, rollout_id, model_call_id, digest FROM staged_keys"))
        return {row[0]: (row[1], row[2], row[3]) for row in rows}


def origins(store: Store) -> list[EventOrigin]:
    """The identity of every event of ``store``, in its sequence order."""
    with store._engine.connect() as connection:
        seqs = connection.execute(sa.text("SELECT seq FROM events ORDER BY seq")).scalars().all()
    found = [store.event_origin(int(seq)) for seq in seqs]
    assert None not in found
    return [origin for origin in found if origin is not None]


def _linearized(store: Store, rollout_id: str) -> Any:
    try:
        return store.linearize(rollout_id).rows
    except ReceiptVerificationError as exc:
        return ("refused", exc.code)


def _completion(store: Store, rollout_id: str, model_call_id: str, same_times: bool) -> object:
    completion = store.completion(rollout_id, model_call_id)
    return completion if completion is None or same_times else replace(completion, recorded_at=0.0)


def assert_target_reads_like_source(
    source: Store, target: Store, *, same_times: bool = True, only_source: bool = True
) -> None:
    """Every call, key, record, completion, lineage and linearized row of ``source`` reads the
    same in ``target``, which audits clean; every source event's identity is in the target once.

    ``same_times=False``: another origin shipped some identical records first, so their
    completion times are that origin's.  ``only_source``: the target holds nothing else, so
    its live keys are exactly the source's (a key withdrawn in the source is gone there too).
    """
    for call in source.calls():
        assert target.call(call.rollout_id, call.model_call_id) == call
        ident = (call.rollout_id, call.model_call_id)
        assert _completion(target, *ident, same_times) == _completion(source, *ident, same_times)
    keys = staged_keys(source)
    target_keys = staged_keys(target)
    assert {key: target_keys.get(key) for key in keys} == keys
    if only_source:
        assert target_keys == keys
        assert {(c.rollout_id, c.model_call_id) for c in target.calls()} == {
            (c.rollout_id, c.model_call_id) for c in source.calls()
        }
    if keys:
        wanted = sorted(keys)
        for mine, theirs in zip(source.fetch(wanted), target.fetch(wanted), strict=True):
            assert (theirs.digest, theirs.token_ids_delta.tolist()) == (mine.digest, mine.token_ids_delta.tolist())
    for summary in source.rollouts():
        assert target.lineage(summary.rollout_id) == source.lineage(summary.rollout_id)
        assert _linearized(target, summary.rollout_id) == _linearized(source, summary.rollout_id)
    audit = target.audit()
    assert audit.ok, audit.summary()
    shipped = origins(target)
    assert len(shipped) == len(set(shipped)), "an event identity was appended twice"
