"""``migrate``: bring a store's schema to this library's revision (the only command that creates a store)."""

from __future__ import annotations

import os

import click

from store.cli import exits, output
from store.cli.opening import STORE_HELP, location, shown, store_argument


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store migrate demo-store/demo.db\n\n"
    "  staging-store migrate new.db --create",
)
@store_argument
@click.option(
    "--create",
    is_flag=True,
    help="Create a new, empty store when the SQLite file does not exist.  [default: refuse]",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a sentence.")
def migrate(store: str | None, create: bool, as_json: bool) -> int:
    """Migrate the store's schema to this library's revision.

    Only a store's own schema is touched: a database that holds other tables and no store
    schema, or a store newer than this library, is refused (exit 3) and left as it was.
    """
    from store.errors import MigrationError, StorageError
    from store.log.engine import create_store_engine, resolve_url, split_schema, stored_revision
    from store.log.schema import SCHEMA_REVISION, SCHEMA_REVISIONS
    from store.store import open_store

    where = location(store)
    url, schema = split_schema(resolve_url(where), None)
    sqlite_path = url.database if url.get_backend_name() == "sqlite" else None
    if sqlite_path is not None and not os.path.exists(sqlite_path):
        if not create:
            raise exits.CommandError(f"no store at {sqlite_path}; pass --create to create a new store there")
        before = None
    else:
        engine, _ = create_store_engine(url, "full", schema, read_only=True)
        try:
            before = stored_revision(engine, url)
            empty = before is None and _is_empty(engine)
        finally:
            engine.dispose()
        if before is None and not empty:
            raise StorageError(f"{where} is not a store: it holds other tables and no store schema; left unchanged")
        if before is not None and before not in SCHEMA_REVISIONS:
            raise MigrationError(f"{where} has schema {before!r}, newer than this library's {SCHEMA_REVISION}")
    with open_store(where) as opened:
        where_shown = shown(opened)
    shaped = {
        "store": where_shown,
        "from_revision": before,
        "to_revision": SCHEMA_REVISION,
        "changed": before != SCHEMA_REVISION,
    }
    if as_json:
        output.emit_json(shaped)
    elif before == SCHEMA_REVISION:
        output.show(f"{where_shown} is at schema {SCHEMA_REVISION}: nothing to do")
    else:
        output.show(f"{where_shown}: schema {before or '(new store)'} -> {SCHEMA_REVISION}")
    return exits.OK


def _is_empty(engine: object) -> bool:
    """Whether the database holds no table at all (a new file or an empty database)."""
    import sqlalchemy as sa

    assert isinstance(engine, sa.Engine)
    with engine.connect() as connection:
        return not sa.inspect(connection).get_table_names()
