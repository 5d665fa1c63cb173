"""Shared fixtures: every store test runs on SQLite, and on PostgreSQL when
``STORE_TEST_POSTGRES_URL`` is set (``.ci/run`` sets it).

A test run never touches the database that URL names: it creates a database of its own on
that server and drops it at the end, so any number of runs can share one server.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pg_cluster
import profiles
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from store import Store, open_store

PROFILE = profiles.load()  # before any test module builds its hypothesis settings

POSTGRES_URL = os.environ.get("STORE_TEST_POSTGRES_URL")
BACKENDS = ["sqlite", *(["postgresql"] if POSTGRES_URL else [])]


def _engine(url: str, **options: object) -> sa.Engine:
    return sa.create_engine(make_url(url).set(drivername="postgresql+psycopg"), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def postgres_run_url() -> Iterator[str]:
    """A database of this run's own on the server of ``STORE_TEST_POSTGRES_URL``."""
    assert POSTGRES_URL is not None
    name = f"store_test_{os.getpid()}_{secrets.token_hex(4)}"
    admin = _engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def reset_postgres(url: str) -> None:
    """Drop every schema a test made and the public schema's tables, so each test starts empty."""
    engine = _engine(url)
    with engine.begin() as connection:
        schemas = connection.exec_driver_sql(
            "SELECT nspname FROM pg_namespace WHERE left(nspname, 3) <> 'pg_' "
            "AND nspname NOT IN ('information_schema', 'public')"
        ).scalars()
        for schema in list(schemas):
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        tables = connection.exec_driver_sql("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").scalars()
        for table in list(tables):
            connection.exec_driver_sql(f'DROP TABLE IF EXISTS "{table}" CASCADE')
    engine.dispose()


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    if request.param == "sqlite":
        return os.path.join(tmp_path, "store.db")
    url: str = request.getfixturevalue("postgres_run_url")
    reset_postgres(url)
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    with open_store(store_url) as opened:
        yield opened


@pytest.fixture(scope="session")
def pg_template() -> Iterator[Path]:
    """An ``initdb``'d data directory the test's own servers start from (``pg_cluster``)."""
    reason = pg_cluster.why_not()
    if reason is not None:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="store-pg-template-"))
    try:
        yield pg_cluster.make_template(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cluster(pg_template: Path) -> Iterator[pg_cluster.Cluster]:
    """A PostgreSQL server of the test's own, which it may stop, pause or kill (removed after)."""
    with pg_cluster.running(pg_template) as server:
        yield server
