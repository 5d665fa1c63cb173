"""Wire records (wire-contract section 3) as msgspec Structs.

JSON uses Gym's field names.  Every record refuses unknown fields, wrong types (a bool is
not an int, an int is not a float), NaN and infinity, and every cross-field rule, with an
``InvalidRecordError`` naming the failed rule.  A staged record verifies its digest on
construction and on decoding; ``StagedCallRecord.from_components`` builds a local record
computing its digests exactly once.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar

import msgspec
import numpy as np

from store.errors import DigestMismatchError, InvalidRecordError
from store.wire import continuations
from store.wire import digest as _digest
from store.wire import field_checks as check
from store.wire.columns import FloatColumn, TokenIds, encode_floats, encode_ids, encode_mask
from store.wire.digest import EMPTY_EXTRAS_DIGEST, STAGING_SCHEMA_VERSION, PackedColumns

CaptureMode = Literal["text", "token_in"]
AdmissionMode = Literal["text", "token_in", "candidate"]
SchemaVersion = Literal[2, 3]
FinishReason = Literal["stop", "length"]


class _Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every wire record: carries the schema version."""

    schema_version: SchemaVersion = STAGING_SCHEMA_VERSION


# --- admission and continuation (3.2, 3.3) ----------------------------------------------


class GenerationCutContinuation(_Wire, frozen=True, kw_only=True):
    """What a replacement call continues: the durable prefix of a cut call (3.3, union flavor)."""

    source_capture_key: str
    source_model_call_id: str
    staging_keys: tuple[str, ...]
    generation_token_count: int
    digest: str
    effective_output_limit: int
    terminal_finish_reason: FinishReason | None = None
    terminal_stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        name = "GenerationCutContinuation"
        check.schema(name, self.schema_version)
        check.identifier(name, "source_capture_key", self.source_capture_key)
        check.identifier(name, "source_model_call_id", self.source_model_call_id)
        if not self.staging_keys:
            raise check.fail(name, "staging_keys must name at least one key")
        check.unique(name, "staging_keys", self.staging_keys)
        msgspec.structs.force_setattr(self, "staging_keys", tuple(self.staging_keys))
        check.non_negative(name, "generation_token_count", self.generation_token_count)
        check.digest_hex(name, "digest", self.digest)
        check.positive(name, "effective_output_limit", self.effective_output_limit)
        over = continuations.token_count_within_limit(self.generation_token_count, self.effective_output_limit)
        if over is not None:
            raise check.fail(name, f"generation_token_count: {over.message}")
        check.terminal_finish(name, self.terminal_finish_reason, self.terminal_stop_reason)


class CaptureAdmission(_Wire, frozen=True, kw_only=True):
    """Gym's admission of one model call (rides the request as ``ng_capture``)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None = None
    prev_len: int = 0
    mode: AdmissionMode
    required_prefix_token_ids: Sequence[int] = ()
    staging_chain: tuple[str, ...] = ()
    parent_chain_hash: str | None = None
    generation_cut: GenerationCutContinuation | None = None

    def __post_init__(self) -> None:
        name = "CaptureAdmission"
        check.schema(name, self.schema_version)
        check.identifier(name, "rollout_id", self.rollout_id)
        check.identifier(name, "model_call_id", self.model_call_id)
        check.optional_identifier(name, "parent_call_id", self.parent_call_id)
        check.non_negative(name, "prev_len", self.prev_len)
        if self.mode == "candidate":
            raise check.fail(name, "mode 'candidate' (schema-3 replay admissions) is not supported by this store")
        check.literal(name, "mode", self.mode, ("text", "token_in"))
        prefix = _record_ids(name, "required_prefix_token_ids", self.required_prefix_token_ids)
        msgspec.structs.force_setattr(self, "required_prefix_token_ids", prefix)
        for key in self.staging_chain:
            check.identifier(name, "staging_chain entry", key)
        msgspec.structs.force_setattr(self, "staging_chain", tuple(self.staging_chain))
        check.optional_digest_hex(name, "parent_chain_hash", self.parent_chain_hash)
        if self.generation_cut is not None and not isinstance(self.generation_cut, GenerationCutContinuation):
            raise check.fail(name, "generation_cut must be a GenerationCutContinuation")
        if self.mode == "token_in":
            if self.parent_call_id is None or self.prev_len <= 0:
                raise check.fail(name, "token_in requires a parent_call_id and prev_len > 0")
            if self.parent_chain_hash is None:
                raise check.fail(name, "token_in requires the parent's chain hash (parent_chain_hash)")
            if not self.staging_chain and len(prefix) != self.prev_len:
                raise check.fail(name, "required_prefix_token_ids length must equal prev_len without a staging_chain")
        elif (
            self.parent_call_id is not None
            or self.prev_len != 0
            or len(prefix)
            or self.staging_chain
            or self.parent_chain_hash is not None
        ):
            raise check.fail(
                name,
                "a text admission has no parent, prev_len 0, no inline prefix, no staging_chain "
                "and no parent_chain_hash",
            )


def _record_ids(record: str, name: str, values: Any) -> TokenIds:
    try:
        return TokenIds.coerce(values, name)
    except ValueError as exc:
        raise check.fail(record, str(exc)) from exc


# --- staged records (3.4) ------------------------------------------------------------------

# Set by ``from_components`` to the digest it just computed, so construction does not hash again.
_PREHASHED: contextvars.ContextVar[tuple[str, PackedColumns, bool] | None] = contextvars.ContextVar(
    "store_prehashed_record", default=None
)


class _DigestWire(_Wire, frozen=True, kw_only=True):
    digest_version: Literal[2] = 2
    extras_digest_version: Literal[1] = 1


class StagedCallBaseSnapshot(_DigestWire, frozen=True, kw_only=True):
    """A staged call's exact tokens and their commitments (no extras payload)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None = None
    mode: CaptureMode
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    token_ids_delta: Sequence[int]
    token_mask_delta: Sequence[float | int]
    generation_log_probs_delta: Sequence[float | int]
    extras_digest: str = EMPTY_EXTRAS_DIGEST
    chain_hash: str
    cumulative_hash: str

    _record_name: ClassVar[str] = "StagedCallBaseSnapshot"

    def __post_init__(self) -> None:
        name = type(self).__name__
        check.versions(name, self)
        check.identifier(name, "rollout_id", self.rollout_id)
        check.identifier(name, "model_call_id", self.model_call_id)
        check.optional_identifier(name, "parent_call_id", self.parent_call_id)
        check.literal(name, "mode", self.mode, ("text", "token_in"))
        for field in ("prev_len", "delta_len", "cum_len", "weight_version"):
            check.non_negative(name, field, getattr(self, field))
        check.digest_hex(name, "digest", self.digest)
        check.digest_hex(name, "extras_digest", self.extras_digest)
        check.digest_hex(name, "chain_hash", self.chain_hash)
        check.digest_hex(name, "cumulative_hash", self.cumulative_hash)
        check.lineage(name, self.parent_call_id, self.prev_len, self.mode)
        if self.delta_len == 0:
            raise check.fail(name, "delta_len must not be 0")
        prehashed = _PREHASHED.get()
        if prehashed is not None:
            expected, columns, _ = prehashed
            if expected != self.digest:
                raise DigestMismatchError(f"{name}: digest does not match the components it was built from")
        else:
            try:
                computed, columns = _digest.staging_digest_and_columns(**self.digest_fields())
            except (ValueError, TypeError) as exc:
                raise check.fail(name, str(exc)) from exc
            if computed != self.digest:
                raise DigestMismatchError(f"{name}: digest does not match the record's fields (computed {computed})")
        msgspec.structs.force_setattr(self, "token_ids_delta", columns.token_ids)
        msgspec.structs.force_setattr(self, "token_mask_delta", columns.token_mask)
        msgspec.structs.force_setattr(self, "generation_log_probs_delta", columns.log_probs)
        self._check_extras(name)

    def _check_extras(self, name: str) -> None:
        """The base snapshot does not check an extras payload (it carries none)."""

    def digest_fields(self) -> dict[str, Any]:
        """The seventeen inputs of ``compute_staging_digest`` for this record."""
        return {
            "schema_version": self.schema_version,
            "digest_version": self.digest_version,
            "extras_digest_version": self.extras_digest_version,
            "rollout_id": self.rollout_id,
            "model_call_id": self.model_call_id,
            "parent_call_id": self.parent_call_id,
            "mode": self.mode,
            "prev_len": self.prev_len,
            "delta_len": self.delta_len,
            "cum_len": self.cum_len,
            "weight_version": self.weight_version,
            "token_ids_delta": self.token_ids_delta,
            "token_mask_delta": self.token_mask_delta,
            "generation_log_probs_delta": self.generation_log_probs_delta,
            "extras_digest": self.extras_digest,
            "chain_hash": self.chain_hash,
            "cumulative_hash": self.cumulative_hash,
        }

    @property
    def staging_key(self) -> str:
        """The default staging key, ``{rollout_id}/{model_call_id}``."""
        return default_staging_key(self.rollout_id, self.model_call_id)

    @property
    def columns(self) -> PackedColumns:
        """The validated, packed token columns."""
        return PackedColumns(
            _as_ids(self.token_ids_delta),
            _as_floats(self.token_mask_delta),
            _as_floats(self.generation_log_probs_delta),
        )

    @property
    def generated_token_count(self) -> int:
        """How many positions carry mask 1.0 (generated, not carried prompt)."""
        return int(np.count_nonzero(_as_floats(self.token_mask_delta).zero_one_flags()[1]))


def _as_ids(value: Sequence[int]) -> TokenIds:
    assert isinstance(value, TokenIds)  # __post_init__ always stores packed columns
    return value


def _as_floats(value: Sequence[float | int]) -> FloatColumn:
    assert isinstance(value, FloatColumn)
    return value


def default_staging_key(rollout_id: str, model_call_id: str) -> str:
    if not rollout_id or not model_call_id:
        raise InvalidRecordError("a staging key needs a non-empty rollout_id and model_call_id")
    return f"{rollout_id}/{model_call_id}"


# NeMo Gym's name: the default key, ``{rollout_id}/{model_call_id}`` (InvalidRecordError, a
# ValueError, if either is empty).
staging_key = default_staging_key

R = TypeVar("R", bound="StagedCallRecord")


class StagedCallRecord(StagedCallBaseSnapshot, frozen=True, kw_only=True):
    """What a worker hands to the sink: the snapshot plus its extras payload."""

    extras: dict[str, Any] | None = None

    def _check_extras(self, name: str) -> None:
        prehashed = _PREHASHED.get()
        if prehashed is not None and prehashed[2]:
            return  # from_components computed extras_digest from this very payload
        if self.extras is None:
            computed = EMPTY_EXTRAS_DIGEST  # the extras digest of null, a constant (most records)
        else:
            try:
                computed = _digest.compute_extras_digest(self.extras)
            except (ValueError, TypeError) as exc:
                raise check.fail(name, f"extras: {exc}") from exc
        if computed != self.extras_digest:
            raise DigestMismatchError(f"{name}: extras_digest does not match the extras payload")

    @classmethod
    def from_components(
        cls: type[R],
        *,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        mode: CaptureMode,
        prev_len: int,
        weight_version: int,
        token_ids_delta: Any,
        token_mask_delta: Any,
        generation_log_probs_delta: Any,
        chain_hash: str,
        cumulative_hash: str,
        extras: Mapping[str, Any] | None = None,
        schema_version: int = STAGING_SCHEMA_VERSION,
    ) -> R:
        """Build a local record: extras digest and staged digest are each computed once.

        ``delta_len`` and ``cum_len`` follow from the columns.  Structural checks still run;
        the digest is not recomputed during construction.
        """
        if extras is not None and not isinstance(extras, Mapping):  # dict("") would be {}: never guess
            raise check.fail(cls.__name__, f"extras must be a mapping or None, got {type(extras).__name__}")
        payload = dict(extras) if extras is not None else None
        try:
            extras_digest = _digest.compute_extras_digest(payload)
            delta_len = len(token_ids_delta)
            digest, columns = _digest.staging_digest_and_columns(
                schema_version=schema_version,
                digest_version=_digest.STAGING_DIGEST_VERSION,
                extras_digest_version=_digest.EXTRAS_DIGEST_VERSION,
                rollout_id=rollout_id,
                model_call_id=model_call_id,
                parent_call_id=parent_call_id,
                mode=mode,
                prev_len=prev_len,
                delta_len=delta_len,
                cum_len=prev_len + delta_len if type(prev_len) is int else None,
                weight_version=weight_version,
                token_ids_delta=token_ids_delta,
                token_mask_delta=token_mask_delta,
                generation_log_probs_delta=generation_log_probs_delta,
                extras_digest=extras_digest,
                chain_hash=chain_hash,
                cumulative_hash=cumulative_hash,
            )
        except (ValueError, TypeError) as exc:
            if isinstance(exc, InvalidRecordError):
                raise
            raise check.fail(cls.__name__, str(exc)) from exc
        # The stored form too, while the columns are hot: stage() then takes the lock with bytes ready.
        encode_ids(columns.token_ids)
        encode_mask(columns.token_mask)
        encode_floats(columns.log_probs)
        token = _PREHASHED.set((digest, columns, True))  # the extras digest was computed from ``payload`` here
        try:
            return cls(
                schema_version=schema_version,  # type: ignore[arg-type]
                rollout_id=rollout_id,
                model_call_id=model_call_id,
                parent_call_id=parent_call_id,
                mode=mode,
                prev_len=prev_len,
                delta_len=delta_len,
                cum_len=prev_len + delta_len,
                weight_version=weight_version,
                digest=digest,
                token_ids_delta=columns.token_ids,
                token_mask_delta=columns.token_mask,
                generation_log_probs_delta=columns.log_probs,
                extras_digest=extras_digest,
                chain_hash=chain_hash,
                cumulative_hash=cumulative_hash,
                extras=payload,
            )
        finally:
            _PREHASHED.reset(token)


class StagedCallSnapshot(StagedCallRecord, frozen=True, kw_only=True):
    """What a staging source returns: identical to the record."""


S = TypeVar("S", bound=StagedCallBaseSnapshot)


def trusted_snapshot(cls: type[S], digest: str, columns: PackedColumns, **fields: Any) -> S:
    """Build a record whose digest the caller just computed from ``columns`` (internal fast path).

    The extras payload, if any, is still checked against ``extras_digest``.
    """
    token = _PREHASHED.set((digest, columns, False))  # set and reset directly: every fetched record comes here
    try:
        return cls(
            digest=digest,
            token_ids_delta=columns.token_ids,
            token_mask_delta=columns.token_mask,
            generation_log_probs_delta=columns.log_probs,
            **fields,
        )
    finally:
        _PREHASHED.reset(token)


# --- results, coords, ledger rows (3.5 - 3.9) ----------------------------------------------


class StageResult(_Wire, frozen=True, kw_only=True):
    ok: bool
    staging_key: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        name = "StageResult"
        key, version = self.staging_key, self.schema_version
        if self.ok is True and self.error is None and type(key) is str and key and type(version) is int:
            # Every successful stage returns one: the checks below, for this shape, in one place.
            if version not in _digest.SUPPORTED_SCHEMA_VERSIONS:
                check.schema(name, version)
            check.encodable(name, "staging_key", key)
            return
        check.schema(name, self.schema_version)
        if type(self.ok) is not bool:
            raise check.fail(name, f"ok must be a bool, got {self.ok!r}")
        check.optional_identifier(name, "staging_key", self.staging_key)
        check.optional_text(name, "error", self.error)
        if self.ok and self.staging_key is None:
            raise check.fail(name, "ok=true requires a staging_key")
        if not self.ok and not self.error:
            raise check.fail(name, "ok=false requires an error")


Disposition = Literal["staged", "capture_failed"]
CaptureDisposition = Disposition  # NeMo Gym's name
_STAGED_PAYLOAD = ("digest", "extras_digest", "staging_key", "chain_hash", "cumulative_hash")


class CommitCoords(_DigestWire, frozen=True, kw_only=True):
    """Token-free coordinates of a staged (or failed) call (rides the response as ``ng_commit_coords``)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None = None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    disposition: Disposition = "staged"
    digest: str | None = None
    extras_digest: str | None = None
    staging_key: str | None = None
    chain_hash: str | None = None
    cumulative_hash: str | None = None

    def __post_init__(self) -> None:
        name = "CommitCoords"
        check.versions(name, self)
        check.identifier(name, "rollout_id", self.rollout_id)
        check.identifier(name, "model_call_id", self.model_call_id)
        check.optional_identifier(name, "parent_call_id", self.parent_call_id)
        for field in ("prev_len", "delta_len", "cum_len", "weight_version"):
            check.non_negative(name, field, getattr(self, field))
        check.literal(name, "disposition", self.disposition, ("staged", "capture_failed"))
        for field in ("digest", "extras_digest", "chain_hash", "cumulative_hash"):
            check.optional_digest_hex(name, field, getattr(self, field))
        check.optional_identifier(name, "staging_key", self.staging_key)
        check.lineage(name, self.parent_call_id, self.prev_len, None)
        if self.cum_len != self.prev_len + self.delta_len:
            raise check.fail(name, "cum_len must equal prev_len + delta_len")
        present = [getattr(self, field) is not None for field in _STAGED_PAYLOAD]
        if self.disposition == "staged":
            if not all(present):
                raise check.fail(
                    name, "staged coords require digest, extras_digest, staging_key, chain_hash and cumulative_hash"
                )
            if self.delta_len <= 0:
                raise check.fail(name, "staged coords require delta_len > 0")
        else:
            if any(present):
                raise check.fail(name, "capture_failed coords cannot carry staged payload")
            if self.delta_len != 0:
                raise check.fail(name, "capture_failed coords require delta_len == 0")


class CallRecord(_DigestWire, frozen=True, kw_only=True):
    """One token-free ledger or manifest row."""

    capture_key: str | None = None
    model_call_id: str
    parent_call_id: str | None = None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    extras_digest: str
    staging_key: str
    mode: CaptureMode = "token_in"
    chain_hash: str
    cumulative_hash: str
    response_id: str
    admitted_at: float | int | None = None
    output_fingerprint: str | None = None
    continuation_fingerprint: str | None = None
    fingerprint_version: int = 0

    def __post_init__(self) -> None:
        name = "CallRecord"
        check.versions(name, self)
        check.optional_identifier(name, "capture_key", self.capture_key)
        check.identifier(name, "model_call_id", self.model_call_id)
        check.optional_identifier(name, "parent_call_id", self.parent_call_id)
        for field in ("prev_len", "delta_len", "cum_len", "weight_version", "fingerprint_version"):
            check.non_negative(name, field, getattr(self, field))
        for field in ("digest", "extras_digest", "chain_hash", "cumulative_hash"):
            check.digest_hex(name, field, getattr(self, field))
        check.optional_digest_hex(name, "output_fingerprint", self.output_fingerprint)
        check.optional_digest_hex(name, "continuation_fingerprint", self.continuation_fingerprint)
        check.identifier(name, "staging_key", self.staging_key)
        check.identifier(name, "response_id", self.response_id)
        check.literal(name, "mode", self.mode, ("text", "token_in"))
        check.strict_float(name, "admitted_at", self.admitted_at)
        if self.delta_len <= 0:
            raise check.fail(name, "delta_len must be > 0")
        if self.cum_len != self.prev_len + self.delta_len:
            raise check.fail(name, "cum_len must equal prev_len + delta_len")
        check.lineage(name, self.parent_call_id, self.prev_len, self.mode)


class CaptureLedgerCommit(_Wire, frozen=True, kw_only=True):
    rollout_id: str
    record: CallRecord
    staging_chain: tuple[str, ...]
    request_items: list[dict[str, Any]] = []
    response_items: list[dict[str, Any]] = []
    parent_manifest: tuple[CallRecord, ...] = ()

    def __post_init__(self) -> None:
        name = "CaptureLedgerCommit"
        check.schema(name, self.schema_version)
        check.identifier(name, "rollout_id", self.rollout_id)
        if not isinstance(self.record, CallRecord):
            raise check.fail(name, "record must be a CallRecord")
        check.instances(name, "parent_manifest", self.parent_manifest, CallRecord)
        check.instances(name, "request_items", self.request_items, dict)
        check.instances(name, "response_items", self.response_items, dict)
        for field in ("request_items", "response_items"):
            try:
                _digest.check_nesting(getattr(self, field), field)
            except ValueError as exc:
                raise check.fail(name, str(exc)) from exc
        for key in self.staging_chain:
            check.identifier(name, "staging_chain entry", key)
        manifest = self.parent_manifest
        if not manifest:
            return
        ids = [row.model_call_id for row in manifest]
        if len(set(ids)) != len(ids) or self.record.model_call_id in ids:
            raise check.fail(name, "parent_manifest has duplicate ids or repeats the record")
        if any(row.capture_key is None for row in manifest):
            raise check.fail(name, "every parent_manifest row needs a capture_key")
        if manifest[0].parent_call_id is not None:
            raise check.fail(name, "parent_manifest must start at a root")
        for previous, row in itertools.pairwise(manifest):
            if row.parent_call_id != previous.model_call_id or row.prev_len != previous.cum_len:
                raise check.fail(name, "parent_manifest must form one contiguous chain")
        last = manifest[-1]
        if self.record.parent_call_id != last.model_call_id or self.record.prev_len != last.cum_len:
            raise check.fail(name, "the last parent_manifest row must be the record's parent, ending at its prev_len")


class ManifestFailure(_Wire, frozen=True, kw_only=True):
    model_call_id: str
    reason: str

    def __post_init__(self) -> None:
        check.schema("ManifestFailure", self.schema_version)
        check.identifier("ManifestFailure", "model_call_id", self.model_call_id)
        check.identifier("ManifestFailure", "reason", self.reason)


class RolloutManifest(_Wire, frozen=True, kw_only=True):
    rollout_id: str
    records: list[CallRecord] = []
    failures: list[ManifestFailure] = []

    def __post_init__(self) -> None:
        check.schema("RolloutManifest", self.schema_version)
        check.identifier("RolloutManifest", "rollout_id", self.rollout_id)
        check.instances("RolloutManifest", "records", self.records, CallRecord)
        check.instances("RolloutManifest", "failures", self.failures, ManifestFailure)


class RolloutRemoval(_Wire, frozen=True, kw_only=True):
    removed: list[str] = []
    absent: list[str] = []

    def __post_init__(self) -> None:
        check.schema("RolloutRemoval", self.schema_version)
        check.instances("RolloutRemoval", "removed", self.removed, str)
        check.instances("RolloutRemoval", "absent", self.absent, str)
        for value in [*self.removed, *self.absent]:
            check.identifier("RolloutRemoval", "rollout id", value)


TerminalSelection = Literal["declared", "response_id", "content", "heuristic"]


class RolloutReceipt(_DigestWire, frozen=True, kw_only=True):
    rollout_id: str
    reward: float | int | None = None
    terminal_model_call_id: str | None = None
    manifest: list[CallRecord] = []
    capture_poisoned: bool = False
    failure_reason: str | None = None
    terminal_selection: TerminalSelection | None = None
    terminal_attribution_reason: str | None = None

    def __post_init__(self) -> None:
        name = "RolloutReceipt"
        check.versions(name, self)
        check.identifier(name, "rollout_id", self.rollout_id)
        check.strict_float(name, "reward", self.reward)
        check.optional_identifier(name, "terminal_model_call_id", self.terminal_model_call_id)
        check.instances(name, "manifest", self.manifest, CallRecord)
        check.optional_text(name, "failure_reason", self.failure_reason)
        check.optional_text(name, "terminal_attribution_reason", self.terminal_attribution_reason)
        if type(self.capture_poisoned) is not bool:
            raise check.fail(name, "capture_poisoned must be a bool")
        if self.terminal_selection is not None:
            check.literal(
                name, "terminal_selection", self.terminal_selection, ("declared", "response_id", "content", "heuristic")
            )
        ids = [row.model_call_id for row in self.manifest]
        if len(set(ids)) != len(ids):
            raise check.fail(name, "manifest model_call_ids must be unique")
        if self.terminal_model_call_id is not None and self.terminal_model_call_id not in ids:
            raise check.fail(name, "the terminal call is absent from the manifest")
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise check.fail(name, "an unpoisoned receipt cannot carry a failure_reason")
            if self.terminal_model_call_id is None or self.terminal_selection is None:
                raise check.fail(name, "an unpoisoned receipt must name its terminal call and selection method")
        if self.terminal_selection is None and (self.terminal_model_call_id is not None or self.failure_reason is None):
            raise check.fail(name, "a receipt without a selection needs a null terminal and a failure_reason")
