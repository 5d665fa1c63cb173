"""The worker's HTTP control routes as a FastAPI ``APIRouter`` (wire-contract 5.2, 5.5, 6.5).

``control_router(capture, store, token)`` mounts on any FastAPI app (vLLM's OpenAI server
is one).  Every answer is JSON: a refusal is a 4xx ``{"code", "detail"}`` and is decided
before anything is written; bodies are decoded and the store's blocking calls run on the
thread pool, so the event loop keeps serving.  Bodies are read as bytes under a size and a
time cap and decoded with the store's own msgspec records, so the wire stays the contract's,
not a pydantic re-model of it (``store.http.openapi`` describes them to FastAPI).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

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
from store.http import openapi
from store.http.bodies import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    JSON_MEDIA_TYPE,
    PlainBody,
    Refusal,
    decode,
    decode_body,
    one_line,
    read_body,
    require_json,
)
from store.http.paths import CUT_PATH, LEDGER_PREFIX
from store.http.tokens import server_token
from store.retention.ids import MAX_IDS
from store.store import Store
from store.wire.codec import to_json
from store.wire.cut_records import GenerationCutInventory, GenerationCutReceipt
from store.wire.records import RolloutManifest, RolloutRemoval
from store.worker.capture import RolloutTokenCapture

log = logging.getLogger("store.http")

# The calls one inventory may name.  A worker holds at most a few hundred running calls
# (vLLM's max_num_seqs) plus its queue; each entry costs ~0.7 ms to cut and ~0.4 KB of receipt,
# so 4,096 entries bound one request to seconds and ~2 MB of answer.
DEFAULT_MAX_CUT_PREFIXES = 4096
OPENAPI_PATH = "/openapi.json"


class _RolloutIds(PlainBody, forbid_unknown_fields=True):
    rollout_ids: list[str]


_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class _RolloutIdsDocumented(msgspec.Struct, forbid_unknown_fields=True):
    """``_RolloutIds`` with the rules the route checks itself, for the OpenAPI document only
    (the route's own checks keep their statuses: 422 for the count, 400 for an empty or repeated id)."""

    rollout_ids: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1, max_length=MAX_IDS)
    ]


def _rollout_ids_body() -> dict[str, Any]:
    extra = openapi.request_body(_RolloutIdsDocumented)
    extra["requestBody"]["content"][JSON_MEDIA_TYPE]["schema"]["properties"]["rollout_ids"]["uniqueItems"] = True
    return extra


_ROLLOUT_ID_PARAMETER = {
    "parameters": [{"name": "rollout_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}]
}


def control_router(
    capture: RolloutTokenCapture,
    store: Store,
    token: str,
    *,
    root: str = "",
    checkpoint_open: Callable[[], bool] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    max_cut_prefixes: int = DEFAULT_MAX_CUT_PREFIXES,
    cut_on_loop: bool = False,
) -> APIRouter:
    """The generation-cut route under ``{root}`` and the ledger routes under ``{root}/training-token-capture/control``.

    ``token`` is the bearer token every request must carry (visible ASCII, at least 16
    characters); ``checkpoint_open`` (optional) says whether a checkpoint is open, which
    refuses retire and delete with 409.  A body over ``max_body_bytes`` is 413, one that takes
    longer than ``body_timeout`` seconds to arrive is 408, an inventory naming more than
    ``max_cut_prefixes`` calls is 413.  ``cut_on_loop``: decode the inventory and cut in the
    event loop's own thread, in the loop iteration that read the request, rather than on the
    thread pool: for a host whose loop is saturated (vLLM's API server while it decodes), where
    each hand-off to the pool and back waits for the busy loop to come round again
    (``tools/bench_vllm_cut.py``: 64 calls, p50 65-140 ms on the loop against 200-850 ms on the
    pool).  The cut then holds the loop for its own duration (about a millisecond a call).
    """
    if not isinstance(capture, RolloutTokenCapture):
        raise ConfigurationError(f"capture must be a RolloutTokenCapture, got {type(capture).__name__}")
    if not isinstance(store, Store):
        raise ConfigurationError(f"store must be a store.Store, got {type(store).__name__}")
    expected = server_token(token).encode("ascii")
    if not isinstance(root, str) or (root and (not root.startswith("/") or root.endswith("/"))):
        raise ConfigurationError(f"root must be empty or a path like '/worker' (no trailing '/'), got {root!r}")
    if checkpoint_open is not None and not callable(checkpoint_open):
        raise ConfigurationError("checkpoint_open must be callable")
    _positive_int("max_body_bytes", max_body_bytes)
    _positive_int("max_cut_prefixes", max_cut_prefixes)
    if type(body_timeout) not in (int, float) or not 0 < body_timeout < float("inf"):
        raise ConfigurationError(f"body_timeout must be a positive number of seconds, got {body_timeout!r}")
    ledger = store.ledger()
    router = APIRouter()

    def guarded(handler: Callable[[Request], Awaitable[bytes]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                _authorize(request, expected)
                body = await handler(request)
            except Refusal as refusal:
                return _error(refusal.status, refusal.code, refusal.detail)
            except Exception as exc:  # never a traceback to the caller; the log keeps it
                status, code = _classify(exc)
                if status >= 500:
                    log.exception("control route %s failed", request.url.path)
                return _error(status, code, one_line(exc))
            return Response(content=body, media_type=JSON_MEDIA_TYPE)

        endpoint.__name__ = handler.__name__
        return endpoint

    async def json_body(request: Request) -> bytes:
        require_json(request)
        return await read_body(request, max_body_bytes, float(body_timeout))

    async def generation_cut(request: Request) -> bytes:
        body = await json_body(request)
        if cut_on_loop:
            return to_json(capture.serve_generation_cut(decode(body, GenerationCutInventory, max_cut_prefixes)))
        inventory = await decode_body(body, GenerationCutInventory, max_prefixes=max_cut_prefixes)
        receipt: GenerationCutReceipt = await run_in_threadpool(capture.serve_generation_cut, inventory)
        return to_json(receipt)

    async def manifest(request: Request) -> bytes:
        rollout_id = request.path_params["rollout_id"]
        result: RolloutManifest = await run_in_threadpool(ledger.manifest, rollout_id)
        return to_json(result)

    def removal(method: Callable[[list[str]], RolloutRemoval]) -> Callable[[Request], Awaitable[bytes]]:
        async def remove(request: Request) -> bytes:
            ids = (await decode_body(await json_body(request), _RolloutIds)).rollout_ids
            if not 1 <= len(ids) <= MAX_IDS:
                raise Refusal(422, "invalid_request", f"rollout_ids must name 1..{MAX_IDS} ids, got {len(ids)}")
            # Checked after the body so a malformed request is named as such, and before any write.
            if checkpoint_open is not None and await run_in_threadpool(checkpoint_open):
                raise Refusal(409, "checkpoint_open", "a checkpoint is open; retry once it has committed")
            result: RolloutRemoval = await run_in_threadpool(method, ids)
            return to_json(result)

        remove.__name__ = method.__name__
        return remove

    ledger_root = f"{root}{LEDGER_PREFIX}"
    router.add_api_route(
        f"{root}{CUT_PATH}",
        guarded(generation_cut),
        methods=["POST"],
        openapi_extra=openapi.request_body(GenerationCutInventory),
        responses=openapi.responses(GenerationCutReceipt, 400, 401, 408, 409, 413, 415, 422, 503),
    )
    router.add_api_route(
        f"{ledger_root}/rollouts/{{rollout_id}}/manifest",
        guarded(manifest),
        methods=["GET"],
        openapi_extra=_ROLLOUT_ID_PARAMETER,
        responses=openapi.responses(RolloutManifest, 400, 401, 410, 503),
    )
    for action, method in (("retire", ledger.retire), ("delete", ledger.delete)):
        router.add_api_route(
            f"{ledger_root}/rollouts/{action}",
            guarded(removal(method)),
            methods=["POST"],
            openapi_extra=_rollout_ids_body(),
            responses=openapi.responses(RolloutRemoval, 400, 401, 408, 409, 413, 415, 422, 503),
        )
    return router


def control_app(
    capture: RolloutTokenCapture,
    store: Store,
    token: str,
    *,
    checkpoint_open: Callable[[], bool] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    max_cut_prefixes: int = DEFAULT_MAX_CUT_PREFIXES,
) -> FastAPI:
    """A standalone app with only the control routes (``staging-store serve``) and their OpenAPI
    document at ``/openapi.json`` (no auth: it describes the routes, it holds no data); no docs pages."""
    app = FastAPI(title="staging-store control", docs_url=None, redoc_url=None, openapi_url=OPENAPI_PATH)
    app.include_router(
        control_router(
            capture,
            store,
            token,
            checkpoint_open=checkpoint_open,
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
            max_cut_prefixes=max_cut_prefixes,
        )
    )
    return app


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")


def _authorize(request: Request, expected: bytes) -> None:
    """Bearer token, compared in constant time; a missing or malformed header is refused the same way."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), expected)
    if scheme.lower() != "bearer" or not ok:
        raise Refusal(401, "unauthorized", "a valid bearer token is required")


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
    return Response(
        content=msgspec.json.encode({"code": code, "detail": detail}), status_code=status, media_type=JSON_MEDIA_TYPE
    )
