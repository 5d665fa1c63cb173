"""``RolloutTokenCapture``: the worker side of token capture (wire-contract section 4).

Admission (``begin_call``) is validated against the log: a continued call's durable prefix
is resolved from its staged chunks and proven to extend the replacement's exact parent
tokens.  Builders produce records through ``StagedCallRecord.from_components`` so each
locally built record is hashed once; completion stages before it returns coordinates.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from store.errors import (
    AdmissionTypeError,
    CaptureError,
    DigestValueError,
    GenerationCutError,
    ReplicaUnavailableError,
    RolloutFencedError,
    StreamingUnsupportedError,
)
from store.log.events import AdmissionBody, EventKind, Span
from store.projections.fold import TERMINAL_STATES
from store.store import Store
from store.wire.codec import to_json
from store.wire.columns import TokenIds
from store.wire.cut_records import GenerationCutInventory, GenerationCutPrefixAck, GenerationCutReceipt
from store.wire.digest import compute_chain_hash, hash_token_columns, u64
from store.wire.records import (
    CaptureAdmission,
    CommitCoords,
    GenerationCutContinuation,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
)
from store.worker import resume
from store.worker.active_call import (
    ActiveCall,
    build_generation_chunk_record,
    build_prefix_record,
    check_active,
    record_spans,
    token_ids,
)
from store.worker.cuts import CutServer, TerminalGate
from store.worker.resolve import resolve_continuation

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
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``completion_evidence_ttl``: how long (seconds, on ``clock``) a cut may still acknowledge
        a call completed before the cut reached it; older evidence is never used and is dropped.
        ``clock``: seconds since the epoch, stamping admissions, completions and evidence ages
        (inject one to test TTLs without sleeping).  With ``flush_threshold_tokens`` a flush
        thread runs every ``flush_interval`` seconds until ``close()`` or the store's close."""
        if not isinstance(store, Store):
            raise CaptureError(f"store must be a store.Store, got {type(store).__name__}")
        if not callable(weight_version_fn):
            raise CaptureError("weight_version_fn must be callable")
        if not callable(clock):
            raise CaptureError(f"clock must be callable (like time.time), got {clock!r}")
        _check_flush_options(flush_threshold_tokens, flush_interval, completion_evidence_ttl)
        self.store = store
        self._weight_version_fn = weight_version_fn
        self.adapter = adapter
        self.cuts = CutServer(
            store,
            flush_threshold_tokens=flush_threshold_tokens,
            flush_interval=flush_interval,
            evidence_ttl=completion_evidence_ttl,
            clock=clock,
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
        admitted_at: float | None = None,
    ) -> ActiveCall:
        """Admit a call; a continued call's prefix is resolved from the log when not passed.

        Every refusal is a ``CaptureError`` whose ``code`` names the failed check and whose
        message says what differed; a refusal writes nothing.  ``admitted_at``: the admission
        time the orchestrator stamped (and will put in its cut tickets); cut tickets for this
        call must then carry it.  Without it the call is stamped with this worker's clock
        (``call.admitted_at``) and tickets are not compared.
        """
        self.cuts.check_process()
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
                f"generation_cut_staging_keys must be a list of keys, got {generation_cut_staging_keys!r}", "keys"
            )
        if admitted_at is not None and (type(admitted_at) is not float or not math.isfinite(admitted_at)):
            raise CaptureError(f"admitted_at must be a finite float (seconds since the epoch), got {admitted_at!r}")
        prefix = resolve_prefix(admission, prefix_token_ids)
        version = self._stamp(weight_version)
        self._refuse_finished_call(admission)
        continuation = admission.generation_cut
        restored_spans: list[Span] = []
        if generation_cut is not None:
            if continuation is None:
                raise CaptureError(
                    "generation cut not authorized: the admission carries no generation_cut", "not_authorized"
                )
            check_generation_cut(admission, continuation, generation_cut, generation_cut_staging_keys, version)
            check_parent_tokens(admission, prefix, generation_cut)
            # The snapshot's digest matches the continuation; the store's chunks must be that very
            # cut too (the audit reads them), so they are resolved and checked like any continuation.
            restored_spans = resolve_continuation(self.store, admission, continuation, prefix, version).spans
        elif continuation is not None:
            resolved = resolve_continuation(self.store, admission, continuation, prefix, version)
            keys = continuation.staging_keys if generation_cut_staging_keys is None else generation_cut_staging_keys
            check_generation_cut(admission, continuation, resolved.snapshot, keys, version)
            # The rebuilt snapshot's chain and cumulative hashes were computed from this very
            # parent chain hash and prefix, so the parent-token check (4.6) holds by construction.
            generation_cut, restored_spans = resolved.snapshot, resolved.spans
        stamped = self.cuts.now() if admitted_at is None else admitted_at
        call = ActiveCall(
            admission, version, prefix, generation_cut, restored_spans, stamped, checks_tickets=admitted_at is not None
        )
        self.store.record_admission(
            admission.rollout_id, admission.model_call_id, _admission_body(call), recorded_at=stamped
        )
        return call

    def continue_cut(
        self,
        ack: GenerationCutPrefixAck,
        *,
        attempt: int | None = None,
        weight_version: int | None = None,
        admitted_at: float | None = None,
        track: bool = True,
    ) -> ActiveCall:
        """Admit the replacement of a cut call from its acknowledgement, in one call.

        The replacement is attempt ``ack.attempt_index + 1`` (or ``attempt``) of the rollout, under
        ``capture_key(rollout, attempt)``; its lineage (parent, prev_len, parent chain hash) and
        parent tokens are read back from the store, and ``begin_call`` validates the continuation.
        With ``track`` (the default) the call is tracked with its engine prompt and the call's
        whole output limit, so the caller decodes from ``call.continuation.engine_prompt_token_ids``
        for at most ``call.continuation.remaining_output_limit`` tokens and completes it with
        ``complete_observed``.  Refusals are ``GenerationCutError``s with a ``code``.
        """
        admission = resume.replacement_admission(self.store, ack, attempt)
        call = self.begin_call(admission, weight_version=weight_version, admitted_at=admitted_at)
        if track:
            self.track(call)
        return call

    def continue_latest_cut(
        self,
        rollout_id: str,
        model_call_id: str,
        *,
        weight_version: int | None = None,
        admitted_at: float | None = None,
        track: bool = True,
    ) -> ActiveCall:
        """``continue_cut`` of the newest cut acknowledged for the call in this store
        (``Store.latest_cut``): the path after a crash lost the receipt.  ``code`` ``no_cut``
        when no receipt acknowledges a durable prefix of the call."""
        ack = self.store.latest_cut(rollout_id, model_call_id)
        if ack is None:
            raise GenerationCutError(
                f"no cut receipt acknowledges a durable prefix of {rollout_id}/{model_call_id}", "no_cut"
            )
        return self.continue_cut(ack, weight_version=weight_version, admitted_at=admitted_at, track=track)

    def _refuse_finished_call(self, admission: CaptureAdmission) -> None:
        """A call captures once: admitting it again after it finished would reopen a settled call."""
        info = self.store.call(admission.rollout_id, admission.model_call_id)
        if info is not None and info.state in TERMINAL_STATES:
            raise CaptureError(
                f"call {admission.rollout_id}/{admission.model_call_id} already {info.state}; "
                "a finished call cannot be admitted again",
                "finished_call",
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
        """Build, claim, stage, then return coordinates; data problems give ``capture_failed``.

        A continued call may be completed in either shape: the engine's (prompt =
        ``continuation.engine_prompt_token_ids``, generated = only the tokens decoded after the
        restore) or the call's natural one (prompt = prefix + carried prompt tokens, generated =
        the restored tokens, with their staged log-probs, then the new ones); both stage the same
        record.  Log-probs are stored as float32.  ``capture_failed`` is final for the call: its
        rollout is refused by ``linearize``/``export`` (``capture_poisoned``) unless a later
        attempt completes the call.
        """
        check_active(call)
        at = self.cuts.now()  # read first: a clock that fails leaves the call as it was
        with self.cuts.terminal_gate(call) as gate:
            return self._complete(call, gate, at, prompt_token_ids, generated_token_ids, generated_logprobs, extras)

    def complete_observed(self, call: ActiveCall, *, extras: Mapping[str, Any] | None = None) -> CommitCoords:
        """Complete a tracked call from what ``observe`` was given: its engine prompt and every
        token observed since ``track`` (for a continued call, the restored prefix comes first).

        Nothing is passed twice.  An observation error (unaligned or unreadable output, tokens
        past the output limit) gives ``capture_failed`` coordinates naming it.
        """
        check_active(call)
        if self.cuts.live(call) is None:
            raise CaptureError(
                f"{call} is not tracked (or a newer admission of the call was tracked since): "
                "complete_observed() completes what track()+observe() saw"
            )
        at = self.cuts.now()  # read first: a clock that fails leaves the call as it was
        with self.cuts.terminal_gate(call) as gate:
            live = gate.live
            if live is None or live.observation_error is not None:
                call.claim_completion()  # raises when another completion won the race
                reason = "the call is no longer tracked" if live is None else live.observation_error
                return self._failed(call, f"observing the engine failed: {reason}")
            generated, logprobs = live.observed()
            return self._complete(call, gate, at, live.prompt, generated, logprobs, extras)

    def _complete(
        self,
        call: ActiveCall,
        gate: TerminalGate,
        at: float,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: Mapping[str, Any] | None,
    ) -> CommitCoords:
        try:
            record = self.build_prefix_record(
                call,
                prompt_token_ids=prompt_token_ids,
                generated_token_ids=generated_token_ids,
                generated_logprobs=generated_logprobs,
                extras=extras,
            )
            gate.check_limit(record.generated_token_count)
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
                recorded_at=at,  # the evidence of this completion ages on the capture's clock
            )
        except ReplicaUnavailableError as exc:  # kept here; a cut says durable_failure until it ships
            log.warning("%s", exc)
            kept = exc.results[0] if isinstance(exc.results, list) and exc.results else None
            result = kept if isinstance(kept, StageResult) else StageResult(ok=False, error=str(exc))
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
        gate.completed(coords, record.generated_token_count, at)
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

    def track(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        effective_output_limit: int | None = None,
    ) -> None:
        """Register a live call for cuts: its exact engine prompt and its whole output budget.

        ``effective_output_limit`` is the call's whole output limit (vLLM's resolved
        ``max_tokens`` for the call as first issued), never what is left of it: for a continued
        call it is ``call.continuation.effective_output_limit`` (the engine is told
        ``remaining_output_limit``), and any other value is refused (``code`` ``output_limit``).
        For a continued call both arguments may be left out: the prompt is the continuation's
        ``engine_prompt_token_ids`` (anything else is refused, ``code`` ``prompt``) and the limit
        the continuation's.  No cut acknowledges more generated tokens than the limit: tokens
        observed past it make the call's next cut fail (``GenerationCutError``).
        """
        check_active(call)
        continuation = call.continuation
        limit = effective_output_limit
        if continuation is not None:
            if limit is None:
                limit = continuation.effective_output_limit
            elif type(limit) is int and limit != continuation.effective_output_limit:
                remaining = continuation.remaining_output_limit
                hint = " (that is the remaining limit the engine is told)" if limit == remaining else ""
                raise CaptureError(
                    f"track() wants the call's whole output limit, {continuation.effective_output_limit} as its "
                    f"continuation names it, got {limit}{hint}; the engine decodes at most "
                    f"continuation.remaining_output_limit = {remaining} more tokens",
                    "output_limit",
                )
            if prompt_token_ids is None:
                prompt_token_ids = continuation.engine_prompt_token_ids
            elif token_ids(prompt_token_ids, "prompt_token_ids") != continuation.engine_prompt_token_ids:
                raise CaptureError(
                    "a continued call's engine prompt is its prefix plus the restored cut tokens "
                    f"(continuation.engine_prompt_token_ids, {len(continuation.engine_prompt_token_ids)} tokens); "
                    f"got {len(prompt_token_ids)} other tokens",
                    "prompt",
                )
        elif prompt_token_ids is None:
            raise CaptureError("track() needs the call's prompt_token_ids (only a continued call has them already)")
        if limit is not None and type(limit) is int and limit > _U64_MAX:  # acks and completions carry it as a u64
            raise CaptureError(
                f"effective_output_limit must be at most 2**64-1, got an int of {limit.bit_length()} bits",
                "output_limit",
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
        """Append newly decoded tokens of a tracked call (O(new tokens); no store access).

        ``logprobs`` are natural-log probabilities of each token; they are held as float64 here
        and stored as float32 (binary32, as Gym stores them): keep ``float(numpy.float32(lp))``
        if you compare with what the store returns.  ``finish_reason`` (``stop`` or ``length``)
        with the last tokens, or alone, says how the call ended.
        """
        check_active(call)
        self.cuts.observe(call, token_ids, logprobs, finish_reason, stop_reason)

    def serve_generation_cut(self, inventory: GenerationCutInventory) -> GenerationCutReceipt:
        """Stage the durable prefix of every named in-flight call; the receipt is kept in the log."""
        return self.cuts.serve(inventory)

    def flush_due(self) -> int:
        """Run one periodic flush pass now; returns how many calls were flushed."""
        return self.cuts.flush_due()

    def close(self) -> None:
        """Stop the periodic flush thread and wait for it (the store stays open): a flush in
        progress commits whole first, and no flush starts after this returns.  Closing the
        store does the same."""
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
        raise CaptureError(
            f"generation_cut_staging_keys {None if staging_keys is None else list(staging_keys)} do not match "
            f"the continuation's staging_keys {list(continuation.staging_keys)}",
            "keys",
        )
    if snapshot.rollout_id != continuation.source_capture_key:
        raise CaptureError(
            f"the cut snapshot's rollout_id {snapshot.rollout_id!r} is not the continuation's "
            f"source_capture_key {continuation.source_capture_key!r}",
            "source_call",
        )
    if snapshot.model_call_id != continuation.source_model_call_id:
        raise CaptureError(
            f"the cut snapshot's model_call_id {snapshot.model_call_id!r} is not the continuation's "
            f"source_model_call_id {continuation.source_model_call_id!r}",
            "source_call",
        )
    lineage = (snapshot.parent_call_id, snapshot.prev_len, snapshot.mode)
    wanted = (admission.parent_call_id, admission.prev_len, admission.mode)
    if lineage != wanted:
        raise CaptureError(
            f"the cut snapshot's lineage (parent, prev_len, mode) {lineage} does not match the admission's {wanted}",
            "lineage",
        )
    if snapshot.generated_token_count != continuation.generation_token_count:
        raise CaptureError(
            f"the cut snapshot has {snapshot.generated_token_count} generated tokens, "
            f"the continuation claims {continuation.generation_token_count}",
            "token_count",
        )
    if snapshot.weight_version > current_version:
        raise CaptureError(
            f"the cut's policy version {snapshot.weight_version} is newer than the current version {current_version}",
            "policy_version",
        )
    if snapshot.digest != continuation.digest:
        raise CaptureError(
            f"the cut snapshot's digest {snapshot.digest[:16]}... does not match the continuation's digest "
            f"{continuation.digest[:16]}...",
            "digest",
        )


def check_parent_tokens(admission: CaptureAdmission, prefix: TokenIds, snapshot: StagedCallBaseSnapshot) -> None:
    """Wire-contract 4.6: the durable prefix extends the replacement's exact parent tokens."""
    ids = snapshot.columns.token_ids
    if compute_chain_hash(admission.parent_chain_hash, ids) != snapshot.chain_hash:
        raise CaptureError(
            "the cut's chain hash does not extend the admission's parent chain hash (parent_chain_hash)",
            "parent_chain",
        )
    if hash_token_columns(prefix, ids) != snapshot.cumulative_hash:
        raise CaptureError(
            f"the cut's cumulative hash does not cover the replacement's parent tokens ({len(prefix)} prefix tokens)",
            "cumulative_hash",
        )


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
