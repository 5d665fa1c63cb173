"""An admitted call (``ActiveCall``), how a continued call goes on (``Continuation``), and the
record builders of wire-contract 4.7 and 4.8, which read only the call.

The capture and the cut server both build records through these functions, so neither
needs the other: ``capture`` -> ``cuts`` -> ``active_call``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from store.errors import CaptureDataError, CaptureError
from store.log.events import Span
from store.projections.fold import generated_spans
from store.wire.columns import FloatColumn, TokenIds
from store.wire.digest import build_staging_delta, compute_chain_hash, hash_token_columns, live_prefix_digest
from store.wire.records import CaptureAdmission, StagedCallBaseSnapshot, StagedCallRecord


@dataclass(frozen=True)
class Continuation:
    """How a replacement call continues a restored cut (wire-contract 5.6, 5.8)."""

    engine_prompt_token_ids: TokenIds
    restored_token_ids: TokenIds
    restored_logprobs: FloatColumn
    generation_token_count: int
    effective_output_limit: int
    terminal_finish_reason: str | None
    terminal_stop_reason: str | int | None

    @property
    def remaining_output_limit(self) -> int:
        return max(0, self.effective_output_limit - self.generation_token_count)

    def remaining_limits(self, min_tokens: int = 0) -> tuple[int, int]:
        """``(max_tokens, min_tokens)`` for the engine: both reduced by the restored count."""
        return self.remaining_output_limit, max(0, min_tokens - self.generation_token_count)

    @property
    def is_terminal(self) -> bool:
        """The restored prefix is the whole answer: the cut had finished, or the limit is reached."""
        return self.terminal_finish_reason is not None or self.remaining_output_limit == 0

    @property
    def finish_reason(self) -> str | None:
        if self.terminal_finish_reason is not None:
            return self.terminal_finish_reason
        return "length" if self.remaining_output_limit == 0 else None


class ActiveCall:
    """One admitted call: its admission, stamped version, resolved prefix and restored cut."""

    def __init__(
        self,
        admission: CaptureAdmission,
        weight_version: int,
        prefix_token_ids: TokenIds,
        generation_cut: StagedCallBaseSnapshot | None,
        restored_spans: Sequence[Span],
        admitted_at: float = 0.0,
        *,
        checks_tickets: bool = False,
    ) -> None:
        self.admission = admission
        # When it was admitted (the admission event's time in the log, and a manifest row's
        # ``admitted_at``); ``checks_tickets``: the orchestrator stamped it, so a cut ticket
        # for this call must carry the same time.
        self.admitted_at = admitted_at
        self.checks_tickets = checks_tickets
        self.weight_version = weight_version
        self.prefix_token_ids = prefix_token_ids
        self.generation_cut = generation_cut
        self.restored_spans: tuple[Span, ...] = tuple(restored_spans)
        self._completed = False
        self._completion_lock = threading.Lock()

    @property
    def capture_key(self) -> str:
        return self.admission.rollout_id

    @property
    def model_call_id(self) -> str:
        return self.admission.model_call_id

    @property
    def completed(self) -> bool:
        return self._completed

    @property
    def oldest_weight_version(self) -> int:
        if self.generation_cut is None:
            return self.weight_version
        return min(self.generation_cut.weight_version, self.weight_version)

    @functools.cached_property
    def continuation(self) -> Continuation | None:
        """For a call that continues a restored cut: its engine prompt and remaining budget.

        Built on first use and kept (it joins and selects over the whole restored prefix).
        """
        cut, continuation = self.generation_cut, self.admission.generation_cut
        if cut is None or continuation is None:
            return None
        ids, mask = cut.columns.token_ids, cut.columns.token_mask
        generated = mask.array == 1.0
        return Continuation(
            engine_prompt_token_ids=TokenIds.concat([self.prefix_token_ids, ids]),
            restored_token_ids=TokenIds(ids.array[generated].copy()),
            restored_logprobs=FloatColumn.coerce(cut.columns.log_probs.array[generated], "restored log-probs"),
            generation_token_count=continuation.generation_token_count,
            effective_output_limit=continuation.effective_output_limit,
            terminal_finish_reason=continuation.terminal_finish_reason,
            terminal_stop_reason=continuation.terminal_stop_reason,
        )

    def claim_completion(self) -> None:
        """Claim the call's single completion; a second claim is a caller bug."""
        with self._completion_lock:
            if self._completed:
                raise CaptureError(f"call {self.capture_key}/{self.model_call_id} already completed")
            self._completed = True

    def __repr__(self) -> str:
        return f"ActiveCall({self.capture_key}/{self.model_call_id}, weight_version={self.weight_version})"


# --- builders (4.7, 4.8) ---------------------------------------------------------------------


def build_prefix_record(
    call: ActiveCall,
    *,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    extras: Mapping[str, Any] | None = None,
) -> StagedCallRecord:
    """A validated snapshot of a live call, without touching its completion state."""
    check_active(call)
    admission = call.admission
    prompt = token_ids(prompt_token_ids, "prompt_token_ids")
    generated = token_ids(generated_token_ids, "generated_token_ids")
    logprobs = float_column(generated_logprobs, "generated_logprobs")
    if len(generated) != len(logprobs):
        raise CaptureDataError("generated token ids and log-probs lengths differ")
    prev_len = admission.prev_len
    if admission.mode == "token_in" and not np.array_equal(prompt.array[:prev_len], call.prefix_token_ids.array):
        raise CaptureDataError("the prompt does not start with the call's verified parent prefix")
    cut = call.generation_cut
    if cut is None:
        columns = build_staging_delta(prompt, generated, logprobs, prev_len)
        ids, mask, lps = columns.token_ids, columns.token_mask, columns.log_probs
    else:
        cut_columns = cut.columns
        prompt, generated, logprobs = _after_restored(call, cut, prompt, generated, logprobs)
        ids = TokenIds.concat([cut_columns.token_ids, generated])
        mask = FloatColumn.concat([cut_columns.token_mask, FloatColumn.filled(1.0, len(generated))])
        lps = FloatColumn.concat([cut_columns.log_probs, logprobs])
    return StagedCallRecord.from_components(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        mode="token_in" if admission.mode == "token_in" else "text",
        prev_len=prev_len,
        weight_version=call.oldest_weight_version,
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=lps,
        chain_hash=compute_chain_hash(admission.parent_chain_hash, ids),
        cumulative_hash=hash_token_columns(prompt, generated),
        extras=extras,
        schema_version=admission.schema_version,
    )


def prefix_digest(
    call: ActiveCall, *, prompt_token_ids: TokenIds, generated_token_ids: TokenIds, generated_logprobs: FloatColumn
) -> str:
    """``build_prefix_record(...).digest`` of a live call's own (validated) buffers, without the
    record: what a cut acknowledges once the call's first chunk holds the cumulative record."""
    admission = call.admission
    if call.generation_cut is not None:  # a continued call's columns start with its cut's: the record path
        return build_prefix_record(
            call,
            prompt_token_ids=prompt_token_ids,
            generated_token_ids=generated_token_ids,
            generated_logprobs=generated_logprobs,
        ).digest
    check_active(call)
    try:
        return live_prefix_digest(
            schema_version=admission.schema_version,
            rollout_id=admission.rollout_id,
            model_call_id=admission.model_call_id,
            parent_call_id=admission.parent_call_id,
            mode="token_in" if admission.mode == "token_in" else "text",
            prev_len=admission.prev_len,
            weight_version=call.oldest_weight_version,
            parent_chain_hash=admission.parent_chain_hash,
            prompt=prompt_token_ids,
            generated=generated_token_ids,
            generated_log_probs=generated_logprobs,
        )
    except ValueError as exc:
        raise CaptureDataError(str(exc)) from exc


def _after_restored(
    call: ActiveCall, cut: StagedCallBaseSnapshot, prompt: TokenIds, generated: TokenIds, logprobs: FloatColumn
) -> tuple[TokenIds, TokenIds, FloatColumn]:
    """The engine prompt of a continued call and the tokens it generated after its restored cut,
    from either shape of completion.

    The engine's shape: prompt = prefix + the cut's tokens, generated = the new tokens.  The
    natural shape: prompt = prefix + the cut's carried prompt tokens, generated = the restored
    tokens (with the log-probs the cut staged) followed by the new ones.
    """
    cut_ids = cut.columns.token_ids
    engine_prompt = TokenIds.concat([call.prefix_token_ids, cut_ids])
    if prompt == engine_prompt:
        return prompt, generated, logprobs
    restored = cut.generated_token_count
    carry = len(cut_ids) - restored
    if prompt != TokenIds.concat([call.prefix_token_ids, TokenIds(cut_ids.array[:carry])]):
        raise CaptureDataError(
            f"a continued call's prompt must be its prefix plus the cut's tokens ({len(call.prefix_token_ids)} + "
            f"{len(cut_ids)}, continuation.engine_prompt_token_ids) or its prefix plus the carried prompt "
            f"({len(call.prefix_token_ids)} + {carry}); got {len(prompt)} other tokens",
            "prompt",
        )
    if len(generated) < restored or not np.array_equal(generated.array[:restored], cut_ids.array[carry:]):
        raise CaptureDataError(
            f"completed with the natural prompt, the generated tokens must start with the {restored} restored tokens "
            "(continuation.restored_token_ids)",
            "prompt",
        )
    given = logprobs.array[:restored].astype(np.float32)
    staged = cut.columns.log_probs.array[carry:].astype(np.float32)
    differ = np.flatnonzero(given != staged)
    if len(differ):
        at = int(differ[0])
        raise CaptureDataError(
            f"the log-probs of the restored tokens differ from the cut's (position {at}: {float(given[at])!r} given, "
            f"{float(staged[at])!r} staged); pass continuation.restored_logprobs",
            "prompt",
        )
    new_ids = TokenIds(generated.array[restored:].copy())
    return engine_prompt, new_ids, FloatColumn.coerce(logprobs.array[restored:], "generated_logprobs")


def build_generation_chunk_record(
    call: ActiveCall, *, generated_token_ids: Sequence[int], generated_logprobs: Sequence[float]
) -> StagedCallRecord:
    """Only newly generated tokens, at the call's current version (chunk-local hashes)."""
    check_active(call)
    admission = call.admission
    ids = token_ids(generated_token_ids, "generated_token_ids")
    logprobs = float_column(generated_logprobs, "generated_logprobs")
    if not len(ids):
        raise CaptureDataError("a generation chunk needs at least one generated token")
    if len(ids) != len(logprobs):
        raise CaptureDataError("generated token ids and log-probs lengths differ")
    return StagedCallRecord.from_components(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        mode="token_in" if admission.mode == "token_in" else "text",
        prev_len=admission.prev_len,
        weight_version=call.weight_version,
        token_ids_delta=ids,
        token_mask_delta=FloatColumn.filled(1.0, len(ids)),
        generation_log_probs_delta=logprobs,
        chain_hash=compute_chain_hash(admission.parent_chain_hash, ids),
        cumulative_hash=hash_token_columns(call.prefix_token_ids, ids),
        schema_version=admission.schema_version,
    )


def record_spans(call: ActiveCall, record: StagedCallRecord) -> list[Span]:
    """Which policy version generated which positions of a record built for ``call``."""
    check_active(call)
    if not isinstance(record, StagedCallBaseSnapshot):
        raise CaptureError(f"record_spans needs a staged record, got {type(record).__name__}")
    restored = len(call.generation_cut.token_ids_delta) if call.generation_cut is not None else 0
    tail = record.columns.token_mask[restored:]
    return [*call.restored_spans, *generated_spans(tail, call.weight_version, offset=restored)]


def check_active(call: Any) -> None:
    """Refuse anything but an ``ActiveCall`` that ``begin_call`` returned."""
    if not isinstance(call, ActiveCall):
        raise CaptureError(f"expected the ActiveCall that begin_call returned, got {type(call).__name__}")


def token_ids(values: Sequence[int], name: str) -> TokenIds:
    try:
        return TokenIds.coerce(values, name)
    except ValueError as exc:
        raise CaptureDataError(str(exc)) from exc


def float_column(values: Sequence[float], name: str) -> FloatColumn:
    try:
        return FloatColumn.coerce(values, name)
    except ValueError as exc:
        raise CaptureDataError(str(exc)) from exc
