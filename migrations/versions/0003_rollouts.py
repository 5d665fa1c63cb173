"""The ``rollouts`` projection: fences, capture-ledger counts and deletions per capture key.

No earlier event touches it (the retention and ledger events are new with this revision), so
an existing store starts with an empty table.  New SQLite stores are created with
``auto_vacuum=INCREMENTAL`` (``store.engine.migrate``) so deleted pages go back to the file
system; an older store is converted once by ``Store.compact``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("rollout_id", sa.String, primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("fenced", sa.Integer, nullable=False),
        sa.Column("fence_seq", sa.BigInteger, nullable=True),
        sa.Column("ledger_rows", sa.BigInteger, nullable=False),
        sa.Column("ledger_failures", sa.BigInteger, nullable=False),
        sa.Column("deletions", sa.BigInteger, nullable=False),
        sa.Column("deleted_events", sa.BigInteger, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("rollouts")
