"""A linearized row's routed experts, rebuilt from its calls' extras and verified against the
row's extras commitments at the point of use (wire-contract 6.5)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from store.errors import RebuildError, ReceiptTypeError
from store.rebuild.routes import MISSING_ROUTE_SENTINEL, RoutedExperts, decode_routed_experts
from store.rebuild.verify import LinearizedRow
from store.wire.records import StagedCallRecord


def with_routed_experts(
    row: LinearizedRow,
    extras: Mapping[str, Mapping[str, Any] | None] | Iterable[StagedCallRecord],
) -> LinearizedRow:
    """The row with ``routed_experts`` rebuilt from its calls' extras, verified against its commitments.

    ``extras`` maps call ids to payloads (a missing call counts as null extras), or is the
    calls' records/snapshots with their ``extras``.  A payload that does not match its
    commitment gives ``corrupt_extras``; a bad envelope ``invalid_routes``; routes of another
    length than the call's delta ``route_length_mismatch``; calls whose tables differ in
    layers/top-k or dtype ``route_shape_mismatch``/``route_dtype_mismatch``.  Tokens of calls
    without routes get ``MISSING_ROUTE_SENTINEL``; a row with no routes at all is returned as is.
    """
    payloads = _payloads(extras)
    fragments: dict[str, RoutedExperts] = {}
    for commitment, span in zip(row.extras_commitments, row.weight_version_spans, strict=True):
        payload = payloads.get(commitment.model_call_id)
        commitment.verify(payload)
        routes = payload.get("routed_experts") if payload is not None else None
        if routes is None:
            continue
        fragment = decode_routed_experts(routes)
        if len(fragment) != span.end - span.start:
            raise RebuildError(
                "route_length_mismatch",
                f"call {span.model_call_id}: {len(fragment)} route rows for {span.end - span.start} tokens",
            )
        fragments[span.model_call_id] = fragment
    if not fragments:
        return row
    template = next(iter(fragments.values()))
    for call, fragment in fragments.items():
        if (fragment.num_layers, fragment.topk) != (template.num_layers, template.topk):
            raise RebuildError("route_shape_mismatch", f"call {call}: routes of another layers x top-k shape")
        if fragment.dtype != template.dtype:
            raise RebuildError("route_dtype_mismatch", f"call {call}: routes of dtype {fragment.dtype}")
    parts = [
        fragments[span.model_call_id].values
        if span.model_call_id in fragments
        else np.full(
            (span.end - span.start, template.num_layers, template.topk), MISSING_ROUTE_SENTINEL, template.values.dtype
        )
        for span in row.weight_version_spans
    ]
    table = RoutedExperts(np.concatenate(parts), template.dtype)
    return dataclasses.replace(row, routed_experts=table, routed_experts_dtype=template.dtype)


def _payloads(
    extras: Mapping[str, Mapping[str, Any] | None] | Iterable[StagedCallRecord],
) -> Mapping[str, Mapping[str, Any] | None]:
    if isinstance(extras, Mapping):
        return extras
    payloads: dict[str, Mapping[str, Any] | None] = {}
    for record in extras:
        if not isinstance(record, StagedCallRecord):
            raise ReceiptTypeError("not_a_snapshot", f"expected records with extras, got {type(record).__name__}")
        payloads[record.model_call_id] = record.extras
    return payloads
