"""The complete-record transport's projections: pure folds of ``tokens_*`` events into the
``token_rollouts`` and ``token_entries`` rows, run inline by the append and again by replay.

A rollout's transport events share one stream (``TOKEN_STREAM``), so its observable
``version`` is the number of transport events folded: every put, intent, mark, freeze and drop
moves it, which is what makes a consumer's stale conditional drop fail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec

from store.log.events import EventKind, TokenCallBody, TokenDroppedBody, TokenFrozenBody, TokenPutBody
from store.projections.fold import Event

TOKEN_STREAM = "__tokens__"

_INTENTS_ENCODER = msgspec.msgpack.Encoder()
_INTENTS_DECODER = msgspec.msgpack.Decoder(tuple[str, ...])
_NO_INTENTS = _INTENTS_ENCODER.encode(())


@dataclass(frozen=True)
class TokenRolloutState:
    """One ``token_rollouts`` row."""

    rollout_id: str
    version: int = 0
    frozen: bool = False
    snapshot_id: str | None = None
    incomplete: bool = False
    dropped: bool = False
    entries: int = 0
    open_intents: tuple[str, ...] = ()  # calls with an intent and no entry yet, sorted
    last_seq: int = 0

    def row_values(self) -> tuple[Any, ...]:
        """The row in column order (the live tables' tuple form)."""
        return (
            self.rollout_id,
            self.version,
            int(self.frozen),
            self.snapshot_id,
            int(self.incomplete),
            int(self.dropped),
            self.entries,
            _INTENTS_ENCODER.encode(self.open_intents) if self.open_intents else _NO_INTENTS,
            self.last_seq,
        )

    def to_row(self) -> dict[str, Any]:
        return dict(zip(TOKEN_ROLLOUT_COLUMNS, self.row_values(), strict=True))

    @classmethod
    def from_row(cls, row: Any) -> TokenRolloutState:
        rollout_id, version, frozen, snapshot_id, incomplete, dropped, entries, intents, last_seq = row
        return cls(
            rollout_id=rollout_id,
            version=int(version),
            frozen=bool(frozen),
            snapshot_id=snapshot_id,
            incomplete=bool(incomplete),
            dropped=bool(dropped),
            entries=int(entries),
            open_intents=_INTENTS_DECODER.decode(bytes(intents)),
            last_seq=int(last_seq),
        )

    @property
    def masked(self) -> bool:
        """Whether a snapshot of the rollout must be marked incomplete: a call was marked lost,
        or a call's intent has no entry (it was dispatched and its record never came)."""
        return self.incomplete or bool(self.open_intents)


TOKEN_ROLLOUT_COLUMNS = (
    "rollout_id",
    "version",
    "frozen",
    "snapshot_id",
    "incomplete",
    "dropped",
    "entries",
    "open_intents",
    "last_seq",
)


def fold_token_rollout(current: TokenRolloutState | None, event: Event, *, new_entry: bool = True) -> TokenRolloutState:
    """The ``token_rollouts`` row after a transport event of its rollout.  ``new_entry``: a put
    names a call with no entry yet (the append only writes such puts; replay folds what it finds)."""
    base = current or TokenRolloutState(event.rollout_id)
    kind, body = event.kind, event.body
    moved = replace(base, version=base.version + 1, last_seq=event.seq)
    if kind is EventKind.TOKENS_PUT:
        assert isinstance(body, TokenPutBody)
        intents = tuple(call for call in base.open_intents if call != body.model_call_id)
        return replace(moved, entries=base.entries + int(new_entry), open_intents=intents)
    if kind is EventKind.TOKENS_INTENT:
        assert isinstance(body, TokenCallBody)
        return replace(moved, open_intents=tuple(sorted({*base.open_intents, body.model_call_id})))
    if kind is EventKind.TOKENS_INCOMPLETE:
        return replace(moved, incomplete=True)
    if kind is EventKind.TOKENS_FROZEN:
        assert isinstance(body, TokenFrozenBody)
        return replace(moved, frozen=True, snapshot_id=body.snapshot_id)
    assert kind is EventKind.TOKENS_DROPPED and isinstance(body, TokenDroppedBody)
    return replace(moved, dropped=True)


TOKEN_ENTRY_COLUMNS = (
    "rollout_id",
    "model_call_id",
    "event_seq",
    "payload_digest",
    "token_digest",
    "cum_len",
    "parent_call_id",
    "prompt_is_delta",
    "fingerprint",
    "fingerprint_version",
    "context_len",
    "context_digest",
)


def token_entry_row(event: Event) -> tuple[Any, ...]:
    """The ``token_entries`` row a ``tokens_put`` event adds, in column order."""
    body = event.body
    assert isinstance(body, TokenPutBody)
    return (
        event.rollout_id,
        body.model_call_id,
        event.seq,
        body.payload_digest,
        body.token_digest,
        body.cum_len,
        body.parent_call_id,
        int(body.prompt_is_delta),
        body.fingerprint,
        body.fingerprint_version,
        body.context_len,
        body.context_digest,
    )
