"""Terminal selection without a witness (wire-contract 6.3) and witness attribution (6.4).

The fifteen named tests of Gym's test_token_capture_staging_terminal.py (section 9), every
outcome and reason of both functions, and properties over random call forests.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples

from store import (
    ASSISTANT_FINGERPRINT_VERSION,
    EMPTY_EXTRAS_DIGEST,
    CallRecord,
    TerminalAttribution,
    TerminalSelection,
    assistant_fingerprint,
    resolve_terminal,
    select_terminal_call,
)

FAST = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _row(
    call: str,
    *,
    parent: str | None = None,
    prev_len: int = 0,
    admitted_at: float | None = None,
    response_id: str | None = None,
    tokens: str | None = None,
    **fields: Any,
) -> CallRecord:
    """A token-free manifest row of 10 tokens; ``tokens`` names its token sequence (equal names: equal tokens)."""
    identity = (tokens or call).encode().hex().ljust(64, "0")[:64]
    return CallRecord(
        model_call_id=call,
        parent_call_id=parent,
        prev_len=prev_len,
        delta_len=10,
        cum_len=prev_len + 10,
        weight_version=1,
        digest="b" * 64,
        extras_digest=EMPTY_EXTRAS_DIGEST,
        staging_key=f"r1/{call}",
        mode="text" if parent is None else "token_in",
        chain_hash=identity,
        cumulative_hash=identity,
        response_id=response_id or f"resp-{call}",
        admitted_at=admitted_at,
        **fields,
    )


def _chain(*calls: str, start_at: float | None = 100.0) -> list[CallRecord]:
    rows: list[CallRecord] = []
    for offset, call in enumerate(calls):
        stamp = None if start_at is None else start_at + offset
        parent = rows[-1].model_call_id if rows else None
        rows.append(_row(call, parent=parent, prev_len=10 * offset, admitted_at=stamp))
    return rows


def selected(call: str) -> TerminalSelection:
    return TerminalSelection(call, "selected")


def refused(reason: str) -> TerminalSelection:
    return TerminalSelection(None, reason)


# --- the named tests of section 9 (Gym test_token_capture_staging_terminal.py) --------------------


def test_empty_manifest_selects_nothing() -> None:
    assert select_terminal_call([]) == refused("no_records")


def test_single_linear_chain_selects_the_leaf() -> None:
    assert select_terminal_call(_chain("c1", "c2", "c3")) == selected("c3")
    assert select_terminal_call(_chain("only")) == selected("only")


def test_abandoned_mid_rollout_retry_is_eliminated() -> None:
    rows = [*_chain("c1", "c2", "c3"), _row("c2-retry", parent="c1", prev_len=10, admitted_at=101.5)]
    assert select_terminal_call(rows) == selected("c3")


def test_retry_of_the_final_call_is_ambiguous() -> None:
    rows = [*_chain("c1", "c2"), _row("c2-retry", parent="c1", prev_len=10, admitted_at=101.5)]
    assert select_terminal_call(rows) == refused("ambiguous_terminal")


def test_two_abandoned_siblings_under_the_last_fork_are_ambiguous() -> None:
    rows = [
        *_chain("c1", "c2", "c3"),
        _row("c4-a", parent="c3", prev_len=30, admitted_at=104.0),
        _row("c4-b", parent="c3", prev_len=30, admitted_at=105.0),
    ]
    assert select_terminal_call(rows) == refused("ambiguous_terminal")


def test_two_roots_earliest_admission_wins() -> None:
    main, aux = _chain("m1", "m2", start_at=100.0), _chain("a1", "a2", start_at=200.0)
    assert select_terminal_call(main + aux) == selected("m2")
    assert select_terminal_call(aux + main) == selected("m2")  # the timestamps decide, not the order


def test_extended_root_beats_an_abandoned_earlier_root() -> None:
    rows = [_row("r0", admitted_at=50.0), *_chain("m1", "m2", start_at=100.0)]
    assert select_terminal_call(rows) == selected("m2")


def test_root_timestamp_tie_breaks_by_manifest_order() -> None:
    first, second = _chain("m1", "m2"), _chain("n1", "n2")
    assert select_terminal_call(first + second) == selected("m2")
    assert select_terminal_call(second + first) == selected("n2")


def test_all_unstamped_rows_fall_back_to_manifest_order() -> None:
    main, aux = _chain("m1", "m2", start_at=None), _chain("a1", "a2", start_at=None)
    assert select_terminal_call(main + aux) == selected("m2")
    assert select_terminal_call(aux + main) == selected("a2")


def test_mixed_stamped_and_unstamped_roots_prefer_the_stamped_root() -> None:
    rows = [_row("u1"), *_chain("s1", start_at=999.0)]  # the unstamped root sorts last though listed first
    assert select_terminal_call(rows) == selected("s1")


def test_deep_chain_with_dead_side_branch_selects_the_main_leaf() -> None:
    rows = [*_chain("c1", "c2", "c3", "c4"), _row("side", parent="c2", prev_len=20, admitted_at=150.0)]
    assert select_terminal_call(rows) == selected("c4")


def test_two_extended_branches_are_ambiguous() -> None:
    rows = [
        *_chain("c1", "c2"),
        _row("d2", parent="c1", prev_len=10, admitted_at=101.5),
        _row("d3", parent="d2", prev_len=20, admitted_at=102.5),
        _row("c3", parent="c2", prev_len=20, admitted_at=102.0),
    ]
    assert select_terminal_call(rows) == refused("ambiguous_terminal")


def test_orphaned_row_selects_nothing() -> None:
    rows = [*_chain("c1", "c2"), _row("lost", parent="ghost", prev_len=10, admitted_at=103.0)]
    assert select_terminal_call(rows) == refused("orphaned_row")


def test_cyclic_rows_select_nothing() -> None:
    rows = [_row("c1", parent="c2", prev_len=10), _row("c2", parent="c1", prev_len=10)]
    assert select_terminal_call(rows) == refused("no_root")


def test_duplicate_call_ids_select_nothing() -> None:
    rows = _chain("c1", "c2") + _chain("c1", start_at=300.0)
    assert select_terminal_call(rows) == refused("duplicate_call_id")


# --- properties of select_terminal_call ----------------------------------------------------------


@st.composite
def forests(draw: st.DrawFn) -> list[CallRecord]:
    """Random call forests with distinct admission times (some unstamped)."""
    count = draw(st.integers(1, 12))
    stamps = draw(st.lists(st.floats(0, 1e6), min_size=count, max_size=count, unique=True))
    rows: list[CallRecord] = []
    for index in range(count):
        parent = draw(st.sampled_from([None, *range(index)])) if index else None
        stamp = None if draw(st.integers(0, 4)) == 0 else stamps[index]
        if parent is None:
            rows.append(_row(f"c{index}", admitted_at=stamp))
        else:
            rows.append(_row(f"c{index}", parent=f"c{parent}", prev_len=rows[parent].cum_len, admitted_at=stamp))
    return rows


@FAST
@given(forests(), st.randoms(use_true_random=False))
def test_a_selection_is_an_unambiguous_leaf_and_independent_of_stamped_order(
    rows: list[CallRecord], shuffler: random.Random
) -> None:
    result = select_terminal_call(rows)
    by_id = {row.model_call_id: row for row in rows}
    if result.reason == "selected":
        assert result.terminal_model_call_id is not None
        assert all(row.parent_call_id != result.terminal_model_call_id for row in rows)  # a leaf
        cursor: CallRecord | None = by_id[result.terminal_model_call_id]
        while cursor is not None:  # every fork on its path had one extended (or a single) child
            siblings = [row for row in rows if row.parent_call_id == cursor.parent_call_id]
            extended = [row for row in siblings if any(other.parent_call_id == row.model_call_id for other in rows)]
            if cursor.parent_call_id is not None:
                assert cursor in (extended or siblings) and len(extended or siblings) == 1
            cursor = by_id.get(cursor.parent_call_id) if cursor.parent_call_id else None
    else:
        assert result == refused("ambiguous_terminal")
    # With every root stamped, the manifest order cannot matter.
    if all(row.admitted_at is not None for row in rows if row.parent_call_id is None):
        shuffled = list(rows)
        shuffler.shuffle(shuffled)
        assert select_terminal_call(shuffled) == result


# --- resolve_terminal (6.4) -------------------------------------------------------------------------

V = ASSISTANT_FINGERPRINT_VERSION


def _answer(text: str, *extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [*extra, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]


def _fingerprinted(call: str, text: str, **fields: Any) -> CallRecord:
    return _row(call, output_fingerprint=assistant_fingerprint(_answer(text)), fingerprint_version=V, **fields)


def attribution(call: str | None, method: str | None, reason: str, may_fall_back: bool = False) -> TerminalAttribution:
    return TerminalAttribution(call, method, reason, may_fall_back)  # type: ignore[arg-type]


def test_declared_response_id_is_authoritative_and_never_falls_back() -> None:
    rows = [_row("c1", response_id="resp-1"), _row("c2", response_id="resp-2")]
    assert resolve_terminal(rows, None, "resp-2") == attribution("c2", "declared", "no_response_object")
    assert resolve_terminal(rows, None, "resp-9") == attribution(None, None, "declared_terminal_not_captured")
    twins = [_row("c1", response_id="same"), _row("c2", response_id="same")]
    assert resolve_terminal(twins, {"id": "same"}, "same") == attribution(None, None, "declared_ambiguous")
    # Twins with identical tokens are one candidate: the smallest id.
    same_tokens = [_row("c2", response_id="same", tokens="t"), _row("c1", response_id="same", tokens="t")]
    assert resolve_terminal(same_tokens, None, "same").model_call_id == "c1"


def test_response_id_witness_reasons() -> None:
    rows = [_row("c1", response_id="resp-1"), _row("c2", response_id="resp-2"), _row("c3", response_id="resp-2")]
    assert resolve_terminal(rows, {"id": "resp-1"}) == attribution("c1", "response_id", "response_has_no_output", False)
    assert resolve_terminal(rows, {"id": "resp-9"}).reason == "response_id_no_match,response_has_no_output"
    assert resolve_terminal(rows, {"id": "resp-2"}).reason == "response_id_ambiguous,response_has_no_output"
    for response in ({}, {"id": ""}, {"id": 7}):
        result = resolve_terminal(rows, response)
        assert result == attribution(None, None, "response_has_no_id,response_has_no_output", True)

    class Response:  # an object with attributes (a pydantic response) reads the same
        id = "resp-1"
        output = None

    assert resolve_terminal(rows, Response()).model_call_id == "c1"


def test_content_witness_matches_output_continuation_and_trailing_block() -> None:
    tool_turn = [
        {"type": "message", "role": "user", "content": "what is 2+2?"},
        {"type": "function_call", "call_id": "t1", "name": "calc", "arguments": '{"b": 2, "a": 2}'},
        {"type": "function_call_output", "call_id": "t1", "output": "4"},
    ]
    transcript = _answer("it is 4", *tool_turn)
    final = _fingerprinted("c2", "it is 4", parent="c1", prev_len=10)
    first = _row("c1", output_fingerprint=assistant_fingerprint(tool_turn), fingerprint_version=V)
    # The trailing model-authored block of the transcript is the final call's own output.
    assert resolve_terminal([first, final], {"output": transcript}) == attribution(
        "c2", "content", "response_has_no_id"
    )
    # The whole transcript's fingerprint matches a row's continuation fingerprint.
    cumulative = _row("c9", continuation_fingerprint=assistant_fingerprint(transcript), fingerprint_version=V)
    assert resolve_terminal([cumulative], {"output": transcript}).model_call_id == "c9"
    # Rows of another fingerprint version take no part.
    stale = _row("c2", output_fingerprint=assistant_fingerprint(_answer("it is 4")), fingerprint_version=V + 1)
    assert resolve_terminal([stale], {"output": transcript}).reason == "response_has_no_id,no_content_match"
    # Two different calls with the same output: ambiguous.  Same tokens: one.
    twins = [_fingerprinted("a", "hi"), _fingerprinted("b", "hi")]
    assert resolve_terminal(twins, {"output": _answer("hi")}).reason == "response_has_no_id,content_ambiguous"
    same = [_fingerprinted("b", "hi", tokens="t"), _fingerprinted("a", "hi", tokens="t")]
    assert resolve_terminal(same, {"output": _answer("hi")}).model_call_id == "a"
    # The whole output read as one call's own output (a single-turn answer) matches that call.
    assert resolve_terminal([first, final], {"output": tool_turn}).model_call_id == "c1"
    # A transcript ending in a tool result has no trailing block, so it never matches a mid-chain call.
    pending = [*transcript, {"type": "function_call_output", "call_id": "t2", "output": "..."}]
    assert resolve_terminal([first, final], {"output": pending}).reason == "response_has_no_id,no_content_match"


def test_content_witness_reasons_for_unusable_output() -> None:
    rows = [_fingerprinted("c1", "hi")]
    reasons = {
        "response_has_no_output": [{"output": []}, {"output": None}, {"output": "text"}],
        "no_model_authored_output": [
            {"output": [{"type": "message", "role": "user", "content": "hi"}]},
            {"output": ["not an item"]},  # Gym reads the objects of the output only
        ],
        "response_output_unfingerprintable": [
            {"output": [{"role": "assistant", "content": [{"url": "x"}]}]},  # a block without a type
            {"output": [{"role": "assistant", "content": [5]}]},
            {"output": [{"role": "assistant", "content": 5}]},
            {"output": [{"role": "assistant", "content": "", "tool_calls": [5]}]},
            {"output": [{"type": "function_call", "call_id": "x", "name": "f", "arguments": {"a": 2**70}}]},
        ],
        # What version 1 could not read, version 2 (Gym's) fingerprints: no row matches it.
        "no_content_match": [
            {"output": [{"role": "assistant", "content": [{"type": "image", "url": "x"}]}]},
            {"output": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]},
            {"output": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
            {"output": [{"type": "function_call", "call_id": "x", "name": "f", "arguments": {"a": float("nan")}}]},
        ],
    }
    for reason, responses in reasons.items():
        for response in responses:
            assert resolve_terminal(rows, response) == attribution(None, None, f"response_has_no_id,{reason}", True)


def test_the_fingerprint_reads_every_dialect_alike_and_ignores_non_model_items() -> None:
    responses_items = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "t1", "name": "calc", "arguments": '{"a": 1, "b": [2]}'},
    ]
    chat = [
        {"role": "user", "content": "ignored"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": '{"b":[2],"a":1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "reformatted freely"},
    ]
    anthropic = [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t1", "name": "calc", "input": {"a": 1, "b": [2]}},
            ],
        },
    ]
    fingerprint = assistant_fingerprint(responses_items)
    assert fingerprint is not None and len(fingerprint) == 64
    assert assistant_fingerprint(chat) == assistant_fingerprint(anthropic) == fingerprint
    assert assistant_fingerprint(_answer("ok!")) != assistant_fingerprint(_answer("ok"))
    assert assistant_fingerprint(_answer("ab")) != assistant_fingerprint([*_answer("a"), *_answer("b")])
    assert assistant_fingerprint([{"role": "user", "content": "hi"}]) is None


def test_witnesses_must_agree() -> None:
    rows = [_fingerprinted("c1", "one", response_id="resp-1"), _fingerprinted("c2", "two", response_id="resp-2")]
    agreed = resolve_terminal(rows, {"id": "resp-2", "output": _answer("two")}, "resp-2")
    assert agreed == attribution("c2", "declared", "corroborated_by=response_id+content")
    assert resolve_terminal(rows, {"id": "resp-2", "output": _answer("two")}) == attribution(
        "c2", "response_id", "corroborated_by=content"
    )
    partial = resolve_terminal(rows, {"id": "resp-2", "output": _answer("three")})
    assert partial == attribution("c2", "response_id", "no_content_match")
    disagreement = resolve_terminal(rows, {"id": "resp-1", "output": _answer("two")}, "resp-2")
    assert disagreement == attribution(None, None, "witness_disagreement[declared=c2;response_id=c1;content=c2]")
    # Calls with identical tokens are interchangeable: no disagreement, the smallest id wins.
    twins = [
        _fingerprinted("c1", "one", response_id="resp-1", tokens="t"),
        _fingerprinted("c2", "two", response_id="resp-2", tokens="t"),
    ]
    assert resolve_terminal(twins, {"id": "resp-2", "output": _answer("one")}) == attribution(
        "c1", "response_id", "corroborated_by=content"
    )


def test_no_witness_at_all_lets_the_caller_fall_back_to_the_heuristic() -> None:
    rows = _chain("c1", "c2")
    result = resolve_terminal(rows, None)
    assert result == attribution(None, None, "no_response_object", True)
    assert select_terminal_call(rows) == selected("c2")
    assert resolve_terminal([], {"id": "x", "output": _answer("hi")}) == attribution(
        None, None, "response_id_no_match,no_content_match", True
    )
    assert resolve_terminal(["not a row"], None) == attribution(None, None, "invalid_records")  # type: ignore[list-item]


@settings(max_examples=examples(40), deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=12,
    )
)
def test_resolve_terminal_never_raises(output: Any) -> None:
    rows = [_fingerprinted("c1", "hi")]
    result = resolve_terminal(rows, {"id": "resp-c1", "output": output})
    assert result.model_call_id == "c1"  # the response id still attributes, whatever the output
    assert resolve_terminal(rows, output, output if isinstance(output, str) else None).reason
