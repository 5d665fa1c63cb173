"""A real engine end to end (issue 21): a tiny transformers Llama (random weights from a seeded
config, KV cache, tokens sampled from its logits, log-probs from their log-softmax) drives a
worker process; a cut is served from a second thread while the main thread decodes; the worker
is SIGKILLed; a fresh process continues the cut call from the store alone at a newer policy
version, after every mistake of the issue is refused with nothing written.

The rollout must equal the same seeded engine decoding without interruption: token ids and
masks exactly, log-probs within ``LOGPROB_TOLERANCE``.  Why a tolerance at all: the tokens a
cut restored keep the log-probs staged by the first attempt (bit for bit), but the tokens
decoded after the restore come from logits computed by one prefill over prompt + prefix
instead of step by step through the KV cache; float32 attention and matmul sums then run in
another order and move a log-prob by about 1e-5 at most on this model (logits spread over
~10 nats).  1e-4 is ten times that and still a thousand times below any difference a trainer
would notice (log-probs are stored as float32 anyway, whose spacing near -5 is ~5e-7).

Skipped, with the reason, unless torch and transformers import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the real-engine tests need torch (pip install torch==2.13.0)")
pytest.importorskip("transformers", reason="the real-engine tests need the [transformers] extra")

import engine_worker  # noqa: E402  (after the skips: it imports torch)

from store import ConfigurationError, GenerationCutInventory, GenerationCutPrefix, open_store, to_json  # noqa: E402

LOGPROB_TOLERANCE = 1e-4
WORKER = Path(__file__).with_name("engine_worker.py")
TIMEOUT = 120


class Process:
    def __init__(self, phase: str, path: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(sys.path))
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), phase, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def expect(self, event: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message: dict[str, Any] = json.loads(line)
            if message["event"] == event:
                return message
        self.process.wait(TIMEOUT)
        assert self.process.stderr is not None
        raise AssertionError(
            f"the worker exited ({self.process.returncode}) before {event!r}: {self.process.stderr.read()}"
        )

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(TIMEOUT)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def uninterrupted() -> tuple[list[int], list[float], list[float]]:
    """The rollout decoded by the same seeded engine without a cut or a crash."""
    engine = engine_worker.engine()
    ids: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    for turn in range(engine_worker.TURNS):
        user = engine_worker.user(turn)
        engine.prefill([*ids, *user])
        for _ in range(engine_worker.LIMIT):
            engine.step()
        ids += [*user, *engine.generated_token_ids]
        mask += [0.0] * len(user) + [1.0] * engine_worker.LIMIT
        logprobs += [0.0] * len(user) + list(engine.generated_logprobs)
    return ids, mask, logprobs


def test_a_real_engine_cut_while_decoding_killed_and_continued_in_a_fresh_process(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    open_store(path).close()
    reference: list[tuple[list[int], list[float], list[float]]] = []
    computing = threading.Thread(target=lambda: reference.append(uninterrupted()), daemon=True)
    computing.start()  # while the worker processes decode (torch releases the GIL)
    first = Process("serve", path)
    try:
        inflight = first.expect("inflight")
        inventory = GenerationCutInventory.build(
            checkpoint_id="checkpoint-1",
            server_name="policy-0",
            active_prefixes=[
                GenerationCutPrefix(
                    ticket_id="ticket-r",
                    rollout_id="r",
                    attempt_index=0,
                    model_call_id=inflight["model_call_id"],
                    admitted_at=inflight["admitted_at"],
                )
            ],
        )
        first.send(to_json(inventory).decode())  # served on the worker's second thread
        [ack] = first.expect("receipt")["receipt"]["prefixes"]
        decoding = first.expect("decoding")
        os.kill(first.process.pid, signal.SIGKILL)
        assert first.process.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        first.close()
    restored = ack["prefix_token_count"]
    assert ack["disposition"] == "durable_prefix" and ack["effective_output_limit"] == engine_worker.LIMIT
    # The cut held what was decoded when it froze the buffer, while decoding went on around it.
    assert engine_worker.CUT_AT <= restored <= decoding["decoded"] < engine_worker.LIMIT

    second = Process("resume", path)
    try:
        mistakes = second.expect("refused")["mistakes"]
        done = second.expect("done")
        assert second.process.wait(TIMEOUT) == 0
    finally:
        second.close()
    assert {name: (found["code"], found["wrote"]) for name, found in mistakes.items()} == {
        "own_capture_key": ("own_attempt", False),
        "wrong_parent_call_id": ("lineage", False),
        "tampered_parent_token": ("cumulative_hash", False),
        "tampered_digest": ("digest", False),
        "wrong_token_count": ("token_count", False),
        "older_policy_version": ("policy_version", False),
    }, mistakes
    assert done["limit_refusal"] == "output_limit"
    assert (done["restored"], done["decoded"]) == (restored, engine_worker.LIMIT - restored)

    computing.join(TIMEOUT)
    [(ids, mask, logprobs)] = reference
    with open_store(path, read_only=True) as store:
        audit = store.audit()
        assert audit.ok, audit.summary()
        assert store.replay().ok
        export = tmp_path / "export.jsonl"
        report = store.export_jsonl(str(export), rollout_ids=["r"])
        assert report.ok and report.rows == 1
    [row] = [json.loads(line) for line in export.read_text().splitlines()]
    assert row["token_ids"] == ids  # every token of the uninterrupted run
    assert row["token_mask"] == mask
    worst = max(abs(a - b) for a, b in zip(row["logprobs"], logprobs, strict=True))
    assert worst <= LOGPROB_TOLERANCE, worst
    # Per token: the first attempt's policy (1) up to the cut, the replacement's (2) after it.
    user_lengths = [len(engine_worker.user(turn)) for turn in range(engine_worker.TURNS)]
    expected: list[int | None] = []
    for turn, carried in enumerate(user_lengths):
        generated = [1] * engine_worker.LIMIT if turn < 2 else [2] * engine_worker.LIMIT
        if turn == 2:
            generated = [1] * restored + [2] * (engine_worker.LIMIT - restored)
        expected += [None] * carried + generated
    assert row["token_policy_versions"] == expected
    # A continued call is stamped with its oldest version in weight_versions (as Gym does).
    assert row["weight_versions"] == [1, 1, 1, 2]


def test_the_demo_runs_on_the_transformers_engine(tmp_path: Path) -> None:
    """``staging-store demo --engine transformers``: the main job on the tiny Llama, verified."""
    from store.demo.run import run_demo

    summary = run_demo(str(tmp_path / "demo.db"), rollouts=1, workers=1, tokens=16, seed=3, engine_kind="transformers")
    assert summary.ok, summary.failures
    assert (summary.rollouts_identical, summary.continuations_validated, summary.audit_ok) == (1, 1, True)
    assert summary.tokens_reused > 0


def test_the_engine_feeds_its_inputs_on_the_models_device() -> None:
    """A model moved off the CPU (``model.to("cuda")`` on a worker with a GPU) gets its input ids
    on its own device, for the prefill and for every step.  The model here sits on PyTorch's
    ``meta`` device, which runs a forward without data (no GPU on CI): the ids each forward was
    given must be on ``meta`` too, where a CPU tensor would fail the first forward on a GPU."""
    from store.adapters.transformers import TransformersEngine, tiny_llama

    model = tiny_llama(0).to("meta")
    devices: list[str] = []
    model.register_forward_pre_hook(
        lambda _module, _args, kwargs: devices.append(kwargs["input_ids"].device.type), with_kwargs=True
    )
    engine = TransformersEngine(model, seed=1)
    engine.prefill([3, 4, 5])
    engine._forward([7])  # a step's forward of its sampled token (sampling itself needs values)
    assert devices == ["meta", "meta"]


def test_a_cold_temperature_decodes_greedily_and_reports_the_models_own_log_probs() -> None:
    """At temperature 1e-4 the tempered distribution is the argmax's alone, so every token is
    the argmax of the model's logits over the sequence so far (checked by one full forward, not
    the engine's cache); each log-prob is the untempered log-softmax at that token (what vLLM
    reports by default), within float32 summation order (1e-5)."""
    from store.adapters.transformers import TransformersEngine, tiny_llama

    model = tiny_llama(4)
    engine = TransformersEngine(model, seed=9, temperature=1e-4)
    prompt = [5, 17, 29, 41]
    engine.prefill(prompt)
    steps = [engine.step() for _ in range(12)]
    ids = [token for token, _ in steps]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*prompt, *ids]])).logits[0, len(prompt) - 1 : -1].float()
    assert ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(ids)), torch.tensor(ids)].tolist()
    assert [logprob for _, logprob in steps] == pytest.approx(expected, abs=1e-5)
    assert list(engine.generated_token_ids) == ids


def test_a_stop_token_of_the_transformers_engine_ends_the_call_with_finish_stop(tmp_path: Path) -> None:
    """``stop_token_ids``: the call ends at the first one decoded (it is the call's last output
    token), ``finish_reason="stop"``, and the tokens before it are the unstopped engine's."""
    from store import CaptureAdmission, RolloutTokenCapture, generate
    from store.adapters.transformers import TransformersEngine, tiny_llama

    model = tiny_llama(2)
    free = TransformersEngine(model, seed=3)
    free.prefill([7, 8, 9])
    unstopped = [free.step()[0] for _ in range(20)]
    stop = unstopped[5]
    first = unstopped.index(stop)
    with open_store(str(tmp_path / "s.db")) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
        call = capture.begin_call(CaptureAdmission(rollout_id="r", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=[7, 8, 9], effective_output_limit=20)
        assert generate(capture, call, TransformersEngine(model, seed=3, stop_token_ids=[stop])) == "stop"
        coords = capture.complete_observed(call)
        assert coords.staging_key is not None, coords
        (record,) = store.fetch([coords.staging_key])
        assert list(record.token_ids_delta) == [7, 8, 9, *unstopped[: first + 1]]
        info = store.call("r", "c0")
        assert info is not None and info.state == "completed"
        capture.close()
    with pytest.raises(ConfigurationError, match="temperature"):
        TransformersEngine(model, temperature=0)
    with pytest.raises(ConfigurationError, match="seed"):
        TransformersEngine(model, seed=-1)
