"""The store's vLLM adapter against NeMo Gym 0.7.0's ``VLLMCaptureAdapter`` (issue 32, item 5):
every response shape Gym's adapter reads, the store's reads with the same result (prompt ids,
generated ids and log-probs, extras), and Gym's capture stages the same digest through either.

Skipped where Gym's token-capture package is not importable (``make real-clients`` installs it).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from store import VllmAdapter, encode_routed_experts, open_store

gym_vllm = pytest.importorskip(
    "nemo_gym.token_id_capture.adapters.vllm", reason="NeMo Gym 0.7.0 is not installed (make real-clients)"
)
gym_staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="NeMo Gym 0.7.0 is not installed")

PROMPT = [11, 12, 13]
GENERATED = [21, 22]
LOGPROBS = [-0.25, -1.5]
ROUTES = encode_routed_experts([[[1, 2]]] * (len(PROMPT) + len(GENERATED)))
SPANS = [{"modality": "image", "offset": 1, "length": 2}]


def _content() -> list[dict[str, Any]]:
    return [{"token": f"token_id:{token}", "logprob": value} for token, value in zip(GENERATED, LOGPROBS, strict=True)]


def _chat(**message: Any) -> dict[str, Any]:
    """A chat completion as vLLM answers capture's request (response-level prompt ids)."""
    return {
        "id": "chatcmpl-1",
        "prompt_token_ids": PROMPT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok", **message},
                "logprobs": {"content": _content()},
                "token_ids": GENERATED,
                "finish_reason": "stop",
            }
        ],
    }


def _without_response_prompt(payload: dict[str, Any]) -> dict[str, Any]:
    payload.pop("prompt_token_ids")
    return payload


def _message_tokens() -> dict[str, Any]:
    payload = _chat(generation_token_ids=[31, 32, 33], generation_log_probs=[-0.5, -0.125, -2.0])
    payload["choices"][0].pop("logprobs")
    payload["choices"][0].pop("token_ids")
    return payload


# Every shape Gym's adapter reads.
GYM_SHAPES: dict[str, Any] = {
    "chat, response prompt ids, log-prob tokens": _chat(),
    "chat without token_ids": (lambda p: (p["choices"][0].pop("token_ids"), p)[1])(_chat()),
    "prompt ids on the message": _without_response_prompt(_chat(prompt_token_ids=PROMPT)),
    "prompt ids on the response and the message": _chat(prompt_token_ids=[9, 9]),
    "generation ids and log-probs on the message": _message_tokens(),
    "message tokens beside log-prob tokens": _chat(generation_token_ids=[31], generation_log_probs=[-0.5]),
    "routed experts on the message (envelope)": _chat(routed_experts=ROUTES),
    "routed experts on the message (nested list)": _chat(routed_experts=[[[1, 2]]] * 5),
    "routed experts on the message (object)": _chat(routed_experts={"encoding": "x", "payload": ROUTES}),
    "media spans": {**_chat(), "media_spans": SPANS},
    "media spans and routed experts": {**_chat(routed_experts=ROUTES), "media_spans": SPANS},
    "empty media spans": {**_chat(), "media_spans": []},
    "message null": (lambda p: (p["choices"][0].update(message=None), p)[1])(_chat()),
}

# Shapes both refuse (Gym with a ValueError, the store with CaptureDataError, a ValueError).
REFUSED: dict[str, Any] = {
    "no prompt ids": _without_response_prompt(_chat()),
    "routed experts of a bad type": _chat(routed_experts=5),
    "media spans not a list": {**_chat(), "media_spans": {"a": 1}},
    "media spans holding a non-object": {**_chat(), "media_spans": [1]},
    "message not an object": (lambda p: (p["choices"][0].update(message=["x"]), p)[1])(_chat()),
    "two choices": (lambda p: (p["choices"].append(copy.deepcopy(p["choices"][0])), p)[1])(_chat()),
    "message ids and log-probs of different lengths": _chat(generation_token_ids=[1, 2], generation_log_probs=[-1.0]),
    "no generation at all": _message_tokens(),
}
REFUSED["no generation at all"]["choices"][0]["message"].pop("generation_log_probs")  # ids alone are not read


def _read(adapter: Any, payload: Any) -> Any:
    try:
        return (
            adapter.extract_prompt_ids(copy.deepcopy(payload)),
            adapter.extract_generation(copy.deepcopy(payload)),
            adapter.extract_extras(copy.deepcopy(payload)),
        )
    except ValueError:
        return "refused"


@pytest.mark.parametrize("name", list(GYM_SHAPES))
def test_every_shape_gym_reads_reads_alike(name: str) -> None:
    payload = GYM_SHAPES[name]
    gym_read = _read(gym_vllm.VLLMCaptureAdapter(), payload)
    assert gym_read != "refused"
    assert _read(VllmAdapter(), payload) == gym_read


@pytest.mark.parametrize("name", list(REFUSED))
def test_shapes_gym_refuses_the_store_refuses(name: str) -> None:
    payload = REFUSED[name]
    assert _read(gym_vllm.VLLMCaptureAdapter(), payload) == "refused"
    assert _read(VllmAdapter(), payload) == "refused"


def test_the_stores_own_shapes_beyond_gyms() -> None:
    """vLLM's completions answer carries the prompt on the choice, and a server may put routed
    experts on the choice: the store reads both (Gym's adapter reads neither)."""
    completions = _without_response_prompt(_chat())
    completions["choices"][0]["prompt_token_ids"] = PROMPT
    assert VllmAdapter().extract_prompt_ids(completions) == PROMPT
    on_choice = _chat()
    on_choice["choices"][0]["routed_experts"] = ROUTES
    assert VllmAdapter().extract_extras(on_choice) == {"routed_experts": ROUTES}
    both = _chat(routed_experts=ROUTES)
    both["choices"][0]["routed_experts"] = "other"
    assert VllmAdapter().extract_extras(both) == {"routed_experts": ROUTES}  # the message's, as Gym reads it


@pytest.mark.parametrize("name", list(GYM_SHAPES))
def test_gyms_capture_stages_the_same_digest_through_either_adapter(name: str, tmp_path: Path) -> None:
    payload = GYM_SHAPES[name]
    digests = []
    for adapter in (gym_vllm.VLLMCaptureAdapter(), VllmAdapter()):
        with open_store(tmp_path / f"{type(adapter).__name__}.db") as store:
            capture = gym_staging.RolloutTokenCapture(sink=store, weight_version_fn=lambda: 1, adapter=adapter)
            call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="r", model_call_id="c", mode="text"))
            coords = capture.complete_call_from_response(call, copy.deepcopy(payload))
            assert coords.disposition == "staged"
            digests.append((coords.digest, coords.extras_digest))
    assert digests[0] == digests[1]


def test_a_shape_gym_cannot_read_is_capture_failed_through_the_stores_adapter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open_store(tmp_path / "s.db") as store:
        capture = gym_staging.RolloutTokenCapture(sink=store, weight_version_fn=lambda: 1, adapter=VllmAdapter())
        call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="r", model_call_id="c", mode="text"))
        with caplog.at_level(logging.WARNING):
            coords = capture.complete_call_from_response(call, REFUSED["routed experts of a bad type"])
        assert coords.disposition == "capture_failed"
        assert store.staged_keys() == []
