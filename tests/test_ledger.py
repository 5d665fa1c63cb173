"""The capture ledger (wire-contract 6.5, 3.8-3.10): Gym's ``test_token_capture_ledger.py`` names,
plus retire/delete, receipts from a manifest, and bad input."""

from __future__ import annotations

from typing import Any

import pytest
from capture_helpers import event_count, writes_nothing
from rollouts import Rollout, manifest_row

from store import (
    ASSISTANT_FINGERPRINT_VERSION,
    UNRESOLVED_PARENT,
    WORKER_CAPTURE_FAILED,
    CallRecord,
    CaptureLedger,
    CaptureLedgerCommit,
    InvalidRecordError,
    LedgerConflictError,
    RolloutFencedError,
    RolloutManifest,
    Store,
    assistant_fingerprint,
    open_store,
    receipt_from_manifest,
    verify_and_linearize,
)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class Conversation:
    """A staged rollout and the ledger commits Gym writes for it, turn by turn."""

    def __init__(self, store: Store, rollout_id: str = "r0") -> None:
        self.store = store
        self.ledger = store.ledger()
        self.rollout = Rollout(rollout_id)
        self.items: dict[str, list[dict[str, Any]]] = {}  # each call's request + response
        self.chains: dict[str, tuple[str, ...]] = {}

    def commit(
        self, call_id: str, *, parent: str | None = None, reply: str | None = None, record: bool = True
    ) -> CaptureLedgerCommit:
        staged = self.rollout.call(call_id, parent=parent, prompt=[len(self.items) + 1], generated=[50, 51])
        assert self.store.stage(staged).ok
        request = [*self.items[parent], user(f"next {call_id}")] if parent else [user("hello")]
        response = [assistant(reply or f"answer {call_id}")]
        self.items[call_id] = [*request, *response]
        parent_chain = self.chains[parent] if parent else ()
        self.chains[call_id] = (*parent_chain, staged.staging_key)
        commit = CaptureLedgerCommit(
            rollout_id=self.rollout.rollout_id,
            # Stamped with fingerprints as Gym's model server stamps every row it commits.
            record=manifest_row(
                staged,
                admitted_at=float(len(self.items)),
                output_fingerprint=assistant_fingerprint(response),
                continuation_fingerprint=assistant_fingerprint([*request, *response]),
                fingerprint_version=ASSISTANT_FINGERPRINT_VERSION,
            ),
            staging_chain=self.chains[call_id],
            request_items=request,
            response_items=response,
        )
        if record:
            self.ledger.record(commit)
        return commit


# --- Gym test_token_capture_ledger.py --------------------------------------------------------------


def test_ledger_row_round_trips_token_free_manifest(store: Store) -> None:
    talk = Conversation(store)
    root = talk.commit("c0")
    child = talk.commit("c1", parent="c0")
    manifest = talk.ledger.manifest("r0")
    assert manifest == RolloutManifest(rollout_id="r0", records=[root.record, child.record], failures=[])
    assert manifest.records[1].staging_key == child.record.staging_key
    assert "token_ids" not in str(manifest) and "request_items" not in str(manifest)  # token-free


def test_legacy_row_without_admitted_at_still_validates(store: Store) -> None:
    talk = Conversation(store)
    commit = talk.commit("c0", record=False)
    legacy = CaptureLedgerCommit(
        rollout_id="r0",
        record=CallRecord(**{**_fields(commit.record), "admitted_at": None}),
        staging_chain=commit.staging_chain,
    )
    talk.ledger.record(legacy)
    [row] = talk.ledger.manifest("r0").records
    assert row.admitted_at is None and row.digest == commit.record.digest


def test_same_call_commit_is_idempotent_and_conflicts_raise(store: Store) -> None:
    talk = Conversation(store)
    commit = talk.commit("c0")
    before = event_count(store)
    talk.ledger.record(commit)  # identical payload: no-op
    assert event_count(store) == before
    different = CaptureLedgerCommit(
        rollout_id="r0",
        record=CallRecord(**{**_fields(commit.record), "response_id": "another-response"}),
        staging_chain=commit.staging_chain,
    )
    with writes_nothing(store), pytest.raises(LedgerConflictError, match="different commit for call 'c0'"):
        talk.ledger.record(different)
    assert talk.ledger.manifest("r0").records == [commit.record]


def test_failure_rows_poison_and_never_resolve(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    talk.commit("c1", parent="c0")
    talk.ledger.record_failure("r0", "c1", WORKER_CAPTURE_FAILED)
    talk.ledger.record_failure("r0", "c1", WORKER_CAPTURE_FAILED)  # the same failure again: once
    manifest = talk.ledger.manifest("r0")
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [("c1", WORKER_CAPTURE_FAILED)]
    assert receipt_from_manifest(manifest).capture_poisoned
    # A request continuing the failed call does not resolve to it: it is poisoned too.
    request = [*talk.items["c1"], user("more")]
    resolved = talk.ledger.admit("r0", "c2", request)
    assert resolved.admission is None and resolved.failure == UNRESOLVED_PARENT


def test_has_rows_is_false_for_untouched_rollout(store: Store) -> None:
    ledger = store.ledger()
    assert not ledger.has_rows("untouched")
    assert store.stage(Rollout("staged-only").call("c0")).ok
    assert not ledger.has_rows("staged-only")  # staged tokens are not ledger rows
    Conversation(store, "r0").commit("c0")
    assert ledger.has_rows("r0")
    ledger.record_failure("failed-only", "c0", WORKER_CAPTURE_FAILED)
    assert ledger.has_rows("failed-only")


def test_admission_match_is_token_in_with_exact_prefix(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    child = talk.commit("c1", parent="c0")
    resolved = talk.ledger.admit("r0", "c2", [*talk.items["c1"], user("and then?")])
    admission = resolved.admission
    assert resolved.failure is None and admission is not None
    assert (admission.mode, admission.parent_call_id) == ("token_in", "c1")
    assert admission.prev_len == child.record.cum_len
    assert admission.parent_chain_hash == child.record.chain_hash
    assert admission.staging_chain == talk.chains["c1"]
    # The chain names the exact prefix: the staged records concatenate to prev_len tokens.
    snapshots = store.fetch(list(admission.staging_chain))
    assert sum(s.delta_len for s in snapshots) == admission.prev_len


def test_admission_empty_fingerprint_is_text_root(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    resolved = talk.ledger.admit("r0", "c5", [{"role": "system", "content": "s"}, user("fresh start")])
    assert resolved.admission is not None and resolved.admission.mode == "text"
    assert resolved.admission.parent_call_id is None


def test_admission_seeded_history_on_empty_ledger_is_text_root(store: Store) -> None:
    ledger = store.ledger()
    seeded = [user("q"), assistant("a seeded answer"), user("q2")]
    resolved = ledger.admit("r0", "c0", seeded)
    assert resolved.failure is None and resolved.admission is not None
    assert resolved.admission.mode == "text" and not ledger.has_rows("r0")


def test_admission_unresolved_poisons_instead_of_new_root(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    history = [user("hello"), assistant("an answer this ledger never saw"), user("q")]
    resolved = talk.ledger.admit("r0", "c1", history)
    assert resolved.admission is None and resolved.failure == UNRESOLVED_PARENT
    failures = talk.ledger.manifest("r0").failures
    assert [(f.model_call_id, f.reason) for f in failures] == [("c1", UNRESOLVED_PARENT)]


def test_ambiguous_siblings_are_unresolved(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    talk.commit("a", parent="c0", reply="same words")
    talk.commit("b", parent="c0", reply="same words")  # a sibling whose conversation reads alike
    # Only model-authored items are fingerprinted: the two conversations read alike.
    resolved = talk.ledger.admit("r0", "c9", [*talk.items["a"], user("go on")])
    assert resolved.admission is None and resolved.failure == UNRESOLVED_PARENT


def test_commit_ordering_parent_resolvable_only_after_record(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    pending = talk.commit("c1", parent="c0", record=False)  # served, not yet committed
    request = [*talk.items["c1"], user("next")]
    assert talk.ledger.admit("r0", "c2", request).failure == UNRESOLVED_PARENT
    talk.ledger.record(pending)
    resolved = talk.ledger.admit("r0", "c3", request)
    assert resolved.admission is not None and resolved.admission.parent_call_id == "c1"


def test_file_store_cross_handle_visibility(store_url: str) -> None:
    with open_store(store_url) as first, open_store(store_url) as second:
        talk = Conversation(first)
        commit = talk.commit("c0")
        other = second.ledger()  # another handle on the same store sees the commit at once
        assert other.has_rows("r0")
        assert other.manifest("r0").records == [commit.record]
        assert other.admit("r0", "c1", [*talk.items["c0"], user("q")]).admission is not None
        other.retire(["r0"])
        with pytest.raises(RolloutFencedError):
            talk.ledger.manifest("r0")


def test_legacy_lineage_rows_do_not_enter_the_manifest(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    talk.ledger.record_lineage("r0", "legacy", [user("hello")], [assistant("old row")])
    manifest = talk.ledger.manifest("r0")
    assert [row.model_call_id for row in manifest.records] == ["c0"] and manifest.failures == []
    # Nor does it resolve a parent: it has no commit coordinates.
    legacy_history = [user("hello"), assistant("old row"), user("q")]
    assert talk.ledger.admit("r0", "c1", legacy_history).failure == UNRESOLVED_PARENT


# --- retire, delete, receipts -------------------------------------------------------------------------


def test_retire_fences_the_ledger_and_delete_removes_it_and_the_fence(store: Store) -> None:
    talk = Conversation(store)
    commit = talk.commit("c0")
    removal = talk.ledger.retire(["r0", "nobody"])
    assert (removal.removed, removal.absent) == (["r0"], ["nobody"])
    assert not talk.ledger.has_rows("r0")
    with writes_nothing(store):
        with pytest.raises(RolloutFencedError):
            talk.ledger.manifest("r0")  # Gym answers 410, not an empty manifest
        with pytest.raises(RolloutFencedError):
            talk.ledger.record(commit)
        with pytest.raises(RolloutFencedError):
            talk.ledger.record_failure("r0", "c1", WORKER_CAPTURE_FAILED)
    assert store.fetch([commit.record.staging_key])  # staged tokens untouched by the ledger
    removal = talk.ledger.delete(["r0", "nobody", "never-fenced"])
    assert (removal.removed, removal.absent) == (["r0", "nobody"], ["never-fenced"])  # "nobody" had a fence
    assert talk.ledger.manifest("r0").records == [] and not talk.ledger.has_rows("r0")
    assert store.fetch([commit.record.staging_key])  # a ledger delete leaves staged records
    talk.ledger.record(commit)  # the id can be reused
    assert talk.ledger.manifest("r0").records == [commit.record]
    assert store.replay().ok
    report = store.audit()
    assert report.ok and report.counts["tombstones"] == 2, report.summary()  # r0 and nobody


def test_store_delete_removes_the_ledger_too(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    assert store.delete(["r0"]).removed == ["r0"]
    assert not talk.ledger.has_rows("r0") and talk.ledger.manifest("r0").records == []
    assert store.replay().ok and store.audit().ok


def test_receipt_from_a_manifest_verifies_and_linearizes(store: Store) -> None:
    talk = Conversation(store)
    talk.commit("c0")
    talk.commit("c1", parent="c0")
    manifest = talk.ledger.manifest("r0")
    receipt = receipt_from_manifest(manifest, reward=1.0)
    assert (receipt.terminal_model_call_id, receipt.terminal_selection) == ("c1", "heuristic")
    assert not receipt.capture_poisoned
    snapshots = store.fetch([row.staging_key for row in manifest.records])
    row = verify_and_linearize(receipt, snapshots)
    assert list(row.token_ids) == talk.rollout.tokens["c1"]
    empty = receipt_from_manifest(RolloutManifest(rollout_id="r9"))
    assert empty.capture_poisoned and empty.failure_reason == "no_records"


def test_bad_ledger_input_is_refused_and_writes_nothing(store: Store) -> None:
    ledger: CaptureLedger = store.ledger()
    with writes_nothing(store):
        with pytest.raises(InvalidRecordError):
            ledger.record({"rollout_id": "r0"})  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            ledger.record_failure("r0", "", WORKER_CAPTURE_FAILED)
        with pytest.raises(InvalidRecordError):
            ledger.record_failure("r0", "c0", "")
        with pytest.raises(InvalidRecordError):
            ledger.admit("r0", "c0", "not a list")  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            ledger.admit("r0", "c0", [{"role": "assistant", "content": 7}])
        with pytest.raises(InvalidRecordError):
            ledger.manifest(7)  # type: ignore[arg-type]


def _fields(record: CallRecord) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(record)
