"""The event types of the log and their msgpack bodies.

Bodies evolve only by appending fields with defaults (msgspec schema evolution), so an
old log always replays under new code.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from store.wire.records import StagedCallRecord


class EventKind(enum.StrEnum):
    CALL_ADMITTED = "call_admitted"
    PREFIX_STAGED = "prefix_staged"
    CHUNK_STAGED = "chunk_staged"
    CALL_COMPLETED = "call_completed"
    CALL_FAILED = "call_failed"
    KEYS_CLEARED = "keys_cleared"
    CUT_RECEIPT = "cut_receipt"
    ROLLOUT_RETIRED = "rollout_retired"
    ROLLOUT_DELETED = "rollout_deleted"
    ROLLOUT_FORGOTTEN = "rollout_forgotten"
    LEDGER_RECORDED = "ledger_recorded"
    LEDGER_FAILED = "ledger_failed"
    WORKER_JOINED = "worker_joined"
    WORKER_STOPPED = "worker_stopped"
    WORKER_LOST = "worker_lost"
    # The complete-record transport (``store.transport``): Gym's TokenSink/TokenSource.
    TOKENS_PUT = "tokens_put"
    TOKENS_INTENT = "tokens_intent"
    TOKENS_INCOMPLETE = "tokens_incomplete"
    TOKENS_FROZEN = "tokens_frozen"
    TOKENS_DROPPED = "tokens_dropped"


RECORD_KINDS = frozenset({EventKind.PREFIX_STAGED, EventKind.CHUNK_STAGED, EventKind.CALL_COMPLETED})
# Fences and tombstones of a capture key: never refused by a fence, never removed by a delete.
RETENTION_KINDS = frozenset({EventKind.ROLLOUT_RETIRED, EventKind.ROLLOUT_DELETED, EventKind.ROLLOUT_FORGOTTEN})
LEDGER_KINDS = frozenset({EventKind.LEDGER_RECORDED, EventKind.LEDGER_FAILED})
WORKER_KINDS = frozenset({EventKind.WORKER_JOINED, EventKind.WORKER_STOPPED, EventKind.WORKER_LOST})
TOKEN_KINDS = frozenset(
    {
        EventKind.TOKENS_PUT,
        EventKind.TOKENS_INTENT,
        EventKind.TOKENS_INCOMPLETE,
        EventKind.TOKENS_FROZEN,
        EventKind.TOKENS_DROPPED,
    }
)

# (start, end, version): delta positions [start, end) of the call's record were generated
# by that policy version.  Carried prompt tokens belong to no span.
Span = tuple[int, int, int]


class Completion(msgspec.Struct, kw_only=True):
    """How a tracked call finished: what a later cut needs to acknowledge it from the log."""

    effective_output_limit: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RecordBody(msgspec.Struct, kw_only=True):
    """A staged record without its token columns (those are stored packed beside it)."""

    schema_version: int
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: str
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    extras_digest: str
    chain_hash: str
    cumulative_hash: str
    extras: dict[str, Any] | None = None
    spans: list[Span] = []
    completion: Completion | None = None


def record_body(record: StagedCallRecord, spans: list[Span], completion: Completion | None = None) -> RecordBody:
    """The body of a record event: the record without its packed columns, plus its spans."""
    return RecordBody(
        schema_version=record.schema_version,
        rollout_id=record.rollout_id,
        model_call_id=record.model_call_id,
        parent_call_id=record.parent_call_id,
        mode=record.mode,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        extras_digest=record.extras_digest,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
        extras=record.extras,
        spans=spans,
        completion=completion,
    )


class AdmissionBody(msgspec.Struct, kw_only=True):
    """An accepted admission: identity and lineage, its stamped version, what it continues.

    The inline prefix is not repeated here: those tokens are the parent's, bound by
    ``parent_chain_hash``.  ``restored_spans`` are the policy versions of a restored cut.
    """

    schema_version: int
    parent_call_id: str | None
    mode: str
    prev_len: int
    parent_chain_hash: str | None
    weight_version: int
    staging_chain: list[str] = []
    generation_cut: bytes | None = None  # the GenerationCutContinuation as JSON
    continues: tuple[str, str] | None = None  # (source capture key, source model call id)
    restored_spans: list[Span] = []
    restored_delta_len: int = 0  # delta tokens of the restored cut (carry + generated)


class FailureBody(msgspec.Struct, kw_only=True):
    reason: str


class KeysClearedBody(msgspec.Struct, kw_only=True):
    staging_keys: list[str]
    reason: str


class CutReceiptBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    checkpoint_id: str
    inventory_digest: str
    receipt: bytes  # the GenerationCutReceipt as JSON, byte for byte
    # Where its durable_prefix acknowledgements are durable: "local" (the store that served
    # the cut; left out of the bytes, so a local receipt encodes as before) or "replicated"
    # (every record they name was in the store's replica before the receipt was written).
    domain: str = "local"


class FenceBody(msgspec.Struct, kw_only=True):
    """A fence set (retired) or removed (forgotten) on a capture key."""

    reason: str = ""


class TombstoneBody(msgspec.Struct, kw_only=True):
    """What a delete removed, so an audit can explain the gap it left in the log.

    ``checksum`` is an xxh3-128 over the removed events' own checksums in sequence order.
    ``ledger_only``: only the capture ledger's rows went (the staged records stayed).
    """

    first_seq: int
    last_seq: int
    events: int
    records: int
    stored_bytes: int
    checksum: bytes
    ledger_only: bool = False


class LedgerRecordBody(msgspec.Struct, kw_only=True):
    """One capture-ledger commit: the ``CaptureLedgerCommit`` as JSON, byte for byte, and the
    assistant fingerprint of its conversation (request + response), which children match."""

    commit: bytes
    fingerprint: str | None = None


class WorkerBody(msgspec.Struct, kw_only=True):
    """A policy worker process joined, stopped or was lost (logged by the checkpoint coordinator).

    ``joined_seq`` is its join event; ``checkpoint_id`` the open checkpoint its leaving blocked.
    """

    pid: int
    index: int
    expected: int
    connected: int
    joined_seq: int | None = None
    checkpoint_id: str | None = None


class TokenPutBody(msgspec.Struct, kw_only=True):
    """One complete record put through the transport: Gym's ``TokenEntry`` as canonical JSON
    (sorted keys), byte for byte, and what the projection and the lineage resolver read of it
    without parsing it again (each checked against ``payload`` when it was put, and by the audit)."""

    model_call_id: str
    payload: bytes
    payload_digest: str  # SHA-256 of ``payload``: an identical re-put is a no-op, any other a conflict
    token_digest: str | None = None  # the entry's own ``digest`` (Gym's token digest of its cumulative ids)
    cum_len: int | None = None
    parent_call_id: str | None = None
    prompt_is_delta: bool = False
    fingerprint: str = ""  # ``continuation_fingerprint``
    fingerprint_version: int | None = None
    context_len: int = 0
    context_digest: str = ""


class TokenCallBody(msgspec.Struct, kw_only=True):
    """A call named by the transport: a pre-dispatch intent (``begin_call``) or a lost call
    (``mark_incomplete``; the call may be empty)."""

    model_call_id: str


class TokenFrozenBody(msgspec.Struct, kw_only=True):
    snapshot_id: str


class TokenDroppedBody(msgspec.Struct, kw_only=True):
    """The frozen snapshot a consumer retired (its id and version, as it consumed them)."""

    snapshot_id: str
    version: int


BODY_TYPES: dict[EventKind, type[msgspec.Struct]] = {
    EventKind.CALL_ADMITTED: AdmissionBody,
    EventKind.PREFIX_STAGED: RecordBody,
    EventKind.CHUNK_STAGED: RecordBody,
    EventKind.CALL_COMPLETED: RecordBody,
    EventKind.CALL_FAILED: FailureBody,
    EventKind.KEYS_CLEARED: KeysClearedBody,
    EventKind.CUT_RECEIPT: CutReceiptBody,
    EventKind.ROLLOUT_RETIRED: FenceBody,
    EventKind.ROLLOUT_DELETED: TombstoneBody,
    EventKind.ROLLOUT_FORGOTTEN: FenceBody,
    EventKind.LEDGER_RECORDED: LedgerRecordBody,
    EventKind.LEDGER_FAILED: FailureBody,
    EventKind.WORKER_JOINED: WorkerBody,
    EventKind.WORKER_STOPPED: WorkerBody,
    EventKind.WORKER_LOST: WorkerBody,
    EventKind.TOKENS_PUT: TokenPutBody,
    EventKind.TOKENS_INTENT: TokenCallBody,
    EventKind.TOKENS_INCOMPLETE: TokenCallBody,
    EventKind.TOKENS_FROZEN: TokenFrozenBody,
    EventKind.TOKENS_DROPPED: TokenDroppedBody,
}

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(body) for kind, body in BODY_TYPES.items()}


def encode_body(body: msgspec.Struct) -> bytes:
    return _ENCODER.encode(body)


def decode_body(kind: EventKind, data: bytes) -> Any:
    return _DECODERS[kind].decode(data)
