"""The ledger's reason vocabulary (wire-contract 3.10): wire values, never reused."""

from __future__ import annotations

from typing import Final

UNRESOLVED_PARENT: Final = "unresolved_parent"
REQUEST_FINISHED_WITHOUT_STAGED_COORDINATES: Final = "request_finished_without_staged_coordinates"
WORKER_RESPONSE_MISSING_COMMIT_COORDINATES: Final = "worker_response_missing_commit_coordinates"
WORKER_CAPTURE_FAILED: Final = "worker_capture_failed"
INVALID_WORKER_COMMIT_COORDINATES: Final = "invalid_worker_commit_coordinates"
# Gym's values for these two legacy-row constants were not found (3.10); these are this
# store's own spelling, used only for lineage rows that carry no commit coordinates.
LEDGER_ROW_MISSING_RESPONSE_ID: Final = "ledger_row_missing_response_id"
LEDGER_ROW_MISSING_CHAIN_HASH: Final = "ledger_row_missing_chain_hash"

POISON_REASONS: Final = (
    UNRESOLVED_PARENT,
    REQUEST_FINISHED_WITHOUT_STAGED_COORDINATES,
    WORKER_RESPONSE_MISSING_COMMIT_COORDINATES,
    WORKER_CAPTURE_FAILED,
    INVALID_WORKER_COMMIT_COORDINATES,
)
