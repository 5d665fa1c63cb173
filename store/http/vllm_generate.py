"""The engine client's ``generate`` on vLLM's OpenAI server, observing captured calls.

For a request the capture middleware admitted (``SERVED``), ``CapturingGenerate`` fixes the
engine prompt (a token_in chat child gets the parent's exact tokens, see
``store.adapters.vllm_splice``; a continued call its continuation's prompt and remaining limit),
tracks the call, asks the engine for DELTA outputs and observes every token and log-prob as it
arrives, so a cut from the control route stages what has been decoded so far; the handler still
gets one final output, the deltas merged (``RequestOutput.add``).  Other requests go to vLLM's
own ``generate`` untouched.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Sequence
from typing import Any

from store.adapters.vllm import one_weight_version
from store.adapters.vllm_splice import splice_verified_prefix
from store.errors import CaptureDataError
from store.http.bodies import one_line
from store.http.vllm_calls import SERVED, ServedCall
from store.worker.capture import RolloutTokenCapture

History = Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[list[int]]]
_ENGINE_FINISHES = ("stop", "length")


class CapturingGenerate:
    """The engine client's ``generate``, observing captured requests token by token.

    ``history(request, messages)`` renders chat messages with vLLM's own renderer (no generation
    prompt) and returns their token ids; ``end_token_ids`` are the tokens a chat turn ends with.
    """

    def __init__(
        self,
        generate: Callable[..., AsyncGenerator[Any, None]],
        capture: RolloutTokenCapture,
        *,
        history: History | None,
        end_token_ids: Collection[int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self._generate = generate
        self._capture = capture
        self._history = history
        self._end_token_ids = frozenset(end_token_ids)
        self._decode = decode

    def __call__(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncGenerator[Any, None]:
        served = SERVED.get()
        if served is None or served.tracked:  # not captured (or a second sequence of one request)
            return self._generate(prompt, sampling_params, request_id, **kwargs)
        return self._captured(served, prompt, sampling_params, request_id, kwargs)

    async def _captured(
        self, served: ServedCall, prompt: Any, params: Any, request_id: str, kwargs: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        from vllm.sampling_params import RequestOutputKind

        call = served.call
        continuation = call.continuation
        params = params.clone()
        if continuation is not None:
            engine_prompt = list(continuation.engine_prompt_token_ids)
            self._capture.track(call)
            served.tracked = True
            if continuation.is_terminal:
                yield self._restored_only(request_id, prompt, continuation)
                return
            params.max_tokens, params.min_tokens = continuation.remaining_limits(params.min_tokens or 0)
        else:
            engine_prompt = await self._engine_prompt(served, _prompt_ids(prompt))
            self._capture.track(call, prompt_token_ids=engine_prompt, effective_output_limit=params.max_tokens)
            served.tracked = True
        params.output_kind = RequestOutputKind.DELTA
        if params.logprobs is None:
            params.logprobs = 0
        merged = None
        async for output in self._generate(_with_prompt_ids(prompt, engine_prompt), params, request_id, **kwargs):
            self._observe(served, output)
            if merged is None:
                merged = output
            else:
                merged.add(output, aggregate=True)
        if merged is not None and continuation is not None:
            self._prepend_restored(merged, continuation)
        yield merged

    async def _engine_prompt(self, served: ServedCall, rendered: list[int]) -> list[int]:
        """The rendered prompt, or for a token_in chat child the parent's exact tokens spliced in."""
        call = served.call
        prefix = list(call.prefix_token_ids)
        if served.kind != "chat" or not prefix or rendered[: len(prefix)] == prefix or self._history is None:
            return rendered
        messages = served.request.get("messages")
        last = _last_assistant(messages)
        if last is None:
            return rendered  # no parent turn to replace: capture refuses the prompt if it lacks the prefix
        try:
            history = await self._history(served.request, messages[: last + 1])  # type: ignore[index]
            return splice_verified_prefix(prefix, rendered, history, self._end_token_ids)
        except CaptureDataError as exc:
            served.problems.append(one_line(exc))
            return rendered

    def _observe(self, served: ServedCall, output: Any) -> None:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        entries = completion.logprobs
        if ids and (entries is None or len(entries) < len(ids)):
            served.problems.append("vLLM returned tokens without their log-probs")
            return
        logprobs = [entries[len(entries) - len(ids) + i][token].logprob for i, token in enumerate(ids)] if ids else []
        finish = completion.finish_reason
        if finish is not None:
            try:
                one_weight_version(getattr(completion, "weight_versions", None))
            except CaptureDataError as exc:
                served.problems.append(str(exc))
                return
        if finish is not None and finish not in _ENGINE_FINISHES:
            served.engine_finish = finish
            served.problems.append(f"the engine ended the call with finish_reason {finish!r}")
            finish = None
        stop = completion.stop_reason if finish == "stop" else None
        self._capture.observe(served.call, ids, logprobs, finish_reason=finish, stop_reason=stop)

    def _prepend_restored(self, output: Any, continuation: Any) -> None:
        """The handler answers the whole generation: the restored tokens, then the new ones."""
        from vllm.logprobs import Logprob

        completion = output.outputs[0]
        restored = list(continuation.restored_token_ids)
        entries = [
            {token: Logprob(logprob=float(lp))}
            for token, lp in zip(restored, continuation.restored_logprobs, strict=True)
        ]
        completion.token_ids = [*restored, *completion.token_ids]
        completion.logprobs = [*entries, *(completion.logprobs or [])]
        completion.text = self._decode(restored) + completion.text
        output.prompt_token_ids = list(continuation.engine_prompt_token_ids)[: -len(restored) or None]

    def _restored_only(self, request_id: str, prompt: Any, continuation: Any) -> Any:
        """A cut that had finished the call: its answer is the restored prefix, nothing is generated."""
        from vllm.outputs import CompletionOutput, RequestOutput

        completion = CompletionOutput(
            index=0,
            text="",
            token_ids=[],
            cumulative_logprob=None,
            logprobs=[],
            finish_reason=continuation.finish_reason,
            stop_reason=continuation.terminal_stop_reason,
        )
        output = RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=list(continuation.engine_prompt_token_ids),
            prompt_logprobs=None,
            outputs=[completion],
            finished=True,
        )
        self._prepend_restored(output, continuation)
        return output


def _last_assistant(messages: Any) -> int | None:
    if not isinstance(messages, list):
        return None
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "assistant":
            return index
    return None


def _prompt_ids(prompt: Any) -> list[int]:
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    if not isinstance(ids, Sequence):
        raise CaptureDataError(f"a captured request reached the engine without prompt ids ({type(prompt).__name__})")
    return list(ids)


def _with_prompt_ids(prompt: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    if list(prompt.get("prompt_token_ids", ())) == ids:
        return prompt
    changed = dict(prompt)
    changed["prompt_token_ids"] = ids
    changed.pop("prompt", None)  # the text no longer matches the ids
    changed.pop("prompt_token_offsets", None)
    return changed


__all__ = ["CapturingGenerate", "History"]
