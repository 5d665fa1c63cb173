"""Lineage views over the log (issue 7, parts 2 and 4): policy versions, the call tree of a
rollout across its attempts, ``Store.linearize`` and ``Store.export_jsonl``."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from capture_helpers import damage_token_ids
from factories import make_record
from lineage_helpers import PROMPT, ROOT_GENERATED, two_call_rollout

from store import (
    CaptureAdmission,
    CorruptRecordError,
    InvalidRecordError,
    LinearizedRow,
    ReceiptVerificationError,
    RolloutTokenCapture,
    StaleCall,
    StorageError,
    Store,
    compute_chain_hash,
    hash_token_ids,
    open_store,
)
from store.lineage import linearize as linearize_module

ROW_FIELDS = (
    "token_ids",
    "token_mask",
    "logprobs",
    "model_call_ids",
    "prompt_len",
    "weight_versions",
    "weight_version_spans",
    "link_spans",
    "extras_commitments",
    "terminal_model_call_id",
)


def row_fields(row: LinearizedRow) -> dict[str, object]:
    return {name: getattr(row, name) for name in ROW_FIELDS}


# --- policy-version views ------------------------------------------------------------------------


def test_tokens_per_version_count_a_continued_call_once(store: Store) -> None:
    two_call_rollout(store, "r0", interrupted=True, versions=(7, 9))
    two_call_rollout(store, "r1", interrupted=False, versions=(8, 8))
    # r0: c0 generated 2 at 7; c1 restored 2 generated at 7 and generated 2 more at 9 in attempt 1.
    # Attempt 0's c1 row (the cut) is not counted again: its tokens live on in the continuation.
    assert store.version_tokens("r0") == {7: 4, 9: 2}
    assert store.version_tokens("r0-a1") == {7: 4, 9: 2}, "an attempt's capture key names its rollout"
    assert store.version_tokens("r1") == {8: 6}
    assert store.version_tokens() == {7: 4, 8: 6, 9: 2}
    assert store.version_tokens("nobody") == {}
    views = {view.rollout_id: view for view in store.rollout_versions()}
    assert set(views) == {"r0", "r1"}, "attempts are grouped under their rollout"
    assert (views["r0"].oldest_version, views["r0"].newest_version, views["r0"].generated_tokens) == (7, 9, 6)
    assert views["r1"].tokens_by_version == {8: 6}
    [only] = store.rollout_versions("r1")
    assert only == views["r1"]


def test_stale_calls_and_their_token_counts(store: Store) -> None:
    two_call_rollout(store, "r0", interrupted=True, versions=(7, 9))
    report = store.stale(9, 1)  # versions below 8 are stale
    assert report.calls == [
        StaleCall("r0", "r0", "c0", "completed", oldest_version=7, stale_tokens=2, generated_tokens=2),
        StaleCall("r0", "r0-a1", "c1", "completed", oldest_version=7, stale_tokens=2, generated_tokens=4),
    ]
    assert report.stale_tokens == 4
    assert store.stale(9, 2).calls == []
    assert store.stale(10, 0).stale_tokens == 6
    assert store.stale(1, 5).calls == [], "no version is more than max_lag behind version 1"
    huge = 2**64 - 1
    assert store.stale(huge, 0).stale_tokens == 6, "versions are u64"


@pytest.mark.parametrize("arguments", [(-1, 0), (1, -1), (True, 0), (1.0, 0), (2**64, 0), ("9", 1)])
def test_stale_refuses_bad_arguments(store: Store, arguments: tuple[object, object]) -> None:
    with pytest.raises(InvalidRecordError):
        store.stale(*arguments)  # type: ignore[arg-type]


def test_version_views_refuse_a_non_text_rollout(store: Store) -> None:
    with pytest.raises(InvalidRecordError):
        store.version_tokens(7)  # type: ignore[arg-type]


# --- rollouts() and lineage() --------------------------------------------------------------------


def test_rollouts_group_attempts_under_their_rollout(store: Store) -> None:
    two_call_rollout(store, "r0", interrupted=True)
    two_call_rollout(store, "r1", interrupted=False)
    two_call_rollout(store, "solo-a1", interrupted=False)  # ends like an attempt key, but its rollout is absent
    summaries = store.rollouts()
    assert [(s.rollout_id, s.attempts, s.calls, s.completed, s.failed) for s in summaries] == [
        ("r0", ("r0", "r0-a1"), 2, 2, 0),  # c1's newest row (attempt 1) completed
        ("r1", ("r1",), 2, 2, 0),
        ("solo-a1", ("solo-a1",), 2, 2, 0),
    ]
    assert store.lineage("solo") is None, "a rollout that is not in the store has no attempts"
    solo = store.lineage("solo-a1")
    assert solo is not None and solo.attempts == ("solo-a1",)


def test_an_attempt_whose_attempt_0_staged_nothing_is_still_an_attempt_of_its_rollout(store: Store) -> None:
    """Issue 33 item 12: attempt 0 of "lost" left nothing durable; a restore retired it (as Gym's
    restore retires every earlier attempt) and the replacement staged as attempt 1.  It was listed as
    a rollout "lost-a1" of its own, and linearize("lost") answered empty_manifest."""
    expected = two_call_rollout(store, "whole", interrupted=False)
    assert store.retire(["lost"]).absent == ["lost"]  # attempt 0: fenced, with nothing staged
    for record in (make_record(rollout_id="lost-a1", model_call_id="c0"),):
        assert store.stage(record).ok
    two_call_rollout(store, "solo-a1", interrupted=False)  # no "solo" known at all: its own rollout
    summaries = {s.rollout_id: s.attempts for s in store.rollouts()}
    assert summaries["lost"] == ("lost-a1",) and "lost-a1" not in summaries, summaries
    assert summaries["solo-a1"] == ("solo-a1",)
    lineage = store.lineage("lost")
    assert lineage is not None and lineage.rollout_id == "lost" and lineage.attempts == ("lost-a1",)
    assert [(c.capture_key, c.attempt) for c in lineage.calls] == [("lost-a1", 1)]
    assert store.lineage("lost-a1") == lineage
    [row] = store.linearize("lost").rows
    assert row.rollout_id == "lost" and store.linearize("lost-a1") == store.linearize("lost")
    assert [key.staging_key for key in store.staged_keys("lost")] == ["lost-a1/c0"]
    assert list(store.linearize("whole").rows[0].token_ids) == expected


def test_lineage_shows_the_tree_and_the_cut_a_continued_call_resumed(store: Store) -> None:
    two_call_rollout(store, "r0", interrupted=True, versions=(7, 9))
    tree = store.lineage("r0")
    assert tree is not None
    assert store.lineage("r0-a1") == tree, "an attempt's capture key names its rollout"
    assert tree.rollout_id == "r0" and tree.attempts == ("r0", "r0-a1")
    shape = [(c.capture_key, c.attempt, c.model_call_id, c.parent_call_id, c.state) for c in tree.calls]
    assert shape == [
        ("r0", 0, "c0", None, "completed"),
        ("r0", 0, "c1", "c0", "staging"),
        ("r0-a1", 1, "c1", "c0", "completed"),
    ]
    root, cut, continued = tree.calls
    assert [c.model_call_id for c in tree.roots()] == ["c0"]
    assert [c.capture_key for c in tree.children("c0")] == ["r0", "r0-a1"]
    assert tree.latest("c1") == continued and tree.latest("nobody") is None
    assert (root.prev_len, root.cum_len, root.generated_tokens) == (0, 5, 2)
    assert (continued.prev_len, continued.cum_len, continued.generated_tokens) == (5, 11, 4)
    assert (continued.admitted_version, continued.oldest_version, continued.newest_version) == (9, 7, 9)
    assert [(s.start, s.end, s.weight_version) for s in continued.version_spans] == [(2, 4, 7), (4, 6, 9)]
    assert cut.resumed_by == "r0-a1" and continued.resumed_by is None and cut.resumes is None
    resumed = continued.resumes
    assert resumed is not None
    assert (resumed.capture_key, resumed.attempt, resumed.model_call_id) == ("r0", 0, "c1")
    assert resumed.checkpoint_id == "ckpt-1"
    assert resumed.staging_keys == ("__generation_cut__/ckpt-1/r0/c1/0",)
    assert resumed.generation_token_count == 2
    assert all(c.admitted_at is not None for c in tree.calls)
    assert store.lineage("nobody") is None


def test_lineage_shows_the_unfinished_call_of_a_retired_attempt_as_retired(store: Store) -> None:
    """After the restore the dead attempt is retired: its cut call can never finish, so the
    tree says retired, not staging; finished calls keep their state; forget undoes it."""
    two_call_rollout(store, "r0", interrupted=True, versions=(7, 9))
    store.retire(["r0"])
    tree = store.lineage("r0")
    assert tree is not None
    shape = [(c.capture_key, c.model_call_id, c.state, c.retired) for c in tree.calls]
    assert shape == [
        ("r0", "c0", "completed", True),
        ("r0", "c1", "retired", True),
        ("r0-a1", "c1", "completed", False),
    ]
    info = store.call("r0", "c1")
    assert info is not None and info.state == "staging"  # the calls projection itself is unchanged
    store.forget(["r0"])
    tree = store.lineage("r0")
    assert tree is not None and [(c.state, c.retired) for c in tree.calls][1] == ("staging", False)


def test_lineage_refuses_a_non_text_rollout(store: Store) -> None:
    with pytest.raises(InvalidRecordError):
        store.lineage(None)  # type: ignore[arg-type]


# --- Store.linearize ---------------------------------------------------------------------------


def test_a_continued_call_linearizes_exactly_like_the_same_call_uninterrupted(store: Store) -> None:
    expected = two_call_rollout(store, "cut", interrupted=True)
    assert two_call_rollout(store, "straight", interrupted=False) == expected
    cut, straight = store.linearize("cut"), store.linearize("straight")
    assert len(cut.rows) == len(straight.rows) == 1 and cut.skipped == straight.skipped == []
    assert cut.rows[0].rollout_id == "cut" and straight.rows[0].rollout_id == "straight"
    assert row_fields(cut.rows[0]) == row_fields(straight.rows[0])
    row = cut.rows[0]
    assert list(row.token_ids) == expected
    assert row.model_call_ids == ["c0", "c1"] and row.terminal_model_call_id == "c1"
    assert row.prompt_len == len(PROMPT)
    assert row.link_spans == [("c0", 3, 2), ("c1", 2, 4)]
    assert store.linearize("cut-a1") == cut, "an attempt's capture key names its rollout"


def test_a_continued_call_across_policy_versions_linearizes_to_the_uninterrupted_tokens(store: Store) -> None:
    expected = two_call_rollout(store, "r0", interrupted=True, versions=(7, 9))
    [row] = store.linearize("r0").rows
    assert list(row.token_ids) == expected
    assert row.weight_versions == [7, 7], "a continued record is stamped with the oldest version of its parts"


def test_a_second_root_linearizes_as_a_subagent_row(store: Store) -> None:
    for call_id, prompt in (("main", (1, 2)), ("helper", (7, 8, 9))):
        assert store.stage(make_record(rollout_id="r", model_call_id=call_id, prompt=prompt)).ok
    result = store.linearize("r")
    assert [row.terminal_model_call_id for row in result.rows] == ["main", "helper"]
    assert result.num_roots == 2


def test_linearize_reports_why_a_rollout_cannot_be_linearized(store: Store) -> None:
    with pytest.raises(ReceiptVerificationError) as unknown:
        store.linearize("nobody")
    assert unknown.value.code == "empty_manifest"
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 3)
    call = capture.begin_call(CaptureAdmission(rollout_id="failing", model_call_id="c0", mode="text"))
    capture.fail_call(call, reason="the engine gave up")
    capture.close()
    with pytest.raises(ReceiptVerificationError) as poisoned:
        store.linearize("failing")
    assert poisoned.value.code == "capture_poisoned"
    root = make_record(rollout_id="retried", model_call_id="root")
    assert store.stage(root).ok
    for call_id in ("a", "b"):  # two childless children: a retry of the final call
        child = make_record(
            rollout_id="retried",
            model_call_id=call_id,
            parent_call_id="root",
            parent_chain_hash=root.chain_hash,
            prefix=list(root.token_ids_delta),
        )
        assert store.stage(child).ok
    with pytest.raises(ReceiptVerificationError) as ambiguous:
        store.linearize("retried")
    assert ambiguous.value.code == "ambiguous_terminal"


def test_linearize_checks_the_projection_against_the_records_it_folded(store: Store) -> None:
    two_call_rollout(store, "r0", interrupted=False)
    with store._engine.begin() as connection:
        connection.execute(
            sa.text("UPDATE calls SET chain_hash = :hash WHERE rollout_id = 'r0' AND model_call_id = 'c0'"),
            {"hash": "0" * 64},
        )
    with pytest.raises(ReceiptVerificationError) as edited:
        store.linearize("r0")
    assert edited.value.code == "wrong_chain_hash"
    assert not store.replay().ok


def test_linearize_refuses_damaged_token_bytes(store: Store) -> None:
    two_call_rollout(store, "r0", interrupted=True)
    damage_token_ids(store, "r0-a1/c1")
    with pytest.raises(CorruptRecordError, match="checksum"):
        store.linearize("r0")


def test_linearized_tokens_hash_to_the_terminal_cumulative_hash(store: Store) -> None:
    expected = two_call_rollout(store, "r0", interrupted=True)
    [row] = store.linearize("r0").rows
    info = store.call("r0-a1", "c1")
    assert info is not None and info.cumulative_hash == hash_token_ids(expected) == hash_token_ids(row.token_ids)
    assert list(row.token_ids[: len(PROMPT) + len(ROOT_GENERATED)]) == [*PROMPT, *ROOT_GENERATED]


def test_linearize_reads_a_rollout_on_one_connection(store: Store) -> None:
    """Calls, records and admissions are read on one pooled connection, not one per query."""
    expected = two_call_rollout(store, "r0", interrupted=True)
    checkouts: list[object] = []

    def count(*_: object) -> None:
        checkouts.append(_)

    sa.event.listen(store._engine, "checkout", count)
    try:
        [row] = store.linearize("r0-a1").rows  # an attempt's key: resolving it is one more read
    finally:
        sa.event.remove(store._engine, "checkout", count)
    assert list(row.token_ids) == expected
    assert len(checkouts) == 1


def test_linearize_reads_one_snapshot_while_the_rollout_is_deleted(
    store: Store, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls, records and admissions come from one snapshot: a delete that commits between
    linearize's reads changes nothing it returns (without the snapshot, its records are gone)."""
    two_call_rollout(store, "r0", interrupted=True)
    before = store.linearize("r0")
    read_calls = linearize_module.family_calls

    def calls_then_delete(*args: Any) -> Any:
        calls = read_calls(*args)
        with open_store(store_url) as other:  # another writer commits meanwhile
            assert other.delete(["r0", "r0-a1"])
        return calls

    monkeypatch.setattr(linearize_module, "family_calls", calls_then_delete)
    assert store.linearize("r0") == before
    monkeypatch.undo()
    with pytest.raises(ReceiptVerificationError) as caught:
        store.linearize("r0")
    assert caught.value.code == "empty_manifest"


def test_a_failed_read_in_a_pinned_block_is_a_storage_error_and_frees_the_pin(store: Store) -> None:
    reader = store._reader
    with (
        pytest.raises(StorageError, match="reading nothing"),
        reader.pinned("reading a rollout"),
        reader.connection("reading nothing") as connection,
    ):
        connection.execute(sa.text("SELECT * FROM no_such_table"))
    assert reader._pinned.get() is None
    two_call_rollout(store, "r0", interrupted=False)
    assert len(store.linearize("r0").rows) == 1, "the pool still serves reads after the failed block"


# --- Store.export_jsonl --------------------------------------------------------------------------


def _exported(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_export_round_trips_and_hashes_from_the_exported_tokens(store: Store, tmp_path: Path) -> None:
    expected = two_call_rollout(store, "r0", interrupted=True, versions=(7, 9))
    two_call_rollout(store, "r1", interrupted=False)
    for call_id, prompt in (("main", (1, 2)), ("helper", (7, 8, 9))):
        assert store.stage(make_record(rollout_id="r2", model_call_id=call_id, prompt=prompt)).ok
    seen: list[tuple[int, int]] = []
    path = tmp_path / "rows.jsonl"
    report = store.export_jsonl(path, progress=lambda done, total: seen.append((done, total)))
    assert (report.ok, report.rollouts, report.rows, report.failures) == (True, 3, 4, [])
    assert seen == [(1, 3), (2, 3), (3, 3)]
    lines = _exported(path)
    assert [(line["rollout_id"], line["terminal_model_call_id"]) for line in lines] == [
        ("r0", "c1"),
        ("r1", "c1"),
        ("r2", "main"),
        ("r2", "helper"),
    ]
    for line in lines:
        assert set(line) == {*ROW_FIELDS, "rollout_id", "token_policy_versions"}
        row = next(
            r
            for r in store.linearize(line["rollout_id"]).rows
            if r.terminal_model_call_id == line["terminal_model_call_id"]
        )
        tree = store.lineage(line["rollout_id"])
        assert tree is not None
        leaf = tree.latest(line["terminal_model_call_id"])
        assert leaf is not None
        info = store.call(leaf.capture_key, leaf.model_call_id)
        assert info is not None
        assert hash_token_ids(line["token_ids"]) == info.cumulative_hash, "the exported tokens hash to the leaf's hash"
        running = None
        for call_id, carried, generated in line["link_spans"]:
            span = next(s for s in line["weight_version_spans"] if s["model_call_id"] == call_id)
            running = compute_chain_hash(running, line["token_ids"][span["start"] : span["end"]])
            assert span["end"] - span["start"] == carried + generated
        assert running == info.chain_hash, "the exported tokens rebuild the leaf's chain hash"
        assert line["token_ids"] == list(row.token_ids)
        assert line["token_mask"] == list(row.token_mask) and line["logprobs"] == list(row.logprobs)
        assert len(line["token_policy_versions"]) == len(line["token_ids"])
        generated_positions = [i for i, mask in enumerate(line["token_mask"]) if mask == 1.0]
        assert [i for i, v in enumerate(line["token_policy_versions"]) if v is not None] == generated_positions
    assert lines[0]["token_ids"] == expected
    assert lines[0]["token_policy_versions"] == [None, None, None, 7, 7, None, None, 7, 7, 9, 9]


def test_export_reports_rollouts_that_fail_and_writes_the_rest(store: Store, tmp_path: Path) -> None:
    two_call_rollout(store, "damaged", interrupted=True)
    two_call_rollout(store, "edited", interrupted=False)
    two_call_rollout(store, "good", interrupted=False)
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 3)
    call = capture.begin_call(CaptureAdmission(rollout_id="failing", model_call_id="c0", mode="text"))
    capture.fail_call(call, reason="the engine gave up")
    capture.close()
    damage_token_ids(store, "damaged-a1/c1")
    with store._engine.begin() as connection:  # spans that claim a carried position was generated
        connection.execute(
            sa.text("UPDATE calls SET version_spans = :spans WHERE rollout_id = 'edited' AND model_call_id = 'c0'"),
            {"spans": msgspec.msgpack.encode([(0, 2, 7)])},
        )
    path = tmp_path / "rows.jsonl"
    report = store.export_jsonl(path, rollout_ids=["damaged", "edited", "failing", "good", "nobody"])
    assert [(f.rollout_id, f.code) for f in report.failures] == [
        ("damaged", "corrupt_record"),
        ("edited", "wrong_version_spans"),
        ("failing", "capture_poisoned"),
        ("nobody", "empty_manifest"),
    ]
    assert (report.ok, report.rollouts, report.rows) == (False, 1, 1)
    assert [line["rollout_id"] for line in _exported(path)] == ["good"]


def test_export_writes_the_same_bytes_to_text_and_binary_files(store: Store, tmp_path: Path) -> None:
    two_call_rollout(store, "r0", interrupted=True)
    text, binary = io.StringIO(), io.BytesIO()
    store.export_jsonl(text)
    store.export_jsonl(binary)
    path = tmp_path / "rows.jsonl"
    store.export_jsonl(str(path))
    assert text.getvalue().encode("utf-8") == binary.getvalue() == path.read_bytes()
    assert binary.getvalue().count(b"\n") == 1


class TextOnly:
    """A file-like object that takes only text (not an io.TextIOBase)."""

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as a text stream refuses bytes
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        return len(text)


@pytest.mark.parametrize(
    "arguments",
    [
        {"file": 42},
        {"file": "/nonexistent-folder/rows.jsonl"},
        {"file": "bad\x00name"},
        {"file": TextOnly()},
        {"rollout_ids": "r0"},
        {"rollout_ids": [None]},
        {"progress": 3},
    ],
)
def test_export_refuses_bad_arguments(store: Store, arguments: dict[str, Any]) -> None:
    two_call_rollout(store, "r0", interrupted=False)
    arguments.setdefault("file", io.BytesIO())
    with pytest.raises(InvalidRecordError):
        store.export_jsonl(**arguments)
