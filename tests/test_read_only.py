"""``open_store(path, read_only=True)``: reads work, nothing is created, migrated or changed."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from factories import make_record

from store import (
    MigrationError,
    ReadOnlyStoreError,
    StorageError,
    Store,
    open_store,
)
from store.log.engine import resolve_url


def folder_state(folder: Path) -> dict[str, str]:
    """Every file in ``folder`` and a hash of its bytes."""
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))}


def _populated(path: str) -> None:
    with open_store(path) as store:
        root = make_record(rollout_id="r0", model_call_id="c0")
        assert store.stage(root).ok
        child = make_record(
            rollout_id="r0",
            model_call_id="c1",
            parent_call_id="c0",
            parent_chain_hash=root.chain_hash,
            prefix=list(root.token_ids_delta),
        )
        assert store.stage(child).ok


def _set_revision(url: str, revision: str) -> None:
    engine = sa.create_engine(resolve_url(url))
    with engine.begin() as connection:
        connection.exec_driver_sql(f"UPDATE alembic_version SET version_num = '{revision}'")
    engine.dispose()


def test_reads_a_closed_store_without_creating_or_changing_a_file(tmp_path: Path) -> None:
    path = str(tmp_path / "store.db")
    _populated(path)
    assert folder_state(tmp_path).keys() == {"store.db"}  # a closed store: its WAL checkpointed and removed
    before = folder_state(tmp_path)
    with open_store(path, read_only=True) as store:
        assert store.read_only
        assert [info.model_call_id for info in store.calls("r0")] == ["c0", "c1"]
        assert [key.staging_key for key in store.staged_keys()] == ["r0/c0", "r0/c1"]
        assert store.replay().ok
        assert store.audit().ok
        assert store.lineage("r0") is not None
    assert folder_state(tmp_path) == before


def test_reads_a_store_a_writer_has_open_through_its_wal(tmp_path: Path) -> None:
    path = str(tmp_path / "store.db")
    _populated(path)
    with open_store(path) as writer:
        assert writer.stage(make_record(rollout_id="r1", model_call_id="c0")).ok
        assert (tmp_path / "store.db-wal").exists()
        with open_store(path, read_only=True) as reader:
            # The reader sees the writer's newest commit (it lives in the -wal file so far).
            assert {key.staging_key for key in reader.staged_keys()} == {"r0/c0", "r0/c1", "r1/c0"}
            assert writer.stage(make_record(rollout_id="r2", model_call_id="c0")).ok
            assert reader.call("r2", "c0") is not None
            assert reader.audit().ok


def test_every_write_is_refused_and_nothing_is_written(store_url: str) -> None:
    _populated(store_url)
    with open_store(store_url, read_only=True) as store:
        events = store.replay().events
        with pytest.raises(ReadOnlyStoreError):
            store.stage(make_record(rollout_id="r9", model_call_id="c0"))
        with pytest.raises(ReadOnlyStoreError):
            store.record_failure("r0", "c1", "no")
        with pytest.raises(ReadOnlyStoreError):
            store.clear_keys("r0", "c1", ["__generation_cut__/x/r0/c1/0"], "no")
        with pytest.raises(ReadOnlyStoreError):
            store.replay(repair=True)
        assert store.replay().events == events
    with open_store(store_url) as store:
        assert store.call("r9", "c0") is None
        assert store.replay().events == events


def test_postgresql_sessions_are_read_only_at_the_server(store_url: str) -> None:
    if not store_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only")
    _populated(store_url)
    with (
        open_store(store_url, read_only=True) as store,
        store._engine.connect() as connection,
        pytest.raises(sa.exc.InternalError, match="read-only transaction"),
    ):
        connection.exec_driver_sql("DELETE FROM calls")


def test_a_missing_path_is_refused_and_not_created(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no store at"):
        open_store(str(tmp_path / "typo.db"), read_only=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "content",
    [b"hello, not a database\n" * 40, b"", b"SQLite format 3\x00" + b"\xff" * 200],
    ids=["text", "empty", "torn"],
)
def test_a_file_that_is_not_a_store_is_refused_and_left_alone(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "file.db"
    path.write_bytes(content)
    before = folder_state(tmp_path)
    with pytest.raises(StorageError, match="is not a store"):
        open_store(str(path), read_only=True)
    assert folder_state(tmp_path) == before


def test_someone_elses_sqlite_file_keeps_its_journal_mode_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "theirs.db"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE notes (body TEXT)")
        connection.execute("INSERT INTO notes VALUES ('mine')")
    connection.close()
    before = folder_state(tmp_path)
    with pytest.raises(StorageError, match="not a store"):
        open_store(str(path), read_only=True)
    assert folder_state(tmp_path) == before
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    connection.close()


def test_an_older_or_newer_schema_is_refused_unmigrated(store_url: str, tmp_path: Path) -> None:
    _populated(store_url)
    _set_revision(store_url, "0001")
    with pytest.raises(MigrationError, match="older than this library"):
        open_store(store_url, read_only=True)
    _set_revision(store_url, "9999")
    with pytest.raises(MigrationError, match="newer"):
        open_store(store_url, read_only=True)
    engine = sa.create_engine(resolve_url(store_url))
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == "9999"
    engine.dispose()


def test_read_only_must_be_a_bool(tmp_path: Path) -> None:
    from store import InvalidRecordError

    with pytest.raises(InvalidRecordError, match="read_only"):
        Store(str(tmp_path / "x.db"), read_only="yes")  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_staged_keys_group_attempts_under_their_rollout(store: Store) -> None:
    assert store.stage(make_record(rollout_id="r0", model_call_id="c0")).ok
    assert store.stage(make_record(rollout_id="r0-a1", model_call_id="c1")).ok
    assert store.stage(make_record(rollout_id="r1", model_call_id="c0")).ok
    keys = store.staged_keys("r0")
    assert [(k.staging_key, k.kind) for k in keys] == [("r0-a1/c1", "call_completed"), ("r0/c0", "call_completed")]
    assert [k.staging_key for k in store.staged_keys()] == ["r0-a1/c1", "r0/c0", "r1/c0"]
    assert store.staged_keys("nope") == []


def test_a_reader_opened_on_a_closed_store_sees_a_writer_that_opens_it_afterwards(tmp_path: Path) -> None:
    """Issue 33 item 7: a reader that found no -wal read the file ``immutable``; a writer that
    opened the store afterwards and checkpointed made it report damage that was not there and
    miss every later commit.  Now it reads through the WAL, and leaves no -wal or -shm behind."""
    path = str(tmp_path / "store.db")
    _populated(path)
    assert folder_state(tmp_path).keys() == {"store.db"}
    with open_store(path, read_only=True) as reader:
        assert reader.audit().ok  # its pages are cached now
        with open_store(path) as writer:
            for index in range(300):
                assert writer.stage(make_record(rollout_id=f"w{index}", model_call_id="c0")).ok
            checkpoint = sqlite3.connect(path)  # the writer's commits move into the database file
            assert checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
            checkpoint.close()
            assert writer.stage(make_record(rollout_id="last", model_call_id="c0")).ok  # in the -wal only
            report = reader.audit()
            assert report.ok, report
            assert reader.call("w299", "c0") is not None and reader.call("last", "c0") is not None
            assert len(reader.staged_keys()) == 2 + 300 + 1
    # The writer closed first (the reader still had the store open, so the writer left the -wal);
    # the reader, last out, checkpointed and removed what SQLite needed for the read.
    assert folder_state(tmp_path).keys() == {"store.db"}
    with open_store(path, read_only=True) as again:
        assert len(again.staged_keys()) == 303
