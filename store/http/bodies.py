"""Request bodies for the control routes: the media type, a size cap, a time cap, and decoding
with the store's own records off the event loop.

Every check here refuses before anything is written, with a ``Refusal`` (status, code,
detail) the route turns into its JSON error.  Decoding runs on the thread pool: a body of
several MiB takes tens of milliseconds to parse and validate, which on the event loop would
stall every other request for as long.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from store.errors import InvalidRecordError
from store.wire.codec import from_json

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # an inventory of 4,096 calls is ~0.5 MiB; a runaway body is refused
DEFAULT_BODY_TIMEOUT = 30.0  # seconds from the headers to the body's last byte (8 MiB at ~280 KB/s)
JSON_MEDIA_TYPE = "application/json"


class Refusal(Exception):
    """A request refused before any write: its status, code and a one-line detail."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


class PlainBody(msgspec.Struct, forbid_unknown_fields=True):
    """Base of the routes' own request bodies (decoded by msgspec directly, not as wire records)."""


class _PrefixCount(msgspec.Struct):
    """Only the length of an inventory's ``active_prefixes`` (each entry kept as raw bytes)."""

    active_prefixes: list[msgspec.Raw] = []


def require_json(request: Request) -> None:
    """A body must say it is JSON (``application/json``, parameters such as charset allowed): 415 otherwise,
    so a form post or a browser's ``text/plain`` request never reaches a route."""
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        shown = repr(declared) if declared else "none"
        raise Refusal(
            415, "unsupported_media_type", f"the body must be {JSON_MEDIA_TYPE}; the Content-Type was {shown}"
        )


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` (never read whole
    first) and with 408 when it has not all arrived within ``timeout`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise Refusal(400, "invalid_request", "Content-Length is not a number")
        if int(declared) > limit:
            raise Refusal(413, "body_too_large", f"the body is {declared} bytes; at most {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise Refusal(413, "body_too_large", f"the body passes {limit} bytes")
                chunks.append(chunk)
    except TimeoutError as exc:
        raise Refusal(408, "body_timeout", f"the body did not arrive within {timeout:g} s ({size} bytes came)") from exc
    except ClientDisconnect as exc:  # nobody is left to answer; the route logs nothing
        raise Refusal(400, "client_disconnected", "the client went away before its body arrived") from exc
    return b"".join(chunks)


async def decode_body(body: bytes, record_type: type[T], *, max_prefixes: int | None = None) -> T:
    """``decode(body, record_type)`` on the thread pool."""
    return await run_in_threadpool(decode, body, record_type, max_prefixes)


def decode(body: bytes, record_type: type[T], max_prefixes: int | None = None) -> T:
    """The body as ``record_type``: 400 for an empty body or one that is not JSON (nested too
    deeply included), 413 for an inventory over ``max_prefixes`` entries, 422 for JSON that is not
    the record."""
    if not body:
        raise Refusal(400, "invalid_request", "the request needs a JSON body")
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise Refusal(400, "malformed_json", f"the body is not JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's own depth limit; the JSON is refused, the server goes on
        raise Refusal(400, "malformed_json", "the body's JSON is nested too deeply") from exc
    if max_prefixes is not None:
        _check_prefix_count(body, max_prefixes)
    try:
        if issubclass(record_type, PlainBody):
            return msgspec.json.decode(body, type=record_type)
        return from_json(body, record_type)  # type: ignore[type-var]
    except msgspec.ValidationError as exc:
        raise Refusal(422, "invalid_request", str(exc)) from exc
    except InvalidRecordError as exc:
        raise Refusal(422, "invalid_request", one_line(exc)) from exc


def _check_prefix_count(body: bytes, limit: int) -> None:
    try:
        count = len(msgspec.json.decode(body, type=_PrefixCount).active_prefixes)
    except msgspec.ValidationError:
        return  # not an inventory at all: the record's own decoding names the problem
    if count > limit:
        raise Refusal(
            413, "too_many_prefixes", f"the inventory names {count} calls; at most {limit} per request (split it)"
        )


def one_line(exc: BaseException) -> str:
    text = (str(exc) or type(exc).__name__).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= 400 else first[:397] + "..."
