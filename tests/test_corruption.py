"""Fault test 3, corruption: damage to any stored column or file byte is found, never served.

Every stored column of the log (and of ``staged_keys`` and ``cut_receipts``) is damaged in
one row at a time through raw SQL; then every read of the store is judged (see
``corruption_helpers.probe``): the damaged record's ``fetch`` raises ``CorruptRecordError``,
never another key's record and never a raw error; undamaged records still fetch and verify;
replay names the damaged event or reports the differing projection rows.  Random byte flips
anywhere in a SQLite file give the right record or a ``StoreError``, nothing else.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from corruption_helpers import (
    Damage,
    event_damages,
    event_rows,
    flip_text,
    flipper,
    is_sqlite,
    judge_event_damage,
    one_event_of_each_kind,
    populate,
    probe,
    run_file_trials,
    sample_file,
    set_value,
)
from factories import make_record

from store import CorruptRecordError, EventKind, Store, StoreError, UnknownKeyError, open_store
from store.queries import reads

# --- damaging one row through raw SQL ---------------------------------------------------------------


@pytest.fixture
def raw(store_url: str) -> Iterator[sa.Connection]:
    """An autocommit connection outside the library, to damage the store's rows."""
    url = (
        f"sqlite:///{store_url}"
        if "://" not in store_url
        else store_url.replace("postgresql://", "postgresql+psycopg://")
    )
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        if not is_sqlite(connection):
            connection.exec_driver_sql("SET synchronous_commit = off")  # damage need not wait for the disk
        yield connection
    engine.dispose()


def test_damage_to_any_column_of_an_event_is_found_and_never_served(store: Store, raw: sa.Connection) -> None:
    expected = populate(store)
    sqlite = is_sqlite(raw)
    planted = found = 0
    failures: list[str] = []
    for index, row in enumerate(one_event_of_each_kind(raw)):
        damages = [*event_damages(row, sqlite, thorough=False), Damage("seq", "moved", value=row["seq"] + 1000)]
        for damage in damages:
            every_record_gets_it = damage.column == "kind" and row["staging_key"] is not None
            if not every_record_gets_it and zlib.crc32(f"{damage.column} {damage.label}".encode()) % 3 != index % 3:
                continue  # planted in two of the six events (tools/soak_corruption.py plants all of them)
            set_value(raw, "events", damage.column, damage.sql, damage.value, "seq", row["seq"])
            outcome = probe(store, expected, each_key=False)
            planted += 1
            found += outcome.found
            problems = judge_event_damage(outcome, row, damage, expected)
            failures += [f"event {row['seq']} ({row['kind']}), {damage.column} {damage.label}: {p}" for p in problems]
            moved = row["seq"] + 1000 if damage.column == "seq" else row["seq"]
            set_value(raw, "events", damage.column, ":value", row[damage.column], "seq", moved)
    assert not failures, "\n".join(failures[:40])
    assert planted == found and planted > 50
    assert not probe(store, expected).found  # every row was put back


def test_damage_to_a_staged_key_row_never_serves_another_record(store: Store, raw: sa.Connection) -> None:
    expected = populate(store)
    rows = {row["staging_key"]: row for row in event_rows(raw) if row["staging_key"] is not None}
    admission = next(row for row in event_rows(raw) if row["kind"] == EventKind.CALL_ADMITTED.value)
    other_digest = expected.records["r1/c2"][2]
    failures: list[str] = []
    for key in ("r1/c1", "__generation_cut__/checkpoint-1/r3/c0/0"):
        other = rows["r1/c2"]
        staged = dict(
            raw.execute(sa.text("SELECT * FROM staged_keys WHERE staging_key = :k"), {"k": key}).one()._mapping
        )
        damages = [
            ("event_seq", "another record", {"event_seq": other["seq"]}),
            ("event_seq", "an admission", {"event_seq": admission["seq"]}),
            ("event_seq", "no event", {"event_seq": 10**6}),
            ("rollout_id", "a flipped bit", {"rollout_id": flip_text(staged["rollout_id"])}),
            ("model_call_id", "a flipped bit", {"model_call_id": flip_text(staged["model_call_id"])}),
            ("digest", "a flipped bit", {"digest": flip_text(staged["digest"])}),
            (
                "every column",
                "another record's",
                {"event_seq": other["seq"], "rollout_id": "r1", "model_call_id": "c2", "digest": other_digest},
            ),
            ("staging_key", "renamed", {"staging_key": key + "x"}),
        ]
        for column, label, values in damages:
            assignments = ", ".join(f"{name} = :{name}" for name in values)
            raw.execute(sa.text(f"UPDATE staged_keys SET {assignments} WHERE staging_key = :k"), {**values, "k": key})
            outcome = probe(store, expected)
            where = f"staged key {key}, {column} {label}"
            failures += [f"{where}: {v}" for v in outcome.violations]
            if column == "staging_key":
                # The row is still there under a damaged key: the acknowledged key is corrupt, not unknown.
                if not outcome.corrupt(f"fetch {key}") or "damaged in the key table" not in str(
                    outcome.detected[f"fetch {key}"]
                ):
                    failures.append(f"{where}: the renamed key was not reported as damaged")
                with pytest.raises(CorruptRecordError, match="another key"):
                    store.fetch([key + "x"])
            elif not (outcome.corrupt(f"fetch {key}") and outcome.corrupt(f"fetch_chunks {key}")):
                failures.append(f"{where}: fetch was not refused as corrupt: {outcome.detected.get(f'fetch {key}')!r}")
            if not outcome.replay_differs:
                failures.append(f"{where}: replay did not report the damaged row")
            if sorted(outcome.detected) != sorted({f"fetch {key}", f"fetch_chunks {key}"} & set(outcome.detected)):
                failures.append(f"{where}: other reads failed: {sorted(outcome.detected)}")
            current = values.get("staging_key", key)
            restore = ", ".join(f"{name} = :{name}" for name in staged)
            raw.execute(
                sa.text(f"UPDATE staged_keys SET {restore} WHERE staging_key = :current"),
                {**staged, "current": current},
            )
    assert not failures, "\n".join(failures)
    assert not probe(store, expected).found


def test_fetch_never_returns_the_record_of_another_key(store_url: str, store: Store, raw: sa.Connection) -> None:
    """Defect 3: a staged_keys row pointing at another call's valid record (one flipped bit can do it)."""
    asked, other = make_record(rollout_id="r1", model_call_id="c1"), make_record(rollout_id="r9", model_call_id="c9")
    assert store.stage(asked).ok and store.stage(other).ok
    other_seq = raw.execute(sa.text("SELECT seq FROM events WHERE staging_key = 'r9/c9'")).scalar_one()
    raw.execute(
        sa.text(
            "UPDATE staged_keys SET event_seq = :seq, rollout_id = 'r9', model_call_id = 'c9', digest = :digest "
            "WHERE staging_key = 'r1/c1'"
        ),
        {"seq": other_seq, "digest": other.digest},
    )
    for read in (store.fetch, store.fetch_chunks):
        with pytest.raises(CorruptRecordError) as caught:
            read(["r1/c1"])  # type: ignore[operator]
        assert "'r1/c1'" in str(caught.value) and f"event {other_seq}" in str(caught.value)
    assert store.fetch(["r9/c9"])[0].digest == other.digest
    assert not store.replay().ok


def test_receipt_rows_pointing_elsewhere_are_corrupt(store: Store, raw: sa.Connection) -> None:
    expected = populate(store)
    checkpoint_id, inventory_digest, _ = expected.receipt
    record_seq = raw.execute(sa.text("SELECT seq FROM events WHERE staging_key = 'r1/c1'")).scalar_one()
    original = raw.execute(sa.text("SELECT event_seq FROM cut_receipts")).scalar_one()
    for seq in (record_seq, 10**6):
        raw.execute(sa.text("UPDATE cut_receipts SET event_seq = :seq"), {"seq": seq})
        with pytest.raises(CorruptRecordError, match="checkpoint-1"):
            store.cut_receipt(checkpoint_id, inventory_digest)
        assert not store.replay().ok
    raw.execute(sa.text("UPDATE cut_receipts SET event_seq = :seq"), {"seq": original})
    assert store.cut_receipt(checkpoint_id, inventory_digest) == expected.receipt[2]


def test_a_damaged_calls_row_is_a_corrupt_record_error(store: Store, raw: sa.Connection) -> None:
    record = make_record(rollout_id="r1", model_call_id="c1")
    assert store.stage(record).ok
    raw.execute(sa.text("UPDATE calls SET version_spans = :b"), {"b": b"\xc1"})  # never valid msgpack
    with pytest.raises(CorruptRecordError, match="r1"):
        store.call("r1", "c1")
    with pytest.raises(CorruptRecordError):
        store.calls()
    with pytest.raises(CorruptRecordError):  # the write path reads the row too
        store.record_failure("r1", "c1", "the engine gave up")
    report = store.replay(repair=True)
    assert not report.ok and report.repaired
    assert store.call("r1", "c1") is not None and store.replay().ok


def test_the_checksum_covers_every_column_that_says_what_an_event_is(store: Store, raw: sa.Connection) -> None:
    from store.log.checksum import event_checksum  # imported here: the module also runs against older stores

    record = make_record()
    assert store.stage(record).ok
    [row] = event_rows(raw)
    assert event_checksum(row) == row["checksum"]
    for column in ("rollout_id", "model_call_id", "stream_version", "kind", "staging_key", "body", "token_ids"):
        changed = {**row, column: flip_text(row[column]) if isinstance(row[column], str) else None}
        assert event_checksum(changed) != row["checksum"], column


# --- random byte flips in a SQLite file -------------------------------------------------------------

FILE_TRIALS = 80


def test_random_byte_flips_in_the_file_never_serve_a_wrong_record(tmp_path: Path) -> None:
    data, expected = sample_file(tmp_path)
    trials = run_file_trials(data, expected, tmp_path, flipper(random.Random(6)), FILE_TRIALS)
    assert trials.violations == [], "\n".join(trials.violations[:20])
    # Most of this small file is unused space in its pages (the rollouts, workers and
    # log-shipping tables are empty here): a flip there changes nothing any reader can see.
    assert trials.planted == FILE_TRIALS and trials.found >= FILE_TRIALS // 5


def test_an_undamaged_copy_probes_clean(tmp_path: Path) -> None:
    """The file trials judge real damage: an undamaged copy reads back with nothing found."""
    data, expected = sample_file(tmp_path)
    trials = run_file_trials(data, expected, tmp_path, lambda data: (data, []), 1)
    assert (trials.violations, trials.found, trials.opened) == ([], 0, 1)


# --- a key hidden by damage to its own row (issue 22) -----------------------------------------------


def test_a_key_hidden_by_damage_to_the_key_table_is_corrupt_not_unknown(store: Store, raw: sa.Connection) -> None:
    expected = populate(store)
    key = "r1/c2"
    flipped = flip_text(key)  # one bit of the row's key: the lookup of the real key misses
    raw.execute(sa.text("UPDATE staged_keys SET staging_key = :new WHERE staging_key = :k"), {"new": flipped, "k": key})
    with pytest.raises(CorruptRecordError, match="damaged in the key table") as hidden:
        store.fetch([key])
    assert repr(flipped) in str(hidden.value)
    with pytest.raises(CorruptRecordError):
        store.fetch_chunks(["r1/c1", key])
    raw.execute(sa.text("UPDATE staged_keys SET staging_key = :k WHERE staging_key = :new"), {"new": flipped, "k": key})
    assert not probe(store, expected).found
    # A key the store never held is unknown, wherever it falls among the real keys.
    for absent in ("r1/c2x", "a", "zzz", "r1/c1-"):
        with pytest.raises(UnknownKeyError):
            store.fetch([absent])


def test_a_key_staged_while_a_fetch_looks_for_it_is_unknown_not_corrupt(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The miss check reads after the lookup: a key committed in between has an intact row of its
    own, which is no damage (a periodic flush racing a poll of its chunk on PostgreSQL met this)."""
    populate(store)
    record = make_record(rollout_id="r1", model_call_id="c9", weight_version=1)
    real_check = reads.check_absent

    def stage_then_check(connection: sa.Connection, missing: list[str]) -> None:
        # Another writer commits between fetch's lookup and its miss check (a second store: this
        # one's only PostgreSQL connection is the fetch's own, pool_size=1).
        with open_store(store.url) as writer:
            assert writer.stage(record).ok
        real_check(connection, missing)

    monkeypatch.setattr(reads, "check_absent", stage_then_check)
    with pytest.raises(UnknownKeyError):  # it was absent when fetch looked
        store.fetch([record.staging_key])
    monkeypatch.undo()
    [fetched] = store.fetch([record.staging_key])
    assert fetched.digest == record.digest


def test_a_neighbour_deleted_while_fetch_checks_a_miss_is_no_damage(store: Store) -> None:
    """The miss check reads the key rows next to the key, then their events: a delete committing
    between those reads (rows seen, their events gone) must not read as a damaged key table."""
    populate(store)
    deleted = False

    def delete_between_reads(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal deleted
        if not deleted and statement.startswith("SELECT events.seq, events.staging_key \nFROM events"):
            deleted = True  # the check has read r1's rows as neighbours; now r1 goes
            with open_store(store.url) as writer:
                assert list(writer.delete(["r1"]).removed) == ["r1"]

    engine = store._engine
    sa.event.listen(engine, "before_cursor_execute", delete_between_reads)
    try:
        with pytest.raises(UnknownKeyError):
            store.fetch(["r1/c15"])  # between r1/c1 and r1/c2: both are its neighbours
    finally:
        sa.event.remove(engine, "before_cursor_execute", delete_between_reads)
    assert deleted, "the check never read the neighbours' events"
    with pytest.raises(UnknownKeyError):
        store.fetch(["r1/c1"])  # the delete did land


def test_flipping_any_byte_of_the_key_tables_page_never_makes_an_acknowledged_key_unknown(tmp_path: Path) -> None:
    """Bytes of the SQLite page that holds the staged keys, XORed in turn: fetch of every acknowledged
    key answers its record or a StoreError, never UnknownKeyError."""
    import sqlite3

    data, expected = sample_file(tmp_path)
    with sqlite3.connect(tmp_path / "pristine.db") as pristine:
        page_size = pristine.execute("PRAGMA page_size").fetchone()[0]
        (page,) = pristine.execute("SELECT rootpage FROM sqlite_master WHERE name = 'staged_keys'").fetchone()
    start = (page - 1) * page_size
    # The page's cells (the keys' rows) sit at its end: every one of its last 120 bytes, and its header.
    offsets = [*range(start + page_size - 120, start + page_size), *range(start, start + 12)]
    unknown: list[str] = []
    path = tmp_path / "damaged.db"
    for offset in offsets:
        damaged = bytearray(data)
        damaged[offset] ^= 0x01
        for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            leftover.unlink(missing_ok=True)
        path.write_bytes(bytes(damaged))
        try:
            opened = open_store(path)
        except StoreError:
            continue
        with opened:
            for key in expected.records:
                try:
                    opened.fetch([key])
                except UnknownKeyError:
                    unknown.append(f"offset {offset}: {key}")
                except StoreError:
                    pass
    assert unknown == [], unknown[:10]
