"""Each event names the host that wrote it and the store it was written for.

``writer_host`` joins ``writer_pid``: a fleet's log, shipped into one central store, still says
which host and process wrote each event (a shipped event keeps its origin's pid and host).
``store_id`` is the id of the store the writer meant to append to: an event found in another
store (a transaction pooler or a stale ``search_path`` sent it to the wrong schema) is
reported by the audit.  Both are NULL for events written before this revision.

Revision ID: 0008
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, no default): neither backend rewrites the log's rows.
    op.add_column("events", sa.Column("writer_host", sa.String, nullable=True))
    op.add_column("events", sa.Column("store_id", sa.String(36), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.drop_column("store_id")
        batch.drop_column("writer_host")
