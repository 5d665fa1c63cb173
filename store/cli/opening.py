"""Which store a command works on (its first argument, or ``$STAGING_STORE``) and how it is opened."""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from store.cli.exits import CommandError

if TYPE_CHECKING:
    from store.store import Store

F = TypeVar("F", bound=Callable[..., Any])
ENV = "STAGING_STORE"
STORE_HELP = (
    "STORE is a SQLite path or a postgresql:// URL (?schema=NAME for a store in a schema); "
    f"when omitted, ${ENV} is used."
)


def checked_names(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """The callback of an option naming a rollout, key or checkpoint: non-empty UTF-8 text (each
    value of a repeatable one)."""
    for one in value if isinstance(value, tuple) else () if value is None else (value,):
        problem = name_problem(one)
        if problem is not None:
            raise click.BadParameter(problem, ctx=ctx, param=param)
    return value


def name_problem(value: object) -> str | None:
    """Why a name given on the command line names nothing (None when it is fine)."""
    if not isinstance(value, str) or not value:
        return "it is empty; name one (`staging-store rollouts STORE` lists the rollouts)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{value.encode('utf-8', 'surrogateescape')!r} is not UTF-8 text, so no store holds it"
    return None


def store_argument(function: F) -> F:
    """The optional STORE argument of a command that takes no other argument."""
    return click.argument("store", required=False, metavar="[STORE]")(function)


def looks_like_store(value: str) -> bool:
    """Whether an argument names a store rather than a key: a URL, a path, a store file's suffix,
    or a file that exists."""
    return "://" in value or os.sep in value or value.endswith((".db", ".sqlite", ".sqlite3")) or os.path.exists(value)


def _names_a_store(value: str) -> bool:
    """Stricter than ``looks_like_store``: a key holds '/' (ROLLOUT/CALL), a store path need not."""
    return "://" in value or value.endswith((".db", ".sqlite", ".sqlite3")) or os.path.isfile(value)


def store_and(values: Sequence[str], name: str) -> tuple[str, str]:
    """Split ``[STORE] NAME`` (a command's arguments) into the store and the other argument.

    One argument is NAME when ``$STAGING_STORE`` names the store; without it, the missing
    argument is blamed: NAME after something that looks like a store, else the store.
    """
    if len(values) == 2:
        return values[0], _named(values[1], name)
    if len(values) == 1:
        if not os.environ.get(ENV) and _names_a_store(values[0]):
            raise click.UsageError(f"missing argument {name} (after the store {values[0]})")
        return location(None), _named(values[0], name)
    if not values:
        raise click.UsageError(f"missing argument {name}")
    raise click.UsageError(f"expected [STORE] {name}, got {len(values)} arguments")


def _named(value: str, name: str) -> str:
    problem = name_problem(value)
    if problem is not None:
        raise click.UsageError(f"invalid {name}: {problem}")
    return value


def location(given: str | None) -> str:
    """The store the user named, or ``$STAGING_STORE``."""
    if given:
        return remember(given)
    from_env = os.environ.get(ENV, "")
    if from_env:
        return remember(from_env)
    raise click.UsageError(f"no store given: pass STORE (a path or URL) first, or set {ENV}")


# Every store location this command was given, so an error names each as the user wrote it.
_LOCATIONS: list[str] = []


def remember(given: str) -> str:
    if given not in _LOCATIONS:
        _LOCATIONS.append(given)
    return given


def in_users_words(message: str) -> str:
    """``message`` with each store it names as the user gave it: a SQLite path as typed, not
    resolved (and its folder likewise), a PostgreSQL URL with its ``?schema=`` (password hidden)."""
    for given in _LOCATIONS:
        try:
            if "://" not in given:
                message = _as_typed_path(message, given)
            elif given.startswith(("postgresql:", "postgres:")):
                message = _with_schema(message, given)
        except Exception:  # a location that cannot be parsed is reported by its own error
            continue
    return message


def _as_typed_path(message: str, given: str) -> str:
    from pathlib import Path

    resolved = Path(given).expanduser().resolve()
    if str(resolved) != given:
        message = message.replace(str(resolved), given)
    folder = os.path.dirname(given)
    if folder and str(resolved.parent) != folder:
        message = message.replace(str(resolved.parent), folder)
    return message


def _with_schema(message: str, given: str) -> str:
    from sqlalchemy.engine import make_url

    from store.log.engine import describe_location, split_schema

    url, schema = split_schema(make_url(given), None)
    if schema is None:
        return message
    bare, full = describe_location(url), describe_location(url, schema)
    if full in message:
        return message
    return re.sub(rf"{re.escape(bare)}(?![\w/?])", full, message)


# The path each store was opened by, as the user gave it (an argument or $STAGING_STORE).
_GIVEN: weakref.WeakKeyDictionary[Store, str] = weakref.WeakKeyDictionary()


def shown(store: Store) -> str:
    """The store as the user knows it: a SQLite file's path as they gave it (not resolved), or the
    URL without its password (with its ``?schema=``, and ``postgresql://`` rather than the driver's name)."""
    given = _GIVEN.get(store)
    if given is not None and store.backend == "sqlite":
        return given
    return _plain(store.url)


def shown_location(where: str) -> str:
    """``shown`` of a store not opened here (a replica), from its path or URL."""
    from store.log.engine import resolve_url

    return _plain(resolve_url(where).render_as_string(hide_password=True))


def _plain(url: str) -> str:
    for prefix, plain in (("sqlite+pysqlite:///", ""), ("postgresql+psycopg://", "postgresql://")):
        if url.startswith(prefix):
            return plain + url[len(prefix) :]
    return url


@contextmanager
def read_only(given: str | None) -> Iterator[Store]:
    """Open the store read-only: nothing is created, migrated or changed."""
    from store.store import open_store

    where = location(given)
    with open_store(where, read_only=True) as store:
        _GIVEN[store] = where
        yield store


@contextmanager
def writable(given: str | None, **options: Any) -> Iterator[Store]:
    """Open an existing store for writing (a write command); a missing file is refused, not
    created.  ``options``: ``open_store``'s keyword arguments (a durability domain)."""
    from store.log.engine import resolve_url
    from store.store import open_store

    where = location(given)
    url = resolve_url(where)
    if url.get_backend_name() == "sqlite" and url.database and not os.path.exists(url.database):
        raise CommandError(f"no store at {url.database}; write commands never create one (see `migrate --create`)")
    with open_store(where, read_only=True):  # exists, is a store, has this schema: else a one-line error
        pass
    with open_store(where, **options) as store:
        _GIVEN[store] = where
        yield store
