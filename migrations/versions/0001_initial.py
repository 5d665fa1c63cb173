"""The event log and its projections.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("seq", _SEQ, primary_key=True, autoincrement=True),
        sa.Column("rollout_id", sa.String, nullable=False),
        sa.Column("model_call_id", sa.String, nullable=False),
        sa.Column("stream_version", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("staging_key", sa.String, nullable=True),
        sa.Column("writer_pid", sa.Integer, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("token_ids", sa.LargeBinary, nullable=True),
        sa.Column("token_mask", sa.LargeBinary, nullable=True),
        sa.Column("log_probs", sa.LargeBinary, nullable=True),
        sa.Column("checksum", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("rollout_id", "model_call_id", "stream_version", name="uq_events_stream_version"),
    )
    op.create_table(
        "staged_keys",
        sa.Column("staging_key", sa.String, primary_key=True),
        sa.Column("event_seq", sa.BigInteger, nullable=False),
        sa.Column("rollout_id", sa.String, nullable=False),
        sa.Column("model_call_id", sa.String, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "calls",
        sa.Column("rollout_id", sa.String, nullable=False),
        sa.Column("model_call_id", sa.String, nullable=False),
        sa.Column("stream_version", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("parent_call_id", sa.String, nullable=True),
        sa.Column("mode", sa.String(16), nullable=True),
        sa.Column("prev_len", sa.BigInteger, nullable=True),
        sa.Column("cum_len", sa.BigInteger, nullable=True),
        sa.Column("generated_tokens", sa.BigInteger, nullable=False),
        sa.Column("chain_hash", sa.String(64), nullable=True),
        sa.Column("cumulative_hash", sa.String(64), nullable=True),
        sa.Column("continues_rollout_id", sa.String, nullable=True),
        sa.Column("continues_model_call_id", sa.String, nullable=True),
        sa.Column("admitted_version", sa.String(20), nullable=True),
        sa.Column("oldest_version", sa.String(20), nullable=True),
        sa.Column("newest_version", sa.String(20), nullable=True),
        sa.Column("version_spans", sa.LargeBinary, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", "model_call_id", name="pk_calls"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "cut_receipts",
        sa.Column("checkpoint_id", sa.String, nullable=False),
        sa.Column("inventory_digest", sa.String(64), nullable=False),
        sa.Column("event_seq", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("checkpoint_id", "inventory_digest", name="pk_cut_receipts"),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("cut_receipts")
    op.drop_table("calls")
    op.drop_table("staged_keys")
    op.drop_table("events")
