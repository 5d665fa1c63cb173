"""Store round trips, idempotence, conflicts, reopen, replay, corruption and error mapping.

Every test that takes the ``store``/``store_url`` fixtures runs on SQLite, and on PostgreSQL
when ``STORE_TEST_POSTGRES_URL`` is set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import sqlalchemy as sa
from factories import make_record

import store as lib
from store import EventKind, StagedCallRecord, Store, open_store
from store.log.checksum import event_checksum

U64_MAX = 2**64 - 1


# --- helpers ----------------------------------------------------------------------------------


@contextmanager
def raw_engine(store_url: str) -> Iterator[sa.Engine]:
    """A plain SQLAlchemy engine on the store's database, outside the library (to tamper with it)."""
    if "://" not in store_url:
        url = f"sqlite:///{store_url}"
    else:
        url = store_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sa.create_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def execute(store_url: str, sql: str, params: dict[str, object] | None = None) -> None:
    with raw_engine(store_url) as engine, engine.begin() as connection:
        connection.execute(sa.text(sql), params or {})


def scalar(store_url: str, sql: str, params: dict[str, object] | None = None) -> object:
    with raw_engine(store_url) as engine, engine.connect() as connection:
        return connection.execute(sa.text(sql), params or {}).scalar()


def event_count(store_url: str) -> int:
    count = scalar(store_url, "SELECT count(*) FROM events")
    assert isinstance(count, int)
    return count


def f32(values: list[float]) -> list[float]:
    return [float(np.float32(v)) for v in values]


def child_of(parent: StagedCallRecord, parent_tokens: list[int], **overrides: object) -> StagedCallRecord:
    fields: dict[str, object] = {
        "rollout_id": parent.rollout_id,
        "model_call_id": "call-2",
        "parent_call_id": parent.model_call_id,
        "parent_chain_hash": parent.chain_hash,
        "prefix": parent_tokens,
        "prompt": (30, 31),
        "generated": (40, 41, 42),
    }
    fields.update(overrides)
    return make_record(**fields)  # type: ignore[arg-type]


# --- round trips ------------------------------------------------------------------------------


def test_stage_then_fetch_round_trips_every_field(store: Store) -> None:
    logprobs = [-0.1, -1 / 3, -2.718281828, -1e-7]
    extras = {"turn": 3, "tags": ["a", "b"], "score": 0.25, "nested": {"flag": True, "none": None, "neg": -5}}
    record = make_record(prompt=(1, 2, 3, 4), generated=(100, 101, 102, 103), logprobs=logprobs, extras=extras)

    result = store.stage(record)
    assert result.ok is True
    assert result.staging_key == "rollout-1/call-1" == record.staging_key
    assert result.error is None

    [snapshot] = store.fetch([record.staging_key])
    assert isinstance(snapshot, lib.StagedCallSnapshot)
    assert snapshot.digest == record.digest
    assert snapshot.token_ids_delta.tolist() == [1, 2, 3, 4, 100, 101, 102, 103]
    assert snapshot.token_mask_delta.tolist() == [0.0] * 4 + [1.0] * 4
    # Log-probs are hashed and stored as IEEE binary32: what comes back is the float32 rounding.
    assert snapshot.generation_log_probs_delta.tolist() == [0.0] * 4 + f32(logprobs)
    assert snapshot.generation_log_probs_delta == record.generation_log_probs_delta
    assert snapshot.extras == extras
    assert snapshot.extras_digest == record.extras_digest
    for field in (
        "schema_version",
        "rollout_id",
        "model_call_id",
        "parent_call_id",
        "mode",
        "prev_len",
        "delta_len",
        "cum_len",
        "weight_version",
        "chain_hash",
        "cumulative_hash",
    ):
        assert getattr(snapshot, field) == getattr(record, field), field


def test_fetched_snapshot_encodes_like_the_record_when_logprobs_are_exact_float32(store: Store) -> None:
    record = make_record(logprobs=[-0.5, -0.25], extras={"k": [1, 2, 3]})
    assert store.stage(record).ok
    [snapshot] = store.fetch([record.staging_key])
    assert lib.to_json(snapshot) == lib.to_json(record)


def test_child_record_and_schema_3_round_trip(store: Store) -> None:
    root_tokens = [10, 11, 12, 20, 21]
    root = make_record(schema_version=3)
    child = child_of(root, root_tokens, schema_version=3, weight_version=8)
    assert store.stage(root).ok
    assert store.stage(child).ok

    fetched_root, fetched_child = store.fetch([root.staging_key, child.staging_key])
    assert fetched_root.schema_version == 3 and fetched_root.digest == root.digest
    assert fetched_child.digest == child.digest
    assert fetched_child.parent_call_id == "call-1"
    assert fetched_child.mode == "token_in"
    assert fetched_child.prev_len == len(root_tokens)
    assert fetched_child.cum_len == len(root_tokens) + 5
    assert fetched_child.token_ids_delta.tolist() == [30, 31, 40, 41, 42]


def test_fetch_preserves_requested_order_including_duplicates(store: Store) -> None:
    records = [make_record(model_call_id=f"call-{i}", generated=(200 + i,)) for i in range(5)]
    for record in records:
        assert store.stage(record).ok
    order = [records[i].staging_key for i in (3, 0, 4, 0, 1, 3, 2)]
    fetched = store.fetch(order)
    assert [s.staging_key for s in fetched] == order
    assert [s.token_ids_delta.tolist()[-1] for s in fetched] == [203, 200, 204, 200, 201, 203, 202]
    assert store.fetch([]) == []
    assert [s.staging_key for s in store.fetch(tuple(order[:2]))] == order[:2]


def test_fetch_many_keys_beyond_one_query_chunk(store: Store) -> None:
    # The reader fetches keys in chunks; order must survive the chunking.
    records = [make_record(model_call_id=f"c{i}", generated=(i + 1,), prompt=()) for i in range(1203)]
    for record in records:
        assert store.stage(record).ok
    wanted = [r.staging_key for r in reversed(records)]
    fetched = store.fetch(wanted)
    assert [s.staging_key for s in fetched] == wanted
    assert fetched[0].token_ids_delta.tolist() == [1203]


# --- unknown keys and bad arguments -------------------------------------------------------------


def test_unknown_key_raises_unknown_key_error(store: Store) -> None:
    with pytest.raises(lib.UnknownKeyError) as caught:
        store.fetch(["rollout-x/nothing-here"])
    assert isinstance(caught.value, lib.StoreError)
    assert isinstance(caught.value, KeyError)
    assert "rollout-x/nothing-here" in str(caught.value)


def test_mix_of_known_and_unknown_keys_names_the_missing_one(store: Store) -> None:
    known = make_record()
    assert store.stage(known).ok
    with pytest.raises(lib.UnknownKeyError) as caught:
        store.fetch([known.staging_key, "missing/key-42", known.staging_key])
    message = str(caught.value)
    assert "missing/key-42" in message
    assert known.staging_key not in message


def test_fetch_refuses_a_single_string_and_bad_keys(store: Store) -> None:
    record = make_record()
    assert store.stage(record).ok
    with pytest.raises(lib.InvalidRecordError):
        store.fetch(record.staging_key)  # type: ignore[arg-type]
    with pytest.raises(lib.InvalidRecordError):
        store.fetch([""])
    with pytest.raises(lib.InvalidRecordError):
        store.fetch([123])  # type: ignore[list-item]


def test_stage_refuses_non_records_and_bad_options(store_url: str, store: Store) -> None:
    record = make_record()
    with pytest.raises(lib.InvalidRecordError):
        store.stage({"rollout_id": "r", "model_call_id": "c"})  # type: ignore[arg-type]
    with pytest.raises(lib.InvalidRecordError):
        store.stage(lib.to_json(record))  # type: ignore[arg-type]
    with pytest.raises(lib.InvalidRecordError):
        store.stage(record, staging_key="")
    with pytest.raises(lib.InvalidRecordError):
        store.stage(record, kind=EventKind.CALL_FAILED)
    assert event_count(store_url) == 0
    assert store.calls() == []


# --- idempotence and conflicts -------------------------------------------------------------------


def test_restaging_an_identical_record_is_a_noop(store_url: str, store: Store) -> None:
    record = make_record(extras={"x": 1})
    first = store.stage(record)
    assert first.ok
    events_before = store.replay().events
    calls_before = store.calls()
    assert events_before == 1

    # The same record, and an equal record rebuilt independently, under the same key.
    again = store.stage(record)
    rebuilt = store.stage(make_record(extras={"x": 1}))
    assert again.ok and rebuilt.ok
    assert again.staging_key == rebuilt.staging_key == record.staging_key
    assert store.replay().events == events_before
    assert event_count(store_url) == 1
    assert store.calls() == calls_before


def test_conflicting_record_under_a_used_key_is_refused_and_changes_nothing(store_url: str, store: Store) -> None:
    original = make_record(generated=(20, 21))
    assert store.stage(original).ok
    calls_before = store.calls()

    different = make_record(generated=(20, 22))  # same call, same default key, other tokens
    assert different.staging_key == original.staging_key
    result = store.stage(different)
    assert result.ok is False
    assert result.error is not None and original.staging_key in result.error

    [snapshot] = store.fetch([original.staging_key])
    assert snapshot.digest == original.digest
    assert snapshot.token_ids_delta.tolist() == [10, 11, 12, 20, 21]
    assert event_count(store_url) == 1
    assert store.calls() == calls_before
    assert store.replay().ok


def test_a_record_is_staged_only_under_its_own_keys(store_url: str, store: Store) -> None:
    first = make_record(model_call_id="call-a")
    other = make_record(model_call_id="call-b")
    first_cut = lib.chunk_staging_key("ckpt-7", "rollout-1", "call-a", 0)
    assert store.stage(first).ok
    assert store.stage(first, staging_key=first_cut, kind=EventKind.PREFIX_STAGED).ok
    refused = {
        "another call's default key": dict(staging_key=first.staging_key),
        "another call's cut key": dict(staging_key=first_cut, kind=EventKind.PREFIX_STAGED),
        "a free key outside both namespaces": dict(staging_key="shared-key"),
        "a cut key as a terminal record": dict(staging_key=lib.chunk_staging_key("c", "rollout-1", "call-b", 0)),
        "the default key as a chunk": dict(staging_key=other.staging_key, kind=EventKind.CHUNK_STAGED),
        "a malformed cut key": dict(staging_key="__generation_cut__/rollout-1/call-b/0", kind="prefix_staged"),
    }
    for case, options in refused.items():
        with pytest.raises(lib.InvalidRecordError, match="staged under"):
            store.stage(other, **options)  # type: ignore[arg-type]
        with pytest.raises(lib.InvalidRecordError):
            store.stage_all([lib.StageEntry(other, **options)])  # type: ignore[arg-type]
        assert event_count(store_url) == 2, case
    assert store.call(other.rollout_id, "call-b") is None
    assert store.fetch([first.staging_key])[0].model_call_id == "call-a"


def test_the_reserved_cut_namespace_is_never_a_default_key(store_url: str, store: Store) -> None:
    # Its default key would be the cut key of call ("r", "c") at checkpoint "x".
    forged = make_record(rollout_id="__generation_cut__/x", model_call_id="r/c/0")
    assert forged.staging_key == lib.chunk_staging_key("x", "r", "c", 0)
    with pytest.raises(lib.InvalidRecordError, match="reserved"):
        store.stage(forged)
    assert event_count(store_url) == 0


def test_a_cut_key_of_its_own_call(store: Store) -> None:
    record = make_record()
    key = lib.chunk_staging_key("ckpt-7", "rollout-1", "call-1", 0)
    result = store.stage(record, staging_key=key, kind=EventKind.PREFIX_STAGED)
    assert result.ok and result.staging_key == key
    [snapshot] = store.fetch([key])
    assert snapshot.digest == record.digest
    with pytest.raises(lib.UnknownKeyError):
        store.fetch([record.staging_key])  # only the cut key was written
    assert store.stage(record, staging_key=key, kind="prefix_staged").ok  # idempotent, the kind as its value


def test_a_call_withdraws_only_its_own_cut_keys(store_url: str, store: Store) -> None:
    mine, other = make_record(model_call_id="mine"), make_record(model_call_id="other")
    my_cut, other_cut = (lib.chunk_staging_key("k", "rollout-1", call, 0) for call in ("mine", "other"))
    for record, cut_key in ((mine, my_cut), (other, other_cut)):
        assert store.stage(record).ok
        assert store.stage(record, staging_key=cut_key, kind=EventKind.PREFIX_STAGED).ok
    events = event_count(store_url)
    for keys in (
        [mine.staging_key],  # its own terminal record
        [other.staging_key],  # another call's terminal record
        [other_cut],  # another call's cut key
        [my_cut, other.staging_key],  # all or nothing
        ["rollout-1/mine/extra"],
        ["__generation_cut__/rollout-1/mine/0"],  # no checkpoint id
    ):
        with pytest.raises(lib.InvalidRecordError, match="withdraw"):
            store.clear_keys("rollout-1", "mine", keys, "rolled back")
        assert event_count(store_url) == events
    assert len(store.fetch([mine.staging_key, other.staging_key, my_cut, other_cut])) == 4

    store.clear_keys("rollout-1", "mine", [my_cut, lib.chunk_staging_key("k", "rollout-1", "mine", 1)], "rolled back")
    with pytest.raises(lib.UnknownKeyError):
        store.fetch([my_cut])
    assert event_count(store_url) == events + 1
    assert store.replay().ok


def test_a_cut_key_named_for_a_call_but_held_by_another_is_not_withdrawn(store_url: str, store: Store) -> None:
    # Ids with "/" make one key name two calls: ("b", "c") at checkpoint "x/a", and ("a/b", "c") at "x".
    holder = make_record(rollout_id="a/b", model_call_id="c")
    key = lib.chunk_staging_key("x", "a/b", "c", 0)
    assert key == lib.chunk_staging_key("x/a", "b", "c", 0)
    assert store.stage(holder, staging_key=key, kind=EventKind.PREFIX_STAGED).ok
    with pytest.raises(lib.InvalidRecordError, match="holds a record of a/b/c"):
        store.clear_keys("b", "c", [key], "not mine")
    assert store.fetch([key])[0].rollout_id == "a/b"
    assert event_count(store_url) == 1


# --- reopen and close --------------------------------------------------------------------------


def test_reopen_after_close_keeps_everything(store_url: str) -> None:
    records = [make_record(model_call_id=f"call-{i}", generated=(50 + i, 60 + i)) for i in range(4)]
    with open_store(store_url) as first:
        for record in records:
            assert first.stage(record).ok
        calls_before = first.calls()

    with open_store(store_url, durability="normal") as second:
        fetched = second.fetch([r.staging_key for r in records])
        assert [s.digest for s in fetched] == [r.digest for r in records]
        assert second.calls() == calls_before
        report = second.replay()
        assert report.ok and report.events == 4
        # Idempotence and conflicts still hold across a reopen.
        assert second.stage(records[0]).ok
        assert not second.stage(make_record(model_call_id="call-0", generated=(1,))).ok
        assert second.replay().events == 4


def test_using_a_closed_store_raises(store_url: str) -> None:
    opened = open_store(store_url)
    record = make_record()
    assert opened.stage(record).ok
    opened.close()
    opened.close()  # closing twice is harmless
    for use in (
        lambda: opened.stage(record),
        lambda: opened.fetch([record.staging_key]),
        lambda: opened.replay(),
        lambda: opened.calls(),
        lambda: opened.call("rollout-1", "call-1"),
    ):
        with pytest.raises(lib.StoreClosedError) as caught:
            use()
        assert isinstance(caught.value, lib.StoreError)


def test_context_manager_closes(store_url: str) -> None:
    with open_store(store_url) as opened:
        assert isinstance(opened, Store)
        assert opened.backend in ("sqlite", "postgresql")
    with pytest.raises(lib.StoreClosedError):
        opened.fetch(["anything"])


# --- atomicity of append + projection ----------------------------------------------------------


def test_append_and_projection_commit_together(store_url: str, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = make_record(model_call_id="kept")
    assert store.stage(kept).ok

    from store.append import transaction

    def broken_projection(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("projection failed after the event insert")

    monkeypatch.setattr(transaction.WriteTransaction, "_project", broken_projection)
    # The path that inserts the event, then projects it (PostgreSQL's lone stage of a new stream
    # sends all three rows in one guarded statement instead: tests/test_write_path.py).
    monkeypatch.setattr(transaction.WriteTransaction, "guess_new_stream", lambda self, new: False)
    lost = make_record(model_call_id="lost")
    with pytest.raises(Exception, match="projection failed"):
        store.stage(lost)
    monkeypatch.undo()

    # The event row was inserted before the projection failed; it must not have committed.
    assert event_count(store_url) == 1
    with pytest.raises(lib.UnknownKeyError):
        store.fetch([lost.staging_key])
    assert store.call("rollout-1", "lost") is None
    assert store.replay().ok
    # The store is still usable, and the record can be staged now.
    assert store.stage(lost).ok
    assert store.fetch([lost.staging_key])[0].digest == lost.digest


# --- replay ------------------------------------------------------------------------------------


def stage_a_mix(target: Store) -> list[StagedCallRecord]:
    root = make_record(rollout_id="r-mix", model_call_id="root")
    child = child_of(root, [10, 11, 12, 20, 21], model_call_id="child")
    other = make_record(rollout_id="r-other", model_call_id="solo", extras={"k": "v"})
    prefix = make_record(rollout_id="r-live", model_call_id="live", generated=(1, 2, 3))
    chunk = make_record(rollout_id="r-live", model_call_id="live", prompt=(), generated=(4, 5))
    assert target.stage(root).ok
    assert target.stage(child).ok
    assert target.stage(other).ok
    assert target.stage(prefix, staging_key=lib.chunk_staging_key("k", "r-live", "live", 0), kind="prefix_staged").ok
    assert target.stage(chunk, staging_key=lib.chunk_staging_key("k", "r-live", "live", 1), kind="chunk_staged").ok
    assert target.stage(root).ok  # idempotent
    assert not target.stage(make_record(rollout_id="r-mix", model_call_id="root", generated=(9,))).ok
    return [root, child, other, prefix, chunk]


def test_replay_is_ok_after_a_mix_of_stages(store: Store) -> None:
    stage_a_mix(store)
    report = store.replay()
    assert report.ok is True
    assert report.events == 5
    assert report.differences == () and report.differences_total == 0
    assert "5 events" in report.summary()


def test_replay_detects_a_tampered_calls_row_and_repair_fixes_it(store_url: str, store: Store) -> None:
    stage_a_mix(store)
    execute(store_url, "UPDATE calls SET state = 'failed' WHERE rollout_id = 'r-mix' AND model_call_id = 'child'")
    assert store.call("r-mix", "child").state == "failed"  # type: ignore[union-attr]

    report = store.replay()
    assert report.ok is False
    assert report.differences_total == 1
    [difference] = report.differences
    assert difference.table == "calls"
    assert difference.key == ("r-mix", "child")
    assert difference.live is not None and difference.live["state"] == "failed"
    assert difference.rebuilt is not None and difference.rebuilt["state"] == "completed"
    assert "calls" in str(difference) and "child" in str(difference) and "state" in str(difference)
    assert "child" in report.summary()

    repaired = store.replay(repair=True)
    assert repaired.repaired is True
    assert store.replay().ok
    assert store.call("r-mix", "child").state == "completed"  # type: ignore[union-attr]


def test_replay_detects_a_deleted_staged_key_and_repair_restores_it(store_url: str, store: Store) -> None:
    records = stage_a_mix(store)
    execute(store_url, "DELETE FROM staged_keys WHERE staging_key = 'r-other/solo'")
    with pytest.raises(lib.UnknownKeyError):
        store.fetch(["r-other/solo"])

    report = store.replay()
    assert not report.ok
    assert [(d.table, d.key) for d in report.differences] == [("staged_keys", ("r-other/solo",))]
    assert report.differences[0].live is None
    assert "missing from the live table" in str(report.differences[0])

    assert store.replay(repair=True).repaired
    assert store.replay().ok
    assert store.fetch(["r-other/solo"])[0].digest == records[2].digest


def test_replay_detects_a_live_row_without_an_event(store_url: str, store: Store) -> None:
    stage_a_mix(store)
    execute(
        store_url,
        "INSERT INTO staged_keys (staging_key, event_seq, rollout_id, model_call_id, digest) "
        "VALUES ('ghost', 1, 'r-mix', 'root', :digest)",
        {"digest": "0" * 64},
    )
    report = store.replay()
    assert not report.ok
    [difference] = report.differences
    assert difference.table == "staged_keys" and difference.key == ("ghost",) and difference.rebuilt is None
    store.replay(repair=True)
    assert store.replay().ok
    with pytest.raises(lib.UnknownKeyError):
        store.fetch(["ghost"])


def test_replay_names_every_difference(store_url: str, store: Store) -> None:
    stage_a_mix(store)
    execute(store_url, "UPDATE calls SET generated_tokens = 999")
    report = store.replay()
    assert not report.ok
    assert report.differences_total == 4  # root, child, solo, live
    assert {d.key for d in report.differences} == {
        ("r-mix", "root"),
        ("r-mix", "child"),
        ("r-other", "solo"),
        ("r-live", "live"),
    }
    assert all("generated_tokens" in str(d) for d in report.differences)


# --- corruption --------------------------------------------------------------------------------


def test_corrupted_stored_bytes_fail_the_checksum_on_fetch(store_url: str, store: Store) -> None:
    record = make_record()
    other = make_record(model_call_id="call-other")
    assert store.stage(record).ok and store.stage(other).ok
    stored = scalar(store_url, "SELECT log_probs FROM events WHERE staging_key = :k", {"k": record.staging_key})
    assert isinstance(stored, (bytes, memoryview))
    damaged = bytearray(bytes(stored))
    damaged[-1] ^= 0x01
    execute(
        store_url,
        "UPDATE events SET log_probs = :b WHERE staging_key = :k",
        {"b": bytes(damaged), "k": record.staging_key},
    )
    with pytest.raises(lib.CorruptRecordError) as caught:
        store.fetch([record.staging_key])
    assert isinstance(caught.value, lib.StoreError)
    assert "checksum" in str(caught.value)
    # A fetch that includes the damaged record fails as a whole; the undamaged one still reads.
    with pytest.raises(lib.CorruptRecordError):
        store.fetch([other.staging_key, record.staging_key])
    assert store.fetch([other.staging_key])[0].digest == other.digest


def test_bytes_that_pass_the_checksum_but_not_the_digest_are_refused(store_url: str, store: Store) -> None:
    record = make_record()
    assert store.stage(record).ok
    with raw_engine(store_url) as engine, engine.begin() as connection:
        row = connection.execute(
            sa.text("SELECT * FROM events WHERE staging_key = :k"), {"k": record.staging_key}
        ).one()
        ids = bytearray(bytes(row.token_ids))
        ids[-1] ^= 0x01  # another token id, re-checksummed: only the digest can catch it
        checksum = event_checksum({**row._mapping, "token_ids": bytes(ids)})
        connection.execute(
            sa.text("UPDATE events SET token_ids = :ids, checksum = :c WHERE seq = :seq"),
            {"ids": bytes(ids), "c": checksum, "seq": row.seq},
        )
    with pytest.raises(lib.CorruptRecordError, match="digest"):
        store.fetch([record.staging_key])


# --- projections ---------------------------------------------------------------------------------


def test_call_projection_values(store: Store) -> None:
    root = make_record(weight_version=7)
    root_tokens = [10, 11, 12, 20, 21]
    child = child_of(root, root_tokens, weight_version=9)
    assert store.stage(root).ok
    assert store.stage(child).ok

    info = store.call("rollout-1", "call-1")
    assert info is not None
    assert info.state == "completed"
    assert info.parent_call_id is None and info.mode == "text"
    assert info.prev_len == 0 and info.cum_len == 5
    assert info.generated_tokens == 2
    assert info.chain_hash == root.chain_hash and info.cumulative_hash == root.cumulative_hash
    assert info.continues is None
    assert info.oldest_version == info.newest_version == 7
    assert info.version_spans == (lib.VersionSpan(3, 5, 7),)
    assert store.version_spans("rollout-1", "call-1") == info.version_spans

    child_info = store.call("rollout-1", "call-2")
    assert child_info is not None
    assert child_info.state == "completed"
    assert child_info.parent_call_id == "call-1" and child_info.mode == "token_in"
    assert child_info.prev_len == 5 and child_info.cum_len == 10
    assert child_info.generated_tokens == 3
    assert child_info.version_spans == (lib.VersionSpan(2, 5, 9),)

    assert [c.model_call_id for c in store.calls()] == ["call-1", "call-2"]
    assert [c.model_call_id for c in store.calls("rollout-1")] == ["call-1", "call-2"]
    assert store.calls("no-such-rollout") == []
    assert store.call("rollout-1", "no-such-call") is None
    assert store.version_spans("rollout-1", "no-such-call") == ()


def test_explicit_version_spans_give_oldest_and_newest(store: Store) -> None:
    record = make_record(prompt=(1,), generated=(2, 3, 4, 5), weight_version=12)
    assert store.stage(record, spans=[(1, 3, 10), (3, 5, 12)]).ok
    info = store.call("rollout-1", "call-1")
    assert info is not None
    assert info.oldest_version == 10 and info.newest_version == 12
    assert info.version_spans == (lib.VersionSpan(1, 3, 10), lib.VersionSpan(3, 5, 12))
    assert info.generated_tokens == 4
    assert store.replay().ok


def test_prefix_then_chunk_projection(store: Store) -> None:
    prefix = make_record(model_call_id="live", generated=(1, 2, 3), weight_version=4)
    chunk = make_record(model_call_id="live", prompt=(), generated=(4, 5), weight_version=5)
    prefix_key, chunk_key = (lib.chunk_staging_key("k", "rollout-1", "live", n) for n in (0, 1))
    assert store.stage(prefix, staging_key=prefix_key, kind=EventKind.PREFIX_STAGED).ok
    staged = store.call("rollout-1", "live")
    assert staged is not None and staged.state == "staging"
    assert store.stage(chunk, staging_key=chunk_key, kind=EventKind.CHUNK_STAGED).ok
    info = store.call("rollout-1", "live")
    assert info is not None
    assert info.state == "staging"
    assert info.cum_len == 8
    assert info.generated_tokens == 5
    assert info.oldest_version == 4 and info.newest_version == 5
    fetched = store.fetch([chunk_key, prefix_key])
    assert [s.token_ids_delta.tolist() for s in fetched] == [[4, 5], [10, 11, 12, 1, 2, 3]]
    assert store.replay().ok


# --- packed storage and u64 extremes --------------------------------------------------------------


def test_token_columns_are_stored_packed(store_url: str, store: Store) -> None:
    n = 5000
    generated = [(i * 7919) % 150_000 for i in range(n)]
    record = make_record(prompt=(1, 2), generated=generated, logprobs=[-0.5] * n)
    assert store.stage(record).ok
    with raw_engine(store_url) as engine, engine.connect() as connection:
        row = connection.execute(
            sa.text("SELECT token_ids, token_mask, log_probs FROM events WHERE staging_key = :k"),
            {"k": record.staging_key},
        ).one()
    ids, mask, lps = bytes(row.token_ids), bytes(row.token_mask), bytes(row.log_probs)
    tokens = n + 2
    # ~4 bytes per token for ids below 2**32 (JSON would take ~6-7 bytes a token).
    assert tokens * 4 <= len(ids) <= tokens * 4 + 16
    assert not ids.lstrip().startswith(b"[")
    assert len(lps) <= tokens * 4 + 16
    assert len(mask) <= tokens * 4 + 16  # at most binary32 per position (run-length form is tiny)
    assert store.fetch([record.staging_key])[0].token_ids_delta.tolist() == [1, 2, *generated]


def test_u64_extremes_round_trip(store_url: str, store: Store) -> None:
    ids = [U64_MAX, 2**63, 2**32, 0]
    generated = [U64_MAX - 1, 2**40 + 3]
    record = make_record(prompt=ids, generated=generated, weight_version=U64_MAX)
    result = store.stage(record)
    assert result.ok, result.error
    [snapshot] = store.fetch([record.staging_key])
    assert snapshot.digest == record.digest
    assert snapshot.token_ids_delta.tolist() == [*ids, *generated]
    assert snapshot.weight_version == U64_MAX
    info = store.call("rollout-1", "call-1")
    assert info is not None
    assert info.oldest_version == info.newest_version == U64_MAX
    assert info.version_spans == (lib.VersionSpan(4, 6, U64_MAX),)
    ids_bytes = scalar(store_url, "SELECT token_ids FROM events WHERE staging_key = :k", {"k": record.staging_key})
    assert isinstance(ids_bytes, (bytes, memoryview))
    assert len(bytes(ids_bytes)) <= 6 * 8 + 16  # u64 packed, still binary
    assert store.replay().ok


def test_versions_order_numerically_in_projections(store: Store) -> None:
    # Versions are kept as text in the projection; 10 must still be newer than 9 and 2**64-1 newest.
    record = make_record(prompt=(1,), generated=(2, 3, 4))
    assert store.stage(record, spans=[(1, 2, 9), (2, 3, 10), (3, 4, U64_MAX)]).ok
    info = store.call("rollout-1", "call-1")
    assert info is not None
    assert info.oldest_version == 9 and info.newest_version == U64_MAX


# --- opening: configuration and driver errors -------------------------------------------------


def test_bogus_durability_is_a_configuration_error(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(lib.ConfigurationError) as caught:
        open_store(os.path.join(tmp_path, "s.db"), durability="bogus")
    assert isinstance(caught.value, lib.StoreError)
    assert "durability" in str(caught.value)


def test_directory_path_is_a_configuration_error(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(lib.ConfigurationError):
        open_store(tmp_path)
    with pytest.raises(lib.ConfigurationError):
        open_store(os.path.join(tmp_path, "no-such-folder", "s.db"))
    with pytest.raises(lib.ConfigurationError):
        open_store("")


@pytest.mark.parametrize("url", ["mysql://user@localhost/db", "oracle://x/y", "sqlite:///:memory:", "://nothing"])
def test_unsupported_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises(lib.ConfigurationError) as caught:
        open_store(url)
    assert isinstance(caught.value, lib.StoreError)


def test_unreachable_postgres_does_not_leak_a_driver_error() -> None:
    with pytest.raises(lib.StoreError) as caught:
        open_store("postgresql://postgres@127.0.0.1:1/x")
    assert isinstance(caught.value, lib.StorageError)  # MigrationError is a StorageError
    assert not isinstance(caught.value, sa.exc.SQLAlchemyError)
    assert type(caught.value).__module__ == "store.errors"


def test_a_file_that_is_not_a_database_does_not_leak_a_driver_error(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "garbage.db")
    with open(path, "wb") as handle:
        handle.write(b"this is not a sqlite database at all" * 200)
    with pytest.raises(lib.StoreError) as caught:
        open_store(path)
    assert isinstance(caught.value, lib.StorageError)
    assert type(caught.value).__module__ == "store.errors"


def test_driver_error_during_stage_becomes_storage_error(store_url: str, store: Store) -> None:
    assert store.stage(make_record(model_call_id="before")).ok
    execute(store_url, "DROP TABLE staged_keys")
    with pytest.raises(lib.StoreError) as caught:
        store.stage(make_record(model_call_id="after"))
    assert isinstance(caught.value, lib.StorageError)
    assert type(caught.value).__module__ == "store.errors"
    with pytest.raises(lib.StorageError):
        store.fetch(["rollout-1/before"])


def test_sqlite_store_is_wal_with_requested_synchronous(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "s.db")
    for durability, expected in (("full", 2), ("normal", 1)):
        with open_store(path, durability=durability) as opened:
            assert opened.stage(make_record(model_call_id=durability)).ok
            with opened._engine.connect() as connection:  # the store's own connections
                assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == expected
    import sqlite3

    connection = sqlite3.connect(path)
    try:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        connection.close()


def test_open_store_accepts_pathlike(tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    path = Path(tmp_path) / "p.db"
    with open_store(path) as opened:
        assert opened.backend == "sqlite"
        assert opened.stage(make_record()).ok
    assert path.is_file()


@pytest.mark.parametrize("scheme", ["postgresql+nosuchdriver", "sqlite+nosuchdriver"])
def test_unknown_driver_name_is_a_configuration_error(scheme: str, tmp_path: os.PathLike[str]) -> None:
    # SQLAlchemy raises NoSuchModuleError for an unknown dialect plugin; it must not leak raw.
    target = f"{scheme}:///{os.path.join(tmp_path, 'x.db')}" if scheme.startswith("sqlite") else f"{scheme}://u@h/db"
    with pytest.raises(lib.StoreError) as caught:
        open_store(target)
    assert isinstance(caught.value, lib.ConfigurationError)


def test_lost_postgres_connection_becomes_storage_error_and_recovers(store_url: str, store: Store) -> None:
    if "://" not in store_url:
        pytest.skip("PostgreSQL only: terminates the store's server connections")
    first = make_record(model_call_id="before")
    assert store.stage(first).ok
    execute(
        store_url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    second = make_record(model_call_id="after")
    try:
        result = store.stage(second)
    except lib.StoreError as exc:
        assert isinstance(exc, lib.StorageError)
        result = store.stage(second)  # the next write reconnects
    assert result.ok
    fetched = store.fetch([first.staging_key, second.staging_key])
    assert [s.digest for s in fetched] == [first.digest, second.digest]
    report = store.replay()
    assert report.ok and report.events == 2


def test_stage_accepts_decoded_and_fetched_records(store_url: str, store: Store, tmp_path: os.PathLike[str]) -> None:
    original = make_record(rollout_id="rollout-ü/🚀", model_call_id="call-é", extras={"ключ": "значение"})
    decoded = lib.from_json(lib.to_json(original), StagedCallRecord)
    assert store.stage(decoded).ok
    assert store.stage(original).ok  # the same record, built locally: idempotent
    [snapshot] = store.fetch([original.staging_key])
    assert snapshot.digest == original.digest and snapshot.extras == {"ключ": "значение"}
    # A fetched snapshot can be staged into another store unchanged.
    with open_store(os.path.join(tmp_path, "copy.db")) as other:
        assert other.stage(snapshot).ok
        assert other.fetch([original.staging_key])[0].digest == original.digest
    assert store.replay().events == 1
