"""NeMo Gym 0.7.0's own lineage code against the store (issue 32, items 3 and 4): fingerprints
(version 2) equal Gym's on every dialect, ``resolve_terminal`` attributes rows Gym stamped (and
rows stamped with the store's version 1), and ``CaptureLedger.admit`` decides a parent as Gym's
``FileLineageStore`` and ``resolve_parent`` do, a rewritten or dropped user turn included.

Skipped where Gym's token-capture package is not importable (``make real-clients`` installs it).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from store import (
    ASSISTANT_FINGERPRINT_VERSION,
    UNRESOLVED_PARENT,
    CallRecord,
    CaptureLedgerCommit,
    Store,
    assistant_fingerprint,
    from_json,
    resolve_terminal,
)
from store.rebuild import fingerprint as ours
from store.rebuild.terminal import legacy_assistant_fingerprint

gym_fingerprint = pytest.importorskip(
    "nemo_gym.token_id_capture.fingerprint", reason="NeMo Gym 0.7.0 is not installed (make real-clients)"
)
gym_lineage = pytest.importorskip("nemo_gym.token_id_capture.lineage", reason="NeMo Gym 0.7.0 is not installed")
gym_records = pytest.importorskip("nemo_gym.token_id_capture.staging.records", reason="NeMo Gym 0.7.0 is not installed")
gym_terminal = pytest.importorskip("nemo_gym.token_id_capture.terminal", reason="NeMo Gym 0.7.0 is not installed")

H = "cd" * 32


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


# Every dialect's shapes: the seven of the issue (chat, tool call, reasoning + message, chat
# tool_calls, ...) and the content and tool-result shapes either fingerprint reads.
SAMPLES: list[list[dict[str, Any]]] = [
    [user("hi"), assistant("hello there")],
    [{"type": "function_call", "call_id": "t1", "name": "calc", "arguments": '{"b": [2], "a": 1}'}],
    [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    ],
    [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1e-05}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ],
    [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "tu1", "name": "search", "input": {"q": "x", "n": 2.5e-7}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text"}]}]},
    ],
    [{"type": "function_call", "namespace": "web", "name": "open", "call_id": "n1", "arguments": "not json  "}],
    [
        {"role": "system", "content": "be brief"},
        user("draw"),
        {"role": "assistant", "content": [{"type": "image", "image_url": {"url": "x", "w": 1e16}}, "caption"]},
        {"type": "function_call_output", "call_id": "t1", "output": {"ok": True, "v": [1, None, 0.1]}},
        {"role": "assistant", "content": 'ünïcode \u2028 \x07 "quoted" \\ tab\t', "tool_calls": []},
    ],
    [user("no model turn at all")],
    [],
]


def _random_item(rng: random.Random) -> dict[str, Any]:
    def text() -> str:
        return "".join(rng.choice('ab \n\t"\\é😀\x01') for _ in range(rng.randint(0, 6)))

    def value(depth: int = 0) -> Any:
        kind = rng.randint(0, 6 if depth < 3 else 3)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.randint(-(2**40), 2**40)
        if kind == 2:
            return rng.uniform(-1, 1) * 10 ** rng.randint(-9, 18)
        if kind == 3:
            return text()
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {text(): value(depth + 1) for _ in range(rng.randint(0, 3))}

    shape = rng.randint(0, 6)
    if shape == 0:
        return {"role": rng.choice(["user", "assistant", "system"]), "content": text()}
    if shape == 1:
        return {"type": "function_call", "call_id": text(), "name": text(), "arguments": rng.choice([text(), value()])}
    if shape == 2:
        blocks = [
            {"type": rng.choice(["text", "output_text", "image", "input_text"]), "text": text()} for _ in range(2)
        ]
        return {"role": "assistant", "content": [*blocks, {"type": "tool_use", "id": text(), "input": value()}]}
    if shape == 3:
        call = {"id": text(), "function": {"name": text(), "arguments": rng.choice([text(), value(), None])}}
        return {"role": "assistant", "content": text(), "tool_calls": [call]}
    if shape == 4:
        return {"type": "function_call_output", "call_id": text(), "output": value()}
    if shape == 5:
        return {"role": "tool", "tool_call_id": text(), "content": rng.choice([text(), value()])}
    return {"type": "reasoning", "role": rng.choice([None, "assistant"]), "content": [{"type": "x", "v": value()}]}


def _random_samples(count: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(32)
    return [[_random_item(rng) for _ in range(rng.randint(1, 5))] for _ in range(count)]


# --- item 4: fingerprints ----------------------------------------------------------------------


def test_the_fingerprint_version_is_gyms() -> None:
    assert ASSISTANT_FINGERPRINT_VERSION == gym_fingerprint.FINGERPRINT_VERSION == 2


@pytest.mark.parametrize("items", SAMPLES + _random_samples(400))
def test_fingerprint_and_conversation_digest_equal_gyms(items: list[dict[str, Any]]) -> None:
    """Equal values, or both refuse the items (Gym with a ValueError or TypeError, the store
    with ``UnfingerprintableError``, a ValueError)."""
    assert _outcome(assistant_fingerprint, items) == _outcome(
        lambda found: gym_fingerprint.assistant_fingerprint(found) or None, items
    )
    assert _outcome(ours.conversation_digest, items) == _outcome(gym_fingerprint.conversation_digest, items)


def _outcome(function: Any, items: Any) -> Any:
    try:
        return function(items)
    except (ValueError, TypeError):
        return "refused"


def test_canonical_arguments_equal_gyms() -> None:
    rng = random.Random(4)
    values: list[Any] = [None, "", "  x ", "[1, 2]", '{"b":1,"a":[1e-05, 1e-7, 1e16, -0.0, 3.0]}', "NaN", "1e400"]
    values += [rng.uniform(-1, 1) * 10 ** rng.randint(-12, 22) for _ in range(300)]
    values += [{"k": [rng.random() * 10 ** rng.randint(-8, 8)]} for _ in range(100)]
    for value in values:
        assert ours.canonical_arguments(value) == gym_fingerprint.canonicalize_tool_arguments(value), value


def _gym_row(call: str, output: list[dict[str, Any]], **fields: Any) -> CallRecord:
    """A manifest row as Gym writes it, read by the store."""
    gym_row = gym_records.CallRecord(
        model_call_id=call,
        prev_len=0,
        delta_len=2,
        cum_len=2,
        weight_version=1,
        digest=H,
        extras_digest=H,
        staging_key=f"r/{call}",
        mode="text",
        chain_hash=H,
        cumulative_hash=f"{len(call):064x}",
        response_id=f"served-{call}",
        output_fingerprint=gym_fingerprint.assistant_fingerprint(output) or None,
        fingerprint_version=gym_fingerprint.FINGERPRINT_VERSION,
        **fields,
    )
    return from_json(gym_row.model_dump_json(), CallRecord)


@pytest.mark.parametrize("output", [items for items in SAMPLES if gym_fingerprint.assistant_fingerprint(items)])
def test_resolve_terminal_attributes_by_content_rows_gym_stamped(output: list[dict[str, Any]]) -> None:
    rows = [_gym_row("c1", [assistant("something else")]), _gym_row("c22", output)]
    response = {"output": output}  # no id: the content witness alone
    ours_says = resolve_terminal(rows, response)
    assert (ours_says.model_call_id, ours_says.method) == ("c22", "content")
    gym_says = gym_terminal.resolve_terminal(rows, response)
    assert gym_says.model_call_id == "c22"


def test_rows_stamped_with_version_1_stay_readable() -> None:
    output = [assistant("the answer is 4")]
    legacy = CallRecord(
        model_call_id="old",
        prev_len=0,
        delta_len=2,
        cum_len=2,
        weight_version=1,
        digest=H,
        extras_digest=H,
        staging_key="r/old",
        mode="text",
        chain_hash=H,
        cumulative_hash=H,
        response_id="served-old",
        output_fingerprint=legacy_assistant_fingerprint(output),
        fingerprint_version=1,
    )
    assert legacy.output_fingerprint != assistant_fingerprint(output)  # the versions differ
    found = resolve_terminal([legacy, _gym_row("other", [assistant("no")])], {"output": output})
    assert (found.model_call_id, found.method) == ("old", "content")
    # A version-1 row never matches a version-2 fingerprint, nor the reverse.
    mixed = legacy.__class__(**{**_fields(legacy), "output_fingerprint": assistant_fingerprint(output)})
    assert resolve_terminal([mixed], {"output": output}).model_call_id is None


def _fields(row: CallRecord) -> dict[str, Any]:
    return {name: getattr(row, name) for name in row.__struct_fields__}


# --- item 3: parent resolution -----------------------------------------------------------------


class Both:
    """One rollout's ledger in the store and in Gym's ``FileLineageStore``, fed the same commits."""

    def __init__(self, store: Store, root: Path, rollout: str = "r0") -> None:
        self.store = store
        self.ledger = store.ledger()
        self.gym = gym_lineage.FileLineageStore(root)
        self.rollout = rollout
        self.rows: dict[str, Any] = {}
        self.chains: dict[str, tuple[str, ...]] = {}
        self.committed = False

    def commit(self, call: str, request: list[dict[str, Any]], reply: str, parent: str | None = None) -> list[Any]:
        prev = 0 if parent is None else self.rows[parent].cum_len
        row = gym_records.CallRecord(
            model_call_id=call,
            parent_call_id=parent,
            prev_len=prev,
            delta_len=3,
            cum_len=prev + 3,
            weight_version=1,
            digest=H,
            extras_digest=H,
            staging_key=f"{self.rollout}/{call}",
            mode="text" if parent is None else "token_in",
            chain_hash=f"{len(self.rows) + 1:064x}",
            cumulative_hash=f"{len(self.rows) + 7:064x}",
            response_id=f"served-{call}",
            # Stamped as Gym's model server stamps every row it commits.
            output_fingerprint=gym_fingerprint.assistant_fingerprint([assistant(reply)]),
            continuation_fingerprint=gym_fingerprint.assistant_fingerprint([*request, assistant(reply)]),
            fingerprint_version=gym_fingerprint.FINGERPRINT_VERSION,
        )
        self.rows[call] = row
        self.chains[call] = (*(self.chains[parent] if parent else ()), row.staging_key)
        response = [assistant(reply)]
        commit = gym_records.CaptureLedgerCommit(
            rollout_id=self.rollout,
            record=row,
            staging_chain=self.chains[call],
            request_items=request,
            response_items=response,
        )
        asyncio.run(self.gym.record(commit))
        self.ledger.record(from_json(commit.model_dump_json(), CaptureLedgerCommit))
        self.committed = True
        return [*request, *response]

    def gym_decides(self, request: list[dict[str, Any]]) -> tuple[str, str | None]:
        """Gym's decision as ``resolve_parent`` takes it for external staging."""
        if not gym_fingerprint.assistant_fingerprint(request):
            return ("text", None)
        resolution = asyncio.run(self.gym.resolve(self.rollout, request))
        if resolution.match is not None:
            return ("token_in", resolution.match.model_call_id)
        if not asyncio.run(self.gym.has_rows(self.rollout)):
            return ("text", None)  # seeded history on an empty ledger
        return ("poisoned", UNRESOLVED_PARENT)

    def store_decides(self, call: str, request: list[dict[str, Any]]) -> tuple[str, str | None]:
        decided = self.ledger.admit(self.rollout, call, request)
        if decided.admission is None:
            return ("poisoned", decided.failure)
        return (decided.admission.mode, decided.admission.parent_call_id)


def test_a_rewritten_or_dropped_user_turn_is_unresolved_as_in_gym(store: Store, tmp_path: Path) -> None:
    both = Both(store, tmp_path)
    first = both.commit("c0", [{"role": "system", "content": "sys"}, user("What is 2+2?")], "4")
    second = both.commit("c1", [*first, user("And 3+3?")], "6", parent="c0")
    cases = {
        "faithful": ([*second, user("And 4+4?")], ("token_in", "c1")),
        "a branch from the first call": ([*first, user("again")], ("token_in", "c0")),
        "rewritten user turn": (
            [first[0], user("What is 2+3?"), first[2], user("And 3+3?"), second[-1], user("more")],
            ("poisoned", UNRESOLVED_PARENT),
        ),
        "dropped user turn": (
            [first[0], first[2], user("And 3+3?"), second[-1], user("x")],
            ("poisoned", UNRESOLVED_PARENT),
        ),
        "dropped system turn": ([*second[1:], user("x")], ("poisoned", UNRESOLVED_PARENT)),
        "summarized tool-free history": ([user("summary"), second[-1], user("x")], ("poisoned", UNRESOLVED_PARENT)),
        "fresh root": ([user("a new question")], ("text", None)),
    }
    for name, (request, expected) in cases.items():
        assert both.gym_decides(request) == expected, name
        assert both.store_decides(f"n-{name}", request) == expected, name


def test_parent_resolution_agrees_with_gym_on_random_histories(store: Store, tmp_path: Path) -> None:
    rng = random.Random(6)
    both = Both(store, tmp_path)
    conversations: dict[str, list[dict[str, Any]]] = {}
    for index in range(12):
        parent = rng.choice([None, *conversations]) if conversations else None
        base = conversations[parent] if parent else [user(f"q{index}")]
        request = [*base, user(rng.choice(["go on", "why?", f"turn {index}"]))] if parent else base
        conversations[f"c{index}"] = both.commit(f"c{index}", request, rng.choice(["yes", "no", f"r{index}"]), parent)
    agreed = 0
    for trial in range(60):
        history = list(rng.choice(list(conversations.values())))
        edit = rng.randint(0, 4)
        if edit == 1 and len(history) > 1:
            del history[rng.randrange(len(history) - 1)]  # drop a turn
        elif edit == 2:
            spot = rng.randrange(len(history))
            history[spot] = {**history[spot], "content": f"{history[spot]['content']}!"}  # rewrite a turn
        request = [*history, user("next")]
        gym_says = both.gym_decides(request)
        assert both.store_decides(f"t{trial}", request) == gym_says, (trial, edit)
        agreed += gym_says[0] == "token_in"
    assert agreed >= 5  # the trials resolve some parents, not only refusals


def test_seeded_history_on_an_empty_ledger_is_a_text_root_in_both(store: Store, tmp_path: Path) -> None:
    both = Both(store, tmp_path)
    request = [user("hi"), assistant("seeded reply"), user("go on")]
    assert both.gym_decides(request) == both.store_decides("c0", request) == ("text", None)
