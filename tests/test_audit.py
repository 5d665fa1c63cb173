"""The store-wide audit (issue 7.3): every planted fault found in one run, a clean store with
cuts and continuations audits ok, progress, and bounded memory."""

from __future__ import annotations

import sqlite3
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import sqlalchemy as sa
from capture_helpers import Versions, continuation_from, damage_token_ids
from factories import make_record

from store import (
    AuditReport,
    CaptureAdmission,
    CommitCoords,
    CorruptRecordError,
    GenerationCutContinuation,
    GenerationCutInventory,
    GenerationCutPrefix,
    InvalidRecordError,
    RolloutTokenCapture,
    StagedCallRecord,
    StageEntry,
    Store,
    capture_key,
    compute_chain_hash,
    from_json,
    hash_token_ids,
    open_store,
    to_json,
)
from store.log.checksum import event_checksum
from store.log.events import AdmissionBody, EventKind, decode_body, encode_body


@dataclass
class Scenario:
    """Rollout r0: root c0, child c1 cut at checkpoint-1 and continued by attempt 1 (r0-a1),
    and plain records staged directly (p0..p2)."""

    root: CommitCoords
    continued: CommitCoords
    cut_keys: tuple[str, ...]


def build(store: Store) -> Scenario:
    versions = Versions(4)
    capture = RolloutTokenCapture(store=store, weight_version_fn=versions)
    try:
        root_call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text"))
        root = capture.complete_call(
            root_call, prompt_token_ids=[10, 11], generated_token_ids=[12], generated_logprobs=[-0.25]
        )

        def child(rollout_id: str, cont: GenerationCutContinuation | None = None) -> CaptureAdmission:
            return CaptureAdmission(
                rollout_id=rollout_id,
                model_call_id="c1",
                parent_call_id="c0",
                prev_len=3,
                mode="token_in",
                required_prefix_token_ids=[10, 11, 12],
                parent_chain_hash=root.chain_hash,
                generation_cut=cont,
            )

        live = capture.begin_call(child("r0"))
        capture.track(live, prompt_token_ids=[10, 11, 12, 20, 21], effective_output_limit=16)
        capture.observe(live, [30, 31], [-0.5, -0.75])
        prefixes = [
            GenerationCutPrefix(ticket_id="t", rollout_id="r0", attempt_index=0, model_call_id="c1", admitted_at=1.0)
        ]
        receipt = capture.serve_generation_cut(
            GenerationCutInventory.build(checkpoint_id="checkpoint-1", server_name="policy", active_prefixes=prefixes)
        )
        [ack] = receipt.prefixes
        versions.value = 5
        continuation = continuation_from(ack)
        resumed = capture.begin_call(child(capture_key("r0", 1), continuation))
        assert resumed.continuation is not None
        continued = capture.complete_call(
            resumed,
            prompt_token_ids=resumed.continuation.engine_prompt_token_ids,
            generated_token_ids=[32, 33],
            generated_logprobs=[-0.125, -0.25],
        )
        capture.fail_call(
            capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c9", mode="text")), reason="x"
        )
    finally:
        capture.close()
    parent = make_record(rollout_id="p0", model_call_id="c0")
    kid = make_record(
        rollout_id="p0",
        model_call_id="c1",
        parent_call_id="c0",
        parent_chain_hash=parent.chain_hash,
        prefix=[*parent.token_ids_delta],
        prompt=[40],
        generated=[41, 42],
    )
    for record in (parent, kid, make_record(rollout_id="p1"), make_record(rollout_id="p2")):
        assert store.stage(record).ok
    return Scenario(root, continued, tuple(ack.staging_keys))


def test_a_clean_store_with_cuts_and_continuations_audits_ok(store: Store) -> None:
    build(store)
    report = store.audit()
    assert report.ok, report.summary()
    assert report.problems == () and report.problems_total == 0
    counts = report.counts
    assert counts["events"] == store.replay().events
    assert counts["records"] == counts["chains"] == 7
    assert counts["continuations"] == 1 and counts["resumed_records"] == 1
    assert counts["leaves"] == 2  # r0-a1/c1 (its parent in attempt 0) and p0/c1
    assert "unverifiable" not in counts
    assert "audit ok" in report.summary()


# --- planting faults ------------------------------------------------------------------------------


def _row(connection: sa.Connection, where: str, **params: Any) -> dict[str, Any]:
    row = connection.execute(sa.text(f"SELECT * FROM events WHERE {where}"), params).one()
    return {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in row._mapping.items()}


def rewrite_event(store: Store, seq: int, **changes: Any) -> None:
    """Change stored columns of an event and re-checksum it: a forgery the checksum cannot see."""
    with store._engine.begin() as connection:
        values = {**_row(connection, "seq = :seq", seq=seq), **changes}
        values["checksum"] = event_checksum(values)
        assignments = ", ".join(f"{name} = :{name}" for name in [*changes, "checksum"])
        connection.execute(sa.text(f"UPDATE events SET {assignments} WHERE seq = :seq"), values)


def event_of(store: Store, where: str, **params: Any) -> dict[str, Any]:
    with store._engine.connect() as connection:
        return _row(connection, where, **params)


def execute(store: Store, sql: str, **params: Any) -> None:
    with store._engine.begin() as connection:
        connection.execute(sa.text(sql), params)


def test_the_audit_finds_every_planted_fault_in_one_run_and_the_rest_still_serves(store: Store) -> None:
    scenario = build(store)
    for rollout_id in ("q1", "q2", "q3", "q4"):
        assert store.stage(make_record(rollout_id=rollout_id)).ok
    planted: dict[str, tuple[str, Any]] = {}

    # Damaged token bytes.
    damage_token_ids(store, "q1/call-1")
    planted["checksum"] = ("q1/call-1", event_of(store, "staging_key = 'q1/call-1'")["seq"])
    # A damaged body (bytes flipped) and a body edited consistently (re-checksummed): its digest fails.
    q2 = event_of(store, "staging_key = 'q2/call-1'")
    execute(store, "UPDATE events SET body = :body WHERE seq = :seq", body=q2["body"][:-1] + b"\xff", seq=q2["seq"])
    q3 = event_of(store, "staging_key = 'q3/call-1'")
    forged = msgspec.structs.replace(decode_body(EventKind.CALL_COMPLETED, q3["body"]), weight_version=99)
    rewrite_event(store, q3["seq"], body=encode_body(forged))
    planted["digest"] = ("q3/call-1", q3["seq"])
    # A staged key pointing at another record (p1's key at p2's event).
    p2 = event_of(store, "staging_key = 'p2/call-1'")
    execute(
        store,
        "UPDATE staged_keys SET event_seq = :seq, rollout_id = 'p2', digest = :digest WHERE staging_key = 'p1/call-1'",
        seq=p2["seq"],
        digest=decode_body(EventKind.CALL_COMPLETED, p2["body"]).digest,
    )
    planted["staged_key"] = ("p1/call-1", p2["seq"])
    # A broken chain and a wrong parent length, each a record with a valid digest.
    parent = make_record(rollout_id="b0", model_call_id="c0")
    prefix = [*parent.token_ids_delta]
    broken = make_record(
        rollout_id="b0", model_call_id="c1", parent_call_id="c0", parent_chain_hash="ab" * 32, prefix=prefix
    )
    short = make_record(
        rollout_id="b0",
        model_call_id="c2",
        parent_call_id="c0",
        parent_chain_hash=parent.chain_hash,
        prefix=prefix[:-1],
    )
    for record in (parent, broken, short):
        assert store.stage(record).ok
    planted["chain"] = ("b0/c1", event_of(store, "staging_key = 'b0/c1'")["seq"])
    planted["parent_length"] = ("b0/c2", event_of(store, "staging_key = 'b0/c2'")["seq"])
    # A spliced continuation: the continued call's admission now names another call's record as its cut.
    admission = event_of(store, "kind = 'call_admitted' AND rollout_id = :r", r=capture_key("r0", 1))
    body = decode_body(EventKind.CALL_ADMITTED, admission["body"])
    assert isinstance(body, AdmissionBody) and body.generation_cut is not None
    cut = from_json(body.generation_cut, GenerationCutContinuation)
    spliced = msgspec.structs.replace(cut, staging_keys=("p2/call-1",))
    rewrite_event(
        store, admission["seq"], body=encode_body(msgspec.structs.replace(body, generation_cut=to_json(spliced)))
    )
    planted["continuation"] = (None, admission["seq"])
    # A continued call whose record resumed other tokens than the (real) cut its admission names.
    attempt2 = capture_key("r0", 2)
    store.record_admission(
        attempt2,
        "c1",
        AdmissionBody(
            schema_version=2,
            parent_call_id="c0",
            mode="token_in",
            prev_len=3,
            parent_chain_hash=scenario.root.chain_hash,
            weight_version=5,
            generation_cut=body.generation_cut,
            continues=body.continues,
        ),
    )
    resumed_other = make_record(
        rollout_id=attempt2,
        model_call_id="c1",
        parent_call_id="c0",
        parent_chain_hash=scenario.root.chain_hash,
        prefix=[10, 11, 12],
        prompt=[20, 21],
        generated=[39, 38, 37],
    )
    assert store.stage(resumed_other).ok
    spliced_seq = event_of(store, "staging_key = :k", k=f"{attempt2}/c1")["seq"]
    # A projection row edited by hand.
    execute(store, "UPDATE calls SET generated_tokens = 999 WHERE rollout_id = 'p0' AND model_call_id = 'c1'")
    planted["projection"] = (None, None)

    seen: list[tuple[int, int]] = []
    report = store.audit(progress=lambda done, total: seen.append((done, total)))
    assert not report.ok
    by_code: dict[str, list[Any]] = {}
    for problem in report.problems:
        by_code.setdefault(problem.code, []).append(problem)
        assert problem.reason and str(problem)
    assert {"checksum", "digest", "staged_key", "chain", "parent_length", "continuation", "projection"} <= set(by_code)
    for code, (key, seq) in planted.items():
        matches = [p for p in by_code[code] if (key is None or p.staging_key == key) and (seq is None or p.seq == seq)]
        assert matches, f"{code}: {by_code[code]}"
    assert any(p.seq == q2["seq"] and p.code in ("checksum", "undecodable") for p in report.problems)
    [projection] = by_code["projection"]
    assert (projection.rollout_id, projection.model_call_id) == ("p0", "c1") and "generated_tokens" in projection.reason
    assert "the record of key 'p2/call-1'" in by_code["staged_key"][0].reason
    assert "p2" in by_code["continuation"][0].reason
    [resumed] = [p for p in by_code["continuation"] if p.seq == spliced_seq]
    assert "does not start with the cut it continued" in resumed.reason and resumed.staging_key == f"{attempt2}/c1"
    # Nothing unplanted is reported, and everything undamaged still serves.
    faulty = {"q1", "q2", "q3", "p1", "b0", capture_key("r0", 1), attempt2, "p0"}
    assert all(p.rollout_id in faulty or p.staging_key in ("p1/call-1",) for p in report.problems), report.summary()
    keys = ["r0/c0", "p0/c0", "p2/call-1", "q4/call-1", *scenario.cut_keys]
    assert scenario.continued.staging_key is not None
    assert [s.digest for s in store.fetch([*keys, scenario.continued.staging_key])]
    assert seen[-1] == (report.counts["events"], report.counts["events"])


def test_progress_is_called_monotonically_up_to_the_total(store: Store) -> None:
    build(store)
    entries = [StageEntry(make_record(rollout_id=f"m{i}")) for i in range(600)]
    store.stage_all(entries)
    seen: list[tuple[int, int]] = []
    report = store.audit(progress=lambda done, total: seen.append((done, total)))
    assert report.ok, report.summary()
    total = report.counts["events"]
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert len(seen) > 2
    assert all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_progress_must_be_callable(store: Store) -> None:
    with pytest.raises(InvalidRecordError, match="callable"):
        store.audit(progress=42)  # type: ignore[arg-type]


def _big_record(index: int, rng: np.random.Generator, tokens: int = 4096) -> StagedCallRecord:
    ids = rng.integers(0, 150_000, size=tokens).tolist()
    return StagedCallRecord.from_components(
        rollout_id=f"big{index}",
        model_call_id="c0",
        parent_call_id=None,
        mode="text",
        prev_len=0,
        weight_version=1,
        token_ids_delta=ids,
        token_mask_delta=[0.0] * 16 + [1.0] * (tokens - 16),
        generation_log_probs_delta=[0.0] * 16 + [-0.5] * (tokens - 16),
        chain_hash=compute_chain_hash(None, ids),
        cumulative_hash=hash_token_ids(ids),
    )


def test_the_audit_streams_in_bounded_memory(store: Store) -> None:
    """A few hundred 4,096-token records: the audit's peak is a small part of their tokens."""
    rng = np.random.default_rng(7)
    records = 240
    for start in range(0, records, 40):
        store.stage_all([StageEntry(_big_record(i, rng)) for i in range(start, start + 40)])
    token_bytes = records * 4096 * 16  # ids as u64, mask and log-probs as f32, as the audit hashes them
    tracemalloc.start()
    try:
        report = store.audit()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok and report.counts["records"] == records
    assert peak < token_bytes / 4, f"peak {peak} bytes for {token_bytes} bytes of tokens"


def test_audit_report_summary_names_each_problem(store: Store) -> None:
    assert store.stage(make_record(rollout_id="s1")).ok
    damage_token_ids(store, "s1/call-1")
    report = store.audit()
    assert isinstance(report, AuditReport) and not report.ok and report.problems_total == 1
    [problem] = report.problems
    assert problem.code == "checksum" and problem.staging_key == "s1/call-1"
    assert (problem.rollout_id, problem.model_call_id) == ("s1", "call-1")
    assert "[checksum]" in report.summary() and "s1/call-1" in report.summary()


def test_a_child_staged_before_its_parent_is_checked_after_the_pass_and_reported_once(store: Store) -> None:
    parent = make_record(rollout_id="late", model_call_id="c0")
    prefix = [*parent.token_ids_delta]
    good = make_record(
        rollout_id="late", model_call_id="c1", parent_call_id="c0", parent_chain_hash=parent.chain_hash, prefix=prefix
    )
    short = make_record(
        rollout_id="late",
        model_call_id="c2",
        parent_call_id="c0",
        parent_chain_hash=parent.chain_hash,
        prefix=prefix[:-1],
    )
    for record in (good, short, parent):  # both children reach the log before their parent
        assert store.stage(record).ok
    report = store.audit()
    assert report.counts["chains"] == 3 and not report.counts.get("unverifiable")
    assert [(problem.code, problem.model_call_id) for problem in report.problems] == [("parent_length", "c2")]
    assert report.problems_total == 1


def test_replay_reports_an_undecodable_event_and_refuses_to_repair_from_it(store: Store) -> None:
    for rollout_id in ("s1", "s2"):
        assert store.stage(make_record(rollout_id=rollout_id)).ok
    damage_token_ids(store, "s1/call-1")
    seq = event_of(store, "staging_key = 's1/call-1'")["seq"]
    report = store.replay()
    assert not report.ok and [s for s, _ in report.undecodable] == [seq]
    assert report.events == 2 and "could not be decoded" in report.summary()
    with pytest.raises(CorruptRecordError, match="cannot repair"):
        store.replay(repair=True)
    assert store.fetch(["s2/call-1"])[0].rollout_id == "s2"


def test_damage_no_row_read_meets_is_a_storage_problem(tmp_path: Path) -> None:
    """SQLite: a damaged index page is found by the audit's page walk, though every row still reads."""
    path = tmp_path / "store.db"
    with open_store(path) as store:
        for index in range(40):
            assert store.stage(make_record(rollout_id=f"r{index}", model_call_id="c1")).ok
        assert store.audit().ok
    with sqlite3.connect(path) as connection:
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        (root,) = connection.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'sqlite_autoindex_events_1'"
        ).fetchone()
    connection.close()
    data = bytearray(path.read_bytes())
    start = (root - 1) * page_size
    for offset in range(start + page_size // 2, start + page_size - 8, 31):  # the index's cells
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    with open_store(path) as store:
        assert len(store.fetch([f"r{index}/c1" for index in range(40)])) == 40  # rows read by rowid
        report = store.audit()
    assert not report.ok and "storage" in report.codes()
    assert any("sqlite_autoindex_events_1" in p.reason or "page" in p.reason for p in report.problems)
    assert report.problems[0].code == "storage"  # the page walk's problems come first, in a fixed place


def test_the_page_walk_reads_the_audits_snapshot(tmp_path: Path) -> None:
    """SQLite: the page walk's connection and the audit's begin at one snapshot (the write lock
    held meanwhile), so a commit after they began is seen by neither."""
    from store.audit.pages import begin_together

    with open_store(tmp_path / "store.db") as store:
        assert store.stage(make_record(rollout_id="a")).ok
        engine, backend = store._engine, store._backend
        with engine.connect() as audit, engine.connect() as walk:
            assert begin_together(engine, backend, audit, walk)
            assert store.stage(make_record(rollout_id="b")).ok  # commits after both began
            seen = [c.exec_driver_sql("SELECT count(*) FROM events").scalar_one() for c in (audit, walk)]
            audit.rollback()
            walk.rollback()
        assert seen == [1, 1]


def test_an_audit_walks_pages_on_its_own_connection_while_a_writer_holds_the_lock(tmp_path: Path) -> None:
    """The audit waits a moment for the write lock to pin its page walk, then walks its own snapshot."""
    path = tmp_path / "store.db"
    with open_store(path) as store:
        assert store.stage(make_record(rollout_id="a")).ok
        writer = sqlite3.connect(path, isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")
            report = store.audit()
        finally:
            writer.close()
        assert report.ok and report.counts["file_checked"] == 1 and report.counts["records"] == 1
        assert store.audit().counts["file_checked"] == 1


# --- a parent the log never had (issue 22) ---------------------------------------------------------


def test_a_record_whose_parent_the_log_never_had_is_a_problem_named(store: Store) -> None:
    orphan = make_record(
        rollout_id="o", model_call_id="c1", parent_call_id="ghost", parent_chain_hash="a" * 64, prefix=[1, 2, 3]
    )
    assert store.stage(orphan).ok
    assert store.stage(make_record(rollout_id="fine")).ok
    report = store.audit()
    assert not report.ok, report.summary()
    assert [(p.code, p.rollout_id, p.model_call_id) for p in report.problems] == [("missing_parent", "o", "c1")]
    assert "ghost" in report.problems[0].reason and "never" in report.problems[0].reason
    assert not report.counts.get("unverifiable")  # named, not counted as merely unverifiable


def test_a_parent_a_delete_removed_leaves_its_later_child_unverifiable_not_a_problem(store: Store) -> None:
    parent = make_record(rollout_id="d", model_call_id="c0")
    assert store.stage(parent).ok
    assert store.delete(["d"]).removed == ["d"]
    child = make_record(
        rollout_id="d",
        model_call_id="c1",
        parent_call_id="c0",
        parent_chain_hash=parent.chain_hash,
        prefix=[*parent.token_ids_delta],
    )
    assert store.stage(child).ok  # staged after the delete: its parent is gone, and the log says why
    report = store.audit()
    assert report.ok, report.summary()
    assert report.counts["unverifiable"] >= 1 and report.counts["tombstones"] == 1
