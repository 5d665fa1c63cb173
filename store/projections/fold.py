"""Projections: pure folds of events into table rows, applied inline and on replay.

The live path and ``replay`` run the same fold functions, so a rebuilt projection can be
compared with the live one row for row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np

from store.errors import CorruptRecordError
from store.log.events import (
    LEDGER_KINDS,
    RECORD_KINDS,
    RETENTION_KINDS,
    TOKEN_KINDS,
    WORKER_KINDS,
    AdmissionBody,
    CutReceiptBody,
    EventKind,
    KeysClearedBody,
    RecordBody,
    Span,
    TombstoneBody,
    WorkerBody,
)
from store.log.schema import version_key
from store.wire.columns import FloatColumn, carry_count

D = TypeVar("D")
_SPANS_ENCODER = msgspec.msgpack.Encoder()
_SPANS_DECODER = msgspec.msgpack.Decoder(list[tuple[int, int, int]])

RECEIPT_STREAM = "__cut_receipts__"
# Streams of a capture key that are not calls: its fences and tombstones, and its ledger rows
# (``LEDGER_PREFIX + model_call_id``, apart from the call's own stream and its versions).
ROLLOUT_STREAM = "__rollout__"
LEDGER_PREFIX = "__ledger__/"
ROLLOUT_KINDS = RETENTION_KINDS | LEDGER_KINDS
WORKERS_STREAM = "__policy_workers__"  # worker events: one stream per pid


@dataclass(frozen=True)
class Event:
    """One decoded event, as the folds see it."""

    seq: int
    kind: EventKind
    rollout_id: str
    model_call_id: str
    stream_version: int
    staging_key: str | None
    body: Any


@dataclass(frozen=True)
class CallState:
    """One row of the ``calls`` projection."""

    rollout_id: str
    model_call_id: str
    stream_version: int
    state: str
    parent_call_id: str | None = None
    mode: str | None = None
    prev_len: int | None = None
    cum_len: int | None = None
    generated_tokens: int = 0
    chain_hash: str | None = None
    cumulative_hash: str | None = None
    continues_rollout_id: str | None = None
    continues_model_call_id: str | None = None
    admitted_version: int | None = None
    spans: tuple[Span, ...] = field(default=())
    last_seq: int = 0

    @property
    def oldest_version(self) -> int | None:
        return min((s[2] for s in self.spans), default=None)

    @property
    def newest_version(self) -> int | None:
        return max((s[2] for s in self.spans), default=None)

    def to_row(self) -> dict[str, Any]:
        return dict(zip(CALL_ROW_COLUMNS, self.row_values(), strict=True))

    def row_values(self) -> tuple[Any, ...]:
        """The row's values in ``CALL_ROW_COLUMNS`` order (the calls table's column order)."""
        spans = self.spans
        if len(spans) == 1:  # the common case: one version generated the call
            oldest: str | None = version_key(spans[0][2])
            newest: str | None = oldest
        elif spans:
            versions = [span[2] for span in spans]
            oldest = version_key(min(versions))
            newest = version_key(max(versions))
        else:
            oldest = newest = None
        admitted = self.admitted_version
        return (
            self.rollout_id,
            self.model_call_id,
            self.stream_version,
            self.state,
            self.parent_call_id,
            self.mode,
            self.prev_len,
            self.cum_len,
            self.generated_tokens,
            self.chain_hash,
            self.cumulative_hash,
            self.continues_rollout_id,
            self.continues_model_call_id,
            None if admitted is None else version_key(admitted),
            oldest,
            newest,
            _SPANS_ENCODER.encode(spans),  # a tuple packs as the same msgpack array as a list
            self.last_seq,
        )

    @classmethod
    def from_row(cls, row: Any) -> CallState:
        values = dict(row._mapping) if hasattr(row, "_mapping") else dict(row)
        try:
            return cls._decoded(values)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            call = f"{values.get('rollout_id')!r}/{values.get('model_call_id')!r}"
            message = f"the calls row of {call} is damaged ({exc}); replay(repair=True) rebuilds it"
            raise CorruptRecordError(message) from exc

    @classmethod
    def _decoded(cls, values: dict[str, Any]) -> CallState:
        admitted = values["admitted_version"]
        return cls(
            rollout_id=values["rollout_id"],
            model_call_id=values["model_call_id"],
            stream_version=values["stream_version"],
            state=values["state"],
            parent_call_id=values["parent_call_id"],
            mode=values["mode"],
            prev_len=values["prev_len"],
            cum_len=values["cum_len"],
            generated_tokens=values["generated_tokens"],
            chain_hash=values["chain_hash"],
            cumulative_hash=values["cumulative_hash"],
            continues_rollout_id=values["continues_rollout_id"],
            continues_model_call_id=values["continues_model_call_id"],
            admitted_version=None if admitted is None else int(admitted),
            spans=tuple(_SPANS_DECODER.decode(bytes(values["version_spans"]))),
            last_seq=values["last_seq"],
        )


CALL_ROW_COLUMNS = (
    "rollout_id",
    "model_call_id",
    "stream_version",
    "state",
    "parent_call_id",
    "mode",
    "prev_len",
    "cum_len",
    "generated_tokens",
    "chain_hash",
    "cumulative_hash",
    "continues_rollout_id",
    "continues_model_call_id",
    "admitted_version",
    "oldest_version",
    "newest_version",
    "version_spans",
    "last_seq",
)


@dataclass(frozen=True)
class KeyState:
    """One row of the ``staged_keys`` projection."""

    event_seq: int
    rollout_id: str
    model_call_id: str
    digest: str


TERMINAL_STATES = frozenset({"completed", "failed"})


def affects_call(kind: EventKind) -> bool:
    return (
        kind is not EventKind.CUT_RECEIPT
        and kind not in ROLLOUT_KINDS
        and kind not in WORKER_KINDS
        and kind not in TOKEN_KINDS
    )


def fenced_kind(kind: EventKind) -> bool:
    """Whether a fence on the event's capture key refuses it (all but fences and tombstones)."""
    return kind not in RETENTION_KINDS


@dataclass(frozen=True)
class RolloutState:
    """One row of the ``rollouts`` projection: a capture key's fence, ledger counts, deletions.

    Only capture keys with a ledger row or a retention event have one, so staging pays a
    single indexed read (the fence check) and no write here.
    """

    rollout_id: str
    state: str = "active"  # active, retired, deleted, forgotten
    fenced: bool = False
    fence_seq: int | None = None
    ledger_rows: int = 0
    ledger_failures: int = 0
    deletions: int = 0
    deleted_events: int = 0
    last_seq: int = 0

    def to_row(self) -> dict[str, Any]:
        return {**self.__dict__, "fenced": int(self.fenced)}

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> RolloutState:
        values = dict(zip(ROLLOUT_COLUMNS, row, strict=True))
        values["fenced"] = bool(values["fenced"])
        return cls(**values)


ROLLOUT_COLUMNS = tuple(RolloutState.__dataclass_fields__)


def fold_rollout(current: RolloutState | None, event: Event) -> RolloutState | None:
    """The rollouts row after ``event``; None when the event does not touch it."""
    kind = event.kind
    if kind not in ROLLOUT_KINDS:
        return current
    base = current or RolloutState(event.rollout_id)
    seq = event.seq
    if kind is EventKind.LEDGER_RECORDED:
        return _moved_rollout(base, ledger_rows=base.ledger_rows + 1, last_seq=seq)
    if kind is EventKind.LEDGER_FAILED:
        return _moved_rollout(base, ledger_failures=base.ledger_failures + 1, last_seq=seq)
    if kind is EventKind.ROLLOUT_RETIRED:
        return _moved_rollout(base, state="retired", fenced=True, fence_seq=seq, last_seq=seq)
    if kind is EventKind.ROLLOUT_FORGOTTEN:
        return _moved_rollout(base, state="forgotten", fenced=False, fence_seq=None, last_seq=seq)
    body = event.body
    assert isinstance(body, TombstoneBody)
    # The delete removed the ledger rows (and, unless ledger_only, the staged records) and the fence.
    return _moved_rollout(
        base,
        state="deleted",
        fenced=False,
        fence_seq=None,
        ledger_rows=0,
        ledger_failures=0,
        deletions=base.deletions + 1,
        deleted_events=base.deleted_events + body.events,
        last_seq=seq,
    )


def _moved_rollout(base: RolloutState, **changes: Any) -> RolloutState:
    return RolloutState(**{**base.__dict__, **changes})


def filled(cls: type[D], fields: dict[str, Any]) -> D:
    """An instance of the frozen dataclass ``cls`` whose ``__dict__`` is ``fields`` (every
    field, in any order).

    The folds run once per event on the write path and on every pass over the log, and the
    append and every read build an ``Event`` per event.  A frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__``, which was most of a fold; the instance
    takes the dictionary built for it instead.  Only for classes with no ``__post_init__``
    and no slots (``CallState``, ``KeyState``, ``Event``): the result is the same object.
    """
    made = _new_object(cls)
    _set_fields(made, "__dict__", fields)
    return made


_new_object = object.__new__
_set_fields = object.__setattr__
_BLANK_FIELDS = CallState("", "", 0, "admitted").__dict__  # a call's row before its first event


# The kinds ``fold_call`` tells apart, as module globals: a class attribute of an Enum is a
# slower lookup, and the folds run once per event.
_ADMITTED = EventKind.CALL_ADMITTED
_COMPLETED = EventKind.CALL_COMPLETED
_PREFIX = EventKind.PREFIX_STAGED
_CHUNK = EventKind.CHUNK_STAGED
_FAILED = EventKind.CALL_FAILED


def fold_call(current: CallState | None, event: Event) -> CallState:
    """The calls row after ``event`` (which belongs to that call's stream)."""
    # The new row is one dict display over the current one (or the blank row), named for the
    # event's stream (the current row's own names): one dictionary and one object per event.
    base = _BLANK_FIELDS if current is None else current.__dict__
    rollout_id, model_call_id = event.rollout_id, event.model_call_id
    kind, body = event.kind, event.body
    version, seq = event.stream_version, event.seq
    if kind is _ADMITTED and base["state"] in TERMINAL_STATES:
        # The capture refuses to admit a finished call again; an admission that reached the
        # log anyway (a racing worker) must not hide the call's staged terminal record.
        return filled(
            CallState,
            {
                **base,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "stream_version": version,
                "last_seq": seq,
            },
        )
    if kind is _ADMITTED:
        assert isinstance(body, AdmissionBody)
        continuation = body.continues
        return filled(
            CallState,
            {
                **base,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "stream_version": version,
                "last_seq": seq,
                "state": "admitted",
                "parent_call_id": body.parent_call_id,
                "mode": body.mode,
                "prev_len": body.prev_len,
                "continues_rollout_id": continuation[0] if continuation else None,
                "continues_model_call_id": continuation[1] if continuation else None,
                "admitted_version": body.weight_version,
                "cum_len": body.prev_len + body.restored_delta_len if continuation else None,
                "spans": merge_spans(body.restored_spans),
                "generated_tokens": _generated(body.restored_spans),
            },
        )
    if kind is _COMPLETED or kind is _PREFIX:
        assert isinstance(body, RecordBody)
        spans = body.spans
        return filled(
            CallState,
            {
                **base,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "stream_version": version,
                "last_seq": seq,
                "state": "completed" if kind is _COMPLETED else _live(base["state"], "staging"),
                "parent_call_id": body.parent_call_id,
                "mode": body.mode,
                "prev_len": body.prev_len,
                "cum_len": body.cum_len,
                "chain_hash": body.chain_hash,
                "cumulative_hash": body.cumulative_hash,
                "spans": merge_spans(spans),
                "generated_tokens": _generated(spans),
            },
        )
    if kind is _CHUNK:
        assert isinstance(body, RecordBody)
        merged = merge_spans([*base["spans"], *body.spans])
        return filled(
            CallState,
            {
                **base,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "stream_version": version,
                "last_seq": seq,
                "state": _live(base["state"], "staging"),
                "cum_len": (base["cum_len"] or body.prev_len) + body.delta_len,
                "spans": merged,
                "generated_tokens": _generated(merged),
            },
        )
    if kind is _FAILED:
        return filled(
            CallState,
            {
                **base,
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "stream_version": version,
                "last_seq": seq,
                "state": "failed",
            },
        )
    return filled(
        CallState,
        {**base, "rollout_id": rollout_id, "model_call_id": model_call_id, "stream_version": version, "last_seq": seq},
    )  # keys cleared: only the stream position moves


def _live(current: str, new: str) -> str:
    return current if current in TERMINAL_STATES else new


def _generated(spans: Any) -> int:
    if len(spans) == 1:  # the common case: one version generated the whole delta
        start, end, _ = spans[0]
        return end - start  # type: ignore[no-any-return]
    return sum(end - start for start, end, _ in spans)


def fold_keys(event: Event) -> tuple[dict[str, KeyState], list[str]]:
    """Keys the event adds, and keys it withdraws."""
    if event.kind in RECORD_KINDS:
        key, seq, rollout_id, model_call_id, digest = staged_key_row(event)
        state = filled(
            KeyState, {"event_seq": seq, "rollout_id": rollout_id, "model_call_id": model_call_id, "digest": digest}
        )
        return {key: state}, []
    if event.kind is EventKind.KEYS_CLEARED:
        assert isinstance(event.body, KeysClearedBody)
        return {}, list(event.body.staging_keys)
    return {}, []


def staged_key_row(event: Event) -> tuple[str, int, str, str, str]:
    """The ``staged_keys`` row a record event stages, in column order (``fold_keys``' KeyState
    is made from it; a pass over the log keeps the row itself)."""
    key = event.staging_key
    assert key is not None
    return (key, event.seq, event.rollout_id, event.model_call_id, event.body.digest)


def fold_receipt(event: Event) -> tuple[tuple[str, str], int] | None:
    if event.kind is EventKind.CUT_RECEIPT:
        assert isinstance(event.body, CutReceiptBody)
        return (event.body.checkpoint_id, event.body.inventory_digest), event.seq
    return None


@dataclass(frozen=True)
class WorkerState:
    """One row of the ``workers`` projection: a policy worker process, keyed by its join event."""

    join_seq: int
    pid: int
    worker_index: int
    expected: int
    state: str  # connected, stopped or lost
    left_seq: int | None = None
    blocked_checkpoint: str | None = None

    def to_row(self) -> dict[str, Any]:
        return dict(self.__dict__)


_LEFT = {EventKind.WORKER_STOPPED: "stopped", EventKind.WORKER_LOST: "lost"}


def worker_key(event: Event) -> int | None:
    """The ``workers`` row a worker event folds into (None for other events)."""
    if event.kind not in WORKER_KINDS:
        return None
    body = event.body
    assert isinstance(body, WorkerBody)
    return event.seq if event.kind is EventKind.WORKER_JOINED or body.joined_seq is None else body.joined_seq


def fold_worker(current: WorkerState | None, event: Event) -> WorkerState:
    """The ``workers`` row after a worker event (a leave whose join was never logged starts a row)."""
    body = event.body
    assert isinstance(body, WorkerBody)
    key = worker_key(event)
    assert key is not None
    base = current or WorkerState(key, body.pid, body.index, body.expected, "connected")
    if event.kind is EventKind.WORKER_JOINED:
        return base
    return WorkerState(
        base.join_seq, base.pid, base.worker_index, base.expected, _LEFT[event.kind], event.seq, body.checkpoint_id
    )


def merge_spans(spans: Sequence[Span]) -> tuple[Span, ...]:
    """Join adjacent spans of the same version."""
    if len(spans) == 1:  # the common case: nothing to join
        start, end, version = spans[0]
        return ((start, end, version),)
    merged: list[Span] = []
    for start, end, version in spans:
        if merged and merged[-1][1] == start and merged[-1][2] == version:
            merged[-1] = (merged[-1][0], end, version)
        else:
            merged.append((start, end, version))
    return tuple(merged)


def generated_spans(mask: FloatColumn, version: int, offset: int = 0) -> list[Span]:
    """One span per contiguous run of generated (mask 1.0) positions."""
    carry = carry_count(mask)
    if carry is not None:
        length = len(mask)
        return [(offset + carry, offset + length, version)] if carry < length else []
    generated = np.concatenate(([False], mask.zero_one_flags()[1], [False]))
    edges = np.flatnonzero(generated[1:] != generated[:-1])
    return [(offset + int(a), offset + int(b), version) for a, b in zip(edges[::2], edges[1::2], strict=True)]
