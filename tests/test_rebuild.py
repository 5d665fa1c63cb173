"""Rebuild (wire-contract 6.1, 6.2, routed experts of 6.5): the named Gym tests of section 9, each
error code in the contract's order of checks, and properties over random rollouts."""

from __future__ import annotations

import base64
import json
import pickle
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from factories import make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples
from rollouts import Rollout, branched, manifest_row, receipt_for, tampered

from store import (
    EMPTY_EXTRAS_DIGEST,
    MISSING_ROUTE_SENTINEL,
    LinearizedRollout,
    RebuildError,
    ReceiptTypeError,
    ReceiptVerificationError,
    RolloutReceipt,
    SkippedChain,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StoreError,
    compute_chain_hash,
    compute_extras_digest,
    decode_routed_experts,
    encode_routed_experts,
    from_json,
    hash_token_ids,
    linearize,
    to_json,
    verify_and_linearize,
    verify_and_linearize_all,
    with_routed_experts,
)
from store.rebuild.verify import SKIP_ABANDONED_ROOT, SKIP_AMBIGUOUS_LEAF

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rejected(receipt: Any, snapshots: Any) -> str:
    """The code of the ReceiptVerificationError that verification raises."""
    with pytest.raises(ReceiptVerificationError) as error:
        verify_and_linearize(receipt, snapshots)
    return error.value.code


# --- the named tests of section 9 (Gym test_token_capture_staging_rebuild.py) ---------------------


def test_verify_and_linearize_selects_only_terminal_ancestry() -> None:
    receipt, snapshots = branched()
    row = verify_and_linearize(receipt, snapshots)
    assert row.model_call_ids == row.call_ids == ["root", "main"]  # the sibling branch is left out
    assert row.token_ids == [10, 11, 12, 20, 21]
    assert row.token_mask == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert row.logprobs == [0.0, 0.0, -0.5, 0.0, -0.5]
    assert row.prompt_len == 2
    assert row.weight_versions == [3, 4]
    assert row.link_spans == [("root", 2, 1), ("main", 1, 1)]
    assert [(s.model_call_id, s.start, s.end, s.weight_version) for s in row.weight_version_spans] == [
        ("root", 0, 3, 3),
        ("main", 3, 5, 4),
    ]
    assert [(c.model_call_id, c.extras_digest_version, c.extras_digest) for c in row.extras_commitments] == [
        ("root", 1, EMPTY_EXTRAS_DIGEST),
        ("main", 1, EMPTY_EXTRAS_DIGEST),
    ]
    assert (row.rollout_id, row.terminal_model_call_id) == ("rollout-1", "main")
    assert (row.chain_index, row.chain_kind, row.segment_index, row.boundary_parent_call_id) == (0, "terminal", 0, None)
    assert hash_token_ids(row.token_ids) == receipt.manifest[2].cumulative_hash


def test_verification_is_retry_safe_and_deterministic() -> None:
    receipt, snapshots = branched()
    before = [to_json(snapshot) for snapshot in snapshots]
    first = verify_and_linearize(receipt, snapshots)
    assert verify_and_linearize(receipt, snapshots) == first
    assert [to_json(snapshot) for snapshot in snapshots] == before  # inputs untouched
    # Snapshots fetched again (decoded from the wire, as a staging source returns them) give the same row.
    refetched = [from_json(data, StagedCallSnapshot) for data in before]
    assert verify_and_linearize(receipt, refetched) == first
    assert verify_and_linearize(from_json(to_json(receipt), RolloutReceipt), refetched) == first


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("token_ids_delta", [999, 11, 12], "corrupt_digest"),
        ("token_mask_delta", [0.0, 1.0, 1.0], "corrupt_digest"),
        ("generation_log_probs_delta", [0.0, 0.0, -9.0], "corrupt_digest"),
        ("token_mask_delta", [0.0, 0.5, 1.0], "invalid_snapshot"),
        ("generation_log_probs_delta", [0.0, 0.0, float("nan")], "invalid_snapshot"),
        ("weight_version", 8, "wrong_weight_version"),
        ("parent_call_id", "other", "wrong_parent_call_id"),
        ("prev_len", 1, "wrong_prev_len"),
        ("delta_len", 2, "wrong_delta_len"),
        ("cum_len", 99, "wrong_cum_len"),
        ("mode", "token_in", "wrong_mode"),
        ("rollout_id", "rollout-2", "wrong_rollout"),
        ("model_call_id", "other", "snapshot_identity_mismatch"),
        ("digest", "0" * 64, "wrong_digest"),
        ("extras_digest", "0" * 64, "wrong_extras_digest"),
        ("chain_hash", "0" * 64, "wrong_chain_hash"),
        ("cumulative_hash", "0" * 64, "wrong_cumulative_hash"),
        ("schema_version", 999, "wrong_schema_version"),
        ("schema_version", 3, "wrong_schema_version"),
        ("digest_version", 999, "wrong_digest_version"),
        ("extras_digest_version", 999, "wrong_extras_digest_version"),
    ],
)
def test_snapshot_mutation_is_rejected(field: str, value: Any, code: str) -> None:
    receipt, snapshots = branched()
    assert rejected(receipt, [tampered(snapshots[0], **{field: value}), *snapshots[1:]]) == code


def test_extras_mutation_is_rejected() -> None:
    """The verifier never reads extras; a mutated payload fails against the row's commitment at use."""
    rollout = Rollout()
    root = rollout.call(
        "root", prompt=[10, 11], generated=[12], extras={"routed_experts": [[[1, 2]], [[3, 4]], [[5, 6]]]}
    )
    corrupt = tampered(root, extras={"routed_experts": [[[9, 9]]] * 3})
    row = verify_and_linearize(rollout.receipt("root"), [corrupt])  # metadata only: the row itself verifies
    assert row == verify_and_linearize(rollout.receipt("root"), [root])
    with pytest.raises(ReceiptVerificationError) as error:
        with_routed_experts(row, [corrupt])
    assert error.value.code == "corrupt_extras"
    for payload in ({"routed_experts": [[[9, 9]]] * 3}, None, {}, ["not", "a", "mapping"]):
        with pytest.raises(ReceiptVerificationError) as error:
            with_routed_experts(row, {"root": payload})  # type: ignore[dict-item]
        assert error.value.code == "corrupt_extras"
    assert with_routed_experts(row, [root]).routed_experts == [[[1, 2]], [[3, 4]], [[5, 6]]]


@pytest.mark.parametrize(
    ("transform", "code"),
    [
        (lambda rows: rows[:-1], "row_count_mismatch"),
        (lambda rows: [*rows, rows[0]], "row_count_mismatch"),
        (lambda rows: [rows[0], rows[0], rows[2]], "duplicate_snapshot"),
    ],
)
def test_missing_extra_and_duplicate_rows_are_rejected(transform: Any, code: str) -> None:
    receipt, snapshots = branched()
    assert rejected(receipt, transform(snapshots)) == code


def test_snapshot_order_binds_manifest_keys_to_identities() -> None:
    receipt, snapshots = branched()
    assert rejected(receipt, list(reversed(snapshots))) == "snapshot_order_mismatch"
    assert rejected(receipt, [snapshots[1], snapshots[0], snapshots[2]]) == "snapshot_order_mismatch"
    stranger = make_record(model_call_id="stranger")
    assert rejected(receipt, [snapshots[0], snapshots[1], stranger]) == "snapshot_identity_mismatch"


def test_poisoned_failed_and_unsupported_receipts_are_rejected() -> None:
    receipt, snapshots = branched()
    poisoned = RolloutReceipt(
        rollout_id="rollout-1",
        manifest=receipt.manifest,
        capture_poisoned=True,
        terminal_model_call_id="main",
        terminal_selection="declared",
    )
    failed = RolloutReceipt(
        rollout_id="rollout-1", manifest=receipt.manifest, capture_poisoned=True, failure_reason="stage failed"
    )
    cases = [
        (poisoned, "capture_poisoned"),
        (failed, "rollout_failed"),
        (tampered(receipt, schema_version=999), "unsupported_schema"),
        (tampered(receipt, schema_version=1), "unsupported_schema"),
        (tampered(receipt, schema_version=True), "unsupported_schema"),
        (tampered(receipt, digest_version=999), "unsupported_digest"),
        (tampered(receipt, extras_digest_version=999), "unsupported_extras_digest"),
        (tampered(receipt, manifest=[]), "empty_manifest"),
        # Versions are checked first: an unsupported, failed receipt reports the version.
        (tampered(failed, schema_version=999), "unsupported_schema"),
        (tampered(receipt, failure_reason="x", capture_poisoned=True, manifest=[]), "rollout_failed"),
    ]
    for candidate, code in cases:
        assert rejected(candidate, snapshots) == code, code


def test_missing_terminal_and_wrong_parent_length_are_rejected() -> None:
    receipt, snapshots = branched()
    assert rejected(tampered(receipt, terminal_model_call_id=None), snapshots) == "missing_terminal"
    assert rejected(tampered(receipt, terminal_model_call_id="ghost"), snapshots) == "missing_terminal"
    assert rejected(tampered(receipt, terminal_model_call_id=["main"]), snapshots) == "missing_terminal"

    rollout = Rollout()
    rollout.call("root", prompt=[10, 11], generated=[12])
    rollout.tokens["root"] = [10, 11]  # the child claims the parent ended after two tokens
    rollout.call("main", parent="root", prompt=[20], generated=[21])
    with pytest.raises(RebuildError) as error:
        verify_and_linearize(rollout.receipt("main"), rollout.records)
    assert error.value.code == "parent_length_mismatch"


def _route_envelope(values: list[int], shape: str, dtype: str = "int16") -> str:
    packed = struct.pack(f"<{len(values)}h", *values)  # written independently of encode_routed_experts
    return f"nrlre1:{dtype}:{shape}:{base64.b64encode(packed).decode('ascii')}"


def test_routed_expert_envelopes_rebuild_and_missing_spans_use_sentinel() -> None:
    rollout = Rollout()
    root = rollout.call(
        "root", prompt=[10], generated=[11], extras={"routed_experts": _route_envelope([1, 2, 3, 4], "2x1x2")}
    )
    child = rollout.call("child", parent="root", prompt=[20], generated=[21])
    row = verify_and_linearize(rollout.receipt("child"), rollout.records)
    assert row.routed_experts is None  # the verifier never reads extras
    rebuilt = with_routed_experts(row, [root, child])
    assert rebuilt.routed_experts == [[[1, 2]], [[3, 4]], [[-1, -1]], [[-1, -1]]]
    assert rebuilt.routed_experts_dtype == "int16"
    assert MISSING_ROUTE_SENTINEL == -1
    assert rebuilt.token_ids == row.token_ids and rebuilt.link_spans == row.link_spans
    # The same, from a mapping of call id to payload (a call left out counts as null extras).
    assert with_routed_experts(row, {"root": root.extras}) == rebuilt
    # A row none of whose calls carries routes is returned unchanged.
    plain = Rollout()
    plain.call("root")
    plain_row = verify_and_linearize(plain.receipt("root"), plain.records)
    assert with_routed_experts(plain_row, plain.records) is plain_row


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        ("nrlre2:int16:1x1x1:AAA=", "invalid_routes"),
        (_route_envelope([1, 2], "1x1x2"), "route_length_mismatch"),
        (_route_envelope([1, 2, 3, 4, 5, 6], "3x1x2"), "route_length_mismatch"),
    ],
)
def test_unknown_or_misaligned_route_envelope_is_rejected(payload: str, code: str) -> None:
    rollout = Rollout()
    root = rollout.call("root", prompt=[10], generated=[11], extras={"routed_experts": payload})
    row = verify_and_linearize(rollout.receipt("root"), [root])
    with pytest.raises(ReceiptVerificationError) as error:
        with_routed_experts(row, [root])
    assert error.value.code == code


# --- every other code of 6.1, in order --------------------------------------------------------------


def test_values_that_are_not_receipts_or_snapshots_are_type_errors() -> None:
    receipt, snapshots = branched()
    for bad_receipt, bad_snapshots, code in [
        (json.loads(to_json(receipt)), snapshots, "not_a_receipt"),
        (receipt, [json.loads(to_json(snapshots[0])), *snapshots[1:]], "not_a_snapshot"),
        (receipt, [receipt.manifest[0], *snapshots[1:]], "not_a_snapshot"),
        (tampered(receipt, manifest=[{"model_call_id": "root"}]), snapshots, "not_a_call_record"),
        (tampered(receipt, manifest=5), snapshots, "not_a_call_record"),
        (receipt, None, "not_a_snapshot"),
        (receipt, iter(snapshots), "not_a_snapshot"),
    ]:
        with pytest.raises(ReceiptTypeError) as error:
            verify_and_linearize(bad_receipt, bad_snapshots)
        assert isinstance(error.value, TypeError) and isinstance(error.value, StoreError)
        assert error.value.code == code
    # A base snapshot (no extras payload at all) is what the verifier needs.
    base = [
        StagedCallBaseSnapshot(**{k: v for k, v in msgspec.structs.asdict(s).items() if k != "extras"})
        for s in snapshots
    ]
    assert verify_and_linearize(receipt, base) == verify_and_linearize(receipt, snapshots)


def test_duplicate_manifest_rows_and_staging_keys_are_rejected() -> None:
    receipt, snapshots = branched()
    rows = receipt.manifest
    assert rejected(tampered(receipt, manifest=[rows[0], rows[1], rows[0]]), snapshots) == "duplicate_manifest_row"
    shared_key = receipt_for([rows[0], rows[1], manifest_row(snapshots[2], staging_key=rows[1].staging_key)], "main")
    assert rejected(shared_key, snapshots) == "duplicate_staging_key"


def test_rows_staged_by_another_attempt_verify_under_their_capture_key() -> None:
    rollout = Rollout("rollout-1-a1")
    rollout.call("root", prompt=[10, 11], generated=[12], capture_key="rollout-1")  # restored from attempt 0
    rollout.call("child", parent="root", prompt=[20], generated=[21])
    owners = {"root": {"capture_key": "rollout-1"}, "child": {"capture_key": "rollout-1-a1"}}
    row = verify_and_linearize(rollout.receipt("child", **owners), rollout.records)
    assert row.model_call_ids == ["root", "child"] and row.token_ids == [10, 11, 12, 20, 21]
    # Without the row's owner the receipt's rollout id applies, and the root belongs to another attempt.
    assert rejected(rollout.receipt("child"), rollout.records) == "wrong_rollout"
    wrong_owner = {**owners, "root": {"capture_key": "rollout-1-a7"}}
    assert rejected(rollout.receipt("child", **wrong_owner), rollout.records) == "wrong_rollout"


def test_graph_codes_missing_parent_and_lineage_cycle() -> None:
    orphan = make_record(model_call_id="orphan", parent_call_id="ghost", parent_chain_hash="a" * 64, prefix=[1, 2, 3])
    with pytest.raises(RebuildError) as error:
        verify_and_linearize(receipt_for([manifest_row(orphan)], "orphan"), [orphan])
    assert error.value.code == "missing_parent"

    # c1 (positions 20..25) names c2 as parent, c2 (positions 10..20) names c1.  c1's own link is
    # consistent (c2 ends at 20), so the walk up from c1 finds the loop before c2's link is checked.
    c1 = make_record(model_call_id="c1", parent_call_id="c2", parent_chain_hash="a" * 64, prefix=list(range(20)))
    c2 = make_record(
        model_call_id="c2",
        parent_call_id="c1",
        parent_chain_hash="b" * 64,
        prefix=list(range(10)),
        prompt=list(range(8)),
        generated=[1, 2],
    )
    assert (c2.cum_len, c1.prev_len) == (20, 20)
    rows = [manifest_row(c1), manifest_row(c2)]
    with pytest.raises(RebuildError) as error:
        verify_and_linearize(receipt_for(rows, "c1"), [c1, c2])
    assert error.value.code == "lineage_cycle"
    # Listed the other way round, c2's own link is checked first and is inconsistent.
    with pytest.raises(RebuildError) as error:
        verify_and_linearize(receipt_for(rows[::-1], "c1"), [c2, c1])
    assert error.value.code == "parent_length_mismatch"


def test_chain_codes_are_raised_link_by_link() -> None:
    def single(**overrides: Any) -> str:
        record = make_record(model_call_id="root", **overrides)
        return rejected(receipt_for([manifest_row(record)], "root"), [record])

    def from_columns(ids: list[int], mask: list[float], lps: list[float], **overrides: Any) -> StagedCallRecord:
        fields: dict[str, Any] = {
            "rollout_id": "rollout-1",
            "model_call_id": "root",
            "parent_call_id": None,
            "mode": "text",
            "prev_len": 0,
            "weight_version": 1,
            "token_ids_delta": ids,
            "token_mask_delta": mask,
            "generation_log_probs_delta": lps,
            "chain_hash": compute_chain_hash(None, ids),
            "cumulative_hash": hash_token_ids(ids),
        }
        return StagedCallRecord.from_components(**{**fields, **overrides})

    def code_of(record: StagedCallRecord) -> str:
        return rejected(receipt_for([manifest_row(record)], "root"), [record])

    assert single(parent_chain_hash="c" * 64) == "chain_hash_mismatch"  # a root chains from null
    assert code_of(from_columns([1, 2, 3], [1.0, 0.0, 1.0], [-0.1, 0.0, -0.2])) == "invalid_mask_order"
    assert code_of(from_columns([1, 2], [0.0, 0.0], [0.0, 0.0])) == "empty_generation"
    assert code_of(from_columns([1, 2], [0.0, 1.0], [0.0, -0.1], cumulative_hash=hash_token_ids([1, 9]))) == (
        "cumulative_hash_mismatch"
    )
    # -0.0 is a carry mask (float equality, as the digest's own mask rule).
    row = verify_and_linearize(*_single_receipt(from_columns([1, 2], [-0.0, 1.0], [0.0, -0.1])))
    assert row.prompt_len == 1

    # A later link that does not extend its parent's chain.
    rollout = Rollout()
    rollout.call("root")
    rollout.by_id["root"] = tampered(rollout.by_id["root"], chain_hash="d" * 64)
    rollout.call("child", parent="root")
    rollout.by_id["root"] = rollout.records[0]
    assert rejected(rollout.receipt("child"), rollout.records) == "chain_hash_mismatch"


def _single_receipt(record: Any) -> tuple[RolloutReceipt, list[Any]]:
    return receipt_for([manifest_row(record)], record.model_call_id), [record]


def test_errors_are_in_the_store_tree_and_carry_codes() -> None:
    assert issubclass(RebuildError, ReceiptVerificationError)
    assert issubclass(ReceiptVerificationError, StoreError) and issubclass(ReceiptVerificationError, ValueError)
    error = RebuildError("lineage_cycle", "loops")
    assert error.code == "lineage_cycle" and str(error) == "lineage_cycle: loops"
    assert pickle.loads(pickle.dumps(error)).code == "lineage_cycle"


# --- linearize (the compatibility wrapper) ----------------------------------------------------------


def test_linearize_builds_a_declared_receipt_and_runs_the_verifier() -> None:
    receipt, snapshots = branched()
    expected = verify_and_linearize(receipt, snapshots)
    assert linearize("rollout-1", snapshots, receipt.manifest, "main") == expected
    assert linearize("rollout-1", snapshots, receipt.manifest, terminal_hint="main") == expected
    for hint, manifest, code in [
        (None, receipt.manifest, "missing_terminal"),
        ("ghost", receipt.manifest, "missing_terminal"),
        ("main", [], "empty_manifest"),
        ("main", [*receipt.manifest, receipt.manifest[0]], "duplicate_manifest_row"),
    ]:
        with pytest.raises(ReceiptVerificationError) as error:
            linearize("rollout-1", snapshots, manifest, hint)
        assert error.value.code == code
    with pytest.raises(ReceiptVerificationError) as error:
        linearize("rollout-2", snapshots, receipt.manifest, "main")
    assert error.value.code == "wrong_rollout"
    # A schema-3 rollout gets a schema-3 receipt.
    rollout = Rollout(schema_version=3)
    rollout.call("root")
    assert linearize("rollout-1", rollout.records, rollout.rows(), "root").token_ids == [1, 2, 3]


# --- 6.2: every chain of the receipt ------------------------------------------------------------------


def test_linearize_all_publishes_other_roots_by_admission_time() -> None:
    rollout = Rollout()
    rollout.call("main-1", prompt=[1, 2], generated=[3])
    rollout.call("main-2", parent="main-1", prompt=[4], generated=[5])
    rollout.call("late", prompt=[7], generated=[8])
    rollout.call("early", prompt=[9], generated=[10])
    rollout.call("early-2", parent="early", prompt=[11], generated=[12])
    rollout.call("unstamped", prompt=[13], generated=[14])
    times = {"main-1": {"admitted_at": 1.0}, "late": {"admitted_at": 30.0}, "early": {"admitted_at": 20.0}}
    result = verify_and_linearize_all(rollout.receipt("main-2", **times), rollout.records)
    assert isinstance(result, LinearizedRollout)
    assert [row.model_call_ids for row in result.rows] == [
        ["main-1", "main-2"],
        ["early", "early-2"],
        ["late"],
        ["unstamped"],
    ]
    assert [(row.chain_index, row.chain_kind) for row in result.rows] == [
        (0, "terminal"),
        (1, "subagent"),
        (2, "subagent"),
        (3, "subagent"),
    ]
    assert result.rows[0] == verify_and_linearize(rollout.receipt("main-2", **times), rollout.records)
    assert result.rows[1].token_ids == [9, 10, 11, 12] and result.rows[1].prompt_len == 1
    assert (result.skipped, result.num_roots, result.num_boundary_roots) == ([], 4, 0)


def test_linearize_all_skips_retries_forks_and_broken_chains() -> None:
    rollout = Rollout()
    rollout.call("main", prompt=[1, 2], generated=[3])
    rollout.call("main-retry", prompt=[1, 2], generated=[4])  # same first prompt, never extended
    rollout.call("sub", prompt=[5], generated=[6])
    rollout.call("sub-retry", prompt=[5], generated=[7])  # same prompt as sub, which was extended
    rollout.call("sub-2", parent="sub", prompt=[8], generated=[9])
    rollout.call("dup-a", prompt=[20], generated=[21])
    rollout.call("dup-b", prompt=[20], generated=[21])  # byte-identical: the same tokens as dup-a
    rollout.call("fork", prompt=[30], generated=[31])
    rollout.call("fork-a", parent="fork", prompt=[32], generated=[33])
    rollout.call("fork-b", parent="fork", prompt=[34], generated=[35])
    broken = rollout.call("broken", prompt=[40], generated=[41])
    records = list(rollout.records)
    # A subagent chain whose rows lie about its chain hash (consistently, so 6.1 binding passes).
    forged = make_record(model_call_id="broken", prompt=[40], generated=[41], parent_chain_hash="e" * 64)
    records[records.index(broken)] = forged
    rows = [manifest_row(record) for record in records]
    result = verify_and_linearize_all(receipt_for(rows, "main"), records)
    assert [row.model_call_ids for row in result.rows] == [["main"], ["sub", "sub-2"], ["dup-a"]]
    assert result.skipped == [
        SkippedChain("main-retry", SKIP_ABANDONED_ROOT),
        SkippedChain("sub-retry", SKIP_ABANDONED_ROOT),
        SkippedChain("dup-b", SKIP_ABANDONED_ROOT),
        SkippedChain("fork", SKIP_AMBIGUOUS_LEAF),
        SkippedChain("broken", "chain_hash_mismatch"),
    ]
    assert result.num_roots == 8
    # The terminal chain's own failure raises.
    with pytest.raises(RebuildError) as error:
        verify_and_linearize_all(receipt_for(rows, "broken"), records)
    assert error.value.code == "chain_hash_mismatch"
    # Verification of the whole receipt still comes first.
    with pytest.raises(ReceiptVerificationError) as error:
        verify_and_linearize_all(receipt_for(rows, "main"), records[::-1])
    assert error.value.code == "snapshot_order_mismatch"


# --- properties ----------------------------------------------------------------------------------------

_ids = st.lists(st.integers(0, 2**64 - 1), max_size=6)
_gen = st.lists(st.integers(0, 2**32), min_size=1, max_size=6)


@st.composite
def linear_rollouts(draw: st.DrawFn) -> tuple[Rollout, list[tuple[list[int], list[int]]]]:
    rollout = Rollout()
    links = []
    parent = None
    for index in range(draw(st.integers(1, 5))):
        prompt, generated = draw(_ids), draw(_gen)
        rollout.call(f"c{index}", parent=parent, prompt=prompt, generated=generated, weight_version=index)
        links.append((prompt, generated))
        parent = f"c{index}"
    return rollout, links


@FAST
@given(linear_rollouts())
def test_a_linear_rollout_linearizes_to_its_exact_tokens(
    case: tuple[Rollout, list[tuple[list[int], list[int]]]],
) -> None:
    rollout, links = case
    leaf = rollout.records[-1].model_call_id
    row = verify_and_linearize(rollout.receipt(leaf), rollout.records)
    assert row.token_ids == rollout.tokens[leaf]
    assert row.token_mask == [m for p, g in links for m in [0.0] * len(p) + [1.0] * len(g)]
    assert row.link_spans == [(f"c{i}", len(p), len(g)) for i, (p, g) in enumerate(links)]
    assert row.prompt_len == len(links[0][0])
    assert [s.end - s.start for s in row.weight_version_spans] == [len(p) + len(g) for p, g in links]
    assert row.weight_versions == list(range(len(links)))
    assert hash_token_ids(row.token_ids.tolist()) == rollout.records[-1].cumulative_hash
    assert verify_and_linearize_all(rollout.receipt(leaf), rollout.records).rows == [row]


_TAMPERABLE = {
    "token_ids_delta": lambda r: [*r.token_ids_delta.tolist()[:-1], r.token_ids_delta[-1] ^ 1],
    "generation_log_probs_delta": lambda r: [*r.generation_log_probs_delta.tolist()[:-1], -9.5],
    "weight_version": lambda r: r.weight_version + 1,
    "prev_len": lambda r: r.prev_len + 1,
    "cum_len": lambda r: r.cum_len + 1,
    "digest": lambda r: "f" * 64,
    "extras_digest": lambda r: "e" * 64,
    "chain_hash": lambda r: "c" * 64,
    "cumulative_hash": lambda r: "d" * 64,
    "rollout_id": lambda r: r.rollout_id + "x",
}


@FAST
@given(linear_rollouts(), st.data())
def test_any_tampered_snapshot_or_row_is_refused_with_a_code(
    case: tuple[Rollout, list[tuple[list[int], list[int]]]], data: st.DataObject
) -> None:
    rollout, _ = case
    leaf = rollout.records[-1].model_call_id
    index = data.draw(st.integers(0, len(rollout.records) - 1))
    field = data.draw(st.sampled_from(sorted(_TAMPERABLE)))
    target = rollout.records[index]
    forged = tampered(target, **{field: _TAMPERABLE[field](target)})
    snapshots = [forged if i == index else record for i, record in enumerate(rollout.records)]
    if data.draw(st.booleans()):  # tamper the manifest row the same way instead (rows are forged too)
        receipt = rollout.receipt(leaf)
        if field in msgspec.structs.asdict(receipt.manifest[index]) or field == "rollout_id":
            row_field = "capture_key" if field == "rollout_id" else field
            value = forged.rollout_id if field == "rollout_id" else getattr(forged, field)
            rows = list(receipt.manifest)
            rows[index] = tampered(rows[index], **{row_field: value})
            receipt = tampered(receipt, manifest=rows)
        code = rejected(receipt, snapshots)
    else:
        code = rejected(rollout.receipt(leaf), snapshots)
    assert code  # refused, with a code, and never a raw error


# --- routed-expert envelopes ----------------------------------------------------------------------------


@FAST
@given(
    st.sampled_from([("int8", 7), ("int16", 15), ("int32", 31)]).flatmap(
        lambda d: st.tuples(
            st.just(d[0]),
            st.integers(1, 4).flatmap(
                lambda t: st.integers(1, 3).flatmap(
                    lambda layers: st.integers(1, 3).flatmap(
                        lambda k: st.lists(
                            st.lists(
                                st.lists(st.integers(-(2 ** d[1]), 2 ** d[1] - 1), min_size=k, max_size=k),
                                min_size=layers,
                                max_size=layers,
                            ),
                            min_size=t,
                            max_size=t,
                        )
                    )
                )
            ),
        )
    )
)
def test_route_envelopes_round_trip(case: tuple[str, list[list[list[int]]]]) -> None:
    dtype, table = case
    envelope = encode_routed_experts(table, dtype)
    assert envelope.startswith(f"nrlre1:{dtype}:{len(table)}x{len(table[0])}x{len(table[0][0])}:")
    decoded = decode_routed_experts(envelope)
    assert decoded == table and decoded.dtype == dtype and len(decoded) == len(table)
    legacy = decode_routed_experts(table)
    assert legacy == table and legacy.dtype == "legacy-int"


@pytest.mark.parametrize(
    "payload",
    [
        "nrlre1:int64:1x1x1:AAAAAAAAAAA=",  # unknown dtype
        "nrlre1:int16:1x1:AAA=",  # two dimensions
        "nrlre1:int16:1x0x1:",  # a zero dimension
        "nrlre1:int16:1x+1x1:AAA=",  # not plain digits
        "nrlre1:int16:1x1x1:A*==",  # not base64
        "nrlre1:int16:1x1x2:AAA=",  # 2 bytes for 4
        "nrlre1:int16:1x1x1",  # no payload field
        "",
        [],
        [[]],
        [[[1, 2]], [[3]]],  # ragged top-k
        [[[1, 2]], [[3, 4], [5, 6]]],  # ragged layers
        [[[1, True]]],  # not exact ints
        [[[2**70]]],
        {"routes": 1},
        (((1,),),),
    ],
)
def test_malformed_route_envelopes_are_invalid_routes(payload: Any) -> None:
    with pytest.raises(RebuildError) as error:
        decode_routed_experts(payload)
    assert error.value.code == "invalid_routes"


def test_routes_of_different_shape_or_dtype_across_calls_are_rejected() -> None:
    def code_of(first: Any, second: Any) -> str:
        rollout = Rollout()
        root = rollout.call("root", prompt=[10], generated=[11], extras={"routed_experts": first})
        child = rollout.call("child", parent="root", prompt=[20], generated=[21], extras={"routed_experts": second})
        row = verify_and_linearize(rollout.receipt("child"), rollout.records)
        with pytest.raises(RebuildError) as error:
            with_routed_experts(row, [root, child])
        return error.value.code

    assert code_of(encode_routed_experts([[[1, 2]], [[3, 4]]]), encode_routed_experts([[[1]], [[3]]])) == (
        "route_shape_mismatch"
    )
    assert code_of(encode_routed_experts([[[1]], [[2]]], "int8"), encode_routed_experts([[[1]], [[2]]], "int32")) == (
        "route_dtype_mismatch"
    )
    assert code_of([[[1]], [[2]]], encode_routed_experts([[[1]], [[2]]])) == "route_dtype_mismatch"
    with pytest.raises(RebuildError):
        encode_routed_experts([[[300]]], "int8")
    assert compute_extras_digest({"routed_experts": encode_routed_experts([[[1]]])}) != EMPTY_EXTRAS_DIGEST


def test_row_floats_are_the_binary32_values_the_digests_verified() -> None:
    record = make_record(model_call_id="root", prompt=[1], generated=[2, 3], logprobs=[-0.1, -1e-40])
    row = verify_and_linearize(receipt_for([manifest_row(record)], "root"), [record])
    assert row.logprobs.array.tolist() == [0.0, float(np.float32(-0.1)), float(np.float32(-1e-40))]
    assert row.logprobs == [0.0, -0.1, -1e-40]  # equal as hashed
    assert row.token_mask.array.dtype == np.float64 and row.token_mask.tolist() == [0.0, 1.0, 1.0]
