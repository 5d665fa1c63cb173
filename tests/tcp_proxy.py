"""A TCP proxy a test controls: it forwards to a server until told to ``stall``.

Stalled, it keeps every connection open and reads nothing more from either side: to the
client the server has stopped answering mid-conversation (what a hung server or a path that
stops forwarding looks like), while this machine's kernel still acknowledges what the client
sends -- so neither TCP keepalives nor ``tcp_user_timeout`` can notice.  ``blackhole`` goes
further where iptables can (root): every packet to the proxy's port is dropped, as when a
network path dies (nothing is acknowledged any more, on either end).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import subprocess
import threading


class Proxy:
    """Forwards 127.0.0.1:``port`` to ``target_port``; ``stall()`` freezes every connection."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stalled = threading.Event()
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._dropping = False
        self._thread = threading.Thread(target=self._run, name="test-tcp-proxy", daemon=True)
        self._thread.start()

    def stall(self) -> None:
        self._stalled.set()

    def _run(self) -> None:
        peers: dict[socket.socket, socket.socket] = {}
        while not self._closing.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    server = socket.create_connection(self._target)
                    for end in (client, server):
                        end.setblocking(False)
                        self._selector.register(end, selectors.EVENT_READ)
                        self._sockets.append(end)
                    peers[client], peers[server] = server, client
                    continue
                if self._stalled.is_set():
                    continue
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                peer = peers.get(sock)
                if not data or peer is None:
                    for end in (sock, peer):
                        if end is not None:
                            with contextlib.suppress(Exception):
                                self._selector.unregister(end)
                            end.close()
                    continue
                try:
                    peer.setblocking(True)
                    peer.sendall(data)
                    peer.setblocking(False)
                except OSError:
                    pass
            if self._stalled.is_set():
                # Read nothing: sleep instead of spinning on readable sockets.
                self._closing.wait(0.05)

    def blackhole(self) -> bool:
        """Drop every packet to and from the proxy's port (iptables); False where it cannot."""
        if os.geteuid() != 0 or shutil.which("iptables") is None:
            return False
        for rule in self._rules():
            if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode != 0:
                self._unblackhole()
                return False
        self._dropping = True
        return True

    def _rules(self) -> list[list[str]]:
        port = str(self.port)
        return [
            ["INPUT", "-p", "tcp", "-i", "lo", "--dport", port, "-j", "DROP"],
            ["INPUT", "-p", "tcp", "-i", "lo", "--sport", port, "-j", "DROP"],
        ]

    def _unblackhole(self) -> None:
        for rule in self._rules():
            subprocess.run(["iptables", "-D", *rule], capture_output=True)
        self._dropping = False

    def close(self) -> None:
        if self._dropping:
            self._unblackhole()
        self._closing.set()
        self._thread.join(5)
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()
        self._selector.close()


def can_blackhole() -> str | None:
    """Why ``blackhole`` cannot work here (None: it can)."""
    if os.geteuid() != 0:
        return "dropping packets needs root (iptables)"
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    probe = subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True)
    if probe.returncode != 0:
        return f"iptables cannot change rules here: {probe.stderr.decode(errors='replace').strip()}"
    return None
