"""Retention: fences (retire, forget), deletion with tombstones, compaction, the capture ledger."""

from store.retention.compact import CompactReport
from store.retention.ledger import CaptureLedger, LedgerAdmission, receipt_from_manifest
from store.retention.reasons import (
    INVALID_WORKER_COMMIT_COORDINATES,
    LEDGER_ROW_MISSING_CHAIN_HASH,
    LEDGER_ROW_MISSING_RESPONSE_ID,
    POISON_REASONS,
    REQUEST_FINISHED_WITHOUT_STAGED_COORDINATES,
    UNRESOLVED_PARENT,
    WORKER_CAPTURE_FAILED,
    WORKER_RESPONSE_MISSING_COMMIT_COORDINATES,
)

__all__ = [
    "INVALID_WORKER_COMMIT_COORDINATES",
    "LEDGER_ROW_MISSING_CHAIN_HASH",
    "LEDGER_ROW_MISSING_RESPONSE_ID",
    "POISON_REASONS",
    "REQUEST_FINISHED_WITHOUT_STAGED_COORDINATES",
    "UNRESOLVED_PARENT",
    "WORKER_CAPTURE_FAILED",
    "WORKER_RESPONSE_MISSING_COMMIT_COORDINATES",
    "CaptureLedger",
    "CompactReport",
    "LedgerAdmission",
    "receipt_from_manifest",
]
