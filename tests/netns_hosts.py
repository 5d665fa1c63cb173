"""Simulated hosts for the host-loss test and its soak: network namespaces (iproute2 ``ip netns``),
each joined to the root namespace by a veth pair and given a tmpfs of its own for its local store.

Host ``i`` is namespace ``sts<tag>h<i>``; its end of the pair has 10.<b>.<100+i>.2/24, the root
namespace's end 10.<b>.<100+i>.1/24 (where the replica listens).  ``b`` is one run's own block
(``Hosts.network``): two runs at once (pytest-xdist's workers, a soak beside the tests) must
never both route 10.<b>.<100+i>.0/24 from the root namespace, or one run's replies reach the
other's hosts and a healthy link looks cut.  ``destroy`` is the host's loss:
every process in its namespace SIGKILLed, its tmpfs unmounted (the local store is gone), the
namespace and its link deleted.  ``partition``/``mend`` take the root side of its link down/up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("host_worker.py")
BLOCKS = range(64, 128)  # the second octets a run may take: 10.64.0.0/16 to 10.127.0.0/16


def _claim_block() -> tuple[int, int]:
    """A block no other live run holds, as (second octet, the held lock's fd): each block's lock
    file is flocked for the run's life (released when its process dies, however it dies), and a
    block still on a root-namespace link (a killed run's leftovers) is skipped."""
    used = _ip("-o", "-4", "addr", "show").stdout
    folder = Path(tempfile.gettempdir())
    for octet in BLOCKS:
        fd = os.open(folder / f"staging-store-netns-{octet}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if f" 10.{octet}." in used:
            os.close(fd)
            continue
        return octet, fd
    raise RuntimeError(f"every address block 10.{BLOCKS[0]}-{BLOCKS[-1]}.0.0/16 is taken by a live run")


def _link_address(block: int, index: int, end: int) -> str:
    """An address on host ``index``'s link: ``end`` 1 the root namespace's, 2 the host's."""
    return f"10.{block}.{100 + index}.{end}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def why_not() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    name = f"stsprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    name: str
    index: int
    root_link: str
    folder: Path
    block: int  # the second octet of its run's addresses
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def replica_address(self) -> str:
        """The root namespace's address as this host sees it (where the replica listens)."""
        return _link_address(self.block, self.index, 1)

    @property
    def address(self) -> str:
        """This host's own address (its connections come from it)."""
        return _link_address(self.block, self.index, 2)

    def spawn(self, args: Sequence[str], worker: Path = WORKER) -> subprocess.Popen[str]:
        """``python tests/host_worker.py ARGS`` (or another ``worker`` program) in this host's namespace."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.name, sys.executable, str(worker), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        listed = _ip("netns", "pids", self.name, check=False).stdout.split()
        return [int(pid) for pid in listed]


class Hosts:
    """The simulated hosts of one test run (``add``, ``destroy``, ``partition``, ``mend``, ``close``)."""

    def __init__(self) -> None:
        self.tag = os.getpid() % 100000
        self.hosts: list[Host] = []
        self.block, self._lock = _claim_block()

    @property
    def network(self) -> str:
        """Every address of this run's hosts (for a server's pg_hba.conf)."""
        return f"10.{self.block}.0.0/16"

    def address(self, index: int) -> str:
        """The root namespace's end of host ``index``'s link (where the replica listens)."""
        return _link_address(self.block, index, 1)

    def add(self, index: int) -> Host:
        name = f"sts{self.tag}h{index}"
        root_link, host_link = f"sts{self.tag}r{index}", f"sts{self.tag}x{index}"
        folder = Path(tempfile.mkdtemp(prefix=f"store-host{index}-"))
        _ip("netns", "add", name)
        host = Host(name, index, root_link, folder, self.block)
        self.hosts.append(host)
        _ip("link", "add", root_link, "type", "veth", "peer", "name", host_link)
        _ip("link", "set", host_link, "netns", name)
        _ip("addr", "add", f"{self.address(index)}/24", "dev", root_link)
        _ip("link", "set", root_link, "up")
        _ip("-n", name, "addr", "add", f"{host.address}/24", "dev", host_link)
        _ip("-n", name, "link", "set", host_link, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], check=True)
        return host

    def partition(self, host: Host) -> None:
        _ip("link", "set", host.root_link, "down")

    def mend(self, host: Host) -> None:
        _ip("link", "set", host.root_link, "up")

    def unplug(self, host: Host) -> None:
        """The host's network vanishes (its link deleted, both ends), its processes still running:
        nothing it sends arrives, and nothing -- no FIN, no RST -- will when they die."""
        _ip("link", "del", host.root_link, check=False)

    def destroy(self, host: Host) -> None:
        """The host is lost: its processes killed at once, its disk and its network gone."""
        for _ in range(50):  # a process forked meanwhile is found on the next pass
            pids = host.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for process in host.processes:
            with contextlib.suppress(Exception):
                process.wait(10)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    with contextlib.suppress(Exception):
                        stream.close()
        subprocess.run(["umount", "-l", str(host.folder)], check=False, capture_output=True)
        shutil.rmtree(host.folder, ignore_errors=True)
        _ip("netns", "del", host.name, check=False)
        _ip("link", "del", host.root_link, check=False)  # gone with its peer already, as a rule
        if host in self.hosts:
            self.hosts.remove(host)

    def close(self) -> None:
        for host in list(self.hosts):
            self.destroy(host)
        if self._lock >= 0:
            os.close(self._lock)  # the block is free for the next run
            self._lock = -1


@contextlib.contextmanager
def hosts() -> Iterator[Hosts]:
    made = Hosts()
    try:
        yield made
    finally:
        made.close()


def command(process: subprocess.Popen[str], line: str, expect: str, timeout: float = 60.0) -> str:
    """Send a command to a worker and return its answer line (which starts with ``expect``)."""
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return answer(process, expect, timeout)


def answer(process: subprocess.Popen[str], expect: str, timeout: float = 60.0) -> str:
    """The worker's next line starting with ``expect`` (lines before it are skipped)."""
    import selectors

    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise TimeoutError(f"no {expect!r} from the worker in {timeout} s")
            line = process.stdout.readline()
            if not line:
                stderr = process.stderr.read() if process.stderr is not None else ""
                raise RuntimeError(f"the worker ended before {expect!r}: {stderr[-3000:]}")
            if line.startswith(expect):
                return line.rstrip("\n")
