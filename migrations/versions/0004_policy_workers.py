"""The ``workers`` projection: policy worker processes as they joined, stopped or were lost.

Only this table; the worker events themselves live in the existing log.

Revision ID: 0004
Revises: 0002 (relinked to 0003 at merge)
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("join_seq", sa.BigInteger, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("worker_index", sa.Integer, nullable=False),
        sa.Column("expected", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("left_seq", sa.BigInteger, nullable=True),
        sa.Column("blocked_checkpoint", sa.String, nullable=True),
        sa.PrimaryKeyConstraint("join_seq", name="pk_workers"),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("workers")
