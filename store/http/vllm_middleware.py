"""ASGI middleware on vLLM's OpenAI server: captured generation requests in, ``ng_commit_coords`` out.

Installed innermost (so vLLM's own middleware, its ``--api-key`` check included, runs first).
A POST to a generation route whose JSON names ``ng_capture`` is admitted (``CallService.admit``
on the thread pool) and handed on rewritten; the whole answer is held until the call is staged
(``CallService.finish``).  Requests without ``ng_capture`` pass untouched, nothing of them kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from starlette.concurrency import run_in_threadpool

from store.http.bodies import Refusal
from store.http.vllm_calls import CAPTURE_FIELD, ROUTES, SERVED, CallService


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
        token = SERVED.set(served)
        try:
            await self.app(scope, _replay(rewritten, receive), response.send)
        except BaseException as exc:
            await run_in_threadpool(self.service.abandon, served, exc)
            raise
        finally:
            SERVED.reset(token)
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


__all__ = ["CaptureMiddleware"]
