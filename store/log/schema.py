"""The tables (SQLAlchemy Core, portable types only): the event log and its projections.

Policy versions are u64 on the wire; projections keep them as zero-padded 20-digit strings
(``version_key``) so they stay exact and ordered on every backend.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    text,
)

# The alembic revision this code reads and writes; tests check it is the migrations' head.
SCHEMA_REVISION = "0012"
# Every revision the migrations know, oldest first (a read-only open tells older from newer).
SCHEMA_REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0008", "0009", "0010", "0011", "0012")

metadata = MetaData()

# SQLite only aliases the rowid for INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
_SEQ = BigInteger().with_variant(Integer(), "sqlite")

events = Table(
    "events",
    metadata,
    Column("seq", _SEQ, primary_key=True, autoincrement=True),
    Column("rollout_id", String, nullable=False),
    Column("model_call_id", String, nullable=False),
    Column("stream_version", Integer, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("staging_key", String, nullable=True),
    Column("writer_pid", Integer, nullable=False),
    Column("recorded_at", Float, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("token_ids", LargeBinary, nullable=True),
    Column("token_mask", LargeBinary, nullable=True),
    Column("log_probs", LargeBinary, nullable=True),
    Column("checksum", LargeBinary, nullable=False),
    # Provenance, not covered by the checksum (revision 0008; NULL before it): the host that
    # wrote the event (with writer_pid, kept across ships) and the id of the store it was
    # written for (the audit reports an event found in another store).
    Column("writer_host", String, nullable=True),
    Column("store_id", String(36), nullable=True),
    UniqueConstraint("rollout_id", "model_call_id", "stream_version", name="uq_events_stream_version"),
)

staged_keys = Table(
    "staged_keys",
    metadata,
    Column("staging_key", String, primary_key=True),
    Column("event_seq", BigInteger, nullable=False),
    Column("rollout_id", String, nullable=False),
    Column("model_call_id", String, nullable=False),
    Column("digest", String(64), nullable=False),
    sqlite_with_rowid=False,  # one B-tree per projection: fewer pages written per commit
)

calls = Table(
    "calls",
    metadata,
    Column("rollout_id", String, nullable=False),
    Column("model_call_id", String, nullable=False),
    Column("stream_version", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("parent_call_id", String, nullable=True),
    Column("mode", String(16), nullable=True),
    Column("prev_len", BigInteger, nullable=True),
    Column("cum_len", BigInteger, nullable=True),
    Column("generated_tokens", BigInteger, nullable=False),
    Column("chain_hash", String(64), nullable=True),
    Column("cumulative_hash", String(64), nullable=True),
    Column("continues_rollout_id", String, nullable=True),
    Column("continues_model_call_id", String, nullable=True),
    Column("admitted_version", String(20), nullable=True),
    Column("oldest_version", String(20), nullable=True),
    Column("newest_version", String(20), nullable=True),
    Column("version_spans", LargeBinary, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    PrimaryKeyConstraint("rollout_id", "model_call_id", name="pk_calls"),
    # The calls that continue a given call (``Store.retain``); only those rows are indexed.
    Index(
        "ix_calls_continues",
        "continues_rollout_id",
        "continues_model_call_id",
        sqlite_where=text("continues_rollout_id IS NOT NULL"),
        postgresql_where=text("continues_rollout_id IS NOT NULL"),
    ),
    sqlite_with_rowid=False,
)

cut_receipts = Table(
    "cut_receipts",
    metadata,
    Column("checkpoint_id", String, nullable=False),
    Column("inventory_digest", String(64), nullable=False),
    Column("event_seq", BigInteger, nullable=False),
    PrimaryKeyConstraint("checkpoint_id", "inventory_digest", name="pk_cut_receipts"),
    sqlite_with_rowid=False,
)

# Fences, ledger counts and deletions per capture key (only keys that have any; see RolloutState).
rollouts = Table(
    "rollouts",
    metadata,
    Column("rollout_id", String, primary_key=True),
    Column("state", String(16), nullable=False),
    Column("fenced", Integer, nullable=False),
    Column("fence_seq", BigInteger, nullable=True),
    Column("ledger_rows", BigInteger, nullable=False),
    Column("ledger_failures", BigInteger, nullable=False),
    Column("deletions", BigInteger, nullable=False),
    Column("deleted_events", BigInteger, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    sqlite_with_rowid=False,
)

# Policy worker processes, keyed by the event that first named them (their join).
workers = Table(
    "workers",
    metadata,
    Column("join_seq", BigInteger, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("worker_index", Integer, nullable=False),
    Column("expected", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("left_seq", BigInteger, nullable=True),
    Column("blocked_checkpoint", String, nullable=True),
    PrimaryKeyConstraint("join_seq", name="pk_workers"),
    sqlite_with_rowid=False,
)

# The complete-record transport (revision 0011, ``store.transport``): one row per rollout that
# has a transport event, its observable version (the transport events folded so far), whether it
# is frozen (and the snapshot's id), marked incomplete or dropped, and the calls whose
# pre-dispatch intent no entry has answered yet (msgpack list, sorted).
token_rollouts = Table(
    "token_rollouts",
    metadata,
    Column("rollout_id", String, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("frozen", Integer, nullable=False),
    Column("snapshot_id", String, nullable=True),
    Column("incomplete", Integer, nullable=False),
    Column("dropped", Integer, nullable=False),
    Column("entries", BigInteger, nullable=False),
    Column("open_intents", LargeBinary, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    sqlite_with_rowid=False,
)

# One row per entry put: where its event is, its payload's digest (an identical re-put is a
# no-op) and the lineage fields the resolver matches on without reading the payload.
token_entries = Table(
    "token_entries",
    metadata,
    Column("rollout_id", String, nullable=False),
    Column("model_call_id", String, nullable=False),
    Column("event_seq", BigInteger, nullable=False),
    Column("payload_digest", String(64), nullable=False),
    Column("token_digest", String(64), nullable=True),
    Column("cum_len", BigInteger, nullable=True),
    Column("parent_call_id", String, nullable=True),
    Column("prompt_is_delta", Integer, nullable=False),
    Column("fingerprint", String, nullable=False),
    Column("fingerprint_version", BigInteger, nullable=True),
    Column("context_len", BigInteger, nullable=False),
    Column("context_digest", String, nullable=False),
    PrimaryKeyConstraint("rollout_id", "model_call_id", name="pk_token_entries"),
    sqlite_with_rowid=False,
)

PROJECTION_TABLES = (staged_keys, calls, cut_receipts, rollouts, workers, token_rollouts, token_entries)

# Log shipping (store.shipping): not projections of the log, bookkeeping written with it.
store_identity = Table(
    "store_identity",
    metadata,
    Column("store_id", String(36), primary_key=True),  # random, made when the store is created
    sqlite_with_rowid=False,
)

ship_sources = Table(
    "ship_sources",
    metadata,
    Column("source_store_id", String(36), primary_key=True),
    Column("last_seq", BigInteger, nullable=False),  # the source's events up to here were shipped
    # The source's checksum of its event at last_seq (revision 0012; NULL before it): a shipper
    # whose own event there differs holds another history of the same store id.
    Column("last_checksum", LargeBinary, nullable=True),
    sqlite_with_rowid=False,
)

shipped_events = Table(
    "shipped_events",
    metadata,
    Column("origin_store_id", String(36), nullable=False),
    Column("origin_seq", BigInteger, nullable=False),
    Column("event_seq", BigInteger, nullable=True),  # None: already here, nothing appended
    PrimaryKeyConstraint("origin_store_id", "origin_seq", name="pk_shipped_events"),
    Index("ix_shipped_events_event_seq", "event_seq"),
    sqlite_with_rowid=False,
)


def version_key(version: int) -> str:
    """An exact, order-preserving text form of a u64 policy version."""
    return f"{version:020d}"
