"""An index of the calls that continue a cut, by the call they continue.

``Store.retain`` keeps a cut key while an unfinished call of a later attempt still builds on
it, so it asks which calls continue a given call.  Partial: most calls continue nothing, and
their rows (rewritten with every record) never touch it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_CONTINUES = sa.text("continues_rollout_id IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_calls_continues",
        "calls",
        ["continues_rollout_id", "continues_model_call_id"],
        sqlite_where=_CONTINUES,
        postgresql_where=_CONTINUES,
    )


def downgrade() -> None:
    op.drop_index("ix_calls_continues", table_name="calls")
