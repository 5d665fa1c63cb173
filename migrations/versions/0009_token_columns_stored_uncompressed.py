"""PostgreSQL keeps the token-id and log-prob columns out of line without trying to compress them.

Both are stored packed already (u32 or u64 ids, raw binary32 log-probs): PostgreSQL's pglz
finds nothing to take out of them, yet tries on every event of more than ~2 KB before it
moves the value out of line, which was about half the server's time for a ship's events.
``STORAGE EXTERNAL`` moves them out of line as they are.  Only later rows are affected (the
ones already stored are left as they are: nothing is rewritten); the mask (17 bytes as a
run, or binary32 0.0/1.0 patterns that do compress) and the body keep the default.  SQLite
has no such setting: nothing changes there.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_COLUMNS = ("token_ids", "log_probs")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        changes = ", ".join(f"ALTER COLUMN {column} SET STORAGE EXTERNAL" for column in _COLUMNS)
        op.execute(f"ALTER TABLE events {changes}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        changes = ", ".join(f"ALTER COLUMN {column} SET STORAGE EXTENDED" for column in _COLUMNS)
        op.execute(f"ALTER TABLE events {changes}")
