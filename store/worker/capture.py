"""``RolloutTokenCapture``: the worker side of token capture (wire-contract section 4).

Admission (``begin_call``) is validated against the log: a continued call's durable prefix
is resolved from its staged chunks and proven to extend the replacement's exact parent
tokens.  Builders produce records through ``StagedCallRecord.from_components`` so each
locally built record is hashed once; completion stages before it returns coordinates.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from store.errors import (
    AdmissionTypeError,
    CaptureError,
    DigestValueError,
    RolloutFencedError,
    StreamingUnsupportedError,
)
from store.log.events import AdmissionBody, EventKind, Span
from store.projections.fold import TERMINAL_STATES, generated_spans
from store.store import Store
from store.wire.columns import TokenIds
from store.wire.cut_records import GenerationCutInventory, GenerationCutReceipt
from store.wire.digest import compute_chain_hash, hash_token_columns, u64
from store.wire.records import (
    CaptureAdmission,
    CommitCoords,
    GenerationCutContinuation,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
    to_json,
)
from store.worker.active_call import (
    ActiveCall,
    build_generation_chunk_record,
    build_prefix_record,
    check_active,
    record_spans,
    token_ids,
)
from store.worker.cuts import CutServer, resolve_continuation

log = logging.getLogger("store.capture")

WeightVersionProvider = Callable[[], int]


class CaptureAdapter(Protocol):
    """Engine-specific extraction (vLLM, Megatron, ...)."""

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> Any: ...
    def extract_prompt_ids(self, payload: Any) -> Sequence[int]: ...
    def extract_generation(self, payload: Any) -> tuple[Sequence[int], Sequence[float]]: ...
    def extract_extras(self, payload: Any) -> Mapping[str, Any] | None: ...


class RolloutTokenCapture:
    """Worker-side capture over a ``Store`` used as staging sink and source."""

    def __init__(
        self,
        *,
        store: Store,
        weight_version_fn: WeightVersionProvider,
        adapter: CaptureAdapter | None = None,
        flush_threshold_tokens: int = 0,
        flush_interval: float = 0.25,
        completion_evidence_ttl: float = 3600.0,
    ) -> None:
        if not isinstance(store, Store):
            raise CaptureError(f"store must be a store.Store, got {type(store).__name__}")
        if not callable(weight_version_fn):
            raise CaptureError("weight_version_fn must be callable")
        _check_flush_options(flush_threshold_tokens, flush_interval, completion_evidence_ttl)
        self.store = store
        self._weight_version_fn = weight_version_fn
        self.adapter = adapter
        self.cuts = CutServer(
            store,
            flush_threshold_tokens=flush_threshold_tokens,
            flush_interval=flush_interval,
            evidence_ttl=completion_evidence_ttl,
        )

    # --- admission (4.3 - 4.6) -----------------------------------------------------------------

    def begin_call(
        self,
        admission: CaptureAdmission,
        *,
        prefix_token_ids: Sequence[int] | None = None,
        generation_cut: StagedCallBaseSnapshot | None = None,
        generation_cut_staging_keys: Sequence[str] | None = None,
        stream: bool = False,
        weight_version: int | None = None,
    ) -> ActiveCall:
        """Admit a call; a continued call's prefix is resolved from the log when not passed.

        Every refusal is a ``CaptureError`` naming the failed check, and writes nothing.
        """
        if not isinstance(admission, CaptureAdmission):
            raise AdmissionTypeError(f"begin_call needs a CaptureAdmission, got {type(admission).__name__}")
        if type(stream) is not bool:
            raise CaptureError(f"stream must be True or False, got {stream!r}")
        if stream:
            raise StreamingUnsupportedError("token capture needs the whole response; stream=True is refused")
        if generation_cut_staging_keys is not None and not (
            isinstance(generation_cut_staging_keys, (list, tuple))
            and all(isinstance(key, str) for key in generation_cut_staging_keys)
        ):
            raise CaptureError(
                f"generation_cut_staging_keys must be a list of keys, got {generation_cut_staging_keys!r}"
            )
        prefix = resolve_prefix(admission, prefix_token_ids)
        version = self._stamp(weight_version)
        self._refuse_finished_call(admission)
        continuation = admission.generation_cut
        restored_spans: list[Span] = []
        if generation_cut is not None:
            if continuation is None:
                raise CaptureError("generation cut not authorized: the admission carries no generation_cut")
            check_generation_cut(admission, continuation, generation_cut, generation_cut_staging_keys, version)
            check_parent_tokens(admission, prefix, generation_cut)
            restored_spans = generated_spans(generation_cut.columns.token_mask, generation_cut.weight_version)
        elif continuation is not None:
            resolved = resolve_continuation(self.store, admission, continuation, prefix, version)
            keys = continuation.staging_keys if generation_cut_staging_keys is None else generation_cut_staging_keys
            check_generation_cut(admission, continuation, resolved.snapshot, keys, version)
            # The rebuilt snapshot's chain and cumulative hashes were computed from this very
            # parent chain hash and prefix, so the parent-token check (4.6) holds by construction.
            generation_cut, restored_spans = resolved.snapshot, resolved.spans
        call = ActiveCall(admission, version, prefix, generation_cut, restored_spans)
        self.store.record_admission(admission.rollout_id, admission.model_call_id, _admission_body(call))
        return call

    def _refuse_finished_call(self, admission: CaptureAdmission) -> None:
        """A call captures once: admitting it again after it finished would reopen a settled call."""
        info = self.store.call(admission.rollout_id, admission.model_call_id)
        if info is not None and info.state in TERMINAL_STATES:
            raise CaptureError(
                f"call {admission.rollout_id}/{admission.model_call_id} already {info.state}; "
                "a finished call cannot be admitted again"
            )

    def _stamp(self, explicit: int | None) -> int:
        version = explicit if explicit is not None else self._weight_version_fn()
        if type(version) is not int or version < 0:
            raise CaptureError(f"the weight version must be a non-negative int, got {version!r}")
        try:
            u64(version, "weight version")
        except DigestValueError as exc:
            raise CaptureError(str(exc)) from exc
        return version

    # --- builders (4.7, 4.8) ---------------------------------------------------------------------

    def build_prefix_record(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: Mapping[str, Any] | None = None,
    ) -> StagedCallRecord:
        """A validated snapshot of a live call, without touching its completion state."""
        return build_prefix_record(
            call,
            prompt_token_ids=prompt_token_ids,
            generated_token_ids=generated_token_ids,
            generated_logprobs=generated_logprobs,
            extras=extras,
        )

    def build_generation_chunk_record(
        self, call: ActiveCall, *, generated_token_ids: Sequence[int], generated_logprobs: Sequence[float]
    ) -> StagedCallRecord:
        """Only newly generated tokens, at the call's current version (chunk-local hashes)."""
        return build_generation_chunk_record(
            call, generated_token_ids=generated_token_ids, generated_logprobs=generated_logprobs
        )

    def record_spans(self, call: ActiveCall, record: StagedCallRecord) -> list[Span]:
        """Which policy version generated which positions of a record built for ``call``."""
        return record_spans(call, record)

    # --- completion (4.9 - 4.11) -------------------------------------------------------------------

    def complete_call(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: Mapping[str, Any] | None = None,
    ) -> CommitCoords:
        """Build, claim, stage, then return coordinates; data problems give ``capture_failed``."""
        check_active(call)
        with self.cuts.terminal_gate(call) as gate:
            try:
                record = self.build_prefix_record(
                    call,
                    prompt_token_ids=prompt_token_ids,
                    generated_token_ids=generated_token_ids,
                    generated_logprobs=generated_logprobs,
                    extras=extras,
                )
            except (TypeError, ValueError, OverflowError) as exc:
                call.claim_completion()
                return self._failed(call, f"building the record failed: {exc}")
            call.claim_completion()
            try:
                result = self.store.stage(
                    record,
                    kind=EventKind.CALL_COMPLETED,
                    spans=self.record_spans(call, record),
                    completion=gate.completion(),
                )
            except Exception as exc:  # the sink failed: poison the capture, still serve the response
                return self._failed(call, f"staging failed: {type(exc).__name__}: {exc}")
            if not isinstance(result, StageResult) or not result.ok or result.staging_key is None:
                error = result.error if isinstance(result, StageResult) else repr(result)
                log.warning("staging %s was refused: %s", record.staging_key, error)
                return self._failed(call, f"staging was refused: {error}")
            coords = CommitCoords(
                schema_version=record.schema_version,
                rollout_id=record.rollout_id,
                model_call_id=record.model_call_id,
                parent_call_id=record.parent_call_id,
                prev_len=record.prev_len,
                delta_len=record.delta_len,
                cum_len=record.cum_len,
                weight_version=record.weight_version,
                disposition="staged",
                digest=record.digest,
                extras_digest=record.extras_digest,
                staging_key=result.staging_key,
                chain_hash=record.chain_hash,
                cumulative_hash=record.cumulative_hash,
            )
            gate.completed(coords, record.generated_token_count)
            return coords

    def complete_call_from_response(self, call: ActiveCall, payload: Any) -> CommitCoords:
        """Extract prompt, generation and extras with the adapter, then ``complete_call``."""
        check_active(call)
        if self.adapter is None:
            raise CaptureError("complete_call_from_response needs a CaptureAdapter")
        try:
            prompt = self.adapter.extract_prompt_ids(payload)
            generated, logprobs = self.adapter.extract_generation(payload)
            extras = self.adapter.extract_extras(payload)
        except Exception as exc:  # engine output we cannot read poisons the capture only
            with self.cuts.terminal_gate(call):
                call.claim_completion()
                return self._failed(call, f"extracting the response failed: {type(exc).__name__}: {exc}")
        return self.complete_call(
            call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=logprobs, extras=extras
        )

    def finish_restored_call(self, call: ActiveCall) -> CommitCoords:
        """Complete a continued call whose restored prefix is the whole answer (5.8)."""
        check_active(call)
        continuation = call.continuation
        if continuation is None or not continuation.is_terminal:
            raise CaptureError("finish_restored_call needs a continued call whose cut is terminal")
        return self.complete_call(
            call,
            prompt_token_ids=continuation.engine_prompt_token_ids,
            generated_token_ids=[],
            generated_logprobs=[],
        )

    def fail_call(self, call: ActiveCall, *, reason: str) -> CommitCoords:
        """Claim the call and return ``capture_failed`` coordinates."""
        check_active(call)
        with self.cuts.terminal_gate(call):
            call.claim_completion()
            return self._failed(call, reason)

    def _failed(self, call: ActiveCall, reason: str) -> CommitCoords:
        admission = call.admission
        log.warning("capture of %s/%s failed: %s", admission.rollout_id, admission.model_call_id, reason)
        try:
            self.store.record_failure(admission.rollout_id, admission.model_call_id, reason)
        except RolloutFencedError as exc:  # a retired attempt: expected after a restore, no trace
            log.warning("the capture failure of %s was not recorded: %s", call, exc)
        except Exception:  # the failure is already carried by the coords; the log is best effort here
            log.exception("could not record the capture failure of %s", call)
        return CommitCoords(
            schema_version=admission.schema_version,
            rollout_id=admission.rollout_id,
            model_call_id=admission.model_call_id,
            parent_call_id=admission.parent_call_id,
            prev_len=admission.prev_len,
            delta_len=0,
            cum_len=admission.prev_len,
            weight_version=call.weight_version,
            disposition="capture_failed",
        )

    # --- generation cuts (5.3 - 5.8) -----------------------------------------------------------------

    def track(self, call: ActiveCall, *, prompt_token_ids: Sequence[int], effective_output_limit: int | None) -> None:
        """Register a live call for cuts: its exact engine prompt and resolved output budget."""
        check_active(call)
        limit = effective_output_limit
        if limit is not None and type(limit) is int and limit > _U64_MAX:  # acks and completions carry it as a u64
            raise CaptureError(
                f"effective_output_limit must be at most 2**64-1, got an int of {limit.bit_length()} bits"
            )
        self.cuts.track(call, token_ids(prompt_token_ids, "prompt_token_ids"), limit)

    def observe(
        self,
        call: ActiveCall,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> None:
        """Append newly decoded tokens of a tracked call."""
        check_active(call)
        self.cuts.observe(call, token_ids, logprobs, finish_reason, stop_reason)

    def serve_generation_cut(self, inventory: GenerationCutInventory) -> GenerationCutReceipt:
        """Stage the durable prefix of every named in-flight call; the receipt is kept in the log."""
        return self.cuts.serve(inventory)

    def flush_due(self) -> int:
        """Run one periodic flush pass now; returns how many calls were flushed."""
        return self.cuts.flush_due()

    def close(self) -> None:
        """Stop the periodic flush thread (the store stays open)."""
        self.cuts.close()


# --- admission checks --------------------------------------------------------------------------


def resolve_prefix(admission: CaptureAdmission, given: Sequence[int] | None) -> TokenIds:
    """Wire-contract 4.4: the exact parent tokens the call continues."""
    column = None
    if given is not None:
        try:
            column = TokenIds.coerce(given, "prefix_token_ids")
        except ValueError as exc:
            raise CaptureError(f"prefix_token_ids must be non-negative ints: {exc}") from exc
    if admission.mode == "text":
        if column is not None and len(column):
            raise CaptureError("a text admission accepts no prefix_token_ids")
        return TokenIds.coerce([])
    inline = TokenIds.coerce(admission.required_prefix_token_ids)
    if column is None:
        if not len(inline):
            raise CaptureError(
                "a staging-chain admission needs the resolved prefix_token_ids (fetch and concatenate its chain)"
            )
        return inline
    if len(column) != admission.prev_len:
        raise CaptureError(f"prefix_token_ids length {len(column)} does not equal prev_len {admission.prev_len}")
    if len(inline) and inline != column:
        raise CaptureError("prefix_token_ids conflict with the admission's inline prefix")
    return column


def check_generation_cut(
    admission: CaptureAdmission,
    continuation: GenerationCutContinuation,
    snapshot: StagedCallBaseSnapshot,
    staging_keys: Sequence[str] | None,
    current_version: int,
) -> None:
    """Wire-contract 4.5: the snapshot is the continuation's prefix and fits the replacement."""
    if not isinstance(snapshot, StagedCallBaseSnapshot):
        raise CaptureError(f"generation_cut must be a StagedCallBaseSnapshot, got {type(snapshot).__name__}")
    if staging_keys is None or tuple(staging_keys) != continuation.staging_keys:
        raise CaptureError("generation_cut_staging_keys do not match the continuation's staging_keys")
    if snapshot.rollout_id != continuation.source_capture_key:
        raise CaptureError("the cut snapshot's rollout_id is not the continuation's source_capture_key")
    if snapshot.model_call_id != continuation.source_model_call_id:
        raise CaptureError("the cut snapshot's model_call_id is not the continuation's source_model_call_id")
    if snapshot.digest != continuation.digest:
        raise CaptureError("the cut snapshot's digest does not match the continuation's digest")
    if (snapshot.parent_call_id, snapshot.prev_len, snapshot.mode) != (
        admission.parent_call_id,
        admission.prev_len,
        admission.mode,
    ):
        raise CaptureError("the cut snapshot's lineage (parent, prev_len, mode) does not match the admission")
    if snapshot.generated_token_count != continuation.generation_token_count:
        raise CaptureError(
            f"the cut snapshot has {snapshot.generated_token_count} generated tokens, "
            f"the continuation claims {continuation.generation_token_count}"
        )
    if snapshot.weight_version > current_version:
        raise CaptureError(
            f"the cut's policy version {snapshot.weight_version} is newer than the current version {current_version}"
        )


def check_parent_tokens(admission: CaptureAdmission, prefix: TokenIds, snapshot: StagedCallBaseSnapshot) -> None:
    """Wire-contract 4.6: the durable prefix extends the replacement's exact parent tokens."""
    ids = snapshot.columns.token_ids
    if compute_chain_hash(admission.parent_chain_hash, ids) != snapshot.chain_hash:
        raise CaptureError("the cut's chain hash does not extend the admission's parent chain hash")
    if hash_token_columns(prefix, ids) != snapshot.cumulative_hash:
        raise CaptureError("the cut's cumulative hash does not cover the replacement's parent tokens")


def _admission_body(call: ActiveCall) -> AdmissionBody:
    admission = call.admission
    continuation = admission.generation_cut
    return AdmissionBody(
        schema_version=admission.schema_version,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        parent_chain_hash=admission.parent_chain_hash,
        weight_version=call.weight_version,
        staging_chain=list(admission.staging_chain),
        generation_cut=to_json(continuation) if continuation is not None else None,
        continues=(continuation.source_capture_key, continuation.source_model_call_id) if continuation else None,
        restored_spans=list(call.restored_spans),
        restored_delta_len=call.generation_cut.delta_len if call.generation_cut is not None else 0,
    )


def _check_flush_options(threshold: Any, interval: Any, ttl: Any) -> None:
    if type(threshold) is not int or threshold < 0:
        raise CaptureError(f"flush_threshold_tokens must be a non-negative int, got {threshold!r}")
    if type(interval) not in (int, float) or not 0 < interval <= _MAX_FLUSH_INTERVAL:
        raise CaptureError(f"flush_interval must be seconds in (0, {_MAX_FLUSH_INTERVAL}], got {interval!r}")
    if type(ttl) not in (int, float) or not 0 <= ttl < math.inf:
        raise CaptureError(f"completion_evidence_ttl must be a non-negative number of seconds, got {ttl!r}")


_MAX_FLUSH_INTERVAL = 3600.0
_U64_MAX = 2**64 - 1
