"""Generation-cut wire records (wire-contract 5.2): inventory, acknowledgements, receipt."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from store.errors import InvalidRecordError
from store.wire import continuations
from store.wire import field_checks as check
from store.wire.records import (
    FinishReason,
    GenerationCutContinuation,
)

_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
GENERATION_CUT_KEY_PREFIX = "__generation_cut__"


def capture_key(rollout_id: str, attempt_index: int) -> str:
    """The capture key of an attempt: the bare rollout id for attempt 0, else ``{id}-a{n}``."""
    return rollout_id if attempt_index == 0 else f"{rollout_id}-a{attempt_index}"


def split_capture_key(key: str, rollout_id: str) -> int:
    """The attempt index of capture key ``key`` of rollout ``rollout_id`` (``capture_key``'s inverse).

    The rollout id is needed: an id may itself end in ``-a1``, so ``x-a1`` alone could be attempt
    1 of ``x`` or attempt 0 of ``x-a1``.  A key that is no attempt of the rollout is refused.
    """
    if not isinstance(key, str) or not isinstance(rollout_id, str) or not rollout_id:
        raise InvalidRecordError(f"split_capture_key needs two non-empty strings, got {key!r} and {rollout_id!r}")
    if key == rollout_id:
        return 0
    suffix = key.removeprefix(f"{rollout_id}-a")
    if suffix != key and suffix.isascii() and suffix.isdigit() and not suffix.startswith("0"):
        return int(suffix)
    raise InvalidRecordError(f"{key!r} is not a capture key of rollout {rollout_id!r} (expected it or {rollout_id}-aN)")


def chunk_staging_key(checkpoint_id: str, capture: str, model_call_id: str, sequence: int) -> str:
    return f"{GENERATION_CUT_KEY_PREFIX}/{checkpoint_id}/{capture}/{model_call_id}/{sequence}"


def is_cut_key_of(key: str, capture: str, model_call_id: str) -> bool:
    """Whether ``key`` is a cut or flush chunk key (``chunk_staging_key``) of this call, at any checkpoint."""
    prefix, call = f"{GENERATION_CUT_KEY_PREFIX}/", f"/{capture}/{model_call_id}"
    head, _, sequence = key.rpartition("/")
    return (
        sequence.isascii()
        and sequence.isdigit()
        and head.startswith(prefix)
        and head.endswith(call)
        and len(head) > len(prefix) + len(call)  # a non-empty checkpoint id between them
    )


class _CutWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class GenerationCutPrefix(_CutWire, frozen=True, kw_only=True):
    """One in-flight call the policy model asks a worker to cut."""

    ticket_id: str
    rollout_id: str
    attempt_index: int
    model_call_id: str
    admitted_at: float | int  # an int stays an int when decoded (msgspec would make 1 into 1.0), and is refused

    def __post_init__(self) -> None:
        name = "GenerationCutPrefix"
        check.identifier(name, "ticket_id", self.ticket_id)
        if not isinstance(self.rollout_id, str) or not _ROLLOUT_ID.fullmatch(self.rollout_id):
            raise check.fail(
                name, f"rollout_id must be letters, digits, '.', '_' or '-' (not first), got {self.rollout_id!r}"
            )
        check.non_negative(name, "attempt_index", self.attempt_index)
        check.identifier(name, "model_call_id", self.model_call_id)
        check.strict_float(name, "admitted_at", self.admitted_at, optional=False)

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt_index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ticket_id": self.ticket_id,
            "rollout_id": self.rollout_id,
            "attempt_index": self.attempt_index,
            "model_call_id": self.model_call_id,
            "admitted_at": self.admitted_at,
        }


def inventory_digest(checkpoint_id: str, server_name: str, prefixes: Iterable[GenerationCutPrefix]) -> str:
    """SHA-256 of the inventory as JSON: sorted keys, compact separators, ASCII escaping."""
    payload = {
        "checkpoint_id": checkpoint_id,
        "server_name": server_name,
        "active_prefixes": [prefix.to_dict() for prefix in prefixes],
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


class GenerationCutInventory(_CutWire, frozen=True, kw_only=True):
    """The in-flight calls of one worker to cut at a checkpoint; build it with ``build``."""

    checkpoint_id: str
    server_name: str
    active_prefixes: tuple[GenerationCutPrefix, ...]
    inventory_digest: str

    def __post_init__(self) -> None:
        name = "GenerationCutInventory"
        check.identifier(name, "checkpoint_id", self.checkpoint_id)
        check.identifier(name, "server_name", self.server_name)
        prefixes = tuple(self.active_prefixes)
        msgspec.structs.force_setattr(self, "active_prefixes", prefixes)
        tickets = [prefix.ticket_id for prefix in prefixes]
        if tickets != sorted(tickets):
            raise check.fail(name, "active_prefixes must be sorted by ticket_id")
        check.unique(name, "ticket ids", tickets)
        check.digest_hex(name, "inventory_digest", self.inventory_digest)
        if inventory_digest(self.checkpoint_id, self.server_name, prefixes) != self.inventory_digest:
            raise check.fail(name, "inventory_digest does not match the inventory")

    @classmethod
    def build(
        cls, *, checkpoint_id: str, server_name: str, active_prefixes: Iterable[GenerationCutPrefix]
    ) -> GenerationCutInventory:
        """Sort the prefixes by ticket and compute the digest."""
        prefixes = tuple(sorted(active_prefixes, key=lambda prefix: prefix.ticket_id))
        return cls(
            checkpoint_id=checkpoint_id,
            server_name=server_name,
            active_prefixes=prefixes,
            inventory_digest=inventory_digest(checkpoint_id, server_name, prefixes),
        )


AckDisposition = Literal["durable_prefix", "durable_failure"]
CutKind = Literal["active_prefix", "terminal_completion"]


class GenerationCutPrefixAck(_CutWire, frozen=True, kw_only=True):
    """A worker's answer for one ticket: a durable prefix, or a durable failure."""

    ticket_id: str
    rollout_id: str
    attempt_index: int
    model_call_id: str
    admitted_at: float | int  # an int stays an int when decoded (msgspec would make 1 into 1.0), and is refused
    disposition: AckDisposition
    cut_kind: CutKind | None = None
    frozen_buffer_id: str | None = None
    staging_keys: tuple[str, ...] = ()
    prefix_token_count: int | None = None
    prefix_digest: str | None = None
    effective_output_limit: int | None = None
    terminal_finish_reason: FinishReason | None = None
    terminal_stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        name = "GenerationCutPrefixAck"
        GenerationCutPrefix.__post_init__(self)  # type: ignore[arg-type]  # same identity rules
        check.literal(name, "disposition", self.disposition, ("durable_prefix", "durable_failure"))
        msgspec.structs.force_setattr(self, "staging_keys", tuple(self.staging_keys))
        check.unique(name, "staging_keys", self.staging_keys)
        check.terminal_finish(name, self.terminal_finish_reason, self.terminal_stop_reason)
        payload = (
            self.cut_kind,
            self.frozen_buffer_id,
            self.prefix_token_count,
            self.prefix_digest,
            self.effective_output_limit,
        )
        if self.disposition == "durable_prefix":
            if any(value is None for value in payload) or not self.staging_keys:
                raise check.fail(
                    name, "durable_prefix requires cut_kind, frozen_buffer_id, staging_keys, count, digest, limit"
                )
            check.literal(name, "cut_kind", self.cut_kind, ("active_prefix", "terminal_completion"))
            check.identifier(name, "frozen_buffer_id", self.frozen_buffer_id)
            check.non_negative(name, "prefix_token_count", self.prefix_token_count)
            check.digest_hex(name, "prefix_digest", self.prefix_digest)
            check.positive(name, "effective_output_limit", self.effective_output_limit)
            over = continuations.token_count_within_limit(self.prefix_token_count, self.effective_output_limit)  # type: ignore[arg-type]
            if over is not None:
                raise check.fail(name, f"prefix_token_count: {over.message}")
        elif any(value is not None for value in payload) or self.staging_keys or self.terminal_finish_reason:
            raise check.fail(name, "durable_failure carries no cut payload")

    def continuation(self) -> GenerationCutContinuation:
        """What a replacement call continues (Gym's ``GenerationCutRecord.continuation``, 5.2):
        the source capture key is this ticket's, the rest is copied.  Only for ``durable_prefix``."""
        if self.disposition != "durable_prefix":
            raise check.fail("GenerationCutPrefixAck", "a durable_failure has no continuation")
        return GenerationCutContinuation(
            source_capture_key=capture_key(self.rollout_id, self.attempt_index),
            source_model_call_id=self.model_call_id,
            staging_keys=self.staging_keys,
            generation_token_count=self.prefix_token_count,  # type: ignore[arg-type]  # set for durable_prefix
            digest=self.prefix_digest,  # type: ignore[arg-type]
            effective_output_limit=self.effective_output_limit,  # type: ignore[arg-type]
            terminal_finish_reason=self.terminal_finish_reason,
            terminal_stop_reason=self.terminal_stop_reason,
        )

    def matches(self, prefix: GenerationCutPrefix) -> bool:
        return (self.rollout_id, self.attempt_index, self.model_call_id, self.admitted_at) == (
            prefix.rollout_id,
            prefix.attempt_index,
            prefix.model_call_id,
            prefix.admitted_at,
        )


class GenerationCutReceipt(_CutWire, frozen=True, kw_only=True):
    """A worker's receipt for one inventory."""

    checkpoint_id: str
    cut_id: str
    inventory_digest: str
    inventory: GenerationCutInventory
    backend_snapshot_id: str
    prefixes: tuple[GenerationCutPrefixAck, ...]

    def __post_init__(self) -> None:
        name = "GenerationCutReceipt"
        for field in ("checkpoint_id", "cut_id", "backend_snapshot_id"):
            check.identifier(name, field, getattr(self, field))
        check.digest_hex(name, "inventory_digest", self.inventory_digest)
        msgspec.structs.force_setattr(self, "prefixes", tuple(self.prefixes))

    def validate_for(self, inventory: GenerationCutInventory) -> None:
        """Refuse a receipt that does not answer exactly this inventory."""
        name = "GenerationCutReceipt"
        if self.inventory != inventory or self.inventory_digest != inventory.inventory_digest:
            raise check.fail(name, "the receipt is for a different inventory")
        if self.checkpoint_id != inventory.checkpoint_id:
            raise check.fail(name, "the receipt is for a different checkpoint")
        tickets = {prefix.ticket_id: prefix for prefix in inventory.active_prefixes}
        seen: set[str] = set()
        for ack in self.prefixes:
            if ack.ticket_id not in tickets or ack.ticket_id in seen:
                raise check.fail(name, f"ticket {ack.ticket_id!r} is unknown or acknowledged twice")
            seen.add(ack.ticket_id)
            if not ack.matches(tickets[ack.ticket_id]):
                raise check.fail(name, f"the acknowledgement of ticket {ack.ticket_id!r} does not match its call")
        if seen != set(tickets):
            raise check.fail(name, "every ticket must be acknowledged exactly once")
