"""The policy checkpoint coordinator (wire-contract 8): one ``Coordinator`` in the main process,
a ``WorkerClient`` in each worker process, talking over a Unix socket."""

from store.coordinator.client import WorkerCall, WorkerClient
from store.coordinator.errors import (
    CheckpointStateError,
    CoordinatorError,
    CoordinatorUnavailableError,
    FrameError,
)
from store.coordinator.framing import MAX_FRAME
from store.coordinator.server import SOCKET_ENV, Coordinator, default_socket_path

__all__ = [
    "MAX_FRAME",
    "SOCKET_ENV",
    "CheckpointStateError",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorUnavailableError",
    "FrameError",
    "WorkerCall",
    "WorkerClient",
    "default_socket_path",
]
