"""A PostgreSQL server of a test's own, on ports 55430-55439, that the test may kill, stop or restart.

The shared server (``STORE_TEST_POSTGRES_URL``) is never stopped, killed or reconfigured: a test
that needs a server to fail makes one here.  ``initdb`` runs once per test session into a
template directory; each cluster starts from a copy of it (a start takes about half a second).
Root cannot run a PostgreSQL server, so under root the server runs as the ``postgres`` user.

``kill()`` SIGKILLs every process of the server at once (the postmaster, the backends, the WAL
writer: what a crash of the server's processes leaves), ``pause()``/``resume()`` SIGSTOP and
SIGCONT them all (a server that stops answering while its kernel still acknowledges every packet).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import psycopg

PORTS = range(55430, 55440)
# Fast and small: the tests kill processes, never the machine, so nothing needs an fsync
# (what a killed process wrote to the kernel survives it).
BASE_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "16MB",
    "max_wal_size": "64MB",
    "listen_addresses": "127.0.0.1",
    "log_min_messages": "fatal",
}


def binaries() -> Path | None:
    """The folder holding ``initdb`` and ``postgres`` (None: PostgreSQL's server is not installed)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return None if initdb is None else Path(initdb).parent


def why_not() -> str | None:
    """Why a cluster of the test's own cannot run here (None: it can)."""
    if binaries() is None:
        return "PostgreSQL's server binaries (initdb, postgres) are not installed"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run a server as"
    return None


def _server_user() -> str | None:
    return "postgres" if os.geteuid() == 0 else None


def _give_to_server_user(path: Path) -> None:
    user = _server_user()
    if user is None:
        return
    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        os.chown(root, entry.pw_uid, entry.pw_gid)
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), entry.pw_uid, entry.pw_gid)


def make_template(folder: Path) -> Path:
    """``initdb`` once into ``folder/template`` (trust authentication, user postgres)."""
    bindir = binaries()
    assert bindir is not None
    folder.mkdir(parents=True, exist_ok=True)
    _give_to_server_user(folder)
    data = folder / "template"
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        check=True,
        capture_output=True,
        user=_server_user(),
    )
    return data


def reserve_port(ports: range) -> tuple[int, IO[bytes]]:
    """A free port and the open lock file that reserves it for tests of every process until it
    is closed.  Binding alone is not enough: two clusters made at once (xdist workers) both see
    the port free before either server listens, and the second's ``wait_ready`` then found the
    first's server answering and took it for its own."""
    for port in ports:
        lock = open(os.path.join(tempfile.gettempdir(), f"store-pg-port-{port}.lock"), "ab")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                lock.close()
                continue
        return port, lock
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def _alive(pid: int) -> bool:
    """``pid`` still runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Cluster:
    """One server from the template: ``start`` it, then ``kill``, ``pause``, ``resume``, ``restart``."""

    def __init__(self, template: Path, settings: Mapping[str, str] | None = None) -> None:
        bindir = binaries()
        assert bindir is not None
        self._postgres = bindir / "postgres"
        self.folder = Path(tempfile.mkdtemp(prefix="store-pg-"))
        self.data = self.folder / "data"
        shutil.copytree(template, self.data, symlinks=True)
        os.chmod(self.data, 0o700)
        _give_to_server_user(self.folder)
        self.port, self._port_lock = reserve_port(PORTS)  # held until ``remove``
        self.settings = {**BASE_SETTINGS, **(settings or {})}
        self._process: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres", **query: str) -> str:
        extra = "".join(f"&{name}={value}" for name, value in query.items())
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}?sslmode=disable{extra}"

    def conninfo(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database} sslmode=disable"

    def start(self, *, wait: bool = True) -> None:
        command = [str(self._postgres), "-D", str(self.data), "-p", str(self.port), "-k", str(self.folder)]
        for name, value in self.settings.items():
            command += ["-c", f"{name}={value}"]
        log = open(self.folder / "server.log", "ab")  # noqa: SIM115 (the server writes it after we return)
        try:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=log, user=_server_user(), start_new_session=True
            )
        finally:
            log.close()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.conninfo(), connect_timeout=2) as connection:
                    [[folder]] = connection.execute("SHOW data_directory").fetchall()
                if os.path.realpath(str(folder)) != os.path.realpath(self.data):
                    raise RuntimeError(f"port {self.port} is answered by another server ({folder}), not this cluster's")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline or (self._process is not None and self._process.poll() is not None):
                    raise RuntimeError(f"the test server did not start: {self.log_tail()}") from None
                time.sleep(0.05)

    def log_tail(self) -> str:
        try:
            return (self.folder / "server.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def processes(self) -> list[int]:
        """The postmaster and its children (each backend is a process group of its own)."""
        if self._process is None or self._process.poll() is not None:
            return []
        postmaster = self._process.pid
        found = [postmaster]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                found.append(int(entry))
        return found

    def _signal_all(self, sig: signal.Signals) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL every process of the server at once (nothing gets to flush or clean up)."""
        children = self.processes()[1:]
        self._signal_all(signal.SIGKILL)
        if self._process is not None:
            self._process.wait()
        deadline = time.monotonic() + 10
        while children and time.monotonic() < deadline:  # a killed backend's exit is not instant
            children = [pid for pid in children if _alive(pid)]
            time.sleep(0.01)

    def pause(self) -> None:
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def stop(self) -> None:
        """A fast shutdown (SIGINT), or a kill if it does not end in 10 s."""
        if self._process is None or self._process.poll() is not None:
            return
        self.resume()
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        self.resume()
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)
        self._port_lock.close()

    def execute(self, sql: str, database: str = "postgres") -> list[tuple[object, ...]]:
        with psycopg.connect(self.conninfo(database), autocommit=True, connect_timeout=5) as connection:
            cursor = connection.execute(sql)
            return list(cursor.fetchall()) if cursor.description else []


@contextlib.contextmanager
def running(template: Path, settings: Mapping[str, str] | None = None) -> Iterator[Cluster]:
    cluster = Cluster(template, settings)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()
