"""Alembic migrations of the staging store (installed as ``store.migrations``)."""
