"""The complete-record transport's projections: ``token_rollouts`` and ``token_entries``.

Gym's ``TokenSink``/``TokenSource`` over the store (``store.transport``) appends ``tokens_*``
events to the existing log; these two tables are their projections, rebuilt by ``replay`` like
every other.  No earlier event touches them (the events are new with this revision), so an
existing store starts with both empty.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "token_rollouts",
        sa.Column("rollout_id", sa.String, primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("frozen", sa.Integer, nullable=False),
        sa.Column("snapshot_id", sa.String, nullable=True),
        sa.Column("incomplete", sa.Integer, nullable=False),
        sa.Column("dropped", sa.Integer, nullable=False),
        sa.Column("entries", sa.BigInteger, nullable=False),
        sa.Column("open_intents", sa.LargeBinary, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "token_entries",
        sa.Column("rollout_id", sa.String, nullable=False),
        sa.Column("model_call_id", sa.String, nullable=False),
        sa.Column("event_seq", sa.BigInteger, nullable=False),
        sa.Column("payload_digest", sa.String(64), nullable=False),
        sa.Column("token_digest", sa.String(64), nullable=True),
        sa.Column("cum_len", sa.BigInteger, nullable=True),
        sa.Column("parent_call_id", sa.String, nullable=True),
        sa.Column("prompt_is_delta", sa.Integer, nullable=False),
        sa.Column("fingerprint", sa.String, nullable=False),
        sa.Column("fingerprint_version", sa.BigInteger, nullable=True),
        sa.Column("context_len", sa.BigInteger, nullable=False),
        sa.Column("context_digest", sa.String, nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", "model_call_id", name="pk_token_entries"),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("token_entries")
    op.drop_table("token_rollouts")
