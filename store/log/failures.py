"""What a driver's error means for the caller: which ``StorageError`` it becomes.

The distinctions a caller acts on differently: the server could not be reached
(``ServerUnavailableError``) or is starting up (``ServerStartingError``) -- nothing was
written, retry later; the write lock was not granted in time (``LockTimeoutError``) --
nothing was written, retry; the connection broke before COMMIT was sent
(``ConnectionLostError``) -- nothing was committed; it broke after COMMIT was sent and before
the answer (``CommitUncertainError``) -- it may have committed.  Anything else stays a plain
``StorageError``.  The driver's error is always chained as ``__cause__`` by the caller.
"""

from __future__ import annotations

from store.errors import (
    CommitUncertainError,
    ConnectionLostError,
    LockTimeoutError,
    ServerStartingError,
    ServerUnavailableError,
    StorageError,
)
from store.log.postgres import watchdog_cut

# Set on a driver error raised after the transaction's COMMIT went out (``write_transaction``).
COMMIT_SENT_ATTRIBUTE = "store_commit_sent"

# SQLSTATEs (PostgreSQL's errcodes.txt).
_CANNOT_CONNECT_NOW = "57P03"  # starting up, shutting down, in recovery
_LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout
# The server ended the session: an administrator, a crash of another backend, a session timeout.
_SESSION_ENDED = frozenset({"57P01", "57P02", "25P03", "57P05", "08000", "08003", "08006"})

# libpq and psycopg's texts for a server that cannot take a new connection now ...
_STARTING = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
)
# ... for a connection attempt that found no server to talk to ...
_UNREACHABLE = (
    "connection refused",
    "timeout expired",
    "could not translate host name",
    "no route to host",
    "network is unreachable",
    "no such file or directory",  # a Unix socket that is not there
    "server closed the connection unexpectedly",
    "connection reset by peer",
)
# ... and for a session that broke.
_LOST = (
    "server closed the connection unexpectedly",
    "consuming input failed",
    "sending query failed",
    "sending query and params failed",
    "connection is lost",
    "the connection is closed",
    "connection is bad",
    "ssl syscall error",
    "ssl connection has been closed unexpectedly",
    "terminating connection",
    "lost synchronization with server",
    "connection reset by peer",
    "broken pipe",
    "no connection to the server",
    "bad file descriptor",
)


def driver_cause(exc: BaseException) -> BaseException:
    """The driver's own error under SQLAlchemy's wrapper (or ``exc`` itself)."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def _text(exc: BaseException) -> str:
    return str(exc).lower()


def connecting_failed(exc: BaseException) -> bool:
    """A new connection found no server to talk to (refused, no answer, starting up); not a
    server that refused this client (a wrong database, role or password)."""
    cause = driver_cause(exc)
    if type(cause).__name__ == "ConnectionTimeout" or _starting(cause):
        return True
    text = _text(cause)
    return text.startswith("connection failed") and any(part in text for part in _UNREACHABLE)


def _starting(cause: BaseException) -> bool:
    return getattr(cause, "sqlstate", None) == _CANNOT_CONNECT_NOW or any(part in _text(cause) for part in _STARTING)


def connection_lost(exc: BaseException) -> bool:
    """The session broke (or the server ended it): nothing more can run on that connection."""
    cause = driver_cause(exc)
    if getattr(cause, "sqlstate", None) in _SESSION_ENDED:
        return True
    if getattr(exc, "connection_invalidated", False):
        return True
    text = _text(cause)
    return any(part in text for part in _LOST)


def lock_timed_out(exc: BaseException) -> bool:
    """The write lock was not granted in time: PostgreSQL's ``lock_timeout``, SQLite's busy timeout."""
    cause = driver_cause(exc)
    if getattr(cause, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
        return True
    return type(cause).__name__ == "OperationalError" and "database is locked" in _text(cause)


def _pool_exhausted(exc: BaseException) -> bool:
    """SQLAlchemy's pool had no connection to hand out within its timeout."""
    return type(exc).__name__ == "TimeoutError" and type(exc).__module__.startswith("sqlalchemy")


def storage_error(
    action: str, exc: BaseException, *, commit_sent: bool = False, cut: float | None = None
) -> StorageError:
    """The ``StorageError`` for a driver error raised while ``action``.

    ``commit_sent``: the transaction's COMMIT had gone out when it failed (a lost connection
    then may have committed).  ``cut``: the watchdog ended the connection after this many
    seconds without an answer.
    """
    cause = driver_cause(exc)
    # One line: a driver's message can span several ("...refused\n\tIs the server running..."),
    # and a log line that quotes this error must stay one line.
    detail = " ".join(f"{type(cause).__name__}: {cause}".split())
    if cut is None:
        cut = watchdog_cut(exc)
    commit_sent = commit_sent or bool(getattr(cause, COMMIT_SENT_ATTRIBUTE, False))
    if cut is not None:
        detail = f"no answer from the server within {cut:g} s; the connection was cut ({detail})"
    if connecting_failed(exc) and cut is None:
        if _starting(cause):
            return ServerStartingError(
                f"{action} failed: the server is starting up, shutting down or recovering; "
                f"nothing was written, retry once it is up ({detail})"
            )
        return ServerUnavailableError(
            f"{action} failed: the server could not be reached; nothing was written ({detail})"
        )
    if lock_timed_out(exc):
        return LockTimeoutError(
            f"{action} failed: the store's write lock was not granted within the lock timeout "
            f"(another writer held it); nothing was written ({detail})"
        )
    if _pool_exhausted(exc):
        return StorageError(
            f"{action} failed: every connection the store may hold (open_store's pool_size) stayed in use "
            f"past the pool timeout; nothing was written ({detail})"
        )
    if cut is not None or connection_lost(exc):
        if commit_sent:
            return CommitUncertainError(
                f"{action} failed: the connection was lost after COMMIT was sent; the commit may or may not "
                f"have happened (re-staging an identical record is a no-op) ({detail})"
            )
        return ConnectionLostError(f"{action} failed: the connection was lost; nothing was committed ({detail})")
    return StorageError(f"{action} failed: {detail}")
