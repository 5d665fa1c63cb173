"""Alembic environment: ``open_store`` passes its connection; the alembic CLI passes a URL."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from store.log.schema import metadata

config = context.config
connection = config.attributes.get("connection")

if connection is None:
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as new_connection:
        context.configure(connection=new_connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
else:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
