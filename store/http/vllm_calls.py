"""Captured calls on vLLM's OpenAI server: the admission in, every token observed, coordinates out.

Three pieces, all on vLLM's public objects (nothing of vLLM is patched or copied):

* ``CaptureMiddleware`` (ASGI, the app's innermost middleware, so vLLM's own auth runs first):
  a POST to a generation route whose JSON carries ``ng_capture`` is admitted
  (``begin_call`` on the thread pool), its body rewritten into capture's shape
  (``VllmAdapter.enter_prefix``) and handed on; when vLLM has answered, the call is completed
  from what the engine produced (staged before the response leaves) and the response carries
  ``ng_commit_coords``.  Requests without ``ng_capture`` pass untouched.
* ``CapturingGenerate`` replaces the engine client's ``generate``: for a captured request it
  fixes the engine prompt (a token_in chat child gets the parent's exact tokens, see
  ``store.adapters.vllm_splice``; a continued call its continuation's prompt and remaining
  limit), tracks the call, asks the engine for DELTA outputs and observes every token and
  log-prob as it arrives, so a cut from the control route stages what has been decoded so far;
  the handler still gets one final output, the deltas merged (``RequestOutput.add``).
* ``CallService``: admission and completion, the blocking parts, run off the event loop.

The request reaches the engine in the same asyncio task (or one created from it), so a
context variable carries the admitted call from the middleware to ``generate``.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.concurrency import run_in_threadpool

from store.adapters.vllm import COMMIT_COORDS_FIELD, VllmAdapter, one_weight_version
from store.adapters.vllm_splice import splice_verified_prefix
from store.errors import CaptureDataError, CaptureError, InvalidRecordError, StoreError
from store.http.bodies import Refusal, one_line
from store.store import Store
from store.wire.codec import from_json
from store.wire.records import CaptureAdmission
from store.worker.active_call import ActiveCall
from store.worker.capture import RolloutTokenCapture

log = logging.getLogger("store.vllm")

CAPTURE_FIELD = "ng_capture"
# The generation routes a captured call may take, and the request shape each one has.
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/inference/v1/generate": "generate"}
_ENGINE_FINISHES = ("stop", "length")


@dataclass
class ServedCall:
    """One admitted request on its way through vLLM."""

    call: ActiveCall
    kind: str
    request: dict[str, Any]
    worker_call: Any = None  # the coordinator's WorkerCall, when a coordinator is configured
    tracked: bool = False
    engine_finish: str | None = None
    problems: list[str] = field(default_factory=list)


_SERVED: contextvars.ContextVar[ServedCall | None] = contextvars.ContextVar("store_vllm_served_call", default=None)
History = Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[list[int]]]


class CallService:
    """Admits captured requests and completes them (``admit``/``finish`` block: thread pool)."""

    def __init__(self, capture: RolloutTokenCapture, store: Store, *, worker: Any = None) -> None:
        self.capture = capture
        self.store = store
        self.worker = worker  # a store.coordinator.WorkerClient, or None
        self.adapter = VllmAdapter()

    def admit(self, request: dict[str, Any], kind: str) -> ServedCall:
        """The request's admission begun and its body rewritten; a refusal writes nothing."""
        admission = _admission(request.get(CAPTURE_FIELD))
        prefix = self._prefix(admission)
        if request.get("n", 1) not in (1, None):
            raise Refusal(422, "invalid_request", "a captured call has exactly one choice (n=1)")
        try:
            rewritten = self.adapter.enter_prefix(
                {key: value for key, value in request.items() if key != CAPTURE_FIELD}, []
            )
        except CaptureDataError as exc:
            raise Refusal(422, "invalid_request", one_line(exc)) from exc
        worker_call = None
        if self.worker is not None:
            from store.coordinator.errors import CoordinatorError

            try:
                worker_call = self.worker.begin_call(admission.rollout_id, admission.model_call_id)
            except CoordinatorError as exc:
                raise Refusal(exc.status, exc.code, one_line(exc)) from exc
        try:
            call = self.capture.begin_call(admission, prefix_token_ids=prefix)
        except CaptureError as exc:
            self._answered(worker_call, None)  # refused: nothing of it is staged or still open
            raise Refusal(409, f"capture_{exc.code}", one_line(exc)) from exc
        return ServedCall(call=call, kind=kind, request=rewritten, worker_call=worker_call)

    def _prefix(self, admission: CaptureAdmission) -> list[int] | None:
        """The parent's exact tokens: inline, or the staging chain's deltas concatenated."""
        if admission.mode != "token_in" or admission.required_prefix_token_ids or not admission.staging_chain:
            return None
        try:
            snapshots = self.store.fetch(list(admission.staging_chain))
        except StoreError as exc:
            detail = f"the staging chain cannot be read: {one_line(exc)}"
            raise Refusal(409, "capture_unresolved_parent", detail) from exc
        return [token for snapshot in snapshots for token in snapshot.token_ids_delta]

    def finish(self, served: ServedCall, status: int, body: bytes) -> bytes:
        """The response as it leaves: a 200 completed and carrying the coordinates; any other answer
        passed on, the call failed if the engine had begun it."""
        call = served.call
        if status != 200:
            if served.tracked:
                self.capture.fail_call(call, reason=f"vLLM answered HTTP {status}")
            self._answered(served.worker_call, None)
            return body
        try:
            response = msgspec.json.decode(body)
        except msgspec.DecodeError:
            response = None
        if not isinstance(response, dict):
            self.capture.fail_call(call, reason="vLLM's answer is not a JSON object")
            self._answered(served.worker_call, None)
            return body
        if not served.tracked:
            coords = self.capture.fail_call(call, reason="the request never reached the engine")
        elif served.problems:
            coords = self.capture.fail_call(call, reason="; ".join(served.problems))
        elif call.continuation is not None and call.continuation.is_terminal:
            coords = self.capture.finish_restored_call(call)
        else:
            coords = self.capture.complete_observed(call)
        self._answered(served.worker_call, coords.staging_key)
        return msgspec.json.encode(self.adapter.park_commit_coords(response, coords))

    def abandon(self, served: ServedCall, exc: BaseException) -> None:
        """vLLM raised instead of answering: the call is failed if the engine had begun it."""
        if served.tracked:
            self.capture.fail_call(served.call, reason=f"serving failed: {type(exc).__name__}: {exc}")
        self._answered(served.worker_call, None)

    def _answered(self, worker_call: Any, staging_key: str | None) -> None:
        """The coordinator learns the call's answer went out (its row, if staged, can commit):
        an answered call never holds a checkpoint back as undelivered."""
        if self.worker is not None and worker_call is not None:
            self.worker.deliver(worker_call, staging_key)


def _admission(value: Any) -> CaptureAdmission:
    try:
        return from_json(msgspec.json.encode(value), CaptureAdmission)
    except (InvalidRecordError, msgspec.EncodeError) as exc:
        raise Refusal(422, "invalid_admission", f"ng_capture is not a CaptureAdmission: {one_line(exc)}") from exc


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
        served = _SERVED.get()
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


class CaptureMiddleware:
    """ASGI middleware: captured generation requests in, ``ng_commit_coords`` out."""

    def __init__(self, app: Any, service: CallService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        body = await _read(receive)
        if not _captured(body):  # vLLM's own traffic: handed on as it came, nothing decoded kept
            await self.app(scope, _replay(body, receive), send)
            return
        request = _json_object(body)
        del body  # only the rewritten body goes on: a long prompt is not held twice meanwhile
        if request is None:
            await _send_json(send, 400, {"code": "invalid_request", "detail": "the request body is not a JSON object"})
            return
        try:
            served = await run_in_threadpool(self.service.admit, request, kind)
        except Refusal as refusal:
            await _send_json(send, refusal.status, {"code": refusal.code, "detail": refusal.detail})
            return
        del request  # the service kept what it needs (``served.request``, rewritten)
        rewritten = msgspec.json.encode(served.request)
        scope = {**scope, "headers": _with_length(scope["headers"], len(rewritten))}
        response = _Collected()
        token = _SERVED.set(served)
        try:
            await self.app(scope, _replay(rewritten, receive), response.send)
        except BaseException as exc:
            await run_in_threadpool(self.service.abandon, served, exc)
            raise
        finally:
            _SERVED.reset(token)
        out = await run_in_threadpool(self.service.finish, served, response.status, response.body())
        headers = _with_length(response.headers, len(out))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": out, "more_body": False})


class _Collected:
    """The whole response of the app below, held until the call is staged."""

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self._chunks.append(message.get("body", b""))

    def body(self) -> bytes:
        return b"".join(self._chunks)


async def _read(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive_more: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The body, once; then the connection's own messages (vLLM listens for a disconnect)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            message: dict[str, Any] = await receive_more()
            return message
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class _CaptureProbe(msgspec.Struct):
    """A request body read for ``ng_capture`` alone: msgspec skips every other field without
    building it, so looking costs no copy of the request."""

    capture: Any = msgspec.field(default=msgspec.UNSET, name=CAPTURE_FIELD)


_PROBE = msgspec.json.Decoder(_CaptureProbe)


def _captured(body: bytes) -> bool:
    """Whether the body is a JSON object naming ``ng_capture`` (null included: the admission
    then refuses it); anything else is vLLM's to answer."""
    try:
        return _PROBE.decode(body).capture is not msgspec.UNSET
    except (msgspec.DecodeError, RecursionError):
        return False


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _with_length(headers: Sequence[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(name, value) for name, value in headers if name.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode("ascii"))]


async def _send_json(send: Any, status: int, payload: dict[str, Any]) -> None:
    body = msgspec.json.encode(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = [
    "CAPTURE_FIELD",
    "COMMIT_COORDS_FIELD",
    "CallService",
    "CaptureMiddleware",
    "CapturingGenerate",
    "ServedCall",
]
