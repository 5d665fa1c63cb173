"""Small builders of valid records for tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from store import (
    FloatColumn,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    TokenIds,
    compute_chain_hash,
    hash_token_ids,
)


def make_record(
    *,
    rollout_id: str = "rollout-1",
    model_call_id: str = "call-1",
    prompt: Sequence[int] = (10, 11, 12),
    generated: Sequence[int] = (20, 21),
    logprobs: Sequence[float] | None = None,
    parent_call_id: str | None = None,
    parent_chain_hash: str | None = None,
    prefix: Sequence[int] = (),
    weight_version: int = 7,
    extras: dict[str, Any] | None = None,
    schema_version: int = 2,
) -> StagedCallRecord:
    """A root (no parent) or child record: carried ``prompt`` tail, then ``generated`` tokens.

    For a child, ``prefix`` is the parent's cumulative tokens (``prev_len = len(prefix)``).
    """
    lps = list(logprobs) if logprobs is not None else [-0.5 - i / 8 for i in range(len(generated))]
    ids = [*prompt, *generated]
    return StagedCallRecord.from_components(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent_call_id,
        mode="token_in" if parent_call_id else "text",
        prev_len=len(prefix),
        weight_version=weight_version,
        token_ids_delta=ids,
        token_mask_delta=[0.0] * len(prompt) + [1.0] * len(generated),
        generation_log_probs_delta=[0.0] * len(prompt) + lps,
        chain_hash=compute_chain_hash(parent_chain_hash, ids),
        cumulative_hash=hash_token_ids([*prefix, *ids]),
        extras=extras,
        schema_version=schema_version,
    )


def plain_digest_fields(record: StagedCallBaseSnapshot) -> dict[str, Any]:
    """``record.digest_fields()`` with the token columns as plain Python lists."""
    return {
        name: value.tolist() if isinstance(value, (TokenIds, FloatColumn)) else value
        for name, value in record.digest_fields().items()
    }
