"""A PgBouncer of the test's own (Debian's ``pgbouncer`` binary), on ports 6430-6439, in front
of a ``pg_cluster.Cluster``; run with its own ini file, never as the system service."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pg_cluster import _give_to_server_user, _server_user, reserve_port

PORTS = range(6430, 6440)


def binary() -> str | None:
    return shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None)


def why_not() -> str | None:
    """Why no PgBouncer can run here (None: it can)."""
    if binary() is None:
        return "pgbouncer is not installed (apt-get install pgbouncer; .ci/run tries)"
    return None


class Bouncer:
    """PgBouncer in ``pool_mode`` with ``pool_size`` server connections per database and user."""

    def __init__(self, server_port: int, pool_mode: str, pool_size: int = 2, max_clients: int = 2000) -> None:
        self.pool_mode = pool_mode
        self.folder = Path(tempfile.mkdtemp(prefix="store-pgbouncer-"))
        self.port, self._port_lock = reserve_port(PORTS)  # held until ``stop``
        (self.folder / "users.txt").write_text('"postgres" ""\n')
        (self.folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={server_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.folder}\n"
            "auth_type = trust\n"
            f"auth_file = {self.folder / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            f"max_client_conn = {max_clients}\n"
            "max_db_connections = 0\n"
            "server_reset_query = DISCARD ALL\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.folder / 'pgbouncer.log'}\n"
            f"pidfile = {self.folder / 'pgbouncer.pid'}\n"
        )
        _give_to_server_user(self.folder)
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        pgbouncer = binary()
        assert pgbouncer is not None
        self._process = subprocess.Popen(
            [pgbouncer, str(self.folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=_server_user(),
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            if self._process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"pgbouncer did not start: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.folder / "pgbouncer.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}?sslmode=disable"

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        self._port_lock.close()


@contextlib.contextmanager
def running(server_port: int, pool_mode: str, pool_size: int = 2) -> Iterator[Bouncer]:
    bouncer = Bouncer(server_port, pool_mode, pool_size)
    try:
        bouncer.start()
        yield bouncer
    finally:
        bouncer.stop()
