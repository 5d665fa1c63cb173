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
