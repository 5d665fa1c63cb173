"""An ``httpx`` client for the control routes, with the batching and checks of wire-contract 6.5.

Ids are validated and deduplicated before anything is sent, then sent in batches of 4,096;
``removed`` and ``absent`` are concatenated across batches.  Every answer is decoded with the
store's own records and checked against the request (a receipt against its inventory, a
manifest's rollout id against the one asked for).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from store import arguments
from store.errors import ConfigurationError, ControlRequestError, InvalidRecordError, RolloutFencedError
from store.http.paths import CUT_PATH, LEDGER_PREFIX
from store.http.tokens import header_token
from store.retention.ids import MAX_IDS
from store.wire.codec import from_json, to_json
from store.wire.cut_records import GenerationCutInventory, GenerationCutReceipt
from store.wire.records import RolloutManifest, RolloutRemoval

T = TypeVar("T", bound=msgspec.Struct)


class ControlClient:
    """Calls one worker's control routes: ``base_url`` is its control root (no trailing ``/v1``)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 30.0,
        http_client: Any = None,
    ) -> None:
        """``http_client``: an ``httpx.Client`` (or an ``httpx2.Client``: starlette's TestClient
        builds on that fork once it is installed) to send through (a test client, a shared pool);
        it stays open when this client closes.  ``token`` must be visible ASCII (a header carries
        nothing else): ``ConfigurationError`` otherwise."""
        if not isinstance(base_url, str) or not base_url:
            raise ConfigurationError("base_url must be a non-empty URL")
        header_token(token)  # a token no header can carry is refused here, not on the first call
        clients, self._errors = _http_kinds()
        if http_client is not None and not isinstance(http_client, clients):
            raise ConfigurationError(
                f"http_client must be an httpx.Client or an httpx2.Client, got {type(http_client).__name__}"
            )
        self._root = base_url.rstrip("/").removesuffix("/v1")  # 5.2: the OpenAI base URL names the same worker
        self._auth = {"Authorization": f"Bearer {token}"}
        self._owned = http_client is None
        # httpx's Client, or the fork's (same interface): typed as httpx's.
        self._http: httpx.Client = http_client if http_client is not None else httpx.Client(timeout=timeout)  # type: ignore[assignment]

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self._http.close()

    # --- routes ---------------------------------------------------------------------------------

    def generation_cut(self, inventory: GenerationCutInventory) -> GenerationCutReceipt:
        """Ask the worker to cut; the receipt is validated against the inventory before it is returned."""
        if not isinstance(inventory, GenerationCutInventory):
            raise InvalidRecordError(f"generation_cut() takes a GenerationCutInventory, got {type(inventory).__name__}")
        receipt = self._call("POST", CUT_PATH, to_json(inventory), GenerationCutReceipt)
        receipt.validate_for(inventory)
        return receipt

    def manifest(self, rollout_id: str) -> RolloutManifest:
        """The rollout's manifest; ``RolloutFencedError`` if it was retired (410)."""
        rollout_id = arguments.text("rollout_id", rollout_id)
        if "/" in rollout_id:
            raise InvalidRecordError(f"rollout_id cannot hold '/', got {rollout_id!r}")
        try:
            path = f"{LEDGER_PREFIX}/rollouts/{quote(rollout_id, safe='')}/manifest"
            result = self._call("GET", path, None, RolloutManifest)
        except ControlRequestError as exc:
            if exc.status == 410:
                raise RolloutFencedError(rollout_id, None) from exc
            raise
        if result.rollout_id != rollout_id:
            raise ControlRequestError(
                0, "wrong_manifest", f"asked for {rollout_id!r}, the worker answered for {result.rollout_id!r}"
            )
        return result

    def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        return self._remove("retire", rollout_ids)

    def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        return self._remove("delete", rollout_ids)

    # --- plumbing -------------------------------------------------------------------------------

    def _remove(self, action: str, rollout_ids: Sequence[str]) -> RolloutRemoval:
        ids = list(dict.fromkeys(arguments.texts("rollout_ids", rollout_ids)))  # first occurrence order
        if not ids:
            raise InvalidRecordError("rollout_ids must name at least one rollout")
        removed: list[str] = []
        absent: list[str] = []
        for start in range(0, len(ids), MAX_IDS):
            batch = ids[start : start + MAX_IDS]
            body = msgspec.json.encode({"rollout_ids": batch})
            result = self._call("POST", f"{LEDGER_PREFIX}/rollouts/{action}", body, RolloutRemoval)
            unknown = set(result.removed) | set(result.absent)
            if not unknown <= set(batch):
                extra = sorted(unknown - set(batch))[:3]
                raise ControlRequestError(0, "wrong_removal", f"the worker answered for ids it was not sent: {extra}")
            removed.extend(result.removed)
            absent.extend(result.absent)
        return RolloutRemoval(removed=removed, absent=absent)

    def _call(self, method: str, path: str, body: bytes | None, record_type: type[T]) -> T:
        headers = {**self._auth, "Content-Type": "application/json"} if body is not None else self._auth
        try:
            response = self._http.request(method, f"{self._root}{path}", content=body, headers=headers)
        except self._errors as exc:
            raise ControlRequestError(0, "unreachable", f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            code, detail = _error_of(response)
            raise ControlRequestError(response.status_code, code, detail)
        try:
            return from_json(response.content, record_type)
        except InvalidRecordError as exc:
            raise ControlRequestError(0, "invalid_answer", f"{method} {path}: {exc}") from exc


def _http_kinds() -> tuple[tuple[type, ...], tuple[type[Exception], ...]]:
    """The client classes ``http_client`` may be and the transport errors to catch: httpx's, and
    the ``httpx2`` fork's where it is installed (huggingface_hub brings it, and starlette's
    TestClient then builds on it); the fork is looked for only here, never imported otherwise."""
    clients: list[type] = [httpx.Client]
    errors: list[type[Exception]] = [httpx.HTTPError]
    try:
        fork: Any = importlib.import_module("httpx2")
    except ImportError:
        pass
    else:
        clients.append(fork.Client)
        errors.append(fork.HTTPError)
    return tuple(clients), tuple(errors)


def _error_of(response: Any) -> tuple[str, str]:
    """The route's ``{"code", "detail"}``, or FastAPI's ``{"detail"}``, or the raw text."""
    try:
        body: Any = response.json()
    except ValueError:
        return "http_error", response.text[:400] or response.reason_phrase
    if isinstance(body, dict):
        return str(body.get("code") or "http_error"), str(body.get("detail") or body)[:400]
    return "http_error", str(body)[:400]
