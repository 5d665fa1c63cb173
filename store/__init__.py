"""A durable token staging store for RL inference workers (NeMo Gym wire-compatible).

Workers stage every model call's exact tokens before responding; generation cuts stage
the tokens of still-decoding calls so a replacement call can continue from a proven
prefix.  Everything is an event in one append-only log; tables are projections of it.
"""

from store.columns import FloatColumn, TokenIds
from store.digest import (
    EMPTY_EXTRAS_DIGEST,
    STAGING_SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    build_staging_delta,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from store.errors import (
    CaptureError,
    ConfigurationError,
    CorruptRecordError,
    DigestMismatchError,
    DigestTypeError,
    DigestValueError,
    GenerationCutError,
    InvalidRecordError,
    MigrationError,
    StorageError,
    StoreClosedError,
    StoreError,
    StreamingUnsupportedError,
    UnknownKeyError,
)
from store.events import EventKind
from store.queries import CallInfo, VersionSpan
from store.records import (
    CallRecord,
    CaptureAdmission,
    CaptureLedgerCommit,
    CommitCoords,
    GenerationCutContinuation,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)
from store.replay import ReplayDifference, ReplayReport
from store.store import Store, open_store

__all__ = [
    "EMPTY_EXTRAS_DIGEST",
    "STAGING_SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "CallInfo",
    "CallRecord",
    "CaptureAdmission",
    "CaptureError",
    "CaptureLedgerCommit",
    "CommitCoords",
    "ConfigurationError",
    "CorruptRecordError",
    "DigestMismatchError",
    "DigestTypeError",
    "DigestValueError",
    "EventKind",
    "FloatColumn",
    "GenerationCutContinuation",
    "GenerationCutError",
    "InvalidRecordError",
    "ManifestFailure",
    "MigrationError",
    "ReplayDifference",
    "ReplayReport",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "StorageError",
    "Store",
    "StoreClosedError",
    "StoreError",
    "StreamingUnsupportedError",
    "TokenIds",
    "UnknownKeyError",
    "VersionSpan",
    "build_staging_delta",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "from_json",
    "from_msgpack",
    "hash_token_ids",
    "open_store",
    "to_json",
    "to_msgpack",
]
