"""A worker's path from a receipt (or the store, after a crash) to a continued call, and the
mistakes a worker author makes on the way, each refused before anything is written (issue 21).

A 3-turn rollout ``r``: c0 (text) and c1 complete, c2 is cut mid-decoding at policy version 4;
the replacement continues it as attempt 1 at version 5 and completes it from what it observed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from capture_helpers import Versions, writes_nothing

from store import (
    ActiveCall,
    CaptureAdmission,
    CaptureError,
    GenerationCutError,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    InvalidRecordError,
    RolloutTokenCapture,
    Store,
    VersionSpan,
    capture_key,
    open_store,
    split_capture_key,
    to_json,
)
from store.cli.app import main

LIMIT = 12  # each call's whole output limit
CUT_AFTER = 5  # tokens c2 decodes before the checkpoint


def user(turn: int) -> list[int]:
    return [100 + 10 * turn + i for i in range(3)]


def tokens(turn: int, start: int, stop: int) -> tuple[list[int], list[float]]:
    """A deterministic engine: the tokens of a call depend only on its turn and position."""
    ids = [1000 + 100 * turn + i for i in range(start, stop)]
    return ids, [-(i % 5 + 1) / 8 for i in range(start, stop)]  # exact in float32


@dataclass
class Rollout:
    store: Store
    capture: RolloutTokenCapture
    versions: Versions
    history: list[int]
    parent: tuple[str, str] | None = None  # (call id, chain hash)

    def admission(self, turn: int, key: str = "r", **fields: Any) -> CaptureAdmission:
        if self.parent is None:
            return CaptureAdmission(rollout_id=key, model_call_id=f"c{turn}", mode="text", **fields)
        return CaptureAdmission(
            rollout_id=key,
            model_call_id=f"c{turn}",
            parent_call_id=self.parent[0],
            prev_len=len(self.history),
            mode="token_in",
            required_prefix_token_ids=self.history,
            parent_chain_hash=self.parent[1],
            **fields,
        )

    def play(self, turn: int, key: str = "r") -> None:
        call = self.capture.begin_call(self.admission(turn, key))
        prompt = [*self.history, *user(turn)]
        self.capture.track(call, prompt_token_ids=prompt, effective_output_limit=LIMIT)
        self.capture.observe(call, *tokens(turn, 0, LIMIT), finish_reason="length")
        coords = self.capture.complete_observed(call)
        assert coords.disposition == "staged", coords
        self.history = [*prompt, *tokens(turn, 0, LIMIT)[0]]
        self.parent = (coords.model_call_id, coords.chain_hash or "")


def ticket(call: ActiveCall, rollout_id: str = "r", attempt: int = 0, admitted_at: float | None = None) -> Any:
    return GenerationCutPrefix(
        ticket_id=f"t-{call.capture_key}-{call.model_call_id}",
        rollout_id=rollout_id,
        attempt_index=attempt,
        model_call_id=call.model_call_id,
        admitted_at=call.admitted_at if admitted_at is None else admitted_at,
    )


def cut(capture: RolloutTokenCapture, checkpoint: str, *tickets: GenerationCutPrefix) -> GenerationCutPrefixAck:
    inventory = GenerationCutInventory.build(checkpoint_id=checkpoint, server_name="w0", active_prefixes=tickets)
    receipt = capture.serve_generation_cut(inventory)
    receipt.validate_for(inventory)
    return receipt.prefixes[0]


@dataclass
class Cut:
    rollout: Rollout
    call: ActiveCall
    ack: GenerationCutPrefixAck


@pytest.fixture
def rollout(store: Store) -> Rollout:
    versions = Versions(4)
    made = Rollout(store, RolloutTokenCapture(store=store, weight_version_fn=versions), versions, [])
    made.play(0)
    made.play(1)
    return made


@pytest.fixture
def cut_c2(rollout: Rollout) -> Cut:
    """c2 of attempt 0 decoded CUT_AFTER tokens when checkpoint-1 cut it."""
    call = rollout.capture.begin_call(rollout.admission(2))
    rollout.capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    rollout.capture.observe(call, *tokens(2, 0, CUT_AFTER))
    ack = cut(rollout.capture, "checkpoint-1", ticket(call))
    assert ack.disposition == "durable_prefix" and ack.prefix_token_count == CUT_AFTER
    return Cut(rollout, call, ack)


def uninterrupted(store: Store) -> list[int]:
    """The same rollout decoded without a cut, in another rollout id of the same store."""
    again = Rollout(store, RolloutTokenCapture(store=store, weight_version_fn=lambda: 4), Versions(4), [])
    for turn in range(3):
        again.play(turn, key="u")
    return again.history


# --- the path: receipt -> continued call -> completed from what was observed ---------------------


def test_continue_cut_admits_the_next_attempt_and_completes_from_what_it_observed(cut_c2: Cut) -> None:
    rollout, ack = cut_c2.rollout, cut_c2.ack
    rollout.versions.value = 5
    call = rollout.capture.continue_cut(ack)
    assert (call.capture_key, call.model_call_id, call.weight_version) == ("r-a1", "c2", 5)
    resumed = call.continuation
    assert resumed is not None and resumed.remaining_output_limit == LIMIT - CUT_AFTER
    assert list(resumed.engine_prompt_token_ids) == [*rollout.history, *user(2), *tokens(2, 0, CUT_AFTER)[0]]
    # Tracked already: the engine decodes only the rest; the capture completes what it saw.
    rollout.capture.observe(call, *tokens(2, CUT_AFTER, LIMIT), finish_reason="length")
    coords = rollout.capture.complete_observed(call)
    assert coords.disposition == "staged" and coords.staging_key == "r-a1/c2"
    assert coords.weight_version == 4  # the oldest contributing version
    info = rollout.store.call("r-a1", "c2")
    assert info is not None and info.continues == ("r", "c2")
    generated = sum(end - start for start, end, _ in info.version_spans)
    assert generated == LIMIT
    assert [(s, e, v) for s, e, v in info.version_spans] == [(3, 3 + CUT_AFTER, 4), (3 + CUT_AFTER, 3 + LIMIT, 5)]
    assert rollout.store.audit().ok
    [row] = rollout.store.linearize("r").rows
    assert list(row.token_ids) == uninterrupted(rollout.store)


def test_continue_latest_cut_after_a_crash_needs_only_the_rollout_and_the_call(store_url: str) -> None:
    """The orchestrator lost its process and the receipt: the store has both."""
    with open_store(store_url) as store:
        rollout = Rollout(store, RolloutTokenCapture(store=store, weight_version_fn=lambda: 4), Versions(4), [])
        rollout.play(0)
        rollout.play(1)
        history = rollout.history
        call = rollout.capture.begin_call(rollout.admission(2))
        rollout.capture.track(call, prompt_token_ids=[*history, *user(2)], effective_output_limit=LIMIT)
        rollout.capture.observe(call, *tokens(2, 0, 3))
        cut(rollout.capture, "checkpoint-1", ticket(call))
        rollout.capture.observe(call, *tokens(2, 3, CUT_AFTER))
        cut(rollout.capture, "checkpoint-2", ticket(call))  # the newest cut holds CUT_AFTER tokens
        rollout.capture.close()
    with open_store(store_url) as store:  # a fresh process
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 5)
        assert [receipt.checkpoint_id for receipt in store.cut_receipts(rollout_id="r")] == [
            "checkpoint-1",
            "checkpoint-2",
        ]
        latest = store.latest_cut("r", "c2")
        assert latest is not None and latest.prefix_token_count == CUT_AFTER
        call = capture.continue_latest_cut("r", "c2")
        assert call.capture_key == "r-a1"
        assert call.continuation is not None
        assert list(call.continuation.restored_token_ids) == tokens(2, 0, CUT_AFTER)[0]
        capture.observe(call, *tokens(2, CUT_AFTER, LIMIT), finish_reason="length")
        assert capture.complete_observed(call).disposition == "staged"
        with pytest.raises(GenerationCutError) as refused:
            capture.continue_latest_cut("r", "c9")
        assert refused.value.code == "no_cut"
        assert store.audit().ok
        capture.close()


def test_a_continued_cut_can_be_cut_and_continued_again(cut_c2: Cut) -> None:
    rollout = cut_c2.rollout
    first = rollout.capture.continue_cut(cut_c2.ack)
    rollout.capture.observe(first, *tokens(2, CUT_AFTER, CUT_AFTER + 2))
    again = cut(rollout.capture, "checkpoint-2", ticket(first, attempt=1))
    assert again.prefix_token_count == CUT_AFTER + 2 and again.effective_output_limit == LIMIT
    second = rollout.capture.continue_cut(again)
    assert second.capture_key == "r-a2"
    rollout.capture.observe(second, *tokens(2, CUT_AFTER + 2, LIMIT), finish_reason="length")
    assert rollout.capture.complete_observed(second).disposition == "staged"
    assert rollout.store.audit().ok


def test_continue_cut_of_a_root_call(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    call = capture.begin_call(CaptureAdmission(rollout_id="t", model_call_id="c0", mode="text"))
    capture.track(call, prompt_token_ids=user(0), effective_output_limit=LIMIT)
    capture.observe(call, *tokens(0, 0, 4))
    ack = cut(capture, "ck", ticket(call, rollout_id="t"))
    replacement = capture.continue_cut(ack)
    assert replacement.admission.mode == "text" and replacement.capture_key == "t-a1"
    capture.observe(replacement, *tokens(0, 4, 6), finish_reason="stop")
    assert capture.complete_observed(replacement).disposition == "staged"
    assert store.audit().ok


def test_continue_cut_refuses_what_cannot_be_continued(cut_c2: Cut) -> None:
    rollout = cut_c2.rollout
    failure = GenerationCutPrefixAck(**_identity(cut_c2.ack), disposition="durable_failure")
    with writes_nothing(rollout.store, ("r-a1", "c2")), pytest.raises(GenerationCutError) as refused:
        rollout.capture.continue_cut(failure)
    assert refused.value.code == "no_cut"
    with writes_nothing(rollout.store), pytest.raises(GenerationCutError) as refused:
        rollout.capture.continue_cut(cut_c2.ack, attempt=0)
    assert refused.value.code == "own_attempt"


def _identity(ack: GenerationCutPrefixAck) -> dict[str, Any]:
    return {name: getattr(ack, name) for name in ("ticket_id", "rollout_id", "attempt_index", "model_call_id")} | {
        "admitted_at": ack.admitted_at
    }


# --- defect 1: one output limit, checked --------------------------------------------------------


def test_track_refuses_the_remaining_limit_for_a_continued_call(cut_c2: Cut) -> None:
    """Given what the engine is told (the remaining limit), the next cut acknowledged more
    tokens than the limit and a later restore ended the call short; now track() refuses it."""
    rollout = cut_c2.rollout
    call = rollout.capture.continue_cut(cut_c2.ack, track=False)
    assert call.continuation is not None
    remaining = call.continuation.remaining_output_limit
    with writes_nothing(rollout.store), pytest.raises(CaptureError) as refused:
        rollout.capture.track(
            call, prompt_token_ids=call.continuation.engine_prompt_token_ids, effective_output_limit=remaining
        )
    assert refused.value.code == "output_limit"
    assert f"{LIMIT}" in str(refused.value) and "remaining" in str(refused.value)
    with pytest.raises(CaptureError) as refused:
        rollout.capture.track(call, prompt_token_ids=[*rollout.history, *user(2)])
    assert refused.value.code == "prompt"
    rollout.capture.track(call)  # the continuation's prompt and whole limit
    rollout.capture.observe(call, *tokens(2, CUT_AFTER, CUT_AFTER + 3))
    again = cut(rollout.capture, "checkpoint-2", ticket(call, attempt=1))
    assert (again.prefix_token_count, again.effective_output_limit) == (CUT_AFTER + 3, LIMIT)


def test_tokens_past_the_limit_are_never_acknowledged(rollout: Rollout) -> None:
    call = rollout.capture.begin_call(rollout.admission(2))
    rollout.capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=4)
    rollout.capture.observe(call, *tokens(2, 0, 5))
    with writes_nothing(rollout.store), pytest.raises(GenerationCutError, match="past the call's output limit 4"):
        cut(rollout.capture, "checkpoint-1", ticket(call))
    coords = rollout.capture.complete_observed(call)
    assert coords.disposition == "capture_failed"
    # complete_call with more generated tokens than the tracked limit fails the capture too.
    other = rollout.capture.begin_call(rollout.admission(3))
    rollout.capture.track(other, prompt_token_ids=[*rollout.history, *user(3)], effective_output_limit=2)
    coords = rollout.capture.complete_call(
        other,
        prompt_token_ids=[*rollout.history, *user(3)],
        generated_token_ids=tokens(3, 0, 3)[0],
        generated_logprobs=tokens(3, 0, 3)[1],
    )
    assert coords.disposition == "capture_failed"
    # The wire records refuse a count past the limit, whoever made them.
    fields = {**to_json_dict(cut_ack_fields()), "prefix_token_count": 13, "effective_output_limit": 12}
    with pytest.raises(InvalidRecordError, match="output limit"):
        GenerationCutPrefixAck(**fields)


def cut_ack_fields() -> GenerationCutPrefixAck:
    return GenerationCutPrefixAck(
        ticket_id="t",
        rollout_id="r",
        attempt_index=0,
        model_call_id="c",
        admitted_at=1.0,
        disposition="durable_prefix",
        cut_kind="active_prefix",
        frozen_buffer_id="active/ck/0",
        staging_keys=("k",),
        prefix_token_count=1,
        prefix_digest="0" * 64,
        effective_output_limit=12,
    )


def to_json_dict(record: Any) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(to_json(record))
    return value


# --- defect 2: admission refuses what the audit forbids ------------------------------------------


def test_a_replacement_reusing_its_own_capture_key_is_refused_and_the_audit_stays_clean(cut_c2: Cut) -> None:
    rollout, ack = cut_c2.rollout, cut_c2.ack
    own = rollout.admission(2, key="r", generation_cut=ack.continuation())  # "r", not "r-a1"
    with writes_nothing(rollout.store), pytest.raises(GenerationCutError) as refused:
        rollout.capture.begin_call(own)
    assert refused.value.code == "own_attempt"
    assert "capture_key(rollout, attempt + 1)" in str(refused.value)
    assert rollout.store.audit().ok


# --- defect 3: a continued call in its natural shape ----------------------------------------------


def test_complete_call_accepts_a_continued_call_in_its_natural_shape(cut_c2: Cut) -> None:
    rollout = cut_c2.rollout
    call = rollout.capture.continue_cut(cut_c2.ack, track=False)
    continuation = call.continuation
    assert continuation is not None
    ids, logprobs = tokens(2, 0, LIMIT)
    coords = rollout.capture.complete_call(
        call,
        prompt_token_ids=[*rollout.history, *user(2)],  # the call's prompt, not the engine's
        generated_token_ids=ids,  # every generated token, the restored ones first
        generated_logprobs=[*continuation.restored_logprobs, *logprobs[CUT_AFTER:]],
    )
    assert coords.disposition == "staged"
    [record] = rollout.store.fetch(["r-a1/c2"])
    assert list(record.token_ids_delta) == [*user(2), *ids]
    assert rollout.store.audit().ok
    [row] = rollout.store.linearize("r").rows
    assert list(row.token_ids) == uninterrupted(rollout.store)


def test_natural_shape_with_other_restored_log_probs_names_them(cut_c2: Cut) -> None:
    rollout = cut_c2.rollout
    call = rollout.capture.continue_cut(cut_c2.ack, track=False)
    ids, logprobs = tokens(2, 0, LIMIT)
    logprobs[1] += 0.001
    coords = rollout.capture.complete_call(
        call, prompt_token_ids=[*rollout.history, *user(2)], generated_token_ids=ids, generated_logprobs=logprobs
    )
    assert coords.disposition == "capture_failed"


# --- defect 4: each refusal its own code, naming what differed -----------------------------------


@pytest.mark.parametrize(
    ("case", "code", "named"),
    [
        ("wrong-parent-call", "lineage", "'cX'"),
        ("wrong-parent-chain", "parent_chain", "chain hash"),
        ("tampered-parent-token", "cumulative_hash", "parent tokens"),
        ("tampered-digest", "digest", "the continuation names 0000"),
        ("wrong-count", "token_count", "names 4"),
        ("unknown-key", "keys", "__generation_cut__/nope/r/c2/0"),
        ("other-source-call", "source_call", "r/c1"),
        ("newer-version", "policy_version", "newer"),
        ("own-attempt", "own_attempt", "own attempt"),
    ],
)
def test_begin_call_refuses_each_check_with_its_own_code(cut_c2: Cut, case: str, code: str, named: str) -> None:
    rollout, ack = cut_c2.rollout, cut_c2.ack
    continuation = ack.continuation()
    fields: dict[str, Any] = {}
    version = 4
    key = "r-a1"
    cont = {name: getattr(continuation, name) for name in continuation.__struct_fields__}
    if case == "wrong-parent-call":
        fields["parent_call_id"] = "cX"
    elif case == "wrong-parent-chain":
        fields["parent_chain_hash"] = "f" * 64
    elif case == "tampered-parent-token":
        history = list(rollout.history)
        history[0] += 1
        fields["required_prefix_token_ids"] = history
    elif case == "tampered-digest":
        cont["digest"] = "0" * 64
    elif case == "wrong-count":
        cont["generation_token_count"] = 4
    elif case == "unknown-key":
        cont["staging_keys"] = ("__generation_cut__/nope/r/c2/0",)
    elif case == "other-source-call":
        cont["staging_keys"] = ("r/c1",)  # c1's terminal record, named as c2's cut
    elif case == "newer-version":
        version = 3
    elif case == "own-attempt":
        key = "r"
    base = rollout.admission(2, key=key)
    values = {name: getattr(base, name) for name in base.__struct_fields__} | fields
    values["generation_cut"] = type(continuation)(**cont)
    admission = CaptureAdmission(**values)
    with writes_nothing(rollout.store, ("r-a1", "c2")), pytest.raises(CaptureError) as refused:
        rollout.capture.begin_call(admission, weight_version=version)
    assert refused.value.code == code, refused.value
    assert named in str(refused.value)


def test_capture_error_codes_survive_pickling() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(GenerationCutError("it differs", "digest")))
    assert (type(error), error.code, str(error)) == (GenerationCutError, "digest", "it differs")
    assert CaptureError("x").code == "capture"


# --- defect 5: receipts listed by checkpoint and rollout (library and CLI) ------------------------


def test_receipts_are_listed_by_checkpoint_and_by_rollout(
    cut_c2: Cut, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout = cut_c2.rollout
    other = rollout.capture.begin_call(CaptureAdmission(rollout_id="q", model_call_id="c0", mode="text"))
    rollout.capture.track(other, prompt_token_ids=[1], effective_output_limit=4)
    rollout.capture.observe(other, [5], [-0.5])
    cut(rollout.capture, "checkpoint-2", ticket(other, rollout_id="q"))
    store = rollout.store
    assert [r.checkpoint_id for r in store.cut_receipts()] == ["checkpoint-1", "checkpoint-2"]
    assert [r.checkpoint_id for r in store.cut_receipts(checkpoint_id="checkpoint-2")] == ["checkpoint-2"]
    assert [r.checkpoint_id for r in store.cut_receipts(rollout_id="r")] == ["checkpoint-1"]
    assert [r.checkpoint_id for r in store.cut_receipts(rollout_id="q")] == ["checkpoint-2"]
    assert store.cut_receipts(rollout_id="nobody") == []
    kept = store.kept_receipts(rollout_id="q")
    assert [(receipt.checkpoint_id, domain) for receipt, domain in kept] == [("checkpoint-2", "local")]
    assert store.latest_cut("r", "c2") == cut_c2.ack
    assert store.latest_cut("q", "c2") is None
    code = main(["receipts", store_url, "--rollout", "r", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["checkpoint_id"] for r in shown["receipts"]] == ["checkpoint-1"]
    assert shown["receipts"][0]["prefixes"][0]["prefix_token_count"] == CUT_AFTER
    assert shown["domains"] == ["local"]  # durable in this store: a host loss would lose it
    code = main(["receipts", store_url, "--checkpoint", "checkpoint-2"])
    table = capsys.readouterr().out
    assert code == 0 and "q" in table and "durable_prefix" in table
    lines = table.splitlines()  # a count, the header, a rule, then the rows
    assert lines[1].split()[5] == "domain" and lines[3].split()[4] == "local"


# --- defect 6: the smaller ones -------------------------------------------------------------------


def test_split_capture_key_inverts_capture_key() -> None:
    for rollout_id in ("x", "x-a1", "r.7"):
        for attempt in (0, 1, 12):
            assert split_capture_key(capture_key(rollout_id, attempt), rollout_id) == attempt
    assert split_capture_key("x-a1", "x-a1") == 0  # attempt 0 of rollout x-a1, not attempt 1 of x
    for key, rollout_id in (("y", "x"), ("x-a01", "x"), ("x-a0", "x"), ("x-b1", "x"), ("x-a", "x")):
        with pytest.raises(InvalidRecordError):
            split_capture_key(key, rollout_id)


def test_admitted_at_is_kept_and_a_ticket_for_another_admission_is_not_cut(rollout: Rollout) -> None:
    capture = rollout.capture
    stamped = capture.begin_call(rollout.admission(2), admitted_at=1234.5)
    assert stamped.admitted_at == 1234.5
    capture.track(stamped, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    capture.observe(stamped, *tokens(2, 0, 2))
    assert cut(capture, "ck-stale", ticket(stamped, admitted_at=1000.0)).disposition == "durable_failure"
    assert cut(capture, "ck-right", ticket(stamped)).disposition == "durable_prefix"
    lineage = rollout.store.lineage("r")
    assert lineage is not None
    assert [c.admitted_at for c in lineage.calls if c.model_call_id == "c2"] == [1234.5]
    with pytest.raises(CaptureError, match="admitted_at"):
        capture.begin_call(rollout.admission(3), admitted_at=float("nan"))
    # Without one, the worker's clock: tickets are not compared (Gym stamps its own clock).
    unstamped = capture.begin_call(rollout.admission(3))
    capture.track(unstamped, prompt_token_ids=[*rollout.history, *user(3)], effective_output_limit=LIMIT)
    capture.observe(unstamped, *tokens(3, 0, 2))
    assert cut(capture, "ck-gym", ticket(unstamped, admitted_at=7.0)).disposition == "durable_prefix"


def test_version_spans_are_start_end_version_triples(cut_c2: Cut) -> None:
    [span] = cut_c2.rollout.store.version_spans("r", "c1")
    start, end, version = span
    assert span == (start, end, version) == VersionSpan(start, end, version)
    assert (span.start, span.end, span.weight_version) == (3, 3 + LIMIT, 4)


def test_float64_log_probs_are_stored_as_float32(rollout: Rollout) -> None:
    call = rollout.capture.begin_call(rollout.admission(2))
    rollout.capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    rollout.capture.observe(call, [7], [-0.1], finish_reason="stop")
    coords = rollout.capture.complete_observed(call)
    assert coords.staging_key is not None
    [record] = rollout.store.fetch([coords.staging_key])
    assert record.generation_log_probs_delta[-1] == float(np.float32(-0.1)) != -0.1


# --- the engine loop (store.worker.engine) ----------------------------------------------------------


class Scripted:
    """A ``LiveEngine`` that decodes a fixed list of tokens (the loop's bookkeeping, not an engine's)."""

    def __init__(self, tokens: list[int], stop: tuple[int, ...] = ()) -> None:
        self.tokens, self.stop = tokens, stop
        self.prompts: list[list[int]] = []
        self._ids: list[int] = []

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.stop

    @property
    def generated_token_ids(self) -> list[int]:
        return self._ids

    @property
    def generated_logprobs(self) -> list[float]:
        return [-0.5] * len(self._ids)

    def prefill(self, prompt_token_ids: Any) -> None:
        self.prompts.append(list(prompt_token_ids))
        self._ids = []

    def step(self) -> tuple[int, float]:
        token = self.tokens[len(self._ids)]
        self._ids.append(token)
        return token, -0.5


def test_the_engine_loop_stops_at_a_stop_token_or_the_limit_and_continues_a_cut(rollout: Rollout) -> None:
    from store import LiveEngine, decode, generate

    capture = rollout.capture
    assert isinstance(Scripted([]), LiveEngine)
    stopped = capture.begin_call(rollout.admission(2))
    capture.track(stopped, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    engine = Scripted([5, 6, 2, 7], stop=(2,))
    coords = decode(capture, stopped, engine)
    assert coords.delta_len == len(user(2)) + 3 and engine.prompts == [[*rollout.history, *user(2)]]
    assert rollout.store.completion("r", "c2").finish_reason == "stop"  # type: ignore[union-attr]
    # A call cut mid-way and continued: the engine is prefilled with prompt + restored tokens only.
    other = capture.begin_call(rollout.admission(3))
    capture.track(other, prompt_token_ids=[*rollout.history, *user(3)], effective_output_limit=5)
    engine = Scripted(list(range(10, 20)))
    assert generate(capture, other, engine, max_tokens=3) is None
    ack = cut(capture, "ck", ticket(other))
    resumed = capture.continue_cut(ack)
    engine = Scripted(list(range(13, 20)))
    coords = decode(capture, resumed, engine)
    assert engine.prompts == [[*rollout.history, *user(3), 10, 11, 12]]
    assert engine.generated_token_ids == [13, 14]  # the limit of 5, less the 3 restored
    assert rollout.store.completion("r-a1", "c3").finish_reason == "length"  # type: ignore[union-attr]
    assert rollout.store.audit().ok


class CutInsideStep(Scripted):
    """Serves a cut from another thread inside ``step``, once the token is in its lists but before
    ``generate`` has it back: the moment a cut races the decode loop."""

    def __init__(
        self, capture: RolloutTokenCapture, call: ActiveCall, tokens: list[int], stop: tuple[int, ...]
    ) -> None:
        super().__init__(tokens, stop)
        self.capture, self.call = capture, call
        self.acks: list[GenerationCutPrefixAck] = []

    def step(self) -> tuple[int, float]:
        answer = super().step()
        thread = threading.Thread(
            target=lambda: self.acks.append(cut(self.capture, f"ck-{len(self._ids)}", ticket(self.call)))
        )
        thread.start()
        thread.join(30)
        return answer


def test_a_cut_while_generate_decodes_holds_every_token_but_a_stop_token_without_its_finish(rollout: Rollout) -> None:
    from store import generate

    capture = rollout.capture
    call = capture.begin_call(rollout.admission(2))
    capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    engine = CutInsideStep(capture, call, [5, 6, 2, 7], stop=(2,))
    assert generate(capture, call, engine) == "stop"
    # Each cut holds what was decoded up to it; the one inside the stop token's step does not
    # hold the stop token, which only comes with its finish reason.
    assert [ack.prefix_token_count for ack in engine.acks] == [1, 2, 2]
    assert all(ack.terminal_finish_reason is None for ack in engine.acks)
    last = cut(capture, "after", ticket(call))
    assert last.prefix_token_count == 3 and last.terminal_finish_reason == "stop"
    coords = capture.complete_observed(call)
    assert coords.delta_len == len(user(2)) + 3
    assert rollout.store.audit().ok


def test_generate_observes_what_the_engine_decoded_before_it_failed(rollout: Rollout) -> None:
    from store import generate

    capture = rollout.capture
    call = capture.begin_call(rollout.admission(2))
    capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    with pytest.raises(IndexError):  # the scripted engine runs out of tokens at the third step
        generate(capture, call, Scripted([5, 6]))
    assert cut(capture, "ck", ticket(call)).prefix_token_count == 2
    # The call is detached again: observe() takes the rest of its tokens.
    capture.observe(call, [7], [-0.5], finish_reason="length")
    assert capture.complete_observed(call).delta_len == len(user(2)) + 3


def test_observe_refuses_a_call_generate_is_decoding_and_generate_an_untracked_call(rollout: Rollout) -> None:
    from store import generate

    capture = rollout.capture
    call = capture.begin_call(rollout.admission(2))
    capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    refused: list[CaptureError] = []

    def observe_too(token: int, logprob: float) -> None:
        try:
            capture.observe(call, [token], [logprob])
        except CaptureError as exc:
            refused.append(exc)

    assert generate(capture, call, Scripted([5, 6, 7]), max_tokens=2, on_token=observe_too) is None
    assert len(refused) == 2 and "being decoded by generate()" in str(refused[0])
    assert cut(capture, "ck", ticket(call)).prefix_token_count == 2  # each token once
    untracked = capture.begin_call(rollout.admission(3))
    with pytest.raises(CaptureError, match="not tracked"):
        generate(capture, untracked, Scripted([5]))


class Unaligned(Scripted):
    @property
    def generated_logprobs(self) -> list[float]:
        return [-0.5] * max(0, len(self._ids) - 1)


class LogprobLate(CutInsideStep):
    """Its log-prob of the newest token lands after its id; a cut comes in between."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logprobs: list[float] = []

    @property
    def generated_logprobs(self) -> list[float]:
        return self._logprobs

    def step(self) -> tuple[int, float]:
        answer = super().step()  # the id is in, the cut was served
        self._logprobs.append(answer[1])
        return answer


def test_a_cut_takes_only_tokens_whose_log_probs_are_there_and_detach_checks_the_engine(rollout: Rollout) -> None:
    from store import generate

    capture = rollout.capture
    call = capture.begin_call(rollout.admission(2))
    capture.track(call, prompt_token_ids=[*rollout.history, *user(2)], effective_output_limit=LIMIT)
    engine = LogprobLate(capture, call, [5, 6, 7], stop=())
    assert generate(capture, call, engine, max_tokens=3) is None
    assert engine.acks[0].disposition == "durable_failure"  # nothing with its log-prob yet
    assert [ack.prefix_token_count for ack in engine.acks[1:]] == [1, 2]
    assert cut(capture, "after", ticket(call)).prefix_token_count == 3
    # An engine whose lists end unaligned breaks the protocol: the call's cuts are refused.
    broken = capture.begin_call(rollout.admission(3))
    capture.track(broken, prompt_token_ids=[*rollout.history, *user(3)], effective_output_limit=LIMIT)
    generate(capture, broken, Unaligned([5, 6]), max_tokens=2)
    with pytest.raises(GenerationCutError, match="differ in length"):
        cut(capture, "ck-broken", ticket(broken))
