"""How the store talks to PostgreSQL: connection options, per-transaction settings, bounded waits.

No session state.  A transaction-pooling PgBouncer hands each transaction of a client to
whichever server session is free, so a ``SET`` made by one transaction (or at connect) may
land in another client's session and be missing from the next one of this client.  So every
setting a transaction depends on is made inside it, transaction-local (``set_config(...,
true)``, ``SET LOCAL``): the schema (``search_path``), ``synchronous_commit``, the lock,
statement and idle-in-transaction timeouts; isolation and read-only-ness go in each
``BEGIN`` (psycopg's own connection attributes).  A prepared statement lives in one server
session, so statements are prepared (psycopg's default, which the write path's throughput
needs: planning its statements anew costs a third of a lone stage's time on a fast disk) only
when the open found no pooler multiplexing sessions (``multiplexed``); else none is.

Every wait is bounded, on both ends (see ``WAIT_LIMITS``).  The server ends a session that
sits idle in a write transaction (a client whose network died mid-write: its write lock is
freed), cancels a statement that runs too long and gives up on the write lock after the
lock timeout.  A write stuck on its client in the middle of a pipeline or a COPY (no Sync
sent, so never "idle in transaction", and no timeout of the server's ends it) is ended by
the writers waiting for its lock once its lease is over (``write_begin_sql``; migration
0010's ``store_write_lock``).  The one session setting: the server's end of each connection
probes its client with TCP keepalives and gives up on unacknowledged sends
(``session_sql``), so the session of a host that vanished ends in seconds, not after the
kernel's two hours; it is the same for every client, so it does no harm in whatever session
a pooler lands it.  The client gives up connecting after the connect timeout, probes an idle
connection with TCP keepalives, gives up on unacknowledged sends (``tcp_user_timeout``), and
cuts any connection whose wait outlives its deadline (``store.log.watchdog``): a server that
stopped answering with its kernel still acknowledging (SIGSTOP, a frozen VM) is noticed too.
"""

from __future__ import annotations

import contextlib
import math
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DisconnectionError

from store.log.watchdog import WATCHDOG


@dataclass(frozen=True)
class WaitLimits:
    """Seconds each wait may take (documented in the README's PostgreSQL section)."""

    connect: float = 10.0  # a new connection: TCP, startup and authentication
    lock: float = 15.0  # the store's write lock (``lock_timeout``): then ``LockTimeoutError``
    statement: float = 15.0  # one statement of a write transaction (``statement_timeout``)
    idle_in_transaction: float = 5.0  # the server frees a write transaction's session idle this long
    keepalive_idle: int = 10  # TCP keepalives on an idle connection: first probe after this,
    keepalive_interval: int = 3  # then one every this many seconds,
    keepalive_count: int = 3  # this many unanswered and the connection is dropped
    tcp_user_timeout: float = 20.0  # sent data unacknowledged this long: the connection is dropped
    read: float = 120.0  # one read statement, fetch, ping, commit or rollback (client side)
    write_margin: float = 5.0  # a write transaction's deadline beyond its lock wait and statement limits
    # The write lock's lease: a store write that has held the lock this long and is found waiting
    # on its client at two looks ``lock_check`` apart (same statement) is ended by a waiting writer.
    # lease + 2 * lock_check (+ the end of the session) stays under ``lock``: the waiters get the lock.
    lease: float = 5.0
    lock_check: float = 1.0

    @property
    def silent_peer(self) -> float:
        """How long after it last heard from a peer that vanished either end drops the connection
        (idle, or waiting for it): keepalive probes start after ``keepalive_idle``, one every
        ``keepalive_interval``, and with ``tcp_user_timeout`` set Linux drops it at the first probe
        past that timeout (``keepalive_count`` then does not count): 22 s by default."""
        probes = max(1, math.ceil((self.tcp_user_timeout - self.keepalive_idle) / self.keepalive_interval))
        return self.keepalive_idle + probes * self.keepalive_interval

    @property
    def write(self) -> float:
        """A whole write transaction (client side): the lock wait, its statements, COMMIT."""
        return self.lock + self.statement + self.write_margin


WAIT_LIMITS = WaitLimits()

# psycopg.pq.TransactionStatus.IDLE (psycopg is an optional driver: not imported here).
_IDLE = 0


def connect_arguments(url: URL) -> dict[str, Any]:
    """libpq and psycopg options for every connection; what the URL sets itself wins."""
    limits = WAIT_LIMITS
    defaults: dict[str, Any] = {
        "connect_timeout": max(1, round(limits.connect)),
        "keepalives": 1,
        "keepalives_idle": limits.keepalive_idle,
        "keepalives_interval": limits.keepalive_interval,
        "keepalives_count": limits.keepalive_count,
        "tcp_user_timeout": round(limits.tcp_user_timeout * 1000),
    }
    return {name: value for name, value in defaults.items() if name not in url.query}


def search_path_sql(schema: str | None) -> str:
    """Inside a transaction: the store's schema, or the server's default path (never a
    session's ``SET``, which a pooler may have carried over from another client)."""
    return "SET LOCAL search_path TO DEFAULT" if schema is None else f'SET LOCAL search_path TO "{schema}"'


def _milliseconds(seconds: float) -> str:
    return str(round(seconds * 1000))


# The lease mark's advisory lock ids: this tag in the top 16 bits, the grant time (Unix
# milliseconds) in the 48 below.  pg_locks shows a bigint key as classid (high 32 bits) and
# objid (low 32): the tag is ``classid >> 16``.  Migration 0010's function reads it back.
LEASE_TAG = 0x4C45


def write_begin_sql(lock_id: int) -> tuple[str, str]:
    """The statement after BEGIN (and the schema) of a write transaction, for a durable commit
    and a not-durable one: it sets the transaction's limits and ``synchronous_commit``, takes
    the write lock and marks the time it was granted, evaluated left to right.

    The lock: at once if no one holds it or waits for it (``pg_try_advisory_xact_lock`` fails
    when others queue, so no one jumps the queue); else ``store_write_lock`` (migration 0010)
    waits for it, at most the lock timeout, and each ``lock_check`` seconds looks at the
    holder: a store write that has held it past its ``lease`` and waits on its own client (a
    host lost or frozen mid-pipeline or mid-COPY) is ended (``pg_terminate_backend``).  The
    mark: a shared advisory lock whose id holds the grant time (``LEASE_TAG``), which tells the
    waiters that the holder is a store write and since when it holds the lock."""
    limits = WAIT_LIMITS
    limits_sql = (
        f"set_config('statement_timeout', '{_milliseconds(limits.statement)}', true), "
        f"set_config('idle_in_transaction_session_timeout', '{_milliseconds(limits.idle_in_transaction)}', true), "
        f"set_config('lock_timeout', '{_milliseconds(limits.lock)}', true), "
    )
    wait = (
        f"store_write_lock({lock_id}, {_milliseconds(limits.lock)}, "
        f"{_milliseconds(limits.lease)}, {_milliseconds(limits.lock_check)})"
    )
    lock = (
        f"CASE WHEN pg_try_advisory_xact_lock({lock_id}) THEN true ELSE {wait} END, "
        f"pg_advisory_xact_lock_shared(({LEASE_TAG}::bigint << 48) "
        "| (extract(epoch FROM clock_timestamp()) * 1000)::bigint)"
    )
    durable = f"SELECT {limits_sql}set_config('synchronous_commit', 'on', true), {lock}"
    not_durable = f"SELECT {limits_sql}set_config('synchronous_commit', 'off', true), {lock}"
    return durable, not_durable


def session_sql(server_version: int) -> str | None:
    """The server's end of a new connection: TCP keepalives as the client's own, and the same
    limit on unacknowledged sends, so the session of a client whose host vanished ends
    ``silent_peer`` seconds after it last heard from it (idle, or waiting on its client
    mid-transaction) or ``tcp_user_timeout`` after an unacknowledged send, not after the
    kernel's default two hours.  (Ignored by the server on a Unix socket.)  None before PostgreSQL 12,
    which has no ``tcp_user_timeout``."""
    if server_version < 120000:
        return None
    limits = WAIT_LIMITS
    return (
        f"SELECT set_config('tcp_keepalives_idle', '{limits.keepalive_idle}', false), "
        f"set_config('tcp_keepalives_interval', '{limits.keepalive_interval}', false), "
        f"set_config('tcp_keepalives_count', '{limits.keepalive_count}', false), "
        f"set_config('tcp_user_timeout', '{_milliseconds(limits.tcp_user_timeout)}', false)"
    )


def lock_sql(lock_id: int) -> str:
    """Take the store's write lock, waiting at most the lock timeout (a transaction that is not
    the write path's: migrations, the audit's quiet moment, a repairing replay)."""
    lock = _milliseconds(WAIT_LIMITS.lock)
    return f"SELECT set_config('lock_timeout', '{lock}', true), pg_advisory_xact_lock({lock_id})"


@dataclass
class Sessions:
    """What the open learnt of the server's sessions: may this engine prepare statements?"""

    prepared: bool = False  # until the open has looked (``multiplexed``)


PREPARE_THRESHOLD = 5  # psycopg's default: a statement run this often is prepared


def configure(engine: Engine, schema: str | None, *, read_only: bool) -> Sessions:
    """The store's settings on every connection of ``engine`` (see the module note); the
    limits are ``WAIT_LIMITS`` as they are when the store opens."""
    limits = WAIT_LIMITS
    set_path = search_path_sql(schema)
    sessions = Sessions()

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Client-side: psycopg puts these in each BEGIN it sends, so no session keeps them.
        if read_only:
            dbapi_connection.read_only = True  # the server refuses any write
        server_side = session_sql(dbapi_connection.info.server_version)
        if server_side is not None:  # one round trip per new connection, none per transaction
            dbapi_connection.autocommit = True
            try:
                with _watched(dbapi_connection):
                    dbapi_connection.execute(server_side)
            except dbapi_connection.Error as exc:
                if getattr(exc, "sqlstate", None) is None:
                    raise  # the connection broke, not a server that refuses these settings
                # A server (or a PostgreSQL look-alike) that refuses them keeps its own.
            finally:
                dbapi_connection.autocommit = False
        dbapi_connection.server_cursor_factory = _bounded_server_cursor()
        dbapi_connection.prepare_threshold = PREPARE_THRESHOLD if sessions.prepared else None

    @event.listens_for(engine, "before_cursor_execute")
    def _before_execute(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        dbapi_connection = cursor.connection
        if dbapi_connection.info.transaction_status == _IDLE and not dbapi_connection.autocommit:
            # This statement begins a transaction: its schema goes first, in the same round trip.
            with dbapi_connection.pipeline():
                setter = dbapi_connection.cursor()
                setter.execute(set_path)
            setter.close()
        conn.info["store_watch"] = WATCHDOG.arm(dbapi_connection.fileno(), limits.read)

    @event.listens_for(engine, "after_cursor_execute")
    def _after_execute(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        token = conn.info.pop("store_watch", None)
        if token is not None:
            WATCHDOG.disarm(token)

    @event.listens_for(engine, "handle_error")
    def _on_error(context: Any) -> None:
        conn = context.connection
        token = None if conn is None else conn.info.pop("store_watch", None)
        if token is not None and WATCHDOG.disarm(token):
            _mark_cut(context.original_exception, limits.read)

    dialect = engine.dialect
    ping = _bounded(dialect.do_ping, limits.read)

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["store_returned"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        # A connection back from its last user moments ago is alive (if not, the write path's
        # retry or the caller's error handles it); one that sat idle -- across a server
        # restart, say -- is pinged first, and a dead one is replaced before anyone uses it.
        if looks_dead(dbapi_connection):
            raise DisconnectionError("the server closed the pooled connection")
        returned = record.info.get("store_returned")
        if returned is None or time.monotonic() - returned < PING_IDLE_SECONDS:
            return
        try:
            alive = ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError(f"the pooled connection is gone: {exc}") from exc
        if not alive:
            raise DisconnectionError("the pooled connection is gone")

    dialect.do_rollback = _bounded(dialect.do_rollback, limits.read)  # type: ignore[method-assign,assignment]
    dialect.do_commit = _bounded(dialect.do_commit, limits.read)  # type: ignore[method-assign,assignment]
    return sessions


def multiplexed(engine: Engine, rounds: int = 3) -> bool:
    """Whether a pooler hands one server session to several client connections (PgBouncer's
    transaction or statement pooling): two connections of our own ask for their server
    process, in turn; the same process behind both, or a different one behind the same
    connection, is a pooler multiplexing sessions.  (A pooler that happened to hand them
    different sessions every time goes unseen; then a prepared statement fails loudly, never
    silently: every setting a transaction needs is in the transaction.)"""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    cparams = {**cparams, **connect_arguments(engine.url), "prepare_threshold": None, "autocommit": True}
    first = engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
    try:
        second = engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
        try:
            seen: dict[int, set[int]] = {0: set(), 1: set()}
            for _ in range(rounds):
                for index, connection in enumerate((first, second)):
                    seen[index].add(int(connection.execute("SELECT pg_backend_pid()").fetchone()[0]))
        finally:
            second.close()
    finally:
        first.close()
    return len(seen[0]) > 1 or len(seen[1]) > 1 or bool(seen[0] & seen[1])


def looks_dead(dbapi_connection: Any) -> bool:
    """An idle connection with something to read is one the server ended (its FATAL message and
    end of stream: a restart, a terminated backend), or a broken or closed one; no round trip."""
    fileno = _fileno(dbapi_connection)
    if fileno is None or getattr(dbapi_connection, "broken", False):
        return True
    try:
        readable, _, _ = select.select([fileno], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _bounded(operation: Callable[[Any], Any], seconds: float) -> Callable[[Any], Any]:
    """``operation(dbapi_connection)`` under a deadline (the pool's ping and reset, commits)."""

    def bounded(dbapi_connection: Any) -> Any:
        fileno = _fileno(dbapi_connection)
        if fileno is None:
            return operation(dbapi_connection)
        token = WATCHDOG.arm(fileno, seconds)
        try:
            result = operation(dbapi_connection)
        except BaseException as exc:
            if WATCHDOG.disarm(token):
                _mark_cut(exc, seconds)
            raise
        WATCHDOG.disarm(token)
        return result

    return bounded


def _fileno(dbapi_connection: Any) -> int | None:
    """The connection's socket, or None when it has none (closed)."""
    driver_connection = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    try:
        return int(driver_connection.fileno())
    except Exception:
        return None


PING_IDLE_SECONDS = 1.0  # a pooled connection idle this long is pinged before it is handed out
CUT_ATTRIBUTE = "store_watchdog_cut"


def _mark_cut(exc: BaseException, seconds: float) -> None:
    """Note on the driver's error that the watchdog cut its connection (``failures.storage_error``)."""
    with contextlib.suppress(AttributeError):
        setattr(exc, CUT_ATTRIBUTE, seconds)


def watchdog_cut(exc: BaseException) -> float | None:
    """The deadline (seconds) after which the watchdog cut the connection ``exc`` came from, or None."""
    for candidate in (exc, getattr(exc, "orig", None), exc.__cause__):
        seconds = getattr(candidate, CUT_ATTRIBUTE, None)
        if seconds is not None:
            return float(seconds)
    return None


_SERVER_CURSOR: Any = None


def _bounded_server_cursor() -> Any:
    """psycopg's server-side cursor (SQLAlchemy's ``yield_per`` streams) with each fetch under
    the read deadline: a fetch is a round trip no ``*_cursor_execute`` event sees."""
    global _SERVER_CURSOR
    if _SERVER_CURSOR is None:
        import psycopg

        class BoundedServerCursor(psycopg.ServerCursor):
            def fetchone(self) -> Any:
                with _watched(self.connection):
                    return super().fetchone()

            def fetchmany(self, size: int = 0) -> Any:
                with _watched(self.connection):
                    return super().fetchmany(size)

            def fetchall(self) -> Any:
                with _watched(self.connection):
                    return super().fetchall()

        _SERVER_CURSOR = BoundedServerCursor
    return _SERVER_CURSOR


class _watched:
    """A read deadline around one wait on ``connection``."""

    __slots__ = ("_connection", "_token")

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._token = 0

    def __enter__(self) -> None:
        self._token = WATCHDOG.arm(self._connection.fileno(), WAIT_LIMITS.read)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if WATCHDOG.disarm(self._token) and exc is not None:
            _mark_cut(exc, WAIT_LIMITS.read)
