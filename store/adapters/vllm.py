"""``VllmAdapter``: a ``CaptureAdapter`` for vLLM's OpenAI-compatible server (wire-contract 6.5).

Requests are rewritten so the response carries what capture needs: non-streaming, the
sampled token's log-prob (``logprobs``; ``top_logprobs=0`` for chat), tokens as
``token_id:<n>`` and the prompt and generated ids (``return_token_ids``), and the exact
prefix for token_in (``required_prefix_token_ids``).  Responses are read as vLLM writes
them (chat and completions, dicts or pydantic objects); anything that cannot be read raises
``CaptureDataError``, which ``complete_call_from_response`` turns into poisoned coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from store.errors import CaptureDataError
from store.wire.codec import to_json
from store.wire.records import CommitCoords

TOKEN_ID_PREFIX = "token_id:"
COMMIT_COORDS_FIELD = "ng_commit_coords"
_STREAM_ONLY = ("stream_options",)


class VllmAdapter:
    """Reads vLLM chat-completion and completion responses; writes capture's request fields."""

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of the request (a JSON object) forced into capture's shape; token_in prefixes
        (``prefix_ids`` non-empty) ride as ``required_prefix_token_ids``."""
        if not isinstance(request, Mapping):
            raise CaptureDataError(f"a vLLM request must be a JSON object, got {type(request).__name__}")
        # echo would put the prompt (and its log-probs, the first null) in front of the answer.
        forced = {key: value for key, value in request.items() if key not in _STREAM_ONLY and key != "echo"}
        forced["stream"] = False
        forced["return_token_ids"] = True
        if isinstance(forced.get("sampling_params"), Mapping) and "token_ids" in forced:
            # vLLM's token-in route (/inference/v1/generate): sampling options in sampling_params.
            forced["sampling_params"] = {**forced["sampling_params"], "logprobs": 0}
            forced.pop("required_prefix_token_ids", None)
            return forced
        if "messages" in forced:  # chat: logprobs is a flag, top_logprobs a count
            forced["logprobs"] = True
            forced["top_logprobs"] = 0
        else:  # completions: logprobs is the count of alternatives beside the sampled token
            forced["logprobs"] = 0
        forced["return_tokens_as_token_ids"] = True
        prefix = _ints("prefix_ids", prefix_ids)
        if prefix:
            forced["required_prefix_token_ids"] = prefix
        else:
            forced.pop("required_prefix_token_ids", None)
        return forced

    def extract_prompt_ids(self, payload: Any) -> list[int]:
        """The engine prompt: the response's ``prompt_token_ids`` (chat), else the message's, else
        the choice's (completions), in the order NeMo Gym's ``VLLMCaptureAdapter`` reads them."""
        response = _object(payload)
        choice = _choice(response)
        ids = response.get("prompt_token_ids")
        if ids is None:
            ids = _message(choice).get("prompt_token_ids")
        if ids is None:
            ids = choice.get("prompt_token_ids")
        if ids is None:
            raise CaptureDataError("the response carries no prompt_token_ids (request return_token_ids=true)")
        return _ints("prompt_token_ids", ids)

    def extract_generation(self, payload: Any) -> tuple[list[int], list[float]]:
        """Generated ids and their log-probs: the message's ``generation_token_ids`` and
        ``generation_log_probs`` when it carries both (as Gym reads them first), else the choice's
        ``token_ids`` or the ``token_id:<n>`` log-prob tokens, with the log-probs."""
        choice = _choice(_object(payload))
        one_weight_version(choice.get("weight_versions"))  # vLLM's token-in route reports them
        message = _message(choice)
        if "generation_token_ids" in message and "generation_log_probs" in message:
            generated = _ints("message.generation_token_ids", message["generation_token_ids"])
            values = message["generation_log_probs"]
            if not isinstance(values, list):
                raise CaptureDataError("message.generation_log_probs must be a list of log-probs")
            logprobs = [_logprob(value) for value in values]
            if len(logprobs) != len(generated):
                raise CaptureDataError(
                    f"{len(generated)} generated tokens but {len(logprobs)} log-probs in the message"
                )
            return generated, logprobs
        tokens, logprobs = _logprob_entries(choice.get("logprobs"))
        ids = choice.get("token_ids")
        if ids is not None:
            generated = _ints("token_ids", ids)
            if tokens and [_token_id(token) for token in tokens] != generated:
                raise CaptureDataError("the choice's token_ids differ from its log-prob tokens")
        elif tokens:
            generated = [_token_id(token) for token in tokens]
        else:
            raise CaptureDataError("the choice carries neither token_ids nor token_id:<n> log-prob tokens")
        if len(logprobs) != len(generated):
            raise CaptureDataError(
                f"{len(generated)} generated tokens but {len(logprobs)} log-probs (request logprobs=true)"
            )
        return generated, logprobs

    def extract_extras(self, payload: Any) -> dict[str, Any] | None:
        """``routed_experts`` (NeMo RL's routing replay) from the message, else the choice, and the
        response's ``media_spans`` (placeholder positions of media), as NeMo Gym reads them."""
        response = _object(payload)
        choice = _choice(response)
        extras: dict[str, Any] = {}
        routes = _message(choice).get("routed_experts")
        if routes is None:
            routes = choice.get("routed_experts")
        if routes is not None:
            if not isinstance(routes, (str, dict, list)):
                raise CaptureDataError(
                    f"routed_experts must be an envelope, object or list, got {type(routes).__name__}"
                )
            extras["routed_experts"] = routes
        if "media_spans" in response:
            spans = response["media_spans"]
            if not isinstance(spans, list) or not all(isinstance(span, dict) for span in spans):
                raise CaptureDataError("media_spans must be a list of objects")
            extras["media_spans"] = spans
        return extras or None

    def park_commit_coords(self, payload: Any, coords: CommitCoords) -> dict[str, Any]:
        """A copy of the response (a JSON object) with the coordinates as ``ng_commit_coords``."""
        if not isinstance(coords, CommitCoords):
            raise CaptureDataError(f"park_commit_coords needs CommitCoords, got {type(coords).__name__}")
        response = dict(_object(payload))
        response[COMMIT_COORDS_FIELD] = msgspec.json.decode(to_json(coords))
        return response


def one_weight_version(spans: Any) -> None:
    """vLLM labels the weights that sampled each output token (``AsyncLLM.update_weight_version``;
    "default" until set) and reports the spans (``{version, start, end}``) with a finished
    output.  A call's record stamps one weight version for all it generated, so a call decoded
    across a weight update is refused (``CaptureDataError``: the call is ``capture_failed``)
    rather than staged with a version wrong for some of its tokens."""
    if not spans or not isinstance(spans, Sequence):
        return
    found = [(_span_field(span, "version"), _span_field(span, "start")) for span in spans]
    if len({str(label) for label, _ in found}) > 1:
        where = ", ".join(f"{str(label)!r} from token {start}" for label, start in found)
        raise CaptureDataError(
            f"vLLM decoded this call across a weight update ({where}): a record stamps one weight version "
            "for all it generated; cut the calls in flight before updating the weights (each continues under "
            "the new version)"
        )


def _span_field(span: Any, name: str) -> Any:
    return span.get(name) if isinstance(span, Mapping) else getattr(span, name, None)


def _object(payload: Any) -> Mapping[str, Any]:
    """A JSON object, or a pydantic response object as vLLM's server builds it."""
    if isinstance(payload, Mapping):
        return payload
    dump = getattr(payload, "model_dump", None)
    if callable(dump):
        dumped = dump()
        if isinstance(dumped, Mapping):
            return dumped
    raise CaptureDataError(f"a vLLM response must be a JSON object, got {type(payload).__name__}")


def _choice(response: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        count = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise CaptureDataError(f"a captured call needs exactly one choice (n=1), got {count}")
    return choices[0]


def _message(choice: Mapping[str, Any]) -> Mapping[str, Any]:
    message = choice.get("message") or {}
    if not isinstance(message, Mapping):
        raise CaptureDataError(f"choice.message must be an object, got {type(message).__name__}")
    return message


def _logprob_entries(logprobs: Any) -> tuple[list[Any], list[float]]:
    """(tokens, log-probs) of a chat ``{"content": [...]}`` or a completions ``{"tokens", "token_logprobs"}``."""
    if logprobs is None:
        return [], []
    if not isinstance(logprobs, Mapping):
        raise CaptureDataError(f"logprobs must be an object, got {type(logprobs).__name__}")
    if "content" in logprobs:
        content = logprobs["content"] or []
        if not isinstance(content, list) or not all(isinstance(entry, Mapping) for entry in content):
            raise CaptureDataError("logprobs.content must be a list of objects")
        # The token-in route's entries name the token as an int ``token_id``; OpenAI's as ``token``.
        tokens = [entry["token_id"] if "token_id" in entry else entry.get("token") for entry in content]
        return tokens, [_logprob(entry.get("logprob")) for entry in content]
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise CaptureDataError("logprobs.tokens and logprobs.token_logprobs must be lists of one length")
    return tokens, [_logprob(value) for value in values]


def _token_id(token: Any) -> int:
    if type(token) is int and token >= 0:  # the token-in route's ``token_id``
        return token
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        raise CaptureDataError(f"log-prob token {token!r} is not token_id:<n> (request return_tokens_as_token_ids)")
    digits = token[len(TOKEN_ID_PREFIX) :]
    if not digits.isascii() or not digits.isdigit():
        raise CaptureDataError(f"log-prob token {token!r} does not name a token id")
    return int(digits)


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CaptureDataError(f"a log-prob must be a number, got {value!r}")
    result = float(value)
    if math.isnan(result) or result > 0.0:
        raise CaptureDataError(f"a log-prob must be <= 0, got {value!r}")
    return result


def _ints(name: str, values: Any) -> list[int]:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise CaptureDataError(f"{name} must be a list of token ids, got {type(values).__name__}")
    out: list[int] = []
    for value in values:
        if type(value) is not int or value < 0:
            raise CaptureDataError(f"{name} holds {value!r}, not a token id")
        out.append(value)
    return out
