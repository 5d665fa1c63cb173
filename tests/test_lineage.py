"""Lineage views over the log (issue 7, parts 2 and 4): policy versions, the call tree of a
rollout across its attempts, ``Store.linearize`` and ``Store.export_jsonl``."""

from __future__ import annotations

import pytest
from lineage_helpers import two_call_rollout

from store import InvalidRecordError, StaleCall, Store

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


def test_lineage_refuses_a_non_text_rollout(store: Store) -> None:
    with pytest.raises(InvalidRecordError):
        store.lineage(None)  # type: ignore[arg-type]
