"""A store's identity and what it received by log shipping.

``store_identity`` holds one random id per store: the origin of the events it stages.
``ship_sources`` keeps, per store shipped from, the last of its sequence numbers shipped
(where a later ship resumes); ``shipped_events`` maps each shipped event's identity (origin
store id, origin sequence number) to the event it became here.  Written in the same
transaction as the shipped events, so an interrupted ship leaves them in agreement.

Revision ID: 0005
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    identity = op.create_table(
        "store_identity",
        sa.Column("store_id", sa.String(36), primary_key=True),
        sqlite_with_rowid=False,
    )
    op.bulk_insert(identity, [{"store_id": str(uuid.uuid4())}])
    op.create_table(
        "ship_sources",
        sa.Column("source_store_id", sa.String(36), primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "shipped_events",
        sa.Column("origin_store_id", sa.String(36), nullable=False),
        sa.Column("origin_seq", sa.BigInteger, nullable=False),
        sa.Column("event_seq", sa.BigInteger, nullable=True),
        sa.PrimaryKeyConstraint("origin_store_id", "origin_seq", name="pk_shipped_events"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_shipped_events_event_seq", "shipped_events", ["event_seq"])


def downgrade() -> None:
    op.drop_index("ix_shipped_events_event_seq", table_name="shipped_events")
    op.drop_table("shipped_events")
    op.drop_table("ship_sources")
    op.drop_table("store_identity")
