"""Retention: fences (retire, forget), delete with tombstones, compaction (issue 8, wire-contract 6.5)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from capture_helpers import continuation_from, event_count, writes_nothing
from factories import make_record
from test_capture import child_admission, make_capture, root_admission, stage_root

from store import (
    GenerationCutContinuation,
    GenerationCutError,
    GenerationCutInventory,
    GenerationCutPrefix,
    InvalidRecordError,
    RolloutFencedError,
    StageEntry,
    Store,
    UnknownKeyError,
    chunk_staging_key,
    open_store,
)
from store.log import schema
from store.log.checksum import event_checksum
from store.log.events import AdmissionBody, EventKind, FailureBody, encode_body

TESTS = os.path.dirname(os.path.abspath(__file__))


def rollout_row(store: Store, rollout_id: str) -> dict[str, Any] | None:
    with store._engine.connect() as connection:
        row = connection.execute(sa.text("SELECT * FROM rollouts WHERE rollout_id = :r"), {"r": rollout_id}).fetchone()
    return None if row is None else dict(row._mapping)


def events_of(store: Store, rollout_id: str) -> list[tuple[int, str]]:
    with store._engine.connect() as connection:
        rows = connection.execute(
            sa.text("SELECT seq, kind FROM events WHERE rollout_id = :r ORDER BY seq"), {"r": rollout_id}
        )
        return [(int(seq), kind) for seq, kind in rows]


def max_seq(store: Store) -> int:
    with store._engine.connect() as connection:
        return int(connection.execute(sa.text("SELECT max(seq) FROM events")).scalar_one())


# --- fences ---------------------------------------------------------------------------------------


def test_retire_refuses_every_later_write_and_keeps_staged_records_readable(store: Store) -> None:
    staged = make_record(rollout_id="r0", model_call_id="c0")
    assert store.stage(staged).ok
    removal = store.retire(["r0", "never-written"])
    assert (removal.removed, removal.absent) == (["r0"], ["never-written"])
    assert store.fetch([staged.staging_key])[0].digest == staged.digest  # still readable
    late = make_record(rollout_id="r0", model_call_id="c1")
    body = AdmissionBody(
        schema_version=2, parent_call_id=None, mode="text", prev_len=0, parent_chain_hash=None, weight_version=1
    )
    ledger = store.ledger()
    with writes_nothing(store, ("r0", "c1")):
        with pytest.raises(RolloutFencedError, match="'r0' was retired") as refused:
            store.stage(late)
        assert refused.value.fence_seq is not None
        with pytest.raises(RolloutFencedError):
            store.stage(staged)  # even an identical re-stage: the fence is named, not a silent ok
        with pytest.raises(RolloutFencedError):
            store.stage_all([StageEntry(make_record(rollout_id="ok-key")), StageEntry(late)])
        with pytest.raises(RolloutFencedError):
            store.record_admission("r0", "c1", body)
        with pytest.raises(RolloutFencedError):
            store.record_failure("r0", "c1", "late")
        with pytest.raises(RolloutFencedError):
            ledger.record_failure("r0", "c1", "worker_capture_failed")
        with pytest.raises(RolloutFencedError):
            store.stage(make_record(rollout_id="never-written"))  # the fence guards a first write too
    assert store.stage(make_record(rollout_id="other")).ok  # other capture keys are untouched
    assert rollout_row(store, "r0") == {
        "rollout_id": "r0",
        "state": "retired",
        "fenced": 1,
        "fence_seq": refused.value.fence_seq,
        "ledger_rows": 0,
        "ledger_failures": 0,
        "deletions": 0,
        "deleted_events": 0,
        "last_seq": refused.value.fence_seq,
    }


def test_retiring_again_is_a_no_op_and_forget_removes_the_fence(store: Store) -> None:
    assert store.stage(make_record(rollout_id="r0", model_call_id="c0")).ok
    store.retire(["r0"])
    before = event_count(store)
    again = store.retire(["r0"])
    assert again.removed == ["r0"] and event_count(store) == before  # nothing written
    forgotten = store.forget(["r0", "unfenced"])
    assert (forgotten.removed, forgotten.absent) == (["r0"], ["unfenced"])
    assert store.stage(make_record(rollout_id="r0", model_call_id="c1")).ok
    assert rollout_row(store, "r0")["state"] == "forgotten"  # type: ignore[index]
    assert store.forget(["r0"]).absent == ["r0"]
    assert store.replay().ok


def test_a_fence_holds_across_reopen(store_url: str) -> None:
    with open_store(store_url) as first:
        first.stage(make_record(rollout_id="r0", model_call_id="c0"))
        first.retire(["r0"])
    with open_store(store_url) as reopened, pytest.raises(RolloutFencedError):
        reopened.stage(make_record(rollout_id="r0", model_call_id="c1"))


_OTHER_PROCESS = """
import sys
sys.path.insert(0, sys.argv[3])
from factories import make_record
from store import RolloutFencedError, open_store
with open_store(sys.argv[1]) as store:
    if sys.argv[2] == "retire":
        print("RETIRED", store.retire(["r0"]).removed)
    else:
        try:
            store.stage(make_record(rollout_id="r0", model_call_id=sys.argv[2]))
            print("STAGED")
        except RolloutFencedError as exc:
            print("REFUSED", exc)
"""


def _other_process(url: str, action: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, url, action, TESTS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_fence_holds_across_processes_sharing_the_store(store: Store, store_url: str) -> None:
    assert "STAGED" in _other_process(store_url, "c0")
    assert "RETIRED ['r0']" in _other_process(store_url, "retire")  # another process sets the fence
    with pytest.raises(RolloutFencedError):  # this open handle sees it at once
        store.stage(make_record(rollout_id="r0", model_call_id="c1"))
    store.forget(["r0"])
    store.retire(["r0"])  # and a fence set here refuses the other process's write
    assert "REFUSED capture key 'r0' was retired" in _other_process(store_url, "c2")


def test_a_write_queued_in_the_batch_behind_the_fence_is_refused(store: Store) -> None:
    """retire and a late stage wait in one group-commit batch, retire first: the stage is refused."""
    log = store._log
    release = threading.Event()
    entered = threading.Event()

    def blocking(_tx: Any) -> None:
        entered.set()
        release.wait(30)

    leader = threading.Thread(target=lambda: log.write(blocking))
    leader.start()
    assert entered.wait(30)
    results: dict[str, Any] = {}

    def run(name: str, action: Any) -> None:
        try:
            results[name] = action()
        except Exception as exc:
            results[name] = exc

    retire = threading.Thread(target=run, args=("retire", lambda: store.retire(["r0"])))
    retire.start()
    _wait_for(lambda: len(log._queue) == 1)
    late = make_record(rollout_id="r0", model_call_id="c9")
    stage = threading.Thread(target=run, args=("stage", lambda: store.stage(late)))
    stage.start()
    _wait_for(lambda: len(log._queue) == 2)
    release.set()
    for thread in (leader, retire, stage):
        thread.join(30)
    assert isinstance(results["stage"], RolloutFencedError)
    assert results["retire"].absent == ["r0"]
    with pytest.raises(UnknownKeyError):
        store.fetch([late.staging_key])
    assert store.replay().ok


def _wait_for(condition: Any) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_bad_id_lists_are_refused_whole_and_write_nothing(store: Store) -> None:
    store.stage(make_record(rollout_id="r0"))
    bad: list[Any] = [[], ["r0", "r0"], ["r0", 7], "r0", ["r0", ""], [f"k{i}" for i in range(4097)], None]
    with writes_nothing(store):
        for ids in bad:
            for method in (store.retire, store.forget, store.delete, store.ledger().retire, store.ledger().delete):
                with pytest.raises(InvalidRecordError):
                    method(ids)
    assert len(store.retire([f"k{i}" for i in range(4096)]).absent) == 4096  # the bound itself is fine


# --- the restore scenario (5.2: after a restore, earlier attempts are retired) ---------------------


def test_restore_retires_attempt_n_its_late_write_is_refused_while_attempt_n_plus_1_stages(store: Store) -> None:
    capture, _ = make_capture(store, 7)
    root, prefix = stage_root(capture)  # attempt 0 ("r0") staged its root ...
    cut_call = capture.begin_call(child_admission(root, prefix))
    capture.track(cut_call, prompt_token_ids=[*prefix, 20, 21], effective_output_limit=10)
    capture.observe(cut_call, [30, 31], [-0.5, -0.75])
    ticket = GenerationCutPrefix(ticket_id="t1", rollout_id="r0", attempt_index=0, model_call_id="c1", admitted_at=1.0)
    inventory = GenerationCutInventory.build(checkpoint_id="ck", server_name="policy", active_prefixes=[ticket])
    ack = capture.serve_generation_cut(inventory).prefixes[0]  # ... and a cut of its live call
    assert ack.disposition == "durable_prefix" and ack.prefix_digest is not None
    assert ack.prefix_token_count is not None and ack.effective_output_limit is not None
    # Restore: the replacement attempt "r0-a1" continues the cut; then attempt 0 is retired.
    continuation = GenerationCutContinuation(
        source_capture_key="r0",
        source_model_call_id="c1",
        staging_keys=ack.staging_keys,
        generation_token_count=ack.prefix_token_count,
        digest=ack.prefix_digest,
        effective_output_limit=ack.effective_output_limit,
    )
    replacement = capture.begin_call(child_admission(root, prefix, rollout_id="r0-a1", generation_cut=continuation))
    assert store.retire(["r0"]).removed == ["r0"]
    # The dead attempt's late writes: its cut call completing, a new call, another cut.
    with writes_nothing(store, ("r0", "c2")):
        late = capture.complete_call(  # a sink refusal: the capture answers with failed coords
            cut_call,
            prompt_token_ids=[*prefix, 20, 21],
            generated_token_ids=[30, 31, 32],
            generated_logprobs=[-0.5, -0.75, -0.1],
        )
        assert late.disposition == "capture_failed"
        with pytest.raises(RolloutFencedError):
            capture.begin_call(root_admission("r0", "c2"))
    # Attempt 1 stages as usual, continuing the retired attempt's (still readable) cut.
    assert replacement.continuation is not None
    coords = capture.complete_call(
        replacement,
        prompt_token_ids=list(replacement.continuation.engine_prompt_token_ids),
        generated_token_ids=[40],
        generated_logprobs=[-0.3],
    )
    assert coords.disposition == "staged" and coords.staging_key is not None
    assert store.fetch([coords.staging_key])[0].rollout_id == "r0-a1"
    assert store.audit().ok and store.replay().ok
    # Once nothing can still write, attempt 0 is deleted; the audit explains the gap.
    assert store.delete(["r0"]).removed == ["r0"]
    report = store.audit()
    assert report.ok, report.summary()
    assert report.counts["tombstones"] == 1 and report.counts["continuations_of_deleted"] == 1
    assert store.replay().ok


# --- delete ------------------------------------------------------------------------------------------


def _stage_rollout(store: Store, rollout_id: str, calls: int = 3, tokens: int = 64) -> list[str]:
    keys = []
    for index in range(calls):
        record = make_record(
            rollout_id=rollout_id,
            model_call_id=f"c{index}",
            prompt=tuple(range(tokens)),
            generated=tuple(range(tokens, 2 * tokens)),
        )
        assert store.stage(record).ok
        keys.append(record.staging_key)
    return keys


def test_delete_removes_events_and_projection_rows_and_leaves_a_tombstone(store: Store) -> None:
    keys = _stage_rollout(store, "r0")
    kept = _stage_rollout(store, "r1")
    store.retire(["r0"])
    high = max_seq(store)
    removal = store.delete(["r0", "unknown"])
    assert (removal.removed, removal.absent) == (["r0"], ["unknown"])
    with pytest.raises(UnknownKeyError):
        store.fetch(keys[:1])
    assert store.calls("r0") == []
    assert [seq for seq, kind in events_of(store, "r0") if kind not in ("rollout_retired", "rollout_deleted")] == []
    tombstones = [seq for seq, kind in events_of(store, "r0") if kind == EventKind.ROLLOUT_DELETED.value]
    assert tombstones == [high + 1]  # newer than everything it removed: the high-water mark stands
    assert [s.digest for s in store.fetch(kept)] == [s.digest for s in store.fetch(kept)]
    row = rollout_row(store, "r0")
    assert row is not None and (row["state"], row["fenced"], row["deletions"]) == ("deleted", 0, 1)
    assert row["deleted_events"] == 3
    compacted = store.compact()  # SQLite: incremental vacuum; PostgreSQL: VACUUM events
    assert compacted.bytes_after <= compacted.bytes_before
    assert store.replay().ok
    report = store.audit()
    assert report.ok, report.summary()
    assert (report.counts["tombstones"], report.counts["deleted_events"]) == (1, 3)
    # The fence went with the delete: the id can be reused, and sequence numbers never go back.
    assert store.stage(make_record(rollout_id="r0", model_call_id="c0")).ok
    assert max(seq for seq, _ in events_of(store, "r0")) > high + 1
    assert store.delete(["r0"]).removed == ["r0"] and store.delete(["r0"]).absent == ["r0"]
    assert store.replay().ok and store.audit().ok


def test_audit_names_a_delete_that_left_events_behind(store: Store) -> None:
    _stage_rollout(store, "r0", calls=2)
    store.delete(["r0"])
    assert store.audit().ok
    # Put a removed event back, intact (what a botched delete or a partly restored backup leaves).
    stored: dict[str, Any] = {
        "rollout_id": "r0",
        "model_call_id": "c0",
        "stream_version": 9,
        "kind": EventKind.CALL_FAILED.value,
        "staging_key": None,
        "writer_pid": 1,
        "recorded_at": 1.0,
        "body": encode_body(FailureBody(reason="ghost")),
        "token_ids": None,
        "token_mask": None,
        "log_probs": None,
    }
    stored["checksum"] = event_checksum(stored)
    with store._engine.begin() as connection:
        connection.execute(sa.insert(schema.events).values(seq=1, **stored))
    report = store.audit()
    assert "tombstone" in report.codes(), report.summary()
    [problem] = [p for p in report.problems if p.code == "tombstone"]
    assert problem.rollout_id == "r0" and "left 1 event(s)" in problem.reason


def test_delete_gives_the_space_back_after_compaction(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "space.db")
    with open_store(path) as store:
        keep = _stage_rollout(store, "keep", calls=4, tokens=2048)
        for index in range(20):
            _stage_rollout(store, f"r{index}", calls=4, tokens=2048)
        store.compact()
        full = os.path.getsize(path)
        store.delete([f"r{index}" for index in range(20)])
        report = store.compact()
        assert not report.converted
        after = os.path.getsize(path)
        assert not os.path.exists(path + "-wal") or os.path.getsize(path + "-wal") == 0
        # 20 of 21 rollouts went: the file is well under a fifth of its size.
        assert after < full / 5, (full, after)
        assert report.reclaimed > 0
        assert len(store.fetch(keep)) == 4 and store.audit().ok and store.replay().ok


def test_compact_converts_a_store_created_without_incremental_vacuum(tmp_path: Any) -> None:
    import sqlite3

    path = os.path.join(tmp_path, "old.db")
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")  # an older store: auto_vacuum NONE
    connection.close()
    with open_store(path) as store:
        _stage_rollout(store, "r0", calls=4, tokens=2048)
        store.delete(["r0"])
        assert store.compact().converted
        assert not store.compact().converted
    assert sqlite3.connect(path).execute("PRAGMA auto_vacuum").fetchone() == (2,)


# --- retain ------------------------------------------------------------------------------------------


def _cut(store: Store, rollout_id: str, call_id: str, checkpoint: str) -> str:
    key = chunk_staging_key(checkpoint, rollout_id, call_id, 0)
    record = make_record(rollout_id=rollout_id, model_call_id=call_id, generated=(40, 41, len(checkpoint)))
    assert store.stage(record, staging_key=key, kind=EventKind.PREFIX_STAGED).ok
    return key


def test_retain_keeps_exactly_the_retain_set_of_the_capture_keys_in_scope(store: Store) -> None:
    terminal = make_record(rollout_id="r0", model_call_id="c0")
    store.stage(terminal)
    old_cut, kept_cut = _cut(store, "r0", "c1", "ck1"), _cut(store, "r0", "c2", "ck2")
    other = _cut(store, "r1", "c1", "ck1")  # another capture key: out of scope
    store.retire(["r0"])  # retired: the framework's own cleanup still works
    removal = store.retain([terminal.staging_key, kept_cut, "r0/never-staged"])
    assert (removal.removed, removal.absent) == ([old_cut], ["r0/never-staged"])
    with pytest.raises(UnknownKeyError):
        store.fetch([old_cut])
    assert len(store.fetch([terminal.staging_key, kept_cut, other])) == 3
    assert store.retain([terminal.staging_key, kept_cut]).removed == []  # again: nothing to do
    # r1's c1 has staged only a prefix (it is still decoding): its cut keys stay.
    assert store.retain([], capture_keys=["r1"]).removed == []
    finished = make_record(rollout_id="r1", model_call_id="c1")
    store.stage(finished)
    # An explicit scope drops every key of a capture key the set does not name.
    assert store.retain([], capture_keys=["r1"]).removed == [other, finished.staging_key]
    assert store.replay().ok and store.audit().ok
    with writes_nothing(store), pytest.raises(InvalidRecordError):
        store.retain(["ok", 7])  # type: ignore[list-item]


def test_retain_never_withdraws_the_cut_keys_of_a_call_still_decoding(store: Store) -> None:
    """A retain set that leaves out a live call's chunks (computed before its latest cut) must
    not withdraw them: the call's next receipt names them again, and they must still fetch."""
    capture, _ = make_capture(store, 7)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    capture.track(call, prompt_token_ids=[*prefix, 20, 21], effective_output_limit=10)
    ticket = GenerationCutPrefix(ticket_id="t1", rollout_id="r0", attempt_index=0, model_call_id="c1", admitted_at=1.0)

    def cut(checkpoint_id: str) -> list[str]:
        inventory = GenerationCutInventory.build(
            checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=[ticket]
        )
        (ack,) = capture.serve_generation_cut(inventory).prefixes
        assert ack.cut_kind == "active_prefix"
        return list(ack.staging_keys)

    capture.observe(call, [30, 31], [-0.5, -0.75])
    first = cut("ck1")
    removal = store.retain([root.staging_key], capture_keys=["r0"])
    assert removal.removed == []
    capture.observe(call, [32], [-0.125])
    second = cut("ck2")
    assert set(first) <= set(second)
    assert len(store.fetch_chunks(second)) == len(second)  # every acknowledged key still fetches
    # Once the call has ended, what the retain set leaves out goes.
    generated, logprobs = [30, 31, 32], [-0.5, -0.75, -0.125]
    capture.complete_call(
        call, prompt_token_ids=[*prefix, 20, 21], generated_token_ids=generated, generated_logprobs=logprobs
    )
    kept = [info.staging_key for info in store.staged_keys("r0") if not info.staging_key.startswith("__")]
    assert set(store.retain(kept, capture_keys=["r0"]).removed) == set(second)
    assert store.audit().ok


def test_retain_keeps_the_cut_keys_a_later_attempt_still_builds_on(store: Store) -> None:
    """Attempt 1 continues attempt 0's cut; attempt 0 is retired and its retain set leaves the cut
    out.  Attempt 1 is still decoding: its receipts name that key again (its durable prefix starts
    with it), so the key stays until attempt 1's call ends or attempt 1 is retired.  (Found by the
    state machine: a later cut acknowledged a key that no longer fetched, and its restore failed.)"""
    capture, _ = make_capture(store, 7)
    root, prefix = stage_root(capture)
    cut_call = capture.begin_call(child_admission(root, prefix))
    capture.track(cut_call, prompt_token_ids=[*prefix, 20, 21], effective_output_limit=10)
    capture.observe(cut_call, [30, 31], [-0.5, -0.75])

    def cut(checkpoint_id: str, rollout_id: str, attempt: int) -> GenerationCutContinuation:
        ticket = GenerationCutPrefix(
            ticket_id="t1", rollout_id=rollout_id, attempt_index=attempt, model_call_id="c1", admitted_at=1.0
        )
        inventory = GenerationCutInventory.build(
            checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=[ticket]
        )
        (ack,) = capture.serve_generation_cut(inventory).prefixes
        assert ack.cut_kind == "active_prefix"
        assert len(store.fetch_chunks(list(ack.staging_keys))) == len(ack.staging_keys)  # acknowledged: they fetch
        return continuation_from(ack)

    first = cut("ck1", "r0", 0)
    (inherited,) = first.staging_keys
    replacement = capture.begin_call(child_admission(root, prefix, rollout_id="r0-a1", generation_cut=first))
    assert replacement.continuation is not None
    capture.track(
        replacement, prompt_token_ids=list(replacement.continuation.engine_prompt_token_ids), effective_output_limit=10
    )
    assert store.retire(["r0"]).removed == ["r0"]
    # Attempt 0's retain set: its terminal key only.  The cut key stays: attempt 1 builds on it.
    removal = store.retain([root.staging_key], capture_keys=["r0"])
    assert inherited not in removal.removed
    capture.observe(replacement, [32], [-0.125])
    second = cut("ck2", "r0", 1)
    assert second.staging_keys[0] == inherited
    # Attempt 1 dies; attempt 2 restores its cut, which starts with attempt 0's key.
    again = capture.begin_call(child_admission(root, prefix, rollout_id="r0-a2", generation_cut=second))
    assert again.continuation is not None
    assert list(again.continuation.restored_token_ids) == [30, 31, 32]
    assert store.audit().ok
    # Attempts 1 and 2 both build on the key: it goes only once neither still does.
    assert store.retire(["r0-a1"]).removed == ["r0-a1"]
    assert inherited not in store.retain([root.staging_key], capture_keys=["r0"]).removed
    capture.complete_call(
        again,
        prompt_token_ids=list(again.continuation.engine_prompt_token_ids),
        generated_token_ids=[40],
        generated_logprobs=[-0.3],
    )
    assert store.retain([root.staging_key], capture_keys=["r0"]).removed == [inherited]
    report = store.audit()
    assert report.ok, report.summary()
    assert store.replay().ok


def test_a_cut_never_acknowledges_a_key_that_no_longer_holds_its_record(store: Store) -> None:
    """Attempt 0 is deleted while attempt 1 still decodes on its cut (the contract says delete once
    nothing can write; this is the misuse).  Attempt 1's next cut would name attempt 0's key: the
    cut is refused and writes nothing, instead of acknowledging a prefix no restore can fetch."""
    capture, _ = make_capture(store, 7)
    root, prefix = stage_root(capture, rollout_id="r9")
    cut_call = capture.begin_call(child_admission(root, prefix))
    capture.track(cut_call, prompt_token_ids=[*prefix, 20, 21], effective_output_limit=10)
    capture.observe(cut_call, [30, 31], [-0.5, -0.75])

    def inventory(checkpoint_id: str, attempt: int) -> GenerationCutInventory:
        ticket = GenerationCutPrefix(
            ticket_id="t1", rollout_id="r9", attempt_index=attempt, model_call_id="c1", admitted_at=1.0
        )
        return GenerationCutInventory.build(checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=[ticket])

    (ack,) = capture.serve_generation_cut(inventory("ck1", 0)).prefixes
    replacement = capture.begin_call(
        child_admission(root, prefix, rollout_id="r9-a1", generation_cut=continuation_from(ack))
    )
    assert replacement.continuation is not None
    capture.track(
        replacement, prompt_token_ids=list(replacement.continuation.engine_prompt_token_ids), effective_output_limit=10
    )
    assert store.delete(["r9"]).removed == ["r9"]
    capture.observe(replacement, [32], [-0.125])
    later = inventory("ck2", 1)
    with writes_nothing(store), pytest.raises(GenerationCutError, match="holds no record"):
        capture.serve_generation_cut(later)
    assert store.cut_receipt(later.checkpoint_id, later.inventory_digest) is None
    with writes_nothing(store), pytest.raises(InvalidRecordError):
        store.stage_all([], acknowledged="r9/c0")  # type: ignore[arg-type]  # one string is not a list


def test_serving_a_cut_of_a_retired_capture_key_is_refused_and_stages_nothing(store: Store) -> None:
    capture, _ = make_capture(store, 7)
    root, prefix = stage_root(capture)
    call = capture.begin_call(child_admission(root, prefix))
    capture.track(call, prompt_token_ids=[*prefix, 20, 21], effective_output_limit=10)
    capture.observe(call, [30, 31], [-0.5, -0.75])
    store.retire(["r0"])
    ticket = GenerationCutPrefix(ticket_id="t1", rollout_id="r0", attempt_index=0, model_call_id="c1", admitted_at=1.0)
    inventory = GenerationCutInventory.build(checkpoint_id="ck", server_name="policy", active_prefixes=[ticket])
    with writes_nothing(store), pytest.raises(GenerationCutError, match="'r0' was retired"):
        capture.serve_generation_cut(inventory)


def test_failing_a_call_of_a_retired_capture_key_logs_one_line_and_writes_nothing(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """After a restore retired the attempt, its worker failing a call is expected: the coords
    say failed, the fence refuses the failure event, and the log says so without a trace."""
    capture, _ = make_capture(store, 7)
    call = capture.begin_call(root_admission())
    store.retire(["r0"])
    with writes_nothing(store), caplog.at_level("WARNING", logger="store"):
        coords = capture.fail_call(call, reason="engine died")
    assert coords.disposition == "capture_failed"
    refused = [record for record in caplog.records if "was not recorded" in record.getMessage()]
    assert len(refused) == 1 and refused[0].exc_info is None and "retired" in refused[0].getMessage()
