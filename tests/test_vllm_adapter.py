"""``VllmAdapter`` on payloads shaped as vLLM's OpenAI-compatible server writes them (chat and
completions; ``return_token_ids``, ``return_tokens_as_token_ids``; stop and length finishes),
including the three vLLM adapter tests named in wire-contract section 9."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from store import (
    CaptureAdmission,
    CaptureDataError,
    CommitCoords,
    RolloutTokenCapture,
    Store,
    VllmAdapter,
    encode_routed_experts,
    from_json,
)

PROMPT = [151644, 872, 198, 9707, 151645]
GENERATED = [9707, 0, 151645]
LOGPROBS = [-0.0078125, -1.25, -0.0]  # float32-exact: the store keeps float32 columns


def chat_response(*, with_logprobs: bool = True, with_ids: bool = True, finish: str = "stop") -> dict[str, Any]:
    """A ``ChatCompletionResponse`` (vLLM >= 0.10.2, return_token_ids and return_tokens_as_token_ids)."""
    content = [
        {"token": f"token_id:{tid}", "logprob": lp, "bytes": [72], "top_logprobs": []}
        for tid, lp in zip(GENERATED, LOGPROBS, strict=True)
    ]
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello!", "reasoning_content": None, "tool_calls": []},
        "logprobs": {"content": content} if with_logprobs else None,
        "finish_reason": finish,
        "stop_reason": 151645 if finish == "stop" else None,
    }
    response: dict[str, Any] = {
        "id": "chatcmpl-5c1f",
        "object": "chat.completion",
        "created": 1730000000,
        "model": "Qwen/Qwen3-0.6B",
        "choices": [choice],
        "usage": {"prompt_tokens": len(PROMPT), "total_tokens": 8, "completion_tokens": 3},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    if with_ids:
        response["prompt_token_ids"] = PROMPT
        choice["token_ids"] = GENERATED
    return response


def completion_response(*, finish: str = "length", stop: str | None = None) -> dict[str, Any]:
    """A ``CompletionResponse``: ids per choice, ``logprobs`` as tokens/token_logprobs/top_logprobs."""
    return {
        "id": "cmpl-9a",
        "object": "text_completion",
        "created": 1730000000,
        "model": "Qwen/Qwen3-0.6B",
        "choices": [
            {
                "index": 0,
                "text": "Hello wor",
                "logprobs": {
                    "text_offset": [0, 5, 6],
                    "token_logprobs": LOGPROBS,
                    "tokens": [f"token_id:{tid}" for tid in GENERATED],
                    "top_logprobs": [None, None, None],
                },
                "finish_reason": finish,
                "stop_reason": stop,
                "prompt_logprobs": None,
                "prompt_token_ids": PROMPT,
                "token_ids": GENERATED,
            }
        ],
        "usage": {"prompt_tokens": len(PROMPT), "total_tokens": 8, "completion_tokens": 3},
    }


def _capture(store: Store) -> RolloutTokenCapture:
    return RolloutTokenCapture(store=store, weight_version_fn=lambda: 2, adapter=VllmAdapter())


def test_vllm_adapter_round_trips_native_tokens_logprobs_and_routes(store: Store) -> None:
    response = chat_response()
    routes = encode_routed_experts([[[1, 2]]] * (len(PROMPT) + len(GENERATED)))
    response["choices"][0]["routed_experts"] = routes
    capture = _capture(store)
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text"))
    coords = capture.complete_call_from_response(call, response)
    assert coords.disposition == "staged"
    (record,) = store.fetch([coords.staging_key or ""])
    assert list(record.token_ids_delta) == [*PROMPT, *GENERATED]
    assert list(record.generation_log_probs_delta) == [0.0] * len(PROMPT) + LOGPROBS
    assert record.extras == {"routed_experts": routes}

    parked = VllmAdapter().park_commit_coords(response, coords)
    assert from_json(_json(parked["ng_commit_coords"]), CommitCoords) == coords
    assert "ng_commit_coords" not in response  # the caller's payload is not changed


def test_vllm_adapter_supports_message_prompt_ids_and_logprob_tokens() -> None:
    adapter = VllmAdapter()
    # Chat: prompt ids at the response level; generated ids only as token_id:<n> log-prob tokens.
    response = chat_response(with_ids=False)
    response["prompt_token_ids"] = PROMPT
    assert adapter.extract_prompt_ids(response) == PROMPT
    assert adapter.extract_generation(response) == (GENERATED, LOGPROBS)
    assert adapter.extract_extras(response) is None


def test_vllm_extraction_failure_returns_poisoned_coords(store: Store) -> None:
    capture = _capture(store)
    broken = chat_response(with_logprobs=False)
    broken["choices"][0].pop("token_ids")
    call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id="c0", mode="text"))
    coords = capture.complete_call_from_response(call, broken)
    assert coords.disposition == "capture_failed"
    assert coords.staging_key is None
    info = store.call("r0", "c0")
    assert info is not None and info.state == "failed"


def test_completions_with_a_length_finish_and_a_stop_string(store: Store) -> None:
    adapter = VllmAdapter()
    for response in (completion_response(), completion_response(finish="stop", stop="\n\n")):
        assert adapter.extract_prompt_ids(response) == PROMPT
        assert adapter.extract_generation(response) == (GENERATED, LOGPROBS)
    capture = _capture(store)
    call = capture.begin_call(CaptureAdmission(rollout_id="r1", model_call_id="c0", mode="text"))
    assert capture.complete_call_from_response(call, completion_response(finish="stop", stop="\n\n")).disposition == (
        "staged"
    )


def test_chat_with_a_length_finish_and_ids_without_logprobs_is_refused() -> None:
    adapter = VllmAdapter()
    assert adapter.extract_generation(chat_response(finish="length")) == (GENERATED, LOGPROBS)
    with pytest.raises(CaptureDataError, match="log-probs"):
        adapter.extract_generation(chat_response(with_logprobs=False))  # ids but no log-probs to stage


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r["choices"].append(copy.deepcopy(r["choices"][0])),  # n=2
        lambda r: r.update(choices=[]),
        lambda r: r["choices"][0]["logprobs"]["content"][1].update(token="Hello"),
        lambda r: r["choices"][0]["logprobs"]["content"][1].update(token="token_id:-3"),
        lambda r: r["choices"][0]["logprobs"]["content"][1].update(logprob="x"),
        lambda r: r["choices"][0]["logprobs"]["content"][1].update(logprob=0.5),
        lambda r: r["choices"][0].update(token_ids=[1, 2, 3]),  # differs from the log-prob tokens
        lambda r: r["choices"][0].update(token_ids=[1, True, 3]),
        lambda r: r.pop("prompt_token_ids"),
        lambda r: r.update(prompt_token_ids="1 2 3"),
    ],
)
def test_unreadable_responses_raise_capture_data_error(damage: Any) -> None:
    response = chat_response()
    damage(response)
    adapter = VllmAdapter()
    with pytest.raises(CaptureDataError):
        adapter.extract_prompt_ids(response)
        adapter.extract_generation(response)


def test_enter_prefix_forces_capture_fields_without_changing_the_request() -> None:
    adapter = VllmAdapter()
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_logprobs": 5,
    }
    forced = adapter.enter_prefix(chat, [1, 2, 3])
    assert forced["stream"] is False and "stream_options" not in forced
    assert forced["logprobs"] is True and forced["top_logprobs"] == 0
    assert forced["return_tokens_as_token_ids"] is True and forced["return_token_ids"] is True
    assert forced["required_prefix_token_ids"] == [1, 2, 3]
    assert chat["stream"] is True  # a copy
    root = adapter.enter_prefix({**chat, "required_prefix_token_ids": [9]}, [])
    assert "required_prefix_token_ids" not in root  # a text root carries no prefix
    completion = adapter.enter_prefix({"model": "m", "prompt": [1, 2], "logprobs": 3}, [])
    assert completion["logprobs"] == 0 and "top_logprobs" not in completion
    with pytest.raises(CaptureDataError):
        adapter.enter_prefix(["not", "a", "request"], [])
    with pytest.raises(CaptureDataError):
        adapter.enter_prefix(chat, [1, -1])


def test_a_call_sampled_by_two_weight_versions_is_refused() -> None:
    """vLLM's token-in route reports which weight version sampled each output token; a record
    stamps one version for the whole call, so spans of two versions are refused (the call is
    then ``capture_failed``), one version's span is read as before."""
    one = chat_response()
    one["choices"][0]["weight_versions"] = [{"version": "7", "start": 0, "end": 3}]
    assert VllmAdapter().extract_generation(one) == (GENERATED, LOGPROBS)
    two = chat_response()
    spans = [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 3}]
    two["choices"][0]["weight_versions"] = spans
    with pytest.raises(CaptureDataError, match=r"across a weight update \('7' from token 0, '8' from token 2\)"):
        VllmAdapter().extract_generation(two)
    two["choices"][0]["message"].update(generation_token_ids=GENERATED, generation_log_probs=LOGPROBS)
    with pytest.raises(CaptureDataError, match="across a weight update"):  # Gym's message shape too
        VllmAdapter().extract_generation(two)


def test_pydantic_style_responses_are_read_through_model_dump() -> None:
    class Dumped:
        def model_dump(self) -> dict[str, Any]:
            return chat_response()

    assert VllmAdapter().extract_generation(Dumped()) == (GENERATED, LOGPROBS)
    with pytest.raises(CaptureDataError):
        VllmAdapter().extract_generation(object())


def _json(value: Any) -> bytes:
    import json

    return json.dumps(value).encode()


def test_the_store_package_and_the_adapter_import_no_web_framework() -> None:
    """``[http]`` is optional: ``import store`` and the vLLM adapter load without fastapi, uvicorn or httpx."""
    import subprocess
    import sys

    probe = (
        "import sys, store\n"
        "store.Store, store.VllmAdapter, store.RolloutTokenCapture\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'httpx', 'starlette') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
