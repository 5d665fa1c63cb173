"""The complete-record transport (``store.transport.TokenTransport``) with NeMo Gym 0.7.0's own
code as its client: Gym's ``run_conformance`` (all ten checks) on SQLite and PostgreSQL, puts
that survive a SIGKILLed writer and read back in another process, the conditional drop, bad
input refused with nothing written, and the transport's events in replay, audit, delete and
log shipping."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

conformance = pytest.importorskip(
    "nemo_gym.token_id_capture.conformance",
    reason="NeMo Gym 0.7.0 is not installed (make real-clients installs nemo-gym==0.7.0)",
)
from nemo_gym.token_id_capture.lineage import FileLineageStore, stamp_continuation  # noqa: E402
from nemo_gym.token_id_capture.protocols import LineageResolver, TokenCaptureSnapshot, TokenSink, TokenSource  # noqa: E402
from nemo_gym.token_id_capture.records import (  # noqa: E402
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    stamp_lineage,
)
from nemo_gym.token_id_capture.store import TokenCaptureStore  # noqa: E402

from store import (  # noqa: E402
    CorruptRecordError,
    DigestMismatchError,
    EntryConflictError,
    InvalidRecordError,
    RolloutDroppedError,
    RolloutFencedError,
    RolloutFrozenError,
    Store,
    TokenSnapshot,
    TokenTransport,
    open_store,
    token_digest,
)
from store.transport import gym as gym_bindings  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "transport_worker.py"
sys.path.insert(0, str(HERE))
from transport_worker import REQUEST, entry_sha, lost, make_entry, run_writer  # noqa: E402

ALL_CHECKS = [
    "put_then_freeze_visibility",
    "idempotent_reput",
    "conflicting_reput",
    "mark_incomplete_durability",
    "freeze_idempotency",
    "post_freeze_write_safety",
    "conditional_retirement",
    "lineage_visibility",
    "fresh_client_lineage_visibility",
    "begin_call_custody",
]


def events(store: Store) -> int:
    return store.replay().events


# --- Gym's conformance suite ------------------------------------------------------------------


def test_gym_run_conformance_passes_every_check(store_url: str) -> None:
    def factory() -> TokenTransport:
        return TokenTransport.open(store_url)  # a fresh client each time, over the same store

    passed = asyncio.run(conformance.run_conformance(factory, factory, factory))
    assert passed == ALL_CHECKS
    with open_store(store_url) as store:
        assert store.replay().ok
        assert store.audit().ok


def test_gym_file_store_passes_the_same_ten_checks(tmp_path: Path) -> None:
    """The baseline: Gym's own file store and its file lineage store pass exactly these checks."""
    folder = str(tmp_path)
    passed = asyncio.run(
        conformance.run_conformance(
            lambda: TokenCaptureStore(folder), lambda: TokenCaptureStore(folder), lambda: FileLineageStore(folder)
        )
    )
    assert passed == ALL_CHECKS


def test_the_transport_is_each_of_gyms_protocols(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        assert isinstance(transport, TokenSink)
        assert isinstance(transport, TokenSource)
        assert isinstance(transport, LineageResolver)
        assert transport.is_process_shared()


# --- durable when put returns: a SIGKILLed writer, read back by another process ---------------


def test_nothing_acknowledged_is_lost_when_the_writer_is_sigkilled(store_url: str) -> None:
    lines = run_writer(store_url, "kill", acks=80)
    assert any(line.startswith("DROPPED") for line in lines)  # every step of the cycle was acknowledged
    assert lost(store_url, lines) == []
    with open_store(store_url) as store:
        assert store.replay().ok
        assert store.audit().ok


def test_the_kill_check_finds_an_entry_acknowledged_before_its_put(tmp_path: Path) -> None:
    """The check above can fail: a writer that acknowledges before putting is caught."""
    url = str(tmp_path / "store.db")
    lines = run_writer(url, "early", acks=40, ack_early=True)
    assert lost(url, lines) == ["early-t0-0/call-0: acknowledged, missing"]


# --- the conditional drop, the strict fence, the version ---------------------------------------


def entry(rollout_id: str, call: str, seed: int = 0) -> TokenEntry:
    return make_entry(rollout_id, call, seed=seed, tokens=8)


def test_drop_retires_only_the_exact_snapshot_consumed(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        transport.put_now(entry("r", "c1"))
        snapshot = transport.freeze_now("r")
        assert isinstance(snapshot, TokenCaptureSnapshot)
        assert not transport.drop_now("r", snapshot_id=snapshot.snapshot_id, version=snapshot.version + 1)
        assert not transport.drop_now("r", snapshot_id="another", version=snapshot.version)
        again = transport.freeze_now("r")
        assert (again.snapshot_id, again.version, len(again.entries)) == (snapshot.snapshot_id, snapshot.version, 1)
        assert transport.drop_now("r", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        assert not transport.drop_now("r", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        before = events(transport.store)
        for late in (
            lambda: transport.put_now(entry("r", "c2")),
            lambda: transport.freeze_now("r"),
            lambda: transport.mark_incomplete_now("r", "c2"),
            lambda: transport.begin_call_now("r", "c3"),
        ):
            with pytest.raises(RolloutDroppedError):
                late()
        assert events(transport.store) == before
        assert not transport.drop_now("never-frozen", snapshot_id="x", version=0)


def test_a_mark_after_the_freeze_moves_the_version_and_stales_the_drop(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        transport.put_now(entry("r", "c1"))
        snapshot = transport.freeze_now("r")
        transport.mark_incomplete_now("r", "c2")
        with TokenTransport.open(store_url) as other:  # another client sees the mark
            after = other.freeze_now("r")
        assert after.incomplete and after.version == snapshot.version + 1
        assert after.snapshot_id == snapshot.snapshot_id
        assert not transport.drop_now("r", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        assert transport.drop_now("r", snapshot_id=after.snapshot_id, version=after.version)


def test_a_put_after_the_freeze_is_refused_and_writes_nothing(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        transport.put_now(entry("r", "c1"))
        transport.begin_call_now("r", "c1")  # its entry is there: no intent written
        snapshot = transport.freeze_now("r")
        assert not snapshot.incomplete
        before = events(transport.store)
        with pytest.raises(RolloutFrozenError, match="frozen"):
            transport.put_now(entry("r", "c2"))
        with pytest.raises(RolloutFrozenError):
            transport.begin_call_now("r", "c3")
        assert not transport.put_now(entry("r", "c1"))  # the identical entry: already there, a no-op
        assert events(transport.store) == before
        assert transport.drop_now("r", snapshot_id=snapshot.snapshot_id, version=snapshot.version)


def test_an_intent_without_its_entry_masks_the_rollout(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        transport.begin_call_now("r", "c1")
        transport.begin_call_now("r", "c2")
        transport.put_now(entry("r", "c1"))
        assert transport.freeze_now("r").incomplete  # c2 was dispatched, its entry never came
        transport.begin_call_now("s", "c1")
        transport.put_now(entry("s", "c1"))
        assert not transport.freeze_now("s").incomplete


# --- bad input: a specific error from the store's tree, nothing written -------------------------


def entry_json(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = entry("bad", "c1").model_dump(mode="json")
    data.update(changes)
    return data


BAD_PUTS = {
    "not an entry": (42, InvalidRecordError),
    "no rollout id": ({"model_call_id": "c"}, InvalidRecordError),
    "empty call id": (entry_json(model_call_id=""), InvalidRecordError),
    "lone surrogate": (entry_json(model_call_id="c\ud800"), InvalidRecordError),
    "negative token id": (entry_json(prompt_token_ids=[-1, 2]), InvalidRecordError),
    "token id past u64": (entry_json(generation_token_ids=[2**64] * 4), InvalidRecordError),
    "log-probs short": (entry_json(generation_log_probs=[-0.1]), InvalidRecordError),
    "log-prob not a number": (entry_json(generation_log_probs=[float("nan")] * 4), InvalidRecordError),
    "a bool for an id": (entry_json(prompt_token_ids=[True]), InvalidRecordError),
    "newer schema": (entry_json(schema_version=2), InvalidRecordError),
    "cum_len wrong": (entry_json(cum_len=3), InvalidRecordError),
    "digest not hex": (entry_json(digest="xyz"), InvalidRecordError),
    "digest of other tokens": (entry_json(digest=compute_digest([1, 2, 3])), DigestMismatchError),
    "delta without parent": (entry_json(prompt_is_delta=True, parent_call_id=None), InvalidRecordError),
    # Fields Gym's model types: an entry put must read back as Gym's TokenEntry at the freeze.
    "created_at not a number": (entry_json(created_at=float("nan")), InvalidRecordError),
    "token_item_index past output_items": (entry_json(token_item_index=5), InvalidRecordError),
    "unknown parent_resolution": (entry_json(parent_resolution="maybe"), InvalidRecordError),
    "resolved without parent": (entry_json(parent_resolution="resolved", parent_call_id=None), InvalidRecordError),
    "root naming a parent": (entry_json(parent_resolution="root", parent_call_id="c0"), InvalidRecordError),
    "output_items not objects": (entry_json(output_items=[1]), InvalidRecordError),
    "model not text": (entry_json(model=3), InvalidRecordError),
}


@pytest.mark.parametrize("case", sorted(BAD_PUTS))
def test_bad_input_is_refused_with_a_specific_error_and_nothing_written(store_url: str, case: str) -> None:
    value, error = BAD_PUTS[case]
    with TokenTransport.open(store_url) as transport:
        transport.put_now(entry("bad", "c0"))
        before = events(transport.store)
        with pytest.raises(error):
            transport.put_now(value)
        with pytest.raises(error):
            asyncio.run(transport.put(value))
        assert events(transport.store) == before


def test_a_different_entry_for_a_call_is_a_conflict_and_writes_nothing(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        first = entry("r", "c1", seed=1)
        assert transport.put_now(first)
        before = events(transport.store)
        rebuilt = entry("r", "c1", seed=1)
        rebuilt.created_at += 1  # a rebuilt entry, not a retry: Gym says it must fail
        with pytest.raises(EntryConflictError, match="different entry"):
            transport.put_now(rebuilt)
        assert not transport.put_now(TokenEntry.model_validate(first.model_dump(mode="json")))  # a retry
        assert events(transport.store) == before
        [held] = transport.freeze_now("r").entries
        assert held.model_dump(mode="json") == first.model_dump(mode="json")


def test_bad_arguments_of_the_other_calls(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        before = events(transport.store)
        with pytest.raises(InvalidRecordError):
            transport.begin_call_now("", "c")
        with pytest.raises(InvalidRecordError):
            transport.mark_incomplete_now("r", None)  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            transport.freeze_now(7)  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            transport.drop_now("r", snapshot_id="s", version=True)
        with pytest.raises(InvalidRecordError):
            transport.drop_now("r", snapshot_id=None, version=1)  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            transport.resolve_now("r", "not a list")  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            TokenTransport("a path")  # type: ignore[arg-type]
        assert events(transport.store) == before


def test_a_retired_capture_key_refuses_transport_writes(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        transport.put_now(entry("r", "c1"))
        transport.store.retire(["r"])
        before = events(transport.store)
        with pytest.raises(RolloutFencedError):
            transport.put_now(entry("r", "c2"))
        with pytest.raises(RolloutFencedError):
            transport.put_now(entry("r", "c1"))  # even the identical entry, as an identical re-stage
        with pytest.raises(RolloutFencedError):
            transport.mark_incomplete_now("r")
        with pytest.raises(RolloutFencedError):
            transport.freeze_now("r")
        assert events(transport.store) == before


# --- the token digest, the resolver --------------------------------------------------------------


def test_token_digest_is_gyms_compute_digest() -> None:
    import random

    generator = random.Random(7)
    for length in [0, 1, 2, 5, 100, 1000]:
        ids = [generator.randrange(2**64 if length % 2 else 200_000) for _ in range(length)]
        assert token_digest(ids) == compute_digest(ids)


def test_resolve_reads_a_delta_chain_and_never_guesses(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        root = make_entry("r", "c1", seed=1, tokens=6)
        transport.put_now(root)
        history = [*REQUEST, *root.output_items, {"role": "user", "content": "more"}]
        child = TokenEntry(
            rollout_id="r",
            model_call_id="c2",
            prompt_token_ids=[7, 8],  # only the suffix after the parent's tokens
            generation_token_ids=[9],
            generation_log_probs=[-0.5],
            output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]}],
            prompt_is_delta=True,
            parent_call_id="c1",
            parent_resolution=ParentResolutionStatus.RESOLVED,
        )
        stamp_continuation(child, history)
        cumulative = [*root.prompt_token_ids, *root.generation_token_ids, 7, 8, 9]
        stamp_lineage(child, "c1", parent_resolution=ParentResolutionStatus.RESOLVED, cumulative=cumulative)
        transport.put_now(child)
        follow = [*history, *child.output_items, {"role": "user", "content": "again"}]
        resolution = asyncio.run(transport.resolve("r", follow))
        assert resolution.status == ParentResolutionStatus.RESOLVED
        assert resolution.match.model_call_id == "c2"
        assert list(resolution.match.cumulative_token_ids) == cumulative
        # A sibling with the same output and context but other tokens: two candidates, no guess.
        twin = make_entry("r", "c3", seed=2, tokens=6)
        twin.output_items = root.output_items
        stamp_continuation(twin, list(REQUEST))
        stamp_lineage(twin, None, parent_resolution=ParentResolutionStatus.ROOT)
        transport.put_now(twin)
        assert transport.resolve_now("r", history).status == ParentResolutionStatus.UNRESOLVED
        assert transport.resolve_now("other", history).status == ParentResolutionStatus.UNRESOLVED
        snapshot = transport.freeze_now("r")
        transport.drop_now("r", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        assert transport.resolve_now("r", follow).status == ParentResolutionStatus.UNRESOLVED  # dropped


# --- the log: replay, audit, delete, shipping, damage -------------------------------------------


def test_replay_audit_and_delete_cover_the_transport_events(store_url: str) -> None:
    with TokenTransport.open(store_url) as transport:
        store = transport.store
        for rollout in ("a", "b"):
            transport.begin_call_now(rollout, "c9")
            transport.put_now(entry(rollout, "c1"))
            transport.mark_incomplete_now(rollout, "c2")
        snapshot = transport.freeze_now("a")
        transport.drop_now("a", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        report = store.replay()
        assert report.ok and report.events == 8
        assert store.audit().ok
        assert store.delete(["a"]).removed == ["a"]
        assert store.replay().ok and store.audit().ok
        assert transport.freeze_now("a").entries == ()  # the id starts afresh after a delete
        assert [e.model_call_id for e in transport.freeze_now("b").entries] == ["c1"]


def test_a_damaged_payload_is_corruption_on_every_read(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    with TokenTransport.open(path) as transport:
        transport.put_now(entry("r", "c1"))
    import sqlite3

    with sqlite3.connect(path) as connection:
        [(seq, body)] = connection.execute("SELECT seq, body FROM events WHERE kind = 'tokens_put'").fetchall()
        damaged = body.replace(b"-0.1", b"-0.2", 1)  # one log-prob of the payload
        assert damaged != body
        connection.execute("UPDATE events SET body = ? WHERE seq = ?", (damaged, seq))
    with TokenTransport.open(path) as transport:
        with pytest.raises(CorruptRecordError):
            transport.freeze_now("r")
        report = transport.store.audit()
        assert not report.ok and "checksum" in report.summary()
        assert report.problems_total == 1, report.summary()  # the damage, not also the rows it left out


def test_transport_events_ship_to_another_store(tmp_path: Path, store_url: str) -> None:
    with TokenTransport.open(tmp_path / "source.db") as source, open_store(store_url) as target:
        source.put_now(entry("r", "c1"))
        source.mark_incomplete_now("r", "c2")
        snapshot = source.freeze_now("r")
        assert source.store.ship(target).ok
        assert source.store.ship(target).ok  # again: nothing new
        shipped = TokenTransport(target).freeze_now("r")
        assert (shipped.snapshot_id, shipped.version, shipped.incomplete) == (
            snapshot.snapshot_id,
            snapshot.version,
            True,
        )
        assert [e.model_dump(mode="json") for e in shipped.entries] == [
            e.model_dump(mode="json") for e in snapshot.entries
        ]
        assert target.replay().ok and target.audit().ok


def test_a_shipped_put_that_conflicts_is_refused(tmp_path: Path) -> None:
    with TokenTransport.open(tmp_path / "source.db") as source, TokenTransport.open(tmp_path / "target.db") as target:
        source.put_now(entry("r", "c1", seed=1))
        target.put_now(entry("r", "c1", seed=2))
        report = source.store.ship(target.store)
        assert not report.ok and "different entry" in report.summary()


# --- the store without Gym -----------------------------------------------------------------------


def test_the_store_imports_and_snapshots_without_gym(tmp_path: Path) -> None:
    """``import store`` and the transport never import Gym; without Gym a snapshot holds the JSON
    mappings put (the same payload, byte for byte)."""
    code = (
        "import sys; import store; from store import TokenTransport; import store.transport.transport; "
        "assert 'nemo_gym' not in sys.modules, sorted(m for m in sys.modules if 'nemo' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    data = entry("r", "c1").model_dump(mode="json")
    original = gym_bindings.gym_records
    try:
        gym_bindings.gym_records = lambda: None  # type: ignore[assignment]
        with TokenTransport.open(tmp_path / "store.db") as transport:
            transport.put_now(data)
            snapshot = transport.freeze_now("r")
    finally:
        gym_bindings.gym_records = original  # type: ignore[assignment]
    assert isinstance(snapshot, TokenSnapshot)
    assert list(snapshot.entries) == [data]
    assert json.dumps(data, sort_keys=True) == json.dumps(snapshot.entries[0], sort_keys=True)
    assert hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest() == entry_sha(entry("r", "c1"))
