"""Helpers shared by the capture and generation-cut tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from store import GenerationCutContinuation, GenerationCutPrefixAck, Store, capture_key


class Versions:
    """A mutable policy-version provider that counts its calls."""

    def __init__(self, value: Any = 7) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.value


class FakeClock:
    """An injectable clock (seconds since the epoch) that moves only when told: TTLs without sleeps."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "the clock only moves forward"
        self.now += seconds


def event_count(store: Store) -> int:
    """Events in the log (and the projections still match it)."""
    report = store.replay()
    assert report.ok, report.summary()
    return report.events


def raw_event_count(store: Store) -> int:
    """Events in the log, counted with raw SQL (also when a damaged event stops a replay)."""
    with store._engine.connect() as connection:
        return int(connection.execute(sa.text("SELECT count(*) FROM events")).scalar_one())


@contextmanager
def writes_nothing(store: Store, *calls: tuple[str, str], damaged: bool = False) -> Iterator[None]:
    """The block may raise, but it must not append an event or create a calls row.

    ``damaged``: the log holds a damaged event on purpose, so count events without a replay.
    """
    count = raw_event_count if damaged else event_count
    before = count(store)
    yield
    assert count(store) == before, "a refusal must not write to the log"
    for rollout_id, model_call_id in calls:
        assert store.call(rollout_id, model_call_id) is None


def damage_token_ids(store: Store, staging_key: str) -> None:
    """Flip one bit of the stored token ids of the event behind ``staging_key`` (raw SQL)."""
    with store._engine.begin() as connection:
        seq, ids = connection.execute(
            sa.text(
                "SELECT e.seq, e.token_ids FROM events e JOIN staged_keys k ON k.event_seq = e.seq "
                "WHERE k.staging_key = :key"
            ),
            {"key": staging_key},
        ).one()
        damaged = bytearray(ids)
        damaged[-1] ^= 0x01
        connection.execute(
            sa.text("UPDATE events SET token_ids = :ids WHERE seq = :seq"), {"ids": bytes(damaged), "seq": seq}
        )


def continuation_from(ack: GenerationCutPrefixAck, **overrides: Any) -> GenerationCutContinuation:
    """What Gym's ``GenerationCutRecord`` carries for a ``durable_prefix`` acknowledgement."""
    assert ack.disposition == "durable_prefix"
    fields: dict[str, Any] = {
        "source_capture_key": capture_key(ack.rollout_id, ack.attempt_index),
        "source_model_call_id": ack.model_call_id,
        "staging_keys": ack.staging_keys,
        "generation_token_count": ack.prefix_token_count,
        "digest": ack.prefix_digest,
        "effective_output_limit": ack.effective_output_limit,
        "terminal_finish_reason": ack.terminal_finish_reason,
        "terminal_stop_reason": ack.terminal_stop_reason,
    }
    fields.update(overrides)
    return GenerationCutContinuation(**fields)
