"""Which store a command works on (its first argument, or ``$STAGING_STORE``) and how it is opened."""

from __future__ import annotations

import os
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
        return values[0], values[1]
    if len(values) == 1:
        if not os.environ.get(ENV) and _names_a_store(values[0]):
            raise click.UsageError(f"missing argument {name} (after the store {values[0]})")
        return location(None), values[0]
    if not values:
        raise click.UsageError(f"missing argument {name}")
    raise click.UsageError(f"expected [STORE] {name}, got {len(values)} arguments")


def location(given: str | None) -> str:
    """The store the user named, or ``$STAGING_STORE``."""
    if given:
        return given
    from_env = os.environ.get(ENV, "")
    if from_env:
        return from_env
    raise click.UsageError(f"no store given: pass STORE (a path or URL) first, or set {ENV}")


def shown(store: Store) -> str:
    """The store as the user knows it: a SQLite file's path, or the URL without its password
    (with its ``?schema=``, and ``postgresql://`` rather than the driver's name)."""
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

    with open_store(location(given), read_only=True) as store:
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
        yield store
