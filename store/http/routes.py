"""The worker's HTTP control routes as a FastAPI ``APIRouter`` (wire-contract 5.2, 5.5, 6.5).

``control_router(capture, store, token)`` mounts on any FastAPI app (vLLM's OpenAI server
is one).  Every answer is JSON: a refusal is a 4xx ``{"code", "detail"}`` and is decided
before anything is written; the store's blocking calls run on the thread pool so the event
loop keeps serving.  Bodies are read as bytes under a size cap and decoded with the store's
own msgspec records, so the wire stays the contract's, not a pydantic re-model of it.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from store.errors import (
    ConfigurationError,
    GenerationCutError,
    InvalidRecordError,
    LedgerConflictError,
    RolloutFencedError,
    StorageError,
    StoreClosedError,
    StoreError,
)
from store.http.paths import CUT_PATH, LEDGER_PREFIX
from store.retention.ids import MAX_IDS
from store.store import Store
from store.wire.cut_records import GenerationCutInventory, GenerationCutReceipt
from store.wire.records import RolloutManifest, RolloutRemoval, from_json, to_json
from store.worker.capture import RolloutTokenCapture

log = logging.getLogger("store.http")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # an inventory of thousands of calls fits; a runaway body does not
_JSON = "application/json"


class _Refusal(Exception):
    """A request refused before any write: its status, code and a one-line detail."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


class _RolloutIds(msgspec.Struct, forbid_unknown_fields=True):
    rollout_ids: list[str]


def control_router(
    capture: RolloutTokenCapture,
    store: Store,
    token: str,
    *,
    root: str = "",
    checkpoint_open: Callable[[], bool] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> APIRouter:
    """The generation-cut route under ``{root}`` and the ledger routes under ``{root}/training-token-capture/control``.

    ``token`` is the bearer token every request must carry; ``checkpoint_open`` (optional)
    says whether a checkpoint is open, which refuses retire and delete with 409.
    """
    if not isinstance(capture, RolloutTokenCapture):
        raise ConfigurationError(f"capture must be a RolloutTokenCapture, got {type(capture).__name__}")
    if not isinstance(store, Store):
        raise ConfigurationError(f"store must be a store.Store, got {type(store).__name__}")
    if not isinstance(token, str) or not token.strip():
        raise ConfigurationError("token must be a non-empty string")
    if not isinstance(root, str) or (root and (not root.startswith("/") or root.endswith("/"))):
        raise ConfigurationError(f"root must be empty or a path like '/worker' (no trailing '/'), got {root!r}")
    if checkpoint_open is not None and not callable(checkpoint_open):
        raise ConfigurationError("checkpoint_open must be callable")
    if type(max_body_bytes) is not int or max_body_bytes < 1:
        raise ConfigurationError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
    expected = token.encode()
    ledger = store.ledger()
    router = APIRouter()

    def guarded(handler: Callable[[Request], Awaitable[bytes]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                _authorize(request, expected)
                body = await handler(request)
            except _Refusal as refusal:
                return _error(refusal.status, refusal.code, refusal.detail)
            except Exception as exc:  # never a traceback to the caller; the log keeps it
                status, code = _classify(exc)
                if status >= 500:
                    log.exception("control route %s failed", request.url.path)
                return _error(status, code, _one_line(exc))
            return Response(content=body, media_type=_JSON)

        endpoint.__name__ = handler.__name__
        return endpoint

    async def generation_cut(request: Request) -> bytes:
        inventory = _decode(await _body(request, max_body_bytes), GenerationCutInventory)
        receipt: GenerationCutReceipt = await run_in_threadpool(capture.serve_generation_cut, inventory)
        return to_json(receipt)

    async def manifest(request: Request) -> bytes:
        rollout_id = request.path_params["rollout_id"]
        result: RolloutManifest = await run_in_threadpool(ledger.manifest, rollout_id)
        return to_json(result)

    def removal(method: Callable[[list[str]], RolloutRemoval]) -> Callable[[Request], Awaitable[bytes]]:
        async def remove(request: Request) -> bytes:
            ids = _decode(await _body(request, max_body_bytes), _RolloutIds).rollout_ids
            if not 1 <= len(ids) <= MAX_IDS:
                raise _Refusal(422, "invalid_request", f"rollout_ids must name 1..{MAX_IDS} ids, got {len(ids)}")
            # Checked after the body so a malformed request is named as such, and before any write.
            if checkpoint_open is not None and await run_in_threadpool(checkpoint_open):
                raise _Refusal(409, "checkpoint_open", "a checkpoint is open; retry once it has committed")
            result: RolloutRemoval = await run_in_threadpool(method, ids)
            return to_json(result)

        remove.__name__ = method.__name__
        return remove

    ledger_root = f"{root}{LEDGER_PREFIX}"
    router.add_api_route(f"{root}{CUT_PATH}", guarded(generation_cut), methods=["POST"])
    router.add_api_route(f"{ledger_root}/rollouts/{{rollout_id}}/manifest", guarded(manifest), methods=["GET"])
    router.add_api_route(f"{ledger_root}/rollouts/retire", guarded(removal(ledger.retire)), methods=["POST"])
    router.add_api_route(f"{ledger_root}/rollouts/delete", guarded(removal(ledger.delete)), methods=["POST"])
    return router


def control_app(
    capture: RolloutTokenCapture,
    store: Store,
    token: str,
    *,
    checkpoint_open: Callable[[], bool] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """A standalone app with only the control routes (``staging-store serve``); no docs pages."""
    app = FastAPI(title="staging-store control", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(
        control_router(capture, store, token, checkpoint_open=checkpoint_open, max_body_bytes=max_body_bytes)
    )
    return app


def _authorize(request: Request, expected: bytes) -> None:
    """Bearer token, compared in constant time; a missing or malformed header is refused the same way."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), expected)
    if scheme.lower() != "bearer" or not ok:
        raise _Refusal(401, "unauthorized", "a valid bearer token is required")


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` (never read whole first)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _Refusal(400, "invalid_request", "Content-Length is not a number")
        if int(declared) > limit:
            raise _Refusal(413, "body_too_large", f"the body is {declared} bytes; at most {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Refusal(413, "body_too_large", f"the body passes {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, record_type: type[Any]) -> Any:
    if not body:
        raise _Refusal(400, "invalid_request", "the request needs a JSON body")
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise _Refusal(400, "malformed_json", f"the body is not JSON: {exc}") from exc
    if record_type is _RolloutIds:
        try:
            return msgspec.json.decode(body, type=_RolloutIds)
        except msgspec.ValidationError as exc:
            raise _Refusal(422, "invalid_request", str(exc)) from exc
    try:
        return from_json(body, record_type)
    except InvalidRecordError as exc:
        raise _Refusal(422, "invalid_request", _one_line(exc)) from exc


def _classify(exc: Exception) -> tuple[int, str]:
    """The status of an error raised by the store while serving a request that passed the checks."""
    if isinstance(exc, RolloutFencedError):
        return 410, "rollout_retired"
    if isinstance(exc, LedgerConflictError):
        return 409, "ledger_conflict"
    if isinstance(exc, GenerationCutError):
        return 409, "generation_cut_refused"
    if isinstance(exc, (InvalidRecordError, ValueError)):
        return 400, "invalid_request"
    if isinstance(exc, StoreClosedError):
        return 503, "store_closed"
    if isinstance(exc, StorageError):
        return 503, "storage_unavailable"
    if isinstance(exc, StoreError):
        return 409, "refused"
    return 500, "internal_error"


def _error(status: int, code: str, detail: str) -> Response:
    return Response(content=msgspec.json.encode({"code": code, "detail": detail}), status_code=status, media_type=_JSON)


def _one_line(exc: BaseException) -> str:
    text = (str(exc) or type(exc).__name__).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= 400 else first[:397] + "..."
