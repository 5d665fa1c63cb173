"""Bad input at the coordinator: hostile frames are refused or timed out, never fatal, and never
hold up other workers; frames keep what the checkpoint writer keeps; the socket is private."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Iterator

import pytest
from coordinator_helpers import wait_for, workers

from store.coordinator import MAX_FRAME, Coordinator, CoordinatorError, FrameError, WorkerClient, framing
from store.coordinator.connection import Peer


@pytest.fixture
def socket_path(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(tmp_path, "policy.sock")


@pytest.fixture
def coord(socket_path: str) -> Iterator[Coordinator]:
    with Coordinator(socket_path, expected_workers=2, message_timeout=0.5, register_timeout=0.3) as started:
        yield started


def raw(socket_path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(socket_path)
    return sock


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def reply(sock: socket.socket) -> dict[str, object]:
    message = framing.read_frame(sock, body_timeout=5, idle_timeout=5)
    assert isinstance(message, dict)
    return message


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def still_serves(socket_path: str, coord: Coordinator) -> None:
    client = WorkerClient.connect(socket_path, message_timeout=2, shutdown_on_loss=False)
    try:
        assert client.control("status")["connected"] == 1
    finally:
        client.stop()
    assert wait_for(lambda: coord.status()["connected"] == 0)


def test_frames_keep_infinities_nan_and_integers_beyond_64_bits() -> None:
    message = {"id": 1, "kind": "report", "body": [-math.inf, math.inf, 2**70, -(2**100), 0.1]}
    decoded = framing.decode(framing.encode(message)[4:])
    assert decoded["body"][:2] == [-math.inf, math.inf]
    assert decoded["body"][2:] == [2**70, -(2**100), 0.1]
    assert math.isnan(framing.decode(framing.encode(math.nan)[4:]))


def test_a_message_that_cannot_be_framed_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(FrameError) as unframable:
        framing.encode({"body": object()})
    assert (unframable.value.status, unframable.value.code) == (422, "invalid_checkpoint_state")
    with pytest.raises(FrameError, match="frame limit"):
        framing.encode("x" * (MAX_FRAME + 1))


def test_malformed_json_and_non_requests_are_refused_and_the_connection_goes_on(
    socket_path: str, coord: Coordinator
) -> None:
    sock = raw(socket_path)
    for payload in (b"{not json", b"\xff\xfe", b"[1, 2]", b'{"id": 1}', b""):
        sock.sendall(frame(payload))
        error = reply(sock)
        assert error["ok"] is False and error["reply_to"] in (None, 1)
        assert error["error"]["code"] == "invalid_checkpoint_message"  # type: ignore[index]
    sock.sendall(frame(json.dumps({"id": 7, "kind": "report", "body": {}}).encode()))
    assert reply(sock)["error"]["code"] == "invalid_checkpoint_state"  # type: ignore[index]  # not registered
    sock.sendall(frame(json.dumps({"id": 8, "kind": "register", "body": {"pid": os.getpid()}}).encode()))
    assert reply(sock)["ok"] is True
    sock.sendall(frame(json.dumps({"id": 9, "kind": "no-such-kind", "body": None}).encode()))
    unknown = reply(sock)
    assert (unknown["reply_to"], unknown["error"]["code"]) == (9, "unknown_checkpoint_message")  # type: ignore[index]
    sock.sendall(frame(json.dumps({"id": 10, "kind": "register", "body": {"pid": True}}).encode()))
    assert reply(sock)["error"]["status"] == 400  # type: ignore[index]
    sock.close()
    assert wait_for(lambda: coord.status()["connected"] == 0)
    still_serves(socket_path, coord)


def test_oversized_and_truncated_frames_drop_only_that_connection(socket_path: str, coord: Coordinator) -> None:
    oversized = raw(socket_path)
    oversized.sendall(struct.pack(">I", MAX_FRAME + 1))
    error = reply(oversized)
    assert error["error"]["status"] == 413  # type: ignore[index]
    assert closed_by_peer(oversized)
    truncated = raw(socket_path)
    truncated.sendall(struct.pack(">I", 100) + b"{" * 10)  # then nothing: times out inside the frame
    assert reply(truncated)["error"]["status"] == 408  # type: ignore[index]
    assert closed_by_peer(truncated)
    half_header = raw(socket_path)
    half_header.sendall(b"\x00\x00")
    half_header.close()
    still_serves(socket_path, coord)


def test_a_peer_that_sends_nothing_is_dropped_without_blocking_other_workers(
    socket_path: str, coord: Coordinator
) -> None:
    silent = [raw(socket_path) for _ in range(3)]
    with workers(socket_path, 2):  # register while the silent peers hold their connections
        assert coord.status()["connected"] == 2
    for sock in silent:  # dropped after register_timeout, with a 408 saying why
        assert reply(sock)["error"]["status"] == 408  # type: ignore[index]
        assert closed_by_peer(sock)
        sock.close()


def test_unexpected_failures_are_a_500_and_the_coordinator_lives_on(socket_path: str, coord: Coordinator) -> None:
    client = WorkerClient.connect(socket_path, message_timeout=2, shutdown_on_loss=False)
    try:
        with pytest.raises(CoordinatorError) as failed:
            client.control("restore", records=[{"rollout_id": "r", "attempt": 0, "generation_cuts": [{}, {}]}])
        assert (failed.value.status, failed.value.code) == (400, "invalid_checkpoint_message")
        assert "at most one generation cut" in str(failed.value)
        with pytest.raises(CoordinatorError, match="prepare timeout"):
            client.control("prepare", checkpoint_id="ck", timeout="soon")
        assert client.control("status")["checkpoint"] is None  # nothing changed
    finally:
        client.stop()


def test_the_socket_is_private_to_its_user() -> None:
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o755)  # others may reach the socket: only its own mode keeps them out
    socket_path = os.path.join(folder, "policy.sock")
    previous = os.umask(0)  # even a permissive umask leaves the socket 0600
    try:
        coord = Coordinator(socket_path, expected_workers=1).start()
    finally:
        os.umask(previous)
    try:
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        if os.geteuid() == 0:  # root ignores the mode: check that another user is kept out
            assert _connect_as(65534, socket_path) == errno.EACCES
    finally:
        coord.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert not os.path.exists(socket_path)


def _connect_as(uid: int, socket_path: str) -> int:
    """The errno another user's process gets connecting to the socket (0: it connected)."""
    pid = os.fork()
    if pid == 0:  # the child only drops privileges, tries, and exits
        code = 0
        try:
            os.setuid(uid)
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(socket_path)
        except OSError as exc:
            code = exc.errno or 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_failing_handler_is_a_500_and_an_unframable_reply_a_422() -> None:
    def handler(peer: Peer, kind: str, body: object) -> object:
        if kind == "boom":
            raise RuntimeError("handler bug")
        return {"value": object()}  # not JSON

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peers = [
        Peer(sock, handler, on_close=lambda _: None, message_timeout=2, name=name)
        for sock, name in ((ours, "caller"), (theirs, "handler"))
    ]
    for peer in peers:
        peer.start()
    try:
        with pytest.raises(CoordinatorError) as crashed:
            peers[0].request("boom", None)
        assert (crashed.value.status, crashed.value.code) == (500, "checkpoint_error")
        assert "handler bug" in str(crashed.value)
        with pytest.raises(CoordinatorError) as unframable:
            peers[0].request("anything", None)
        assert (unframable.value.status, unframable.value.code) == (422, "invalid_checkpoint_state")
        with pytest.raises(CoordinatorError, match="handler bug"):  # the connection still works
            peers[0].request("boom", None)
    finally:
        for peer in peers:
            peer.close()
