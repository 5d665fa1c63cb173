"""A ship's resume point names the event it ends at: ``ship_sources.last_checksum``.

The checksum of the source's event at ``last_seq``, as the source stored it.  A shipper compares
it with its own event at that seq before it ships anew: a source whose log is behind the
target's resume point, or holds other events at those seqs (a power loss, a restored backup,
two stores copied from one file, which share an id), is refused instead of shipping a second
history past the first (``store.shipping.ship``).  NULL for resume points written before this
revision: only the seq is compared there.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, no default): neither backend rewrites the table's rows.
    op.add_column("ship_sources", sa.Column("last_checksum", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ship_sources") as batch:
        batch.drop_column("last_checksum")
