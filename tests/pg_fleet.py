"""Hosts that write straight into one PostgreSQL store, some of them lost mid-write, for
``test_pg_host_loss.py`` and ``tools/soak_pg_host_loss.py`` (not a test module).

Simulated hosts are network namespaces (``netns_hosts``); the server is one of the run's own
(``pg_cluster``), listening on the root end of every host's link.  Every process runs with the
store's default wait limits.  ``Fleet.lose`` makes one host lose its network in the middle of a
write, then kills its processes: the host holds the store's write lock in a write stopped
inside its pipeline (no Sync sent) or inside a COPY (``lock_holder``), or is simply staging
(``staging``: wherever the write is when the link goes), and has a second process whose
connection sits idle (``idle=True``).  Its link is deleted (nothing more arrives from it, and
no FIN or RST will when its processes die); once the server has ended its sessions, its
processes are SIGKILLed and the namespace deleted.  Meanwhile the stagers on the other hosts
stage one record after another and log each stage's start and end.
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import netns_hosts
import pg_cluster

from store import open_store
from store.log.engine import write_lock_id

WORKER = Path(__file__).with_name("pg_host_worker.py")
PLACES = ("pipeline", "copy", "staging")


@dataclass
class Loss:
    """One lost host: when it held the lock (None: ``staging``), lost its link, and when the server
    ended its writer's and its idle process's sessions (monotonic seconds)."""

    place: str
    holding_at: float | None
    unplugged_at: float
    writer_ended_at: float | None
    idle_ended_at: float | None
    writer_state: tuple[str, str | None] | None  # the holder's session when the link went: state, wait event


@dataclass
class Stager:
    host: netns_hosts.Host
    process: subprocess.Popen[str]
    acks: list[tuple[str, float, float]] = field(default_factory=list)  # key, start, end
    errors: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "ACK":
                key, start, end = rest.split(" ")
                self.acks.append((key, float(start), float(end)))
            elif kind == "ERR":
                self.errors.append(rest)
            elif kind == "BYE":
                break
        self.done.set()


class Fleet:
    """``stagers`` hosts staging without pause, and ``losses`` more made to be lost, one at a time."""

    def __init__(self, hosts: netns_hosts.Hosts, template: Path, stagers: int, losses: int) -> None:
        self.hosts = hosts
        made = [hosts.add(index) for index in range(stagers + losses)]
        self._spare = made[stagers:]
        addresses = ",".join(["127.0.0.1", *(hosts.address(host.index) for host in made)])
        self.server = pg_cluster.Cluster(template, {"listen_addresses": addresses})
        with open(self.server.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {hosts.network} trust\n")
        self.server.start()
        open_store(self.server.url()).close()  # migrated once, before the hosts open it
        self.stagers = [self._stager(host) for host in made[:stagers]]
        self.losses: list[Loss] = []
        self.lost_writers: list[Stager] = []  # the stagers of hosts lost while ``staging``

    def url(self, host: netns_hosts.Host) -> str:
        return f"postgresql://postgres@{host.replica_address}:{self.server.port}/postgres?sslmode=disable"

    def _stager(self, host: netns_hosts.Host) -> Stager:
        stager = Stager(host, host.spawn(["stage", self.url(host), f"s{host.index}"], worker=WORKER))
        threading.Thread(target=stager.read, daemon=True).start()
        return stager

    def wait_for_acks(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while any(len(stager.acks) < count for stager in self.stagers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stagers did not stage {count} records each: {self.errors()}")
            time.sleep(0.05)

    def sessions(self, host: netns_hosts.Host) -> dict[int, tuple[str, str | None, bool]]:
        """The server's sessions from ``host``: pid -> (state, wait event, holds the write lock)."""
        lock = write_lock_id(None)
        rows = self.server.execute(
            "SELECT a.pid, a.state, a.wait_event, EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid "
            "AND l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = 1 "
            f"AND l.classid = {lock >> 32} AND l.objid = {lock & 0xFFFFFFFF}) "
            f"FROM pg_stat_activity a WHERE a.client_addr = '{host.address}'"
        )
        return {int(pid): (str(state), event, bool(holds)) for pid, state, event, holds in rows}  # type: ignore[call-overload]

    def lose(self, place: str, *, idle: bool = False, end_within: float = 120.0) -> Loss:
        """Lose the next spare host mid-write (see the module note)."""
        host = self._spare.pop(0)
        url = self.url(host)
        idler = host.spawn(["idle", url], worker=WORKER) if idle else None
        if idler is not None:
            netns_hosts.answer(idler, "READY")
        holding_at = None
        if place == "staging":
            writer = self._stager(host)
            self.lost_writers.append(writer)
            deadline = time.monotonic() + 30
            while len(writer.acks) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            holder = host.spawn(["hold", url, place], worker=WORKER)
            # One read up to HOLDING (READY skipped): ``answer`` waits on the pipe, so a second
            # call would miss a line already buffered with the first.
            netns_hosts.answer(holder, "HOLDING")
            holding_at = time.monotonic()
        before = self.sessions(host)
        writer_pids = [pid for pid, (_, _, holds) in before.items() if holds]
        idle_pids = [pid for pid, (state, _, _) in before.items() if state == "idle"] if idle else []
        self.hosts.unplug(host)
        unplugged_at = time.monotonic()
        writer_state = None
        if writer_pids:
            state, event, _ = before[writer_pids[0]]
            writer_state = (state, event)
        elif place == "staging":
            writer_pids = list(before)  # whatever it was doing when the link went
            for pid in idle_pids:
                writer_pids.remove(pid)
        writer_ended = idle_ended = None
        deadline = unplugged_at + end_within
        while time.monotonic() < deadline and (writer_ended is None or (idle_pids and idle_ended is None)):
            alive = set(self.sessions(host))
            now = time.monotonic()
            if writer_ended is None and not alive & set(writer_pids):
                writer_ended = now
            if idle_pids and idle_ended is None and not alive & set(idle_pids):
                idle_ended = now
            time.sleep(0.05)
        self.hosts.destroy(host)  # its processes die now, long after its network
        loss = Loss(place, holding_at, unplugged_at, writer_ended, idle_ended, writer_state)
        self.losses.append(loss)
        return loss

    def stop(self) -> None:
        for stager in self.stagers:
            assert stager.process.stdin is not None
            with contextlib.suppress(OSError):
                stager.process.stdin.write("stop\n")
                stager.process.stdin.flush()
        for stager in self.stagers:
            stager.done.wait(60)
            stager.process.wait(60)

    def errors(self) -> list[str]:
        return [error for stager in self.stagers for error in stager.errors]

    def acknowledged(self) -> int:
        """Stages acknowledged, the lost hosts' included."""
        return sum(len(stager.acks) for stager in [*self.stagers, *self.lost_writers])

    def longest_stage(self, after: float = 0.0) -> float:
        """The longest a stage of the stagers took (started after ``after``): how long they were blocked."""
        return max(
            (end - start for stager in self.stagers for _, start, end in stager.acks if start >= after), default=0.0
        )

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time in [start, end] in which no stager finished a stage."""
        ends = sorted(ack_end for stager in self.stagers for _, _, ack_end in stager.acks if start <= ack_end <= end)
        marks = [start, *ends, end]
        return max(later - earlier for earlier, later in itertools.pairwise(marks))

    def lost(self) -> list[str]:
        """Acknowledged keys (the lost hosts' included) the store does not hold."""
        keys = [key for stager in [*self.stagers, *self.lost_writers] for key, _, _ in stager.acks]
        held = {str(row[0]) for row in self.server.execute("SELECT staging_key FROM staged_keys")}
        return [key for key in keys if key not in held]

    def summary(self) -> str:
        """The figures: each loss, the stages acknowledged, lost and failed, the longest stage."""
        lines = []
        for loss in self.losses:
            line = f"lost {loss.place} (its writer's session then: {loss.writer_state}): "
            if loss.writer_ended_at is None:
                line += "its writer's session never ended"
            else:
                line += (
                    f"its writer's session ended {loss.writer_ended_at - loss.unplugged_at:.2f} s after the link went"
                )
                if loss.holding_at is not None:
                    line += f", {loss.writer_ended_at - loss.holding_at:.2f} s after it took the lock"
            if loss.idle_ended_at is not None:
                line += f"; its idle session {loss.idle_ended_at - loss.unplugged_at:.2f} s after the link went"
            lines.append(line)
        lines.append(
            f"{len(self.losses)} hosts destroyed, {self.acknowledged()} stages acknowledged, {len(self.lost())} lost, "
            f"{len(self.errors())} failed; longest stage {self.longest_stage():.2f} s"
        )
        return "\n".join(lines)

    def close(self) -> None:
        for stager in self.stagers:
            if stager.process.poll() is None:
                stager.process.kill()
        self.server.remove()
