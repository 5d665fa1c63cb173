"""``Coordinator``: the main process's end of the policy checkpoint socket (wire-contract 8).

It serves no requests itself: it tracks the worker processes, logs each one by pid as it
joins, stops or is lost (8.3), and drives the checkpoint phases across all of them.

Against a hostile peer of the same user (another user is refused by the socket's mode and
``SO_PEERCRED``): at most ``max_connections`` connections; one that has not registered within
``register_timeout`` is dropped, reads at most 64 KiB frames and gets no thread; a registered
worker's frames are at most ``max_frame_bytes``; the accept loop outlives a failed accept or
thread start.  The socket is born 0600 (``fchmod`` before ``bind``: no process-wide umask, no
``chmod`` of a path that could be a symlink), and a stale socket a killed coordinator left at
the path is replaced, never a live one or a file that is not a socket.

A worker is logged (and recorded in the store) by the pid the kernel reports for its socket
(``SO_PEERCRED``: the process that connected, in this process's pid namespace), never by the
pid its ``register`` frame claims: a peer cannot log itself as another process.  A claim that
differs (a worker in another pid namespace, or a lie) is accepted and named in a WARNING.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from store.coordinator import framing, worker_log
from store.coordinator.connection import HELD_BYTES_TOTAL, Admission, ByteBudget, Peer
from store.coordinator.errors import CheckpointStateError, CoordinatorError, FrameError
from store.coordinator.state import MAX_ATTEMPT, CheckpointState, Worker, check_report

if TYPE_CHECKING:
    from store.store import Store

SOCKET_ENV = "NEMO_GYM_POLICY_CHECKPOINT_SOCKET"
MESSAGE_TIMEOUT = 30.0
CONTROL_GRACE = 10.0
_THREADED = ("control", "claim_cut", "return_cut")
_LOG = logging.getLogger("store.coordinator")
MAX_PID = 2**31 - 1  # pid_t
# accept() failures that pass: out of fds or memory for a moment, or a peer gone before accept
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EINTR, errno.EPROTO}
_ACCEPT_BACKOFF = 0.1  # seconds before accepting again after a failure


def default_socket_path() -> str:
    """``$NEMO_GYM_POLICY_CHECKPOINT_SOCKET``, else ``ng-policy-{pid}-{8 hex}.sock`` in the temp directory."""
    configured = os.environ.get(SOCKET_ENV)
    if configured:
        return configured
    return os.path.join(tempfile.gettempdir(), f"ng-policy-{os.getpid()}-{secrets.token_hex(4)}.sock")


class Coordinator:
    """Listens on a Unix socket (mode 0600) for the policy worker processes of this server."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        expected_workers: int,
        store: Store | None = None,
        message_timeout: float = MESSAGE_TIMEOUT,
        register_timeout: float = 10.0,
        max_connections: int | None = None,
        max_frame_bytes: int = framing.WORKER_FRAME_LIMIT,
    ) -> None:
        """``max_connections`` defaults to twice the expected workers plus 16 (replacements and
        stragglers fit; a flood does not); ``max_frame_bytes`` (16 MiB, at most the contract's
        64 MiB) bounds a registered worker's frames."""
        if not isinstance(expected_workers, int) or isinstance(expected_workers, bool) or expected_workers < 1:
            raise CoordinatorError(f"expected_workers must be a positive integer, got {expected_workers!r}", status=400)
        if max_connections is None:
            max_connections = 2 * expected_workers + 16
        if type(max_connections) is not int or max_connections < expected_workers:
            raise CoordinatorError(
                f"max_connections must be an integer >= expected_workers, got {max_connections!r}", status=400
            )
        if type(max_frame_bytes) is not int or not framing.REGISTER_FRAME_LIMIT <= max_frame_bytes <= framing.MAX_FRAME:
            bounds = f"[{framing.REGISTER_FRAME_LIMIT}, {framing.MAX_FRAME}]"
            raise CoordinatorError(f"max_frame_bytes must be in {bounds}, got {max_frame_bytes!r}", status=400)
        self.socket_path = os.fspath(socket_path) if socket_path is not None else default_socket_path()
        self.expected = expected_workers
        self._store = store
        self.message_timeout = message_timeout
        self._register_timeout = register_timeout
        self.max_connections = max_connections
        self._admission = Admission(
            register_timeout,
            admitted_frame_limit=max_frame_bytes,
            budget=ByteBudget(max(HELD_BYTES_TOTAL, 2 * max_frame_bytes)),
        )
        self._churn = worker_log.ChurnLimit()
        self._events = worker_log.EventLimit(max_connections)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a report arrived or a worker left
        self._state = CheckpointState(expected_workers)
        self._peers: dict[Peer, int | None] = {}  # connection -> worker index once registered
        self._by_index: dict[int, Peer] = {}
        self._goodbyes: set[int] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._closing = False

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Coordinator:
        listener = _bind_private(self.socket_path)
        listener.listen(256)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="coordinator-accept", daemon=True)
        self._acceptor.start()
        return self

    def close(self) -> None:
        """Stop listening and drop every worker connection (the workers then shut down)."""
        with self._lock:
            self._closing = True
            peers = list(self._peers)
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        for peer in peers:
            peer.close()
        for peer in peers:
            peer.closed.wait(timeout=5)
        self._churn.flush()

    def __enter__(self) -> Coordinator:
        return self.start() if self._listener is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        """Workers by pid, expected, accepting, the open checkpoint and its blockers."""
        with self._lock:
            state = self._state
            return {
                "workers": {
                    w.pid: {"index": w.index, "reported": w.report is not None, "served": w.served}
                    for w in state.workers.values()
                },
                "connected": len(state.workers),
                "expected": state.expected,
                "accepting": state.accepting,
                "generation": state.generation,
                "checkpoint": state.checkpoint,
                "blockers": state.blockers(),
                "lost_worker": state.lost_worker,
                "retired": sorted(state.retired),
                "restored_pending": sorted(state.pending),
                "restored": {target: list(rows) for target, rows in sorted(state.restored_rows.items())},
            }

    def wait_for_workers(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until ``count`` workers are registered (for start-up and tests)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._state.workers) != count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    # --- connections ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if self._listener is None or exc.errno not in _TRANSIENT:
                    return  # closed
                _LOG.warning("the checkpoint coordinator could not accept a connection: %s; retrying", exc)
                time.sleep(_ACCEPT_BACKOFF)  # out of fds or memory: give the process a moment
                continue
            try:
                self._admit_connection(sock)
            except Exception:  # never the end of the accept loop: drop this one connection
                _LOG.exception("the checkpoint coordinator dropped a new connection")
                with contextlib.suppress(OSError):
                    sock.close()
            if self._listener is None:
                return

    def _admit_connection(self, sock: socket.socket) -> None:
        """Start serving an accepted connection, or refuse it (another user, past the cap, no thread)."""
        credentials = _peer_credentials(sock)
        if credentials is False:
            sock.close()  # 0600 already keeps others out; this also covers a loosened mode
            return
        peer = Peer(
            sock,
            self._handle,
            on_close=self._closed,
            message_timeout=self.message_timeout,
            admission=self._admission,
            threaded_kinds=_THREADED,
            name="policy worker",
        )
        peer.kernel_pid = credentials  # None where the platform has no SO_PEERCRED
        with self._lock:
            if self._closing:
                sock.close()
                return
            full = len(self._peers) >= self.max_connections
            if not full:
                self._peers[peer] = None
        if full:
            detail = f"the coordinator holds its limit of {self.max_connections} connections"
            _refuse_and_close(sock, CoordinatorError(detail, status=503, code="too_many_connections"))
            return
        try:
            peer.start()
        except RuntimeError as exc:  # the process cannot start a thread now: refuse this one, keep accepting
            with self._lock:
                self._peers.pop(peer, None)
            _LOG.warning("the checkpoint coordinator refused a connection: cannot start its thread (%s)", exc)
            _refuse_and_close(
                sock, CoordinatorError(f"cannot start a thread: {exc}", status=503, code="checkpoint_busy")
            )

    def _closed(self, peer: Peer) -> None:
        with self._lock:
            index = self._peers.pop(peer, None)
            if index is None:
                return
            self._by_index.pop(index, None)
            said_goodbye = index in self._goodbyes
            self._goodbyes.discard(index)
            checkpoint = self._state.checkpoint
            worker = self._state.leave(index)
            given_back = worker is not None and bool(worker.claims)
            update = self._restored_update()
            blocked = self._state.lost_worker and checkpoint is not None
            remaining = len(self._state.workers)
            closing = self._closing
            self._changed.notify_all()
        if worker is None or closing:
            return
        if given_back:  # the dead worker's restored cuts are offered to the workers still here
            self._broadcast("restored_pending", update)
        self._log_leave(worker, said_goodbye, remaining, checkpoint if blocked else None)

    def _log_leave(self, worker: Worker, said_goodbye: bool, remaining: int, blocked: str | None) -> None:
        if blocked is not None or self._churn.allow("stopped" if said_goodbye else "lost"):
            worker_log.log_leave(
                worker, said_goodbye=said_goodbye, remaining=remaining, expected=self.expected, blocked=blocked
            )
        if not worker.recorded:
            return  # its join was not recorded either (worker_log.EventLimit)
        kind = "worker_stopped" if said_goodbye else "worker_lost"
        worker_log.record(self._store, kind, worker, connected=remaining, expected=self.expected, checkpoint=blocked)

    # --- messages from workers ------------------------------------------------------------------

    def _handle(self, peer: Peer, kind: str, body: Any) -> Any:
        if kind == "register":
            return self._register(peer, body)
        with self._lock:
            index = self._peers.get(peer)
        if index is None:
            raise CheckpointStateError("register before sending anything else")
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise FrameError(f"unknown message kind {kind!r}", code="unknown_checkpoint_message")
        return handler(self, index, body)

    def _register(self, peer: Peer, body: Any) -> Any:
        claimed = body.get("pid") if isinstance(body, dict) else None
        if not isinstance(claimed, int) or isinstance(claimed, bool) or not 0 < claimed <= MAX_PID:
            raise FrameError(f"register needs {{'pid': <integer in 1..{MAX_PID}>}}, got {_short(body)}")
        pid = claimed if peer.kernel_pid is None else peer.kernel_pid
        if pid != claimed and self._churn.allow("claimed"):
            worker_log.log_claim(pid, claimed)
        with self._lock:
            if self._peers.get(peer) is not None:
                raise CheckpointStateError("this connection is already registered")
            worker = self._state.join(pid)
            self._peers[peer] = worker.index
            self._by_index[worker.index] = peer
            connected = len(self._state.workers)
            adoption = self._state.adoption()
            self._changed.notify_all()
        peer.admit()
        if self._churn.allow("joined"):
            worker_log.log_join(worker, connected, self.expected)
        worker.recorded = self._store is not None and self._events.allow(worker.pid)
        if worker.recorded:
            worker.joined_seq = worker_log.record(
                self._store, "worker_joined", worker, connected=connected, expected=self.expected, checkpoint=None
            )
        return {"index": worker.index, **adoption}

    def _report(self, index: int, body: Any) -> Any:
        with self._lock:
            self._state.record_report(index, body)
            self._changed.notify_all()
        return {}

    def _deregister(self, index: int, body: Any) -> Any:
        with self._lock:
            self._goodbyes.add(index)
        return {}

    def _claim_cut(self, index: int, body: Any) -> Any:
        key, model_call_id = _call_of(body)
        with self._lock:
            continuation, started = self._state.claim(index, key, model_call_id)
            update = self._restored_update()
        if started:  # no longer pending on any worker, before the claimer goes on
            self._broadcast("restored_pending", update, exclude=index)
        return {"continuation": continuation}

    def _return_cut(self, index: int, body: Any) -> Any:
        key, model_call_id = _call_of(body)
        with self._lock:
            returned = self._state.return_cut(index, key, model_call_id)
            update = self._restored_update()
        if returned:  # offered again to every worker
            self._broadcast("restored_pending", update, exclude=index)
        return {"returned": returned}

    def _restored_update(self) -> dict[str, Any]:
        """The restored attempts still pending and the cuts still unclaimed (called holding the lock)."""
        state = self._state
        return {
            "pending": sorted(state.pending),
            "targets": sorted(target for target, cut in state.cuts.items() if cut.claimed_by is None),
        }

    def _control(self, index: int, body: Any) -> Any:
        if not isinstance(body, dict) or not isinstance(body.get("action"), str):
            raise FrameError("control needs {'action': <name>, ...}")
        action = _CONTROL.get(body["action"])
        if action is None:
            raise FrameError(f"unknown control action {body['action']!r}", code="unknown_checkpoint_message")
        return action(self, body)

    # --- control actions (a worker forwards them from its control route) ------------------------

    def prepare(self, checkpoint_id: str, *, timeout: float = 5.0) -> dict[str, Any]:
        """Close admission on every worker and wait (up to ``timeout``) for all their reports."""
        checkpoint_id = _text("checkpoint_id", checkpoint_id)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._state.prepare(checkpoint_id)
            generation = self._state.generation
        # A worker that does not answer by the deadline stays unreported: it blocks, it never hangs prepare.
        replies = self._broadcast(
            "close", {"checkpoint_id": checkpoint_id, "generation": generation}, timeout=max(0.001, timeout)
        )
        with self._lock:
            for index, reply in replies.items():
                if not isinstance(reply, CoordinatorError) and index in self._state.workers:
                    self._state.record_report(index, reply)
            while self._state.blockers() and not self._state.lost_worker:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            blockers = self._state.blockers()
            return {
                "checkpoint_id": checkpoint_id,
                "ready": not blockers,
                "blockers": blockers,
                "reported": self._state.reported(),
                "expected": self.expected,
            }

    def commit(self, checkpoint_id: str) -> dict[str, Any]:
        """The checkpoint's rows from every worker, leaving out calls still undelivered anywhere."""
        checkpoint_id = _text("checkpoint_id", checkpoint_id)
        with self._lock:
            self._state.require_ready(checkpoint_id)
        replies = self._broadcast("snapshot", {"checkpoint_id": checkpoint_id})
        failed = [index for index, reply in replies.items() if isinstance(reply, CoordinatorError)]
        with self._lock:
            if failed:
                raise CheckpointStateError(
                    f"checkpoint {checkpoint_id!r} is no longer ready: worker(s) {failed} did not answer",
                    code="checkpoint_not_ready",
                )
            snapshots = [check_report(reply) for reply in replies.values()]
            return self._state.commit(checkpoint_id, snapshots)

    def resume(self) -> dict[str, Any]:
        """Open admission again and clear a lost worker's block."""
        with self._lock:
            self._state.resume()
            update = {"generation": self._state.generation, "pending": sorted(self._state.pending)}
        self._broadcast("open", update)
        return {"accepting": True, **update}

    def retire(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        """Refuse an attempt on every worker (and every later one) until ``forget``."""
        key = _attempt(rollout_id, attempt)
        with self._lock:
            self._state.retire(key)
        replies = self._broadcast("retire", {"capture_key": key})
        stopped = sum(r.get("stopped", 0) for r in replies.values() if isinstance(r, dict))
        return {"retired": key, "stopped": stopped}

    def forget(self, rollout_id: str, attempt: int) -> dict[str, Any]:
        key = _attempt(rollout_id, attempt)
        with self._lock:
            self._state.forget(key)
        self._broadcast("forget", {"capture_key": key})
        return {"forgotten": key}

    def restore(self, records: Any) -> dict[str, Any]:
        """Import checkpoint records once, under each episode's next attempt, and offer their
        cuts to every worker.  Refused once a worker has left or any worker served a call."""
        replies = self._broadcast("snapshot", {"checkpoint_id": None})
        served = sum(r.get("served", 0) for r in replies.values() if isinstance(r, dict))
        with self._lock:
            result = self._state.restore(records, served)
            retired = sorted(self._state.retired)
            update = self._restored_update()
        self._broadcast("mark", {"capture_keys": retired})
        self._broadcast("restored_pending", update)
        return result

    def _control_prepare(self, body: dict[str, Any]) -> Any:
        timeout = body.get("timeout", 5.0)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 <= timeout <= 3600:
            raise FrameError("prepare timeout must be a number of seconds in [0, 3600]")
        return self.prepare(body.get("checkpoint_id"), timeout=float(timeout))  # type: ignore[arg-type]

    # --- talking to every worker ----------------------------------------------------------------

    def _broadcast(
        self, kind: str, body: Any, *, exclude: int | None = None, timeout: float | None = None
    ) -> dict[int, Any]:
        """Send ``kind`` to every registered worker at once; each reply, or the error it got."""
        with self._lock:
            targets = [(index, peer) for index, peer in self._by_index.items() if index != exclude]
        replies: dict[int, Any] = {}

        def ask(index: int, peer: Peer) -> None:
            try:
                replies[index] = peer.request(kind, body, timeout=timeout)
            except CoordinatorError as exc:
                replies[index] = exc

        threads = [threading.Thread(target=ask, args=target, daemon=True) for target in targets[1:]]
        for thread in threads:
            thread.start()
        if targets:
            ask(*targets[0])
        for thread in threads:
            thread.join()
        return replies


_HANDLERS: dict[str, Callable[[Coordinator, int, Any], Any]] = {
    "report": Coordinator._report,
    "deregister": Coordinator._deregister,
    "claim_cut": Coordinator._claim_cut,
    "return_cut": Coordinator._return_cut,
    "control": Coordinator._control,
}


def _control_dispatch() -> dict[str, Callable[[Coordinator, dict[str, Any]], Any]]:
    return {
        "prepare": Coordinator._control_prepare,
        "commit": lambda c, b: c.commit(b.get("checkpoint_id")),
        "resume": lambda c, b: c.resume(),
        "retire": lambda c, b: c.retire(b.get("rollout_id"), b.get("attempt")),
        "forget": lambda c, b: c.forget(b.get("rollout_id"), b.get("attempt")),
        "restore": lambda c, b: c.restore(b.get("records")),
        "status": lambda c, b: c.status(),
    }


_CONTROL = _control_dispatch()


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise FrameError(f"{name} must be a non-empty string, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """``repr`` cut to 200 characters: an error echoes a peer's value, never all of it."""
    shown = repr(value)
    return shown if len(shown) <= 200 else shown[:197] + "..."


def _attempt(rollout_id: Any, attempt: Any) -> str:
    from store.wire.cut_records import capture_key

    rollout_id = _text("rollout_id", rollout_id)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt <= MAX_ATTEMPT:
        raise FrameError(f"attempt must be an integer in 0..{MAX_ATTEMPT}, got {_short(attempt)}")
    return capture_key(rollout_id, attempt)


def _call_of(body: Any) -> tuple[str, str]:
    if not isinstance(body, dict):
        raise FrameError("expected {'capture_key': ..., 'model_call_id': ...}")
    return _text("capture_key", body.get("capture_key")), _text("model_call_id", body.get("model_call_id"))


def _peer_credentials(sock: socket.socket) -> int | bool | None:
    """The connecting process's pid if it runs as this user (Linux ``SO_PEERCRED``), False if it
    does not (or cannot be told), None where the platform cannot say (0600 is trusted there)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return False
    if uid != os.getuid():
        return False
    return pid if pid > 0 else None  # 0: the peer is in a pid namespace this one cannot see


def _refuse_and_close(sock: socket.socket, error: CoordinatorError) -> None:
    """One error frame (if the peer takes it at once), then close."""
    with contextlib.suppress(OSError, CoordinatorError):
        framing.send_all(sock, framing.encode({"reply_to": None, "ok": False, "error": error.wire()}), 0.1)
    with contextlib.suppress(OSError):
        sock.close()


def _bind_private(path: str) -> socket.socket:
    """A Unix socket bound at ``path`` and born 0600.

    The mode is set on the socket before ``bind`` (Linux gives the file the socket's mode less
    the umask), so no umask is changed for the whole process and no path is ``chmod``-ed after
    the fact (it could have been swapped for a symlink).  A socket file left by a coordinator
    that was killed (nobody accepts on it) is removed and bound again; a live socket, one
    another user owns, or a path that is not a socket is refused."""
    for attempt in range(2):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.fchmod(listener.fileno(), 0o600)
            listener.bind(path)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE and attempt == 0 and _remove_stale(path):
                continue
            raise CoordinatorError(f"cannot listen on {path!r}: {exc}", status=500) from exc
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if mode & 0o077:  # a platform that ignores a socket's own mode
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise CoordinatorError(f"cannot make {path!r} private (mode {mode:04o})", status=500)
        return listener
    raise AssertionError("unreachable")


def _remove_stale(path: str) -> bool:
    """Remove a socket file at ``path`` that is ours and that nobody listens on; False (and
    nothing removed) for anything else, which the caller then reports."""
    try:
        info = os.lstat(path)
    except OSError:
        return True  # gone meanwhile: bind again
    if not stat.S_ISSOCK(info.st_mode):
        raise CoordinatorError(f"cannot listen on {path!r}: it exists and is not a socket", status=500)
    if info.st_uid != os.getuid():
        raise CoordinatorError(f"cannot listen on {path!r}: the socket there belongs to uid {info.st_uid}", status=500)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        pass  # stale: nobody accepts on it
    except OSError:
        return False
    else:
        raise CoordinatorError(f"cannot listen on {path!r}: another coordinator is listening there", status=500)
    finally:
        probe.close()
    _LOG.warning("removing the stale checkpoint socket %s (its coordinator is gone)", path)
    os.unlink(path)
    return True
