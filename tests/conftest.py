"""Shared fixtures: every store test runs on SQLite, and on PostgreSQL when
``STORE_TEST_POSTGRES_URL`` is set (``.ci/run`` sets it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from store import Store, open_store

POSTGRES_URL = os.environ.get("STORE_TEST_POSTGRES_URL")
BACKENDS = ["sqlite", *(["postgresql"] if POSTGRES_URL else [])]


def reset_postgres(url: str) -> None:
    """Drop the store's tables so each test starts from an empty database."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as connection:
        for table in ("events", "staged_keys", "calls", "cut_receipts", "alembic_version"):
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table} CASCADE")
    engine.dispose()


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    if request.param == "sqlite":
        return os.path.join(tmp_path, "store.db")
    assert POSTGRES_URL is not None
    reset_postgres(POSTGRES_URL)
    return POSTGRES_URL


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    with open_store(store_url) as opened:
        yield opened
