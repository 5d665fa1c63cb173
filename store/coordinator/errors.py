"""The coordinator's errors: each carries the HTTP status and code the wire contract gives it (8.1)."""

from __future__ import annotations

from typing import Any

from store.errors import StoreError


class CoordinatorError(StoreError):
    """A checkpoint-coordinator message failed; ``status`` and ``code`` are its wire error."""

    status = 500
    code = "checkpoint_error"

    def __init__(self, detail: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code

    def wire(self) -> dict[str, Any]:
        """The ``error`` member of a failed reply."""
        return {"status": self.status, "code": self.code, "detail": self.detail}

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.detail, self.status, self.code)


def _rebuild(cls: type[CoordinatorError], detail: str, status: int, code: str) -> CoordinatorError:
    return cls(detail, status=status, code=code)


class CoordinatorUnavailableError(CoordinatorError):
    """The coordinator could not be reached, or never answered (503)."""

    status = 503
    code = "checkpoint_coordinator_unavailable"


class FrameError(CoordinatorError):
    """A frame was malformed, truncated or too large, or its message was not ``{id, kind, body}``."""

    status = 400
    code = "invalid_checkpoint_message"
    in_sync = True  # false once the stream is no longer at a frame boundary


class CheckpointStateError(CoordinatorError):
    """The checkpoint is in the wrong phase for the request (not ready, open, closed, refused)."""

    status = 409
    code = "invalid_checkpoint_state"


def error_from_wire(error: Any) -> CoordinatorError:
    """The typed error of a failed reply's ``error`` member (unknown shapes become a 500)."""
    if not isinstance(error, dict):
        return CoordinatorError(f"the peer replied with a malformed error: {error!r}")
    status, code, detail = error.get("status"), error.get("code"), error.get("detail")
    status = status if isinstance(status, int) else 500
    code = code if isinstance(code, str) else "checkpoint_error"
    detail = detail if isinstance(detail, str) else repr(detail)
    for cls in (CoordinatorUnavailableError, FrameError, CheckpointStateError):
        if cls.code == code:
            return cls(detail, status=status)
    return CoordinatorError(detail, status=status, code=code)
