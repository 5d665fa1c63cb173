"""Captured calls on vLLM's OpenAI server: the call service, and the call on its way through.

``CallService`` does the blocking parts, which run off the event loop: a request carrying
``ng_capture`` is admitted (``begin_call``, its body rewritten into capture's shape by
``VllmAdapter.enter_prefix``), and when vLLM has answered the call is completed from what the
engine produced (staged before the response leaves) and the response carries
``ng_commit_coords``.  ``store.http.vllm_middleware`` brings requests to it and
``store.http.vllm_generate`` observes the engine's tokens; both meet through ``SERVED``.

The request reaches the engine in the same asyncio task (or one created from it), so a
context variable carries the admitted call from the middleware to ``generate``.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import msgspec

from store.adapters.vllm import COMMIT_COORDS_FIELD, VllmAdapter
from store.errors import CaptureDataError, CaptureError, InvalidRecordError, StoreError
from store.http.bodies import Refusal, one_line
from store.store import Store
from store.wire.codec import from_json
from store.wire.records import CaptureAdmission
from store.worker.active_call import ActiveCall
from store.worker.capture import RolloutTokenCapture

CAPTURE_FIELD = "ng_capture"
# The generation routes a captured call may take, and the request shape each one has.
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/inference/v1/generate": "generate"}


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


SERVED: contextvars.ContextVar[ServedCall | None] = contextvars.ContextVar("store_vllm_served_call", default=None)


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


__all__ = ["CAPTURE_FIELD", "COMMIT_COORDS_FIELD", "ROUTES", "SERVED", "CallService", "ServedCall"]
