"""Verify a rollout receipt against its staged snapshots and linearize it (wire-contract 6.1, 6.2).

Pure functions, no storage: the trainer hands in the receipt (token-free manifest rows) and
one snapshot per manifest row, and gets token-exact training rows back, or a
``ReceiptVerificationError``/``RebuildError`` whose ``code`` names the first failed check.
The checks run in the contract's order.  Extras payloads are never read: each row carries
the receipt-bound extras digests (``extras_commitments``) for consumers to verify at their
point of use, as ``store.rebuild.routed_rows.with_routed_experts`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from store.errors import RebuildError, ReceiptTypeError, ReceiptVerificationError
from store.rebuild.routes import RoutedExperts
from store.rebuild.terminal import children_by_parent, descend_to_leaf, root_order_key
from store.wire.columns import FloatColumn, TokenIds
from store.wire.digest import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    PackedColumns,
    compute_chain_hash,
    compute_extras_digest,
    hash_token_columns,
    staging_digest_and_columns,
)
from store.wire.records import CallRecord, RolloutReceipt, StagedCallBaseSnapshot

CHAIN_KIND_TERMINAL: Final = "terminal"
CHAIN_KIND_SUBAGENT: Final = "subagent"
# Reasons of a SkippedChain besides the RebuildError code of a chain that failed its checks.
SKIP_ABANDONED_ROOT: Final = "abandoned_root"
SKIP_AMBIGUOUS_LEAF: Final = "ambiguous_leaf"
SKIP_LEAF_ON_TERMINAL_CHAIN: Final = "leaf_on_terminal_chain"

# The fields a snapshot must share with its manifest row (wrong_<field> otherwise), in order.
_MANIFEST_FIELDS: Final = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
_VERSION_FIELDS: Final = ("schema_version", "digest_version", "extras_digest_version")


@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """The policy version that staged one call's delta, as positions ``[start, end)`` of the row."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


@dataclass(frozen=True, slots=True)
class ExtrasCommitment:
    """The receipt-bound extras digest of one call on the row: what its extras must hash to."""

    model_call_id: str
    extras_digest_version: int
    extras_digest: str

    def verify(self, extras: Mapping[str, Any] | None) -> None:
        """Check a fetched extras payload against the commitment (``corrupt_extras`` otherwise)."""
        try:
            computed = compute_extras_digest(extras)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ReceiptVerificationError(
                "corrupt_extras", f"call {self.model_call_id}: extras cannot be digested: {exc}"
            ) from exc
        if self.extras_digest_version != EXTRAS_DIGEST_VERSION or computed != self.extras_digest:
            raise ReceiptVerificationError(
                "corrupt_extras", f"call {self.model_call_id}: extras do not match the receipt's extras digest"
            )


@dataclass(frozen=True)
class LinearizedRow:
    """One verified root-to-leaf chain, concatenated: a token-exact training row.

    ``token_ids``/``token_mask``/``logprobs`` are immutable numpy-backed columns that compare
    equal to lists.  ``link_spans`` holds ``(call, carried count, generated count)`` per call.
    """

    rollout_id: str
    token_ids: TokenIds
    token_mask: FloatColumn
    logprobs: FloatColumn
    model_call_ids: list[str]
    prompt_len: int
    weight_versions: list[int]
    weight_version_spans: list[WeightVersionSpan]
    link_spans: list[tuple[str, int, int]]
    extras_commitments: list[ExtrasCommitment]
    terminal_model_call_id: str
    chain_index: int = 0
    chain_kind: str = CHAIN_KIND_TERMINAL
    segment_index: int = 0
    boundary_parent_call_id: str | None = None
    routed_experts: RoutedExperts | None = None
    routed_experts_dtype: str | None = None

    @property
    def call_ids(self) -> list[str]:
        """Alias of ``model_call_ids`` (the older spelling)."""
        return self.model_call_ids


@dataclass(frozen=True, slots=True)
class SkippedChain:
    """A root whose chain was not published, and why."""

    root_call_id: str
    reason: str


@dataclass(frozen=True)
class LinearizedRollout:
    """Every publishable chain of a receipt: ``rows[0]`` is the terminal chain, then other roots' chains."""

    rows: list[LinearizedRow]
    skipped: list[SkippedChain] = field(default_factory=list)
    num_roots: int = 1
    num_boundary_roots: int = 0


@dataclass(frozen=True, slots=True)
class _Verified:
    receipt: RolloutReceipt
    records: dict[str, CallRecord]
    columns: dict[str, PackedColumns]


def _fail(code: str, detail: str) -> ReceiptVerificationError:
    return ReceiptVerificationError(code, detail)


# --- 6.1 steps 1-5: the receipt, the binding of snapshots to rows, each row -----------------


def _check_receipt(receipt: Any) -> RolloutReceipt:
    if not isinstance(receipt, RolloutReceipt):
        raise ReceiptTypeError("not_a_receipt", f"expected a RolloutReceipt, got {type(receipt).__name__}")
    schema = receipt.schema_version
    if type(schema) is not int or schema not in SUPPORTED_SCHEMA_VERSIONS:
        raise _fail("unsupported_schema", f"receipt schema_version {schema!r}; this store reads 2 and 3")
    if type(receipt.digest_version) is not int or receipt.digest_version != STAGING_DIGEST_VERSION:
        raise _fail("unsupported_digest", f"receipt digest_version {receipt.digest_version!r}")
    if type(receipt.extras_digest_version) is not int or receipt.extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise _fail("unsupported_extras_digest", f"receipt extras_digest_version {receipt.extras_digest_version!r}")
    if receipt.failure_reason is not None:
        raise _fail("rollout_failed", f"the rollout failed: {receipt.failure_reason}")
    if receipt.capture_poisoned:
        raise _fail("capture_poisoned", "the receipt marks token capture as poisoned")
    if not isinstance(receipt.manifest, (list, tuple)):
        raise ReceiptTypeError(
            "not_a_call_record", f"the manifest must be a list, got {type(receipt.manifest).__name__}"
        )
    if not receipt.manifest:
        raise _fail("empty_manifest", "the receipt commits no calls")
    for row in receipt.manifest:
        if not isinstance(row, CallRecord):
            raise ReceiptTypeError("not_a_call_record", f"manifest rows must be CallRecords, got {type(row).__name__}")
    return receipt


def _first_duplicate(values: Iterable[str]) -> str | None:
    seen: set[str] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


def _bind(manifest: Sequence[CallRecord], snapshots: Sequence[Any]) -> list[StagedCallBaseSnapshot]:
    """Snapshot i must be manifest row i's call (step 4)."""
    for code, values in (
        ("duplicate_manifest_row", [row.model_call_id for row in manifest]),
        ("duplicate_staging_key", [row.staging_key for row in manifest]),
    ):
        duplicate = _first_duplicate(values)
        if duplicate is not None:
            raise _fail(code, f"{duplicate!r} appears twice in the manifest")
    if not isinstance(snapshots, Sequence) or isinstance(snapshots, (str, bytes)):
        raise ReceiptTypeError("not_a_snapshot", f"snapshots must be a sequence, got {type(snapshots).__name__}")
    if len(snapshots) != len(manifest):
        raise _fail("row_count_mismatch", f"{len(snapshots)} snapshots for {len(manifest)} manifest rows")
    for snapshot in snapshots:
        if not isinstance(snapshot, StagedCallBaseSnapshot):
            raise ReceiptTypeError("not_a_snapshot", f"expected staged snapshots, got {type(snapshot).__name__}")
    snapshot_ids = [snapshot.model_call_id for snapshot in snapshots]
    duplicate = _first_duplicate(snapshot_ids)
    if duplicate is not None:
        raise _fail("duplicate_snapshot", f"two snapshots are call {duplicate!r}")
    manifest_ids = {row.model_call_id for row in manifest}
    strangers = [call for call in snapshot_ids if call not in manifest_ids]
    if strangers:
        raise _fail("snapshot_identity_mismatch", f"snapshots of calls not in the manifest: {strangers}")
    for row, snapshot in zip(manifest, snapshots, strict=True):
        if snapshot.model_call_id != row.model_call_id:
            raise _fail(
                "snapshot_order_mismatch",
                f"key {row.staging_key} names call {row.model_call_id}, the snapshot is {snapshot.model_call_id}",
            )
    return list(snapshots)


def _check_row(receipt: RolloutReceipt, row: CallRecord, snapshot: StagedCallBaseSnapshot) -> PackedColumns:
    """Step 5: the snapshot matches its row, and its digest matches its own fields."""
    call = row.model_call_id
    owner = row.capture_key if row.capture_key is not None else receipt.rollout_id
    if snapshot.rollout_id != owner:
        raise _fail("wrong_rollout", f"call {call}: the snapshot belongs to {snapshot.rollout_id!r}, not {owner!r}")
    for name in _MANIFEST_FIELDS:
        actual, expected = getattr(snapshot, name), getattr(row, name)
        if actual != expected:
            raise _fail(f"wrong_{name}", f"call {call}: snapshot {name} {actual!r}, manifest {expected!r}")
    for name in _VERSION_FIELDS:
        actual, expected, declared = getattr(snapshot, name), getattr(row, name), getattr(receipt, name)
        if actual != expected or actual != declared:
            raise _fail(
                f"wrong_{name}", f"call {call}: snapshot {name} {actual!r}, manifest {expected!r}, receipt {declared!r}"
            )
    try:
        digest, columns = staging_digest_and_columns(**snapshot.digest_fields())
    except (ValueError, TypeError, OverflowError) as exc:
        raise _fail("invalid_snapshot", f"call {call}: {exc}") from exc
    if digest != snapshot.digest:
        raise _fail("corrupt_digest", f"call {call}: the staged digest does not match the snapshot's fields")
    return columns


# --- 6.1 step 6: the call graph ----------------------------------------------------------------


def _check_graph(manifest: Sequence[CallRecord], records: Mapping[str, CallRecord]) -> None:
    acyclic: set[str] = set()  # calls whose ancestry is known to reach a root
    for row in manifest:
        if row.parent_call_id is not None:
            parent = records.get(row.parent_call_id)
            if parent is None:
                raise RebuildError(
                    "missing_parent", f"call {row.model_call_id} names absent parent {row.parent_call_id}"
                )
            if parent.cum_len != row.prev_len:
                raise RebuildError(
                    "parent_length_mismatch",
                    f"call {row.model_call_id} starts at {row.prev_len}, its parent ends at {parent.cum_len}",
                )
        walked: set[str] = set()
        cursor: CallRecord | None = row
        while cursor is not None and cursor.model_call_id not in acyclic:
            if cursor.model_call_id in walked:
                raise RebuildError("lineage_cycle", f"the ancestry of call {row.model_call_id} loops")
            walked.add(cursor.model_call_id)
            cursor = records.get(cursor.parent_call_id) if cursor.parent_call_id is not None else None
        acyclic.update(walked)


def _verify(receipt: Any, snapshots: Sequence[Any]) -> _Verified:
    checked = _check_receipt(receipt)
    manifest = checked.manifest
    bound = _bind(manifest, snapshots)
    columns = {
        row.model_call_id: _check_row(checked, row, snapshot) for row, snapshot in zip(manifest, bound, strict=True)
    }
    records = {row.model_call_id: row for row in manifest}
    _check_graph(manifest, records)
    return _Verified(checked, records, columns)


# --- 6.1 steps 7-9: one chain -------------------------------------------------------------------


def _ancestry(records: Mapping[str, CallRecord], leaf_id: str | None) -> list[CallRecord]:
    leaf = records.get(leaf_id) if isinstance(leaf_id, str) else None
    if leaf is None:
        raise RebuildError("missing_terminal", f"the terminal call {leaf_id!r} is not in the manifest")
    chain = [leaf]
    while chain[-1].parent_call_id is not None:
        chain.append(records[chain[-1].parent_call_id])  # present and acyclic: checked by _check_graph
    chain.reverse()
    return chain


def carry_boundary(model_call_id: str, mask: FloatColumn) -> int:
    """How many carried (mask 0.0) positions open the delta, which must then be only generated (1.0)."""
    carried = mask.stored_carry()  # a stored carry-then-generation mask: known without flag arrays
    if carried is not None:
        if carried == len(mask):
            raise RebuildError("empty_generation", f"call {model_call_id}: the delta holds no generated token")
        return carried
    carry, generated = mask.zero_one_flags()
    opened = ~carry
    boundary = int(np.argmax(opened)) if opened.any() else len(mask)
    if not generated[boundary:].all():
        raise RebuildError("invalid_mask_order", f"call {model_call_id}: the mask is not carry-then-generation")
    if boundary == len(mask):
        raise RebuildError("empty_generation", f"call {model_call_id}: the delta holds no generated token")
    return boundary


def _linearize_chain(verified: _Verified, leaf_id: str | None, chain_index: int = 0) -> LinearizedRow:
    chain = _ancestry(verified.records, leaf_id)
    running: str | None = None
    ids: list[TokenIds] = []
    masks: list[FloatColumn] = []
    logprobs: list[FloatColumn] = []
    spans: list[WeightVersionSpan] = []
    links: list[tuple[str, int, int]] = []
    start = 0
    for row in chain:
        columns = verified.columns[row.model_call_id]
        running = compute_chain_hash(running, columns.token_ids)
        if running != row.chain_hash:
            raise RebuildError("chain_hash_mismatch", f"call {row.model_call_id} does not extend its parent's chain")
        carried = carry_boundary(row.model_call_id, columns.token_mask)
        end = start + len(columns.token_ids)
        ids.append(columns.token_ids)
        masks.append(columns.token_mask)
        logprobs.append(columns.log_probs)
        spans.append(WeightVersionSpan(row.model_call_id, start, end, row.weight_version))
        links.append((row.model_call_id, carried, end - start - carried))
        start = end
    if not any(generated for _, _, generated in links):  # unreachable after empty_generation; kept as 6.1 step 8
        raise RebuildError("empty_training_row", f"the chain ending at {chain[-1].model_call_id} trains no token")
    if hash_token_columns(*ids) != chain[-1].cumulative_hash:
        raise RebuildError(
            "cumulative_hash_mismatch",
            f"the cumulative hash of call {chain[-1].model_call_id} does not cover the linearized tokens",
        )
    return LinearizedRow(
        rollout_id=verified.receipt.rollout_id,
        token_ids=TokenIds.concat(ids),
        token_mask=FloatColumn.concat_binary32(masks),
        logprobs=FloatColumn.concat_binary32(logprobs),
        model_call_ids=[row.model_call_id for row in chain],
        prompt_len=links[0][1],
        weight_versions=[row.weight_version for row in chain],
        weight_version_spans=spans,
        link_spans=links,
        extras_commitments=[
            ExtrasCommitment(row.model_call_id, row.extras_digest_version, row.extras_digest) for row in chain
        ],
        terminal_model_call_id=chain[-1].model_call_id,
        chain_index=chain_index,
        chain_kind=CHAIN_KIND_TERMINAL if chain_index == 0 else CHAIN_KIND_SUBAGENT,
    )


def verify_and_linearize(receipt: RolloutReceipt, snapshots: Sequence[StagedCallBaseSnapshot]) -> LinearizedRow:
    """Verify the receipt and its snapshots (snapshot i is manifest row i), linearize its terminal chain.

    Raises ``ReceiptVerificationError`` (or its subclass ``RebuildError`` for the graph and
    chain checks) with the contract's ``code``; ``ReceiptTypeError`` (also a ``TypeError``) for
    a value that is not a receipt or a base snapshot.
    """
    verified = _verify(receipt, snapshots)
    return _linearize_chain(verified, verified.receipt.terminal_model_call_id)


# --- 6.2: every chain -------------------------------------------------------------------------


def _root_prompts(roots: Sequence[CallRecord], columns: Mapping[str, PackedColumns]) -> dict[str, bytes]:
    """Root -> the prompt (carried) tokens of its first request; roots without a readable prompt join no pool."""
    prompts = {}
    for root in roots:
        packed = columns[root.model_call_id]
        try:
            carried = carry_boundary(root.model_call_id, packed.token_mask)
        except RebuildError:
            continue
        if carried:
            prompts[root.model_call_id] = packed.token_ids.big_endian()[:carried].tobytes()
    return prompts


def _abandoned_roots(
    roots: Sequence[CallRecord],
    children: Mapping[str, Sequence[CallRecord]],
    prompts: Mapping[str, bytes],
    terminal_root: str,
) -> set[str]:
    """Unextended roots of a retry pool (same first prompt) that has an extended member."""

    def extended(root: CallRecord) -> bool:
        return root.model_call_id == terminal_root or bool(children.get(root.model_call_id))

    pools: dict[bytes, list[CallRecord]] = {}
    for root in roots:
        if root.model_call_id in prompts:
            pools.setdefault(prompts[root.model_call_id], []).append(root)
    abandoned: set[str] = set()
    for pool in pools.values():
        if len(pool) > 1 and any(extended(root) for root in pool):
            abandoned.update(root.model_call_id for root in pool if not extended(root))
    return abandoned


def verify_and_linearize_all(receipt: RolloutReceipt, snapshots: Sequence[StagedCallBaseSnapshot]) -> LinearizedRollout:
    """Verify once and linearize the terminal chain (``rows[0]``, its failures raise) and every other root's.

    Other roots follow by admission time (unstamped last, ties by manifest position).  A root
    is skipped as ``abandoned_root`` when it is an unextended retry of an extended root with
    the same first prompt, or when its leaf repeats a published chain; as ``ambiguous_leaf``
    when a fork survives on the way down; with its ``RebuildError`` code when its chain fails.
    """
    verified = _verify(receipt, snapshots)
    manifest = verified.receipt.manifest
    terminal_chain = _ancestry(verified.records, verified.receipt.terminal_model_call_id)
    rows = [_linearize_chain(verified, terminal_chain[-1].model_call_id)]
    on_terminal_chain = {row.model_call_id for row in terminal_chain}
    terminal_root = terminal_chain[0].model_call_id

    roots = [row for row in manifest if row.parent_call_id is None]
    children = children_by_parent(manifest)
    abandoned = _abandoned_roots(roots, children, _root_prompts(roots, verified.columns), terminal_root)
    published = {terminal_chain[-1].cumulative_hash}
    skipped: list[SkippedChain] = []
    for root in sorted((r for r in roots if r.model_call_id != terminal_root), key=root_order_key(manifest)):
        reason, leaf = _subagent_leaf(root, children, abandoned, on_terminal_chain, published)
        if leaf is None:
            skipped.append(SkippedChain(root.model_call_id, reason))
            continue
        try:
            rows.append(_linearize_chain(verified, leaf.model_call_id, chain_index=len(rows)))
        except RebuildError as exc:
            skipped.append(SkippedChain(root.model_call_id, exc.code))
            continue
        published.add(leaf.cumulative_hash)
    return LinearizedRollout(rows=rows, skipped=skipped, num_roots=len(roots))


def _subagent_leaf(
    root: CallRecord,
    children: Mapping[str, Sequence[CallRecord]],
    abandoned: set[str],
    on_terminal_chain: set[str],
    published: set[str],
) -> tuple[str, CallRecord | None]:
    """The leaf to publish for a non-terminal root, or the reason it is skipped."""
    if root.model_call_id in abandoned:
        return SKIP_ABANDONED_ROOT, None
    leaf = descend_to_leaf(root, children)
    if leaf is None:
        return SKIP_AMBIGUOUS_LEAF, None
    if leaf.model_call_id in on_terminal_chain:  # roots own disjoint trees: a guard, not a path
        return SKIP_LEAF_ON_TERMINAL_CHAIN, None
    if leaf.cumulative_hash in published:  # a byte-identical retry would train the same tokens twice
        return SKIP_ABANDONED_ROOT, None
    return "", leaf


def linearize(
    rollout_id: str,
    snapshots: Sequence[StagedCallBaseSnapshot],
    manifest: Sequence[CallRecord],
    terminal_hint: str | None = None,
) -> LinearizedRow:
    """Compatibility wrapper: build a ``declared`` receipt for ``terminal_hint`` and run the verifier.

    A null hint gives ``missing_terminal``, as does a hint that names no manifest row.
    """
    if terminal_hint is None:
        raise RebuildError("missing_terminal", "no terminal call was named")
    rows = list(manifest)
    if not rows:
        raise _fail("empty_manifest", "the manifest holds no calls")
    if not all(isinstance(row, CallRecord) for row in rows):
        raise ReceiptTypeError("not_a_call_record", "manifest rows must be CallRecords")
    duplicate = _first_duplicate(row.model_call_id for row in rows)
    if duplicate is not None:
        raise _fail("duplicate_manifest_row", f"{duplicate!r} appears twice in the manifest")
    if all(row.model_call_id != terminal_hint for row in rows):
        raise RebuildError("missing_terminal", f"the terminal call {terminal_hint!r} is not in the manifest")
    receipt = RolloutReceipt(
        schema_version=rows[0].schema_version,
        rollout_id=rollout_id,
        terminal_model_call_id=terminal_hint,
        manifest=rows,
        terminal_selection="declared",
    )
    return verify_and_linearize(receipt, snapshots)
