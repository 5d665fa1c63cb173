"""Opening a store: URL handling, per-backend settings, compiled statements, migrations.

Everything backend-specific lives here, in two thin adapters; the rest of the library
speaks portable SQLAlchemy Core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import re
import sqlite3
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url

from store.errors import ConfigurationError, MigrationError, StorageError
from store.log import postgres
from store.log.failures import connecting_failed, connection_lost, lock_timed_out
from store.log.failures import storage_error as storage_error  # the write path and readers import it here
from store.log.schema import SCHEMA_REVISION, SCHEMA_REVISIONS

DURABILITY_LEVELS = ("full", "normal")
BUSY_TIMEOUT_MS = 60_000
# The -wal file is truncated to this size at the first commit after a checkpoint has
# copied it all into the database.  Steady staging keeps it near SQLite's 1,000-page
# autocheckpoint (about 4 MiB); a long reader lets it grow past this until the reader ends.
WAL_SIZE_LIMIT_BYTES = 16 * 1024 * 1024
_PG_WRITE_LOCK = 0x5354_4147  # advisory lock id: one writer at a time, as on SQLite
# A schema name the store accepts: a plain lower-case identifier, so it needs no quoting
# rules beyond double quotes and means the same to every tool (psql, pg_dump, alembic).
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@dataclass(frozen=True)
class Backend:
    """What differs between SQLite and PostgreSQL; everything else is shared code."""

    name: str
    begin_write_sql: str
    # Opens a read transaction that sees one snapshot and takes no write lock (replay checks).
    begin_snapshot_sql: str = "BEGIN"
    # Run in a write transaction that appended nothing, so its durable commit still writes
    # (and flushes) a commit record: PostgreSQL flushes the log up to it, earlier
    # unsynced commits included.  SQLite syncs its -wal file instead (``sync_file``).
    force_commit_record_sql: str | None = None
    # PostgreSQL: a write transaction's statements go out in pipeline mode (psycopg 3), so
    # only the statements whose results the write path reads wait for the server.
    pipelined: bool = False
    # Takes the next event's seq ahead of its INSERT (PostgreSQL, in the pipeline, under the
    # write lock), so the INSERT needs no RETURNING read; None: the INSERT returns it.
    next_seq_sql: str | None = None
    # Run on the writer connection when the write path takes it, and before it goes back to
    # the pool.  SQLite: the writer does not checkpoint (a commit that crosses the threshold
    # would copy the -wal into the database before returning); ``checkpoint_sql`` runs on
    # another thread and connection instead (``store.log.checkpointer``).
    writer_setup_sql: tuple[str, ...] = ()
    writer_reset_sql: tuple[str, ...] = ()
    checkpoint_sql: str | None = None
    # PostgreSQL: the write path's statements after BEGIN (``store.log.postgres``): the schema,
    # then the transaction's limits, its synchronous_commit and the lock, durable and not.
    search_path_sql: str | None = None
    write_begin_sql: tuple[str, str] | None = None
    # PostgreSQL: whether statements may be prepared on the server (``learn_sessions``).
    sessions: postgres.Sessions | None = None

    def commit_mode_sql(self, durable: bool) -> tuple[str | None, str | None]:
        """SQL to run before BEGIN and inside the transaction so its commit waits for the disk or not."""
        if self.name == "sqlite":
            return _SQLITE_DURABLE if durable else _SQLITE_NOT_DURABLE
        return _POSTGRES_DURABLE if durable else _POSTGRES_NOT_DURABLE


_SQLITE_DURABLE: tuple[str | None, str | None] = ("PRAGMA synchronous = FULL", None)
_SQLITE_NOT_DURABLE: tuple[str | None, str | None] = ("PRAGMA synchronous = NORMAL", None)
# PostgreSQL sets synchronous_commit in its ``write_begin_sql``.
_POSTGRES_DURABLE: tuple[str | None, str | None] = (None, None)
_POSTGRES_NOT_DURABLE: tuple[str | None, str | None] = (None, None)


SQLITE = Backend(
    "sqlite",
    "BEGIN IMMEDIATE",
    writer_setup_sql=("PRAGMA wal_autocheckpoint = 0",),
    writer_reset_sql=("PRAGMA wal_autocheckpoint = 1000",),  # SQLite's default, for the pool's other users
    # PASSIVE: never waits for readers or the writer; what it cannot copy now, the next one does.
    checkpoint_sql="PRAGMA wal_checkpoint(PASSIVE)",
)


def postgresql_backend(schema: str | None = None) -> Backend:
    """PostgreSQL: the write lock is an advisory lock of the store's own schema.

    One writer at a time per store, as on SQLite, and the identity value of every event is
    taken under that lock, so events become visible in sequence order (see ``Store``'s
    sequence-order rule).  Stores in other schemas of the database never wait for it.
    Every setting a transaction needs is made inside it (``store.log.postgres``).
    """
    return Backend(
        "postgresql",
        postgres.lock_sql(write_lock_id(schema)),
        begin_snapshot_sql="SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY",
        force_commit_record_sql="SELECT txid_current()",
        pipelined=True,
        next_seq_sql="SELECT nextval(pg_get_serial_sequence('events', 'seq'))",
        search_path_sql=postgres.search_path_sql(schema),
        write_begin_sql=postgres.write_begin_sql(write_lock_id(schema)),
    )


def write_lock_id(schema: str | None) -> int:
    """The advisory lock id of a store's writer (the default schema keeps the historical id)."""
    if schema is None:
        return _PG_WRITE_LOCK
    return (_PG_WRITE_LOCK << 32) | (zlib.crc32(schema.encode()) & 0x7FFF_FFFF)


POSTGRESQL = postgresql_backend()


def checked_schema(schema: object) -> str | None:
    """``open_store(..., schema=...)``: None, or a plain lower-case identifier."""
    if schema is None:
        return None
    if not isinstance(schema, str):
        raise ConfigurationError(f"schema must be a str, got {type(schema).__name__}")
    if not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            f"schema {_shown(schema)} is not a plain identifier: lower-case letters, digits and _, "
            "not starting with a digit, at most 63 characters"
        )
    if schema.startswith("pg_") or schema == "information_schema":
        raise ConfigurationError(f"schema {schema!r} is reserved by PostgreSQL")
    return schema


def split_schema(url: URL, schema: str | None) -> tuple[URL, str | None]:
    """The URL option ``?schema=NAME`` (so a CLI or a config string can name a schema), taken
    out of the URL the driver sees; it must agree with ``open_store(..., schema=)`` if both are given."""
    given = url.query.get("schema")
    if given is None:
        return url, schema
    if not isinstance(given, str):
        raise ConfigurationError(f"the URL names schema= {len(given)} times; name it once")
    if schema is not None and schema != given:
        raise ConfigurationError(f"the URL says schema={given!r} but schema={schema!r} was passed; name one")
    return url.difference_update_query(["schema"]), given


def resolve_url(url_or_path: str | os.PathLike[str]) -> URL:
    """A plain path means a SQLite file; anything with ``://`` is a SQLAlchemy URL."""
    text = _location_text(url_or_path)
    if "://" not in text:
        try:
            path = Path(text).expanduser().resolve()
            is_dir, parent_is_dir = path.is_dir(), path.parent.is_dir()
        except (OSError, RuntimeError) as exc:  # a name too long, a ~user that does not exist, ...
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigurationError(f"cannot use the store path {_shown(text)}: {reason}") from exc
        if is_dir:
            raise ConfigurationError(f"{path} is a directory; pass the path of a store file")
        if not parent_is_dir:
            raise ConfigurationError(f"the folder {path.parent} does not exist")
        return URL.create("sqlite+pysqlite", database=str(path))
    try:
        url = make_url(text)
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(f"not a database URL: {text!r}") from exc
    if url.get_backend_name() == "postgresql" and url.get_driver_name() in ("", "psycopg2"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def _location_text(url_or_path: Any) -> str:
    """The path or URL as text; what the OS or a driver could never take is refused here."""
    if isinstance(url_or_path, (bytes, bytearray)):
        raise ConfigurationError("open_store takes a str path or URL, not bytes (decode it with os.fsdecode)")
    try:
        text = os.fspath(url_or_path)
    except TypeError:
        raise ConfigurationError(
            f"open_store needs a path or a database URL, got {type(url_or_path).__name__}"
        ) from None
    if not isinstance(text, str):
        raise ConfigurationError(f"open_store takes a str path or URL, not {type(text).__name__}")
    if not text:
        raise ConfigurationError("open_store needs a path or a database URL, got an empty string")
    if "\x00" in text:
        raise ConfigurationError(f"the store path or URL contains a NUL character: {_shown(text)}")
    return text


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 120 else repr(text[:117]) + "..."


DEFAULT_POOL_SIZE = 1  # PostgreSQL connections a store holds at most, its writer's included


def create_store_engine(
    url: URL,
    durability: str,
    schema: str | None = None,
    *,
    read_only: bool = False,
    pool_size: int = DEFAULT_POOL_SIZE,
) -> tuple[Engine, Backend]:
    if durability not in DURABILITY_LEVELS:
        raise ConfigurationError(f"durability must be one of {DURABILITY_LEVELS}, got {durability!r}")
    schema = checked_schema(schema)
    backend_name = url.get_backend_name()
    if backend_name == "sqlite":
        if schema is not None:
            raise ConfigurationError("schemas are a PostgreSQL feature; give each SQLite store its own file")
        if url.database in (None, "", ":memory:"):
            raise ConfigurationError("an in-memory SQLite database is not durable; pass a file path")
        if read_only:
            return _read_only_sqlite_engine(url), SQLITE
        engine = _create_engine(url)
        _configure_sqlite(engine, durability)
        return engine, SQLITE
    if backend_name == "postgresql":
        engine = _create_engine(
            url,
            # No ping on every checkout (a round trip per batch for a writer that checks its
            # connection out per batch): ``postgres.configure`` pings one that sat idle.
            pool_pre_ping=False,
            pool_size=pool_size,
            max_overflow=0,
            # A caller waits this long for one of the store's connections, then gets a StorageError.
            pool_timeout=postgres.WAIT_LIMITS.write,
            connect_args=postgres.connect_arguments(url),
            # Reads run in READ COMMITTED whatever the database's default (psycopg puts it in each BEGIN).
            isolation_level="READ COMMITTED",
        )
        sessions = postgres.configure(engine, schema, read_only=read_only)
        return engine, dataclasses.replace(postgresql_backend(schema), sessions=sessions)
    raise ConfigurationError(f"unsupported database {backend_name!r}; use a SQLite path or a postgresql:// URL")


def _create_engine(url: URL, **options: Any) -> Engine:
    try:
        return sa.create_engine(url, **options)
    except ImportError as exc:
        if url.get_backend_name() == "postgresql":
            from store.install import extra_hint

            raise ConfigurationError(
                f"the PostgreSQL driver ({exc.name or 'psycopg'}) is not installed: {extra_hint('postgres')}"
            ) from exc
        raise ConfigurationError(f"the driver for {url.drivername} is not installed ({exc.name or exc})") from exc
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(f"cannot use {url.drivername!r}: {exc}") from exc


def _configure_sqlite(engine: Engine, durability: str) -> None:
    synchronous = "FULL" if durability == "full" else "NORMAL"

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # Autocommit at the driver: the store issues BEGIN IMMEDIATE itself for writes,
        # so reads never take the write lock and every write has one begin path.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _enable_wal(cursor)
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
        cursor.close()


def _enable_wal(cursor: sqlite3.Cursor) -> None:
    """Switch a new file to WAL (a store file stays in WAL once switched).

    The switch needs an exclusive lock and SQLite does not wait for it, so processes
    opening one new file at once retry here instead of failing.
    """
    if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
        return
    # A new file: deleted pages go back to the file system (incremental vacuum, Store.compact).
    # SQLite takes this only before the switch to WAL and the first table; later it is a no-op.
    cursor.execute("PRAGMA auto_vacuum = INCREMENTAL")
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _read_only_sqlite_engine(url: URL) -> Engine:
    """An engine that can only read ``url``'s file, and leaves no file changed or created.

    It reads through the store's WAL with ``mode=ro``, so a writer that opens the store
    while it reads is seen as any WAL reader sees one: each read transaction one consistent
    snapshot, later commits in later reads.  (An ``immutable`` read of a store no process
    had open broke that: a writer's checkpoint changed the file under it, which read as
    damage, and its commits were never seen.)  SQLite creates the -wal and -shm files of a
    store no process has open even for a ``mode=ro`` reader, and a reader cannot remove
    them; so when the last of this engine's connections closes, ``_remove_side_files``
    removes them as SQLite's last connection does, if no other connection has the store
    open.  Only where this process cannot create or remove them (a folder or file it may
    not write) is a store without a -wal read ``immutable``, as before.
    """
    path = str(url.database)
    if os.path.exists(path) and not os.path.isfile(path):
        raise StorageError(f"{path} is not a store (not a regular file)")
    if not os.path.isfile(path):
        raise StorageError(f"no store at {path} (the file does not exist; read-only commands never create one)")
    if not os.access(path, os.R_OK):
        raise StorageError(f"permission denied: cannot read {path}")
    uri = f"file:{quote(path)}?mode=ro"
    wal = f"{path}-wal"
    leaves_side_files = not os.path.exists(wal) or os.path.getsize(wal) == 0
    can_remove = os.access(path, os.W_OK) and os.access(os.path.dirname(path) or ".", os.W_OK | os.X_OK)
    if leaves_side_files and not can_remove:
        uri += "&immutable=1"
        leaves_side_files = False
    connections = _OpenConnections(path if leaves_side_files else None)

    def connect() -> sqlite3.Connection:
        connection = sqlite3.connect(uri, uri=True, check_same_thread=False, factory=connections.factory)
        connection.isolation_level = None  # reads never BEGIN IMMEDIATE; nothing here writes
        connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        return connection

    return _create_engine(url, creator=connect)


class _OpenConnections:
    """Counts a read-only engine's open SQLite connections; when the last one closes, the
    -wal and -shm files SQLite made for them are removed (``_remove_side_files``)."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._open = 0
        self._lock = threading.Lock()
        owner = self

        class Counted(sqlite3.Connection):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self._counted = True
                with owner._lock:
                    owner._open += 1

            def close(self) -> None:
                super().close()
                if self.__dict__.pop("_counted", False):
                    owner._closed()

        self.factory = Counted

    def _closed(self) -> None:
        with self._lock:
            self._open -= 1
            last = self._open == 0
            if last and self._path is not None:
                _remove_side_files(self._path)


def _remove_side_files(path: str) -> None:
    """Remove a store's -wal and -shm files if no connection (of any process) has it open.

    A read-write connection that reads one page and closes does it: SQLite's last connection
    to a WAL database takes the exclusive lock (only when no other connection holds the store
    open, in this process or another), copies into the database file what the -wal holds (a
    writer's commits made while this engine read: the store's own data, nothing of the
    reader's), and deletes both files.  Any other connection keeps them, and removes them
    itself when it is the last.  Best effort: a store busy at this moment keeps its files.
    """
    if not os.path.exists(f"{path}-wal"):
        return  # another last connection already removed them
    with contextlib.suppress(sqlite3.Error, OSError):
        closer = sqlite3.connect(f"file:{quote(path)}?mode=rw", uri=True, isolation_level=None)
        try:
            closer.execute("PRAGMA schema_version").fetchone()  # opens the WAL; writes nothing
        finally:
            closer.close()


class Statement:
    """A Core statement compiled once for a dialect, run on a raw DBAPI cursor (hot paths)."""

    def __init__(self, statement: sa.sql.ClauseElement, engine: Engine) -> None:
        compiled = statement.compile(dialect=engine.dialect)
        self.sql = compiled.string
        order: Sequence[str] | None = getattr(compiled, "positiontup", None)
        self._positional = None if order is None else operator.itemgetter(*order)
        self._single = order is not None and len(order) == 1

    def params(self, values: Mapping[str, Any]) -> Sequence[Any] | Mapping[str, Any]:
        if self._positional is None:
            return values
        picked = self._positional(values)
        return (picked,) if self._single else picked


def wal_path(url: URL) -> str | None:
    """The -wal file of a SQLite store (None for PostgreSQL)."""
    return f"{url.database}-wal" if url.get_backend_name() == "sqlite" else None


def sync_file(path: str) -> None:
    """fsync ``path``: what other connections committed to it reaches the disk.  A missing
    -wal file was checkpointed into the database (synced) and removed: nothing to do."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"syncing {path} failed: {exc}") from exc
    try:
        os.fsync(descriptor)
    except OSError as exc:
        raise StorageError(f"syncing {path} failed: {exc}") from exc
    finally:
        os.close(descriptor)


def driver_errors(engine: Engine) -> tuple[type[BaseException], ...]:
    dbapi = engine.dialect.loaded_dbapi
    # sqlite3 raises UnicodeDecodeError for an error message quoting a damaged file's schema.
    return (sa.exc.SQLAlchemyError, dbapi.Error, UnicodeDecodeError)


# --- migrations --------------------------------------------------------------------------


def migrations_path() -> Path:
    """The alembic scripts: inside the installed package, or the source tree's ``migrations/``."""
    try:
        located = resources.files("store.migrations")
        path = Path(str(located))
        if (path / "env.py").is_file():
            return path
    except ModuleNotFoundError:
        pass
    source_tree = Path(__file__).resolve().parent.parent / "migrations"
    if (source_tree / "env.py").is_file():
        return source_tree
    raise MigrationError("the store's migration scripts are missing from this installation")


def current_revision(connection: sa.Connection) -> str | None:
    if not sa.inspect(connection).has_table("alembic_version"):
        return None
    return connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


def learn_sessions(engine: Engine, backend: Backend, *, read_only: bool = False) -> None:
    """PostgreSQL, at open: prepare statements unless a pooler multiplexes server sessions."""
    if backend.sessions is None:
        return
    try:
        backend.sessions.prepared = not postgres.multiplexed(engine)
    except driver_errors(engine) as exc:
        raise (read_only_error if read_only else opening_error)(engine.url, exc) from exc


def migrate(engine: Engine, backend: Backend, schema: str | None = None) -> None:
    """Bring the schema to ``SCHEMA_REVISION`` under the write lock (safe across processes).

    A PostgreSQL ``schema`` is created first, under the same lock: processes opening one
    new store at once wait for the first, then find it migrated.
    """
    errors = driver_errors(engine)
    try:
        with engine.connect() as connection:
            if current_revision(connection) == SCHEMA_REVISION:
                connection.rollback()
                return
            connection.rollback()
            connection.exec_driver_sql(backend.begin_write_sql)
            if schema is not None:
                connection.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            revision = current_revision(connection)
            if revision is not None and revision not in SCHEMA_REVISIONS:
                raise unknown_revision_error(describe_location(engine.url, schema), revision, connection)
            if revision != SCHEMA_REVISION:
                _run_alembic(connection)
            connection.commit()
    except StorageError:
        raise
    except errors as exc:
        raise opening_error(engine.url, exc) from exc


def check_schema(engine: Engine, url: URL, schema: str | None = None) -> None:
    """A read-only open: the schema must be exactly this library's (never migrated here).

    Raises ``StorageError`` if the database is not a store (or cannot be read, or holds
    another tool's alembic schema), and ``MigrationError`` if its schema is older (run a
    migration) or newer than this library.
    """
    where = describe_location(url, schema)
    revision = stored_revision(engine, url)
    if revision is None:
        raise StorageError(f"{where} is not a store (it has no store schema)")
    if revision == SCHEMA_REVISION:
        return
    if revision in SCHEMA_REVISIONS:
        raise MigrationError(
            f"{where} has schema {revision}, older than this library's {SCHEMA_REVISION}; "
            "migrate it first (staging-store migrate); it was opened read-only and left unchanged"
        )
    try:
        with engine.connect() as connection:
            raise unknown_revision_error(where, revision, connection)
    except driver_errors(engine) as exc:
        raise read_only_error(url, exc) from exc


# Tables every staging-store schema has had since 0001: an alembic database without them
# belongs to another tool, whatever its revision says.
STORE_TABLES = ("events", "staged_keys", "calls")


def unknown_revision_error(where: str, revision: str, connection: sa.Connection) -> StorageError:
    """A revision this library does not know: a newer store's, or another tool's alembic schema."""
    tables = set(sa.inspect(connection).get_table_names())
    connection.rollback()
    if not set(STORE_TABLES) <= tables:
        return StorageError(
            f"{where} is not a staging-store database (it holds another tool's alembic schema, "
            f"revision {revision!r}); left unchanged"
        )
    return MigrationError(
        f"{where} has schema {revision!r}, which this library ({SCHEMA_REVISION}) does not know: "
        "it is newer; upgrade staging-store to read it"
    )


def stored_revision(engine: Engine, url: URL) -> str | None:
    """The schema revision the database holds (None: not a store), read without writing."""
    try:
        with engine.connect() as connection:
            revision = current_revision(connection)
            connection.rollback()
    except driver_errors(engine) as exc:
        raise read_only_error(url, exc) from exc
    return revision


def describe_location(url: URL, schema: str | None = None) -> str:
    """The store's path (SQLite) or its URL with the password hidden, naming its ``?schema=``
    (taken out of the URL the driver sees) as the user gave it, and the driver as they would
    (``postgresql://``, not ``postgresql+psycopg://``)."""
    if url.get_backend_name() == "sqlite" and url.database:
        return str(url.database)
    if url.get_backend_name() == "postgresql":
        url = url.set(drivername="postgresql")
    if schema is not None:
        url = url.update_query_dict({"schema": schema})
    return url.render_as_string(hide_password=True)


def read_only_error(url: URL, exc: BaseException) -> StorageError:
    """Say, without the driver's text, why a store could not be read."""
    where = describe_location(url)
    reason = str(getattr(exc, "orig", None) or exc)
    if url.get_backend_name() == "sqlite":
        if "not a database" in reason or isinstance(exc, UnicodeDecodeError):
            return StorageError(f"{where} is not a store (not a SQLite database, or a damaged one)")
        if "malformed" in reason or "corrupt" in reason:
            return StorageError(f"{where} is damaged (SQLite reports a malformed database)")
        full = _full_disk_problem(where, reason)
        if full is not None:
            return StorageError(full)
        if "unable to open" in reason:
            return StorageError(f"cannot open {where}")
        return StorageError(f"cannot read {where}")
    missing = re.search(r'database "([^"]+)" does not exist', reason)
    if missing is not None:
        name = missing[1]
        return StorageError(
            f"cannot connect to {where}: the database {name} does not exist: create it (CREATE DATABASE {name}) "
            "or fix the URL"
        )
    if connecting_failed(exc) or connection_lost(exc):
        return storage_error(f"reading {where}", exc)
    if _operational(exc):
        return StorageError(f"cannot connect to {where}")
    return StorageError(f"cannot read {where}")


def _operational(exc: BaseException) -> bool:
    """SQLAlchemy's OperationalError, or the driver's own (a connection made without the pool)."""
    return isinstance(exc, sa.exc.OperationalError) or type(exc).__name__ == "OperationalError"


def opening_error(url: URL, exc: BaseException) -> StorageError:
    """Say what is wrong with the store being opened (not a store, permission denied, ...)."""
    reason = str(getattr(exc, "orig", None) or exc)
    if url.get_backend_name() == "sqlite" and url.database:
        path = url.database
        if "file is not a database" in reason:
            return StorageError(f"{path} is not a store database ({reason})")
        problem = _sqlite_access_problem(path) or _full_disk_problem(path, reason)
        if problem is not None:
            return StorageError(f"{problem} ({reason})")
    elif connecting_failed(exc) or connection_lost(exc) or lock_timed_out(exc):
        return storage_error(f"opening {url.render_as_string(hide_password=True)}", exc)
    elif _operational(exc) and "connect" in reason:
        return StorageError(f"cannot connect to {url.render_as_string(hide_password=True)}: {reason}")
    return MigrationError(f"migrating the store schema failed: {reason}")


def _sqlite_access_problem(path: str) -> str | None:
    """What keeps SQLite from opening ``path``, if the file system can tell."""
    folder = os.path.dirname(path) or "."
    if os.path.exists(path):
        if not os.access(path, os.R_OK):
            return f"permission denied: cannot read {path}"
        if not os.access(path, os.W_OK):
            return f"permission denied: cannot write {path}"
    if not os.access(folder, os.W_OK | os.X_OK):
        name = os.path.basename(path)
        return (
            f"permission denied: cannot create files in {folder} "
            f"(SQLite keeps {name}-wal and {name}-shm beside the store)"
        )
    return None


# Under this much free space an I/O error on open is taken for a full disk: SQLite says "disk
# I/O error" when it cannot grow the -shm file, "database or disk is full" when it cannot write.
_FULL_BELOW_BYTES = 1024 * 1024


def _full_disk_problem(path: str, reason: str) -> str | None:
    """The file system holding ``path`` is full, if that is why SQLite failed to open it."""
    if "disk" not in reason:  # "disk I/O error", "database or disk is full"
        return None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        disk = os.statvfs(folder)
    except OSError:
        return None
    blocks = disk.f_bfree if os.geteuid() == 0 else disk.f_bavail  # root may use the reserved blocks
    free = blocks * disk.f_frsize
    if free >= _FULL_BELOW_BYTES:
        return None
    return (
        f"the file system holding {path} is full ({free:,} bytes free): SQLite needs room for the "
        f"store's -wal and -shm files even to read it; free some space, then open it again"
    )


def _run_alembic(connection: sa.Connection) -> None:
    from alembic import command
    from alembic.config import Config
    from alembic.util.exc import CommandError

    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    config.attributes["connection"] = connection
    try:
        command.upgrade(config, SCHEMA_REVISION)
    except CommandError as exc:
        raise MigrationError(
            f"cannot migrate to schema {SCHEMA_REVISION}: {exc} (is the store newer than this library?)"
        ) from exc
