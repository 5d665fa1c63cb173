"""``WorkerClient``: a policy worker process's end of the checkpoint socket (wire-contract 8).

The worker checks that the socket is served by its own user (``SO_PEERCRED``: another user
squatting the path would otherwise block the real coordinator and receive this worker's
reports), registers with its pid and adopts the coordinator's state; from then on it
admits calls only while admission is open, refuses retired attempts, reports what it
holds, claims restored cuts, and says goodbye before it stops.  If the coordinator goes
away the worker cannot take part in a checkpoint any more, so it shuts itself down (SIGTERM).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from store.coordinator.connection import Peer
from store.coordinator.errors import CheckpointStateError, CoordinatorError, CoordinatorUnavailableError, FrameError
from store.coordinator.server import CONTROL_GRACE, MESSAGE_TIMEOUT, default_socket_path

_LOG = logging.getLogger("store.coordinator")
STOP_TIMEOUT = 1.0  # a stopping worker's goodbye must not hold up its shutdown


@dataclass
class WorkerCall:
    """A call this worker admitted: ``continuation`` is the restored cut it claimed, if any."""

    capture_key: str
    model_call_id: str
    staging_key: str | None = None
    delivered: bool = False
    continuation: Any = None


class WorkerClient:
    """The calling process, registered with the coordinator by its pid (use ``connect``)."""

    def __init__(self, *, message_timeout: float = MESSAGE_TIMEOUT, shutdown_on_loss: bool = True) -> None:
        self.pid = os.getpid()
        self.message_timeout = message_timeout
        self._shutdown_on_loss = shutdown_on_loss
        self._lock = threading.Lock()
        self._peer: Peer | None = None
        self._stopping = False
        self.index: int | None = None
        self.accepting = True
        self.generation = 0
        self.checkpoint: str | None = None
        self.retired: set[str] = set()
        self.restored_pending: set[str] = set()
        self.restored_targets: set[str] = set()
        self.served = 0
        self._calls: dict[tuple[str, str], WorkerCall] = {}

    @classmethod
    def connect(
        cls,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        message_timeout: float = MESSAGE_TIMEOUT,
        shutdown_on_loss: bool = True,
    ) -> WorkerClient:
        """Register this process (by pid) with the coordinator at ``socket_path`` and adopt its state.

        ``CoordinatorUnavailableError`` if it cannot be reached or does not answer.
        """
        client = cls(message_timeout=message_timeout, shutdown_on_loss=shutdown_on_loss)
        path = os.fspath(socket_path) if socket_path is not None else default_socket_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(message_timeout)
            sock.connect(path)
            sock.settimeout(None)  # from here on deadlines are kept with select (framing)
        except OSError as exc:
            sock.close()
            raise CoordinatorUnavailableError(f"cannot reach the checkpoint coordinator at {path!r}: {exc}") from exc
        owner = _listener_uid(sock)
        if owner is not None and owner != os.getuid():  # another user squats the path: tell it nothing
            sock.close()
            raise CoordinatorUnavailableError(
                f"the socket at {path!r} is served by uid {owner}, not this user ({os.getuid()}): "
                "it is not this server's checkpoint coordinator"
            )
        peer = Peer(
            sock, client._handle, on_close=client._lost, message_timeout=message_timeout, name="checkpoint coordinator"
        )
        client._peer = peer
        peer.start()
        adopted = peer.request("register", {"pid": client.pid})
        client._adopt(adopted)
        if client.checkpoint is not None:  # joined during a checkpoint: closed at once, and reports
            client.report()
        return client

    @property
    def connected(self) -> bool:
        peer = self._peer
        return peer is not None and not peer.closed.is_set()

    # --- calls ----------------------------------------------------------------------------------

    def begin_call(self, capture_key: str, model_call_id: str, *, staging_key: str | None = None) -> WorkerCall:
        """Admit a call: refused while admission is closed or its attempt is retired.  A call of
        a restored attempt claims the attempt (and its cut, if no other worker has)."""
        with self._lock:
            if not self.accepting:
                raise CheckpointStateError(
                    f"admission is closed for checkpoint {self.checkpoint!r}", status=503, code="admission_closed"
                )
            if capture_key in self.retired:
                raise CheckpointStateError(f"attempt {capture_key!r} is retired", code="attempt_retired")
            claim = capture_key in self.restored_pending or f"{capture_key}/{model_call_id}" in self.restored_targets
        continuation = None
        if claim:
            reply = self._request("claim_cut", {"capture_key": capture_key, "model_call_id": model_call_id})
            continuation = reply.get("continuation") if isinstance(reply, dict) else None
        call = WorkerCall(capture_key, model_call_id, staging_key, continuation=continuation)
        with self._lock:
            self.restored_pending.discard(capture_key)
            self.restored_targets.discard(f"{capture_key}/{model_call_id}")
            self.served += 1
            self._calls[(capture_key, model_call_id)] = call
        return call

    def deliver(self, call: WorkerCall, staging_key: str | None = None) -> None:
        """The call's response went out: its row can be committed."""
        with self._lock:
            call.delivered = True
            if staging_key is not None:
                call.staging_key = staging_key

    def return_cut(self, call: WorkerCall) -> bool:
        """Give back an unused restored cut, so another worker can claim it."""
        if call.continuation is None:
            return False
        reply = self._request("return_cut", {"capture_key": call.capture_key, "model_call_id": call.model_call_id})
        call.continuation = None
        return bool(isinstance(reply, dict) and reply.get("returned"))

    def calls(self) -> list[WorkerCall]:
        with self._lock:
            return list(self._calls.values())

    # --- messages to the coordinator --------------------------------------------------------

    def report(self) -> None:
        """Report what this worker holds for the open checkpoint."""
        self._request("report", self._report())

    def control(self, action: str, *, deadline: float | None = None, **body: Any) -> Any:
        """Forward a control call (prepare, commit, resume, restore, retire, forget, status).

        The answer may take the call's own ``deadline`` plus a grace period; a coordinator that
        is not connected, or never answers, raises ``CoordinatorUnavailableError`` (503).
        """
        if deadline is None and isinstance(body.get("timeout"), (int, float)):
            deadline = float(body["timeout"])  # prepare's own deadline
        timeout = self.message_timeout if deadline is None else max(self.message_timeout, deadline + CONTROL_GRACE)
        return self._request("control", {"action": action, **body}, timeout=timeout)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """The clean goodbye: tell the coordinator (waiting at most ``timeout``), then disconnect."""
        self._stopping = True
        peer = self._peer
        if peer is None:
            return
        # Shutting down anyway: if the goodbye fails, the coordinator logs this worker as lost.
        with contextlib.suppress(CoordinatorError):
            peer.request("deregister", {"pid": self.pid}, timeout=timeout)
        peer.close()
        peer.closed.wait(timeout)

    def _request(self, kind: str, body: Any, *, timeout: float | None = None) -> Any:
        peer = self._peer
        if peer is None or peer.closed.is_set():
            raise CoordinatorUnavailableError("this worker is not connected to a checkpoint coordinator")
        return peer.request(kind, body, timeout=timeout)

    def _lost(self, peer: Peer) -> None:
        if self._stopping:
            return
        _LOG.error("Policy worker [%d] lost its checkpoint coordinator; shutting down", self.pid)
        if self._shutdown_on_loss:
            os.kill(os.getpid(), signal.SIGTERM)

    # --- messages from the coordinator ----------------------------------------------------------

    def _adopt(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise CoordinatorUnavailableError(f"the coordinator answered register with {state!r}")
        with self._lock:
            self.index = state.get("index")
            self.accepting = bool(state.get("accepting", True))
            self.generation = int(state.get("generation", 0))
            self.checkpoint = state.get("checkpoint")
            if self.checkpoint is not None:
                self.accepting = False
            self.retired = set(state.get("retired", []))
            self.restored_pending = set(state.get("restored_pending", []))
            self.restored_targets = set(state.get("restored_targets", []))

    def _report(self) -> dict[str, Any]:
        with self._lock:
            calls = list(self._calls.values())
            return {
                "checkpoint_id": self.checkpoint,
                "pid": self.pid,
                "served": self.served,
                "rows": [
                    {"capture_key": c.capture_key, "model_call_id": c.model_call_id, "staging_key": c.staging_key}
                    for c in calls
                    if c.delivered
                ],
                "undelivered": [[c.capture_key, c.model_call_id] for c in calls if not c.delivered],
                "streaming": [],
            }

    def _handle(self, peer: Peer, kind: str, body: Any) -> Any:
        body = body if isinstance(body, dict) else {}
        if kind == "close":
            with self._lock:
                self.accepting = False
                self.checkpoint = body.get("checkpoint_id")
                self.generation = int(body.get("generation", self.generation))
            return self._report()
        if kind == "snapshot":
            return self._report()
        if kind == "open":
            with self._lock:
                self.accepting, self.checkpoint = True, None
                self.generation = int(body.get("generation", self.generation))
                self.restored_pending = set(body.get("pending", []))
            return {}
        if kind in ("retire", "mark", "forget"):
            return self._mark(kind, body)
        if kind == "restored_pending":
            with self._lock:
                self.restored_pending = set(body.get("pending", []))
                if "targets" in body:
                    self.restored_targets = set(body["targets"])
            return {}
        raise FrameError(f"unknown message kind {kind!r}", code="unknown_checkpoint_message")

    def _mark(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        keys = body.get("capture_keys") or [body.get("capture_key")]
        if not all(isinstance(key, str) for key in keys):
            raise FrameError(f"{kind} needs capture keys")
        stopped = 0
        with self._lock:
            for key in keys:
                if kind == "forget":
                    self.retired.discard(key)
                    continue
                self.retired.add(key)
                self.restored_pending.discard(key)
                self.restored_targets = {t for t in self.restored_targets if not t.startswith(f"{key}/")}
                if kind == "retire":  # stop and free the attempt's work on this worker
                    gone = [call for call in self._calls if call[0] == key]
                    for call in gone:
                        del self._calls[call]
                    stopped += len(gone)
        return {"stopped": stopped}


def _listener_uid(sock: socket.socket) -> int | None:
    """The uid of the process that accepted ``sock`` (Linux ``SO_PEERCRED``; None where unknown).

    Checked on the connection, not on the path: the file could change hands between a check
    of its owner and the connect."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return None
    return int(uid)
