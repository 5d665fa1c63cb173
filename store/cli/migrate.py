"""``migrate``: bring a store's schema to this library's revision (the only command that creates a store)."""

from __future__ import annotations

import os

import click

from store.cli import exits, output
from store.cli.opening import STORE_HELP, location, shown, store_argument


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store migrate demo-store/demo.db --check\n\n"
    "  staging-store migrate demo-store/demo.db\n\n  staging-store migrate new.db --create",
)
@store_argument
@click.option(
    "--create",
    is_flag=True,
    help="Create a new, empty store where there is none yet (a missing or empty SQLite file, an empty "
    "PostgreSQL database or schema).  [default: refuse]",
)
@click.option(
    "--check",
    is_flag=True,
    help="Only look: print the store's revision, this library's and the steps a migrate would run, "
    "opening the store read-only.  Exit 0 when it is up to date, 1 when steps are pending.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a sentence.")
def migrate(store: str | None, create: bool, check: bool, as_json: bool) -> int:
    """Migrate the store's schema to this library's revision.

    Only a store's own schema is touched: a database that holds other tables and no store
    schema, or a store newer than this library, is refused (exit 3) and left as it was.
    Only --create makes a new store: in a SQLite file that does not exist or is empty, or in
    a PostgreSQL database or ?schema= that holds nothing yet (the schema is created).  A store
    already at this revision is not opened for writing (a read-only file says so, not
    "permission denied").  --check only looks.
    """
    if check and create:
        raise click.UsageError("--check only looks; it takes no --create")
    from store.errors import StorageError
    from store.log.engine import (
        create_store_engine,
        describe_location,
        resolve_url,
        split_schema,
        stored_revision,
        unknown_revision_error,
    )
    from store.log.schema import SCHEMA_REVISION, SCHEMA_REVISIONS
    from store.store import open_store

    where = location(store)
    url, schema = split_schema(resolve_url(where), None)
    named = describe_location(url, schema)
    sqlite_path = url.database if url.get_backend_name() == "sqlite" else None
    if sqlite_path is not None and not os.path.exists(sqlite_path):
        if check:
            raise exits.CommandError(f"no store at {sqlite_path}; nothing to check")
        if not create:
            raise exits.CommandError(f"no store at {sqlite_path}; pass --create to create a new store there")
        before = None
    else:
        engine, _ = create_store_engine(url, "full", schema, read_only=True)
        try:
            before = stored_revision(engine, url)
            nothing = None if before is not None else _holds_nothing(engine, schema)
            if before is not None and before not in SCHEMA_REVISIONS:
                with engine.connect() as connection:
                    raise unknown_revision_error(named, before, connection)
        finally:
            engine.dispose()
        if before is None and nothing is None:
            raise StorageError(f"{named} is not a store: it holds other tables and no store schema; left unchanged")
        if before is None and not create and not check:
            raise exits.CommandError(f"{named} holds no store ({nothing}); pass --create to create a new store there")
    if check:
        return _report_check(where if sqlite_path is not None else named, before, as_json)
    if before == SCHEMA_REVISION:  # nothing to write: never open it for writing
        where_shown = where if sqlite_path is not None else named
    else:
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


def _report_check(where: str, before: str | None, as_json: bool) -> int:
    """``migrate --check``: the revision held, this library's, and the steps a migrate would run."""
    from store.log.schema import SCHEMA_REVISION, SCHEMA_REVISIONS

    start = 0 if before is None else SCHEMA_REVISIONS.index(before) + 1
    pending = list(SCHEMA_REVISIONS[start:])
    shaped = {"store": where, "revision": before, "library_revision": SCHEMA_REVISION, "pending": pending}
    if as_json:
        output.emit_json(shaped)
    elif not pending:
        output.show(f"{where} is at schema {SCHEMA_REVISION}, this library's: up to date")
    else:
        held = before or "none (no store yet: `migrate --create` makes one)"
        output.show(f"{where}: schema {held}; this library's is {SCHEMA_REVISION}; pending: {', '.join(pending)}")
    return exits.PROBLEMS if pending else exits.OK


def _holds_nothing(engine: object, schema: str | None) -> str | None:
    """Why the database holds nothing yet (an empty file, no tables, no such schema), or None
    when it holds tables."""
    import sqlalchemy as sa

    assert isinstance(engine, sa.Engine)
    with engine.connect() as connection:
        if schema is not None:
            found = connection.execute(
                sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :schema"), {"schema": schema}
            ).first()
            if found is None:
                return f"the schema {schema} does not exist"
            tables = sa.inspect(connection).get_table_names(schema=schema)
        else:
            tables = sa.inspect(connection).get_table_names()
        connection.rollback()
    if tables:
        return None
    return "an empty file" if engine.dialect.name == "sqlite" else "no tables"
