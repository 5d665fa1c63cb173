"""The kill loop shared by ``test_kill_loops.py`` and ``tools/soak_kills.py`` (not a test module).

A ``KillLoop`` runs ``kill_worker`` children against one store, each with a failpoint armed
so it dies with SIGKILL, and after every death reopens the store and checks what the child
reported: every acknowledged key fetches and verifies as *its* record, every reported cut
receipt is stored as reported and restores, no partial record is visible, the projections
equal a replay, and sequence numbers only grow.  Problems are collected, not raised, so a
soak can count them.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import kill_worker
import sqlalchemy as sa
from capture_helpers import continuation_from

from store import (
    CaptureAdmission,
    GenerationCutReceipt,
    StagedCallSnapshot,
    Store,
    StoreError,
    from_json,
    open_store,
)
from store.log.engine import resolve_url
from store.log.schema import cut_receipts, events, staged_keys
from store.wire.cut_records import GENERATION_CUT_KEY_PREFIX
from store.worker.capture import resolve_prefix
from store.worker.resolve import resolve_continuation

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "kill_worker.py"
FAILPOINTS = ("before_commit", "after_commit", "mid_batch", "mid_cut")
T = TypeVar("T")
CHILD_TIMEOUT = 120.0  # seconds a child may run before it counts as hung


@dataclass(frozen=True)
class Ack:
    key: str
    rollout_id: str
    model_call_id: str
    digest: str


@dataclass
class Report:
    """What one child wrote before it died."""

    acks: list[Ack] = field(default_factory=list)
    receipts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    done: bool = False

    @classmethod
    def read(cls, path: Path) -> Report:
        report = cls()
        text = path.read_text() if path.exists() else ""
        lines = text.split("\n")
        for line in lines[:-1]:  # the last piece is empty, or a line cut short by the kill
            word, _, rest = line.partition(" ")
            if word == "ACK":
                report.acks.append(Ack(*rest.split(" ")))
            elif word == "RECEIPT":
                report.receipts.append(rest)
            elif word == "DONE":
                report.done = True
            else:
                report.errors.append(line)
        return report


@dataclass
class Totals:
    runs: int = 0
    kills: int = 0
    unkilled: int = 0  # runs that finished before their failpoint's hit came
    kills_by_failpoint: dict[str, int] = field(default_factory=dict)
    acks_reported: int = 0  # distinct acknowledgements the children reported
    receipts_reported: int = 0
    acks_checked: int = 0  # checks made (each ack after its kill, and again by check_all)
    receipts_checked: int = 0
    prefixes_restored: int = 0
    lost: int = 0
    misreported: int = 0
    partial: int = 0
    replay_failures: int = 0
    seq_violations: int = 0
    child_failures: int = 0
    problems: list[str] = field(default_factory=list)
    _subjects: set[str] = field(default_factory=set, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, counter: str, text: str, subject: str | None = None) -> None:
        """Count a problem once per subject (a key, a cut), however often it is checked."""
        if subject is not None:
            if subject in self._subjects:
                return
            self._subjects.add(subject)
        setattr(self, counter, getattr(self, counter) + 1)
        self.problems.append(text)

    def summary(self) -> str:
        by_point = ", ".join(f"{name} {count}" for name, count in sorted(self.kills_by_failpoint.items()))
        return (
            f"runs {self.runs}, kills {self.kills} ({by_point}), unkilled runs {self.unkilled}; "
            f"acks reported {self.acks_reported} (checks {self.acks_checked}), "
            f"receipts reported {self.receipts_reported} (checks {self.receipts_checked}), "
            f"cut prefixes restored {self.prefixes_restored}; lost {self.lost}, misreported {self.misreported}, "
            f"partial {self.partial}, replay failures {self.replay_failures}, "
            f"sequence violations {self.seq_violations}, child failures {self.child_failures}"
        )


class Zygote:
    """A ``kill_worker zygote`` process that forks one child per run (see kill_worker)."""

    def __init__(self, url: str, *, ack_early: bool = False) -> None:
        env = dict(os.environ)
        env[kill_worker.ACK_EARLY_VARIABLE] = "1" if ack_early else ""
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OPENBLAS_NUM_THREADS"] = "1"  # no BLAS thread pool to lose across fork
        for name in ("STORE_FAILPOINT", "STORE_FAILPOINT_SKIP"):
            env.pop(name, None)  # each child arms its own
        self._proc = subprocess.Popen(
            [sys.executable, str(WORKER), "zygote", url],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._expect("READY", timeout=120)

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _expect(self, word: str, timeout: float) -> list[str]:
        line = self._lines.get(timeout=timeout)
        if line is None or line.split()[0] != word:
            raise RuntimeError(f"the kill worker zygote said {line!r}, expected {word}")
        return line.split()

    def run(self, run_id: str, failpoint: str, skip: int, records: int, out: Path) -> tuple[int, int | None]:
        """Run one child; returns its pid and exit status (-9 if killed), None if it hung."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"RUN {run_id} {failpoint} {skip} {records} {out}\n")
        self._proc.stdin.flush()
        pid = int(self._expect("PID", timeout=60)[2])
        try:
            return pid, int(self._expect("EXIT", timeout=CHILD_TIMEOUT)[2])
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            self._expect("EXIT", timeout=60)
            return pid, None

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class KillLoop:
    """Kill children of one store at failpoints and check the store after each death."""

    def __init__(self, url: str, workdir: Path, *, replay_every: int = 1, ack_early: bool = False) -> None:
        """``ack_early`` makes the children acknowledge before staging: a broken worker the
        checks must catch."""
        self.url = url
        self.workdir = workdir
        self.totals = Totals()
        self.replay_every = replay_every
        self._ack_early = ack_early
        self._acks: list[Ack] = []
        self._receipts: list[str] = []
        open_store(url).close()  # create the store, so the log position below exists
        self._engine = sa.create_engine(resolve_url(url), poolclass=sa.pool.NullPool)
        self._zygote: Zygote | None = None  # started by the first kill
        self._last_seq, self._count = self._log_position()

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
        self._engine.dispose()

    # one death ------------------------------------------------------------------------------

    def kill_once(self, failpoint: str, skip: int, records: int = 60) -> None:
        run = self.totals.runs
        self.totals.runs += 1
        run_id = f"k{run}"
        out = self.workdir / f"{run_id}.report"
        if self._zygote is None:
            self._zygote = Zygote(self.url, ack_early=self._ack_early)
        pid, status = self._zygote.run(run_id, failpoint, skip, records, out)
        report = Report.read(out)
        self._classify(run_id, failpoint, status, report, out)
        with open_store(self.url) as store:
            self.check_acks(store, report.acks)
            self.check_receipts(store, report.receipts)
            self.check_no_partial(store, since=self._last_seq)
            self.check_sequence(run_id, pid)
            if self.totals.runs % self.replay_every == 0:
                self.check_replay(store)
        self._acks += report.acks
        self._receipts += report.receipts
        self.totals.acks_reported, self.totals.receipts_reported = len(self._acks), len(self._receipts)

    def _classify(self, run_id: str, failpoint: str, status: int | None, report: Report, out: Path) -> None:
        stderr = Path(str(out) + ".err")
        noted = stderr.exists() and f"FAILPOINT {failpoint} " in stderr.read_text()
        for error in report.errors:
            self.totals.problem("child_failures", f"{run_id}: the child reported {error[:500]}")
        if status == -signal.SIGKILL and noted:
            self.totals.kills += 1
            self.totals.kills_by_failpoint[failpoint] = self.totals.kills_by_failpoint.get(failpoint, 0) + 1
        elif status == 0 and report.done:
            self.totals.unkilled += 1
        else:
            tail = stderr.read_text()[-2000:] if stderr.exists() else ""
            self.totals.problem("child_failures", f"{run_id}: the child ended with status {status}: {tail}")

    # the checks -----------------------------------------------------------------------------

    def check_all(self) -> None:
        """Every ack and receipt reported so far, and the whole store (a soak's last check)."""
        with open_store(self.url) as store:
            self.check_acks(store, self._acks)
            self.check_receipts(store, self._receipts)
            self.check_no_partial(store, since=0)
            self.check_replay(store)

    def check_acks(self, store: Store, acks: list[Ack]) -> None:
        """Each acknowledged key fetches, verifies, and is the record the child reported."""
        for batch in _batches(acks, 500):
            try:
                found: list[StagedCallSnapshot | str] = list(store.fetch([ack.key for ack in batch]))
            except StoreError:
                found = [_fetch_one(store, ack.key) for ack in batch]
            for ack, snapshot in zip(batch, found, strict=True):
                self.totals.acks_checked += 1
                if isinstance(snapshot, str):
                    self.totals.problem("lost", f"acknowledged key {ack.key}: {snapshot}", ack.key)
                elif (snapshot.rollout_id, snapshot.model_call_id, snapshot.digest) != (
                    ack.rollout_id,
                    ack.model_call_id,
                    ack.digest,
                ):
                    self.totals.problem("misreported", f"{ack.key} holds {snapshot.staging_key}, not {ack}", ack.key)
                elif not _is_expected(ack):
                    self.totals.problem("misreported", f"{ack.key} was acknowledged with a wrong digest {ack}", ack.key)

    def check_receipts(self, store: Store, receipts: list[str]) -> None:
        """A reported receipt is stored byte for byte, and each prefix it promises restores."""
        for text in receipts:
            self.totals.receipts_checked += 1
            receipt = from_json(text, GenerationCutReceipt)
            stored = store.cut_receipt(receipt.checkpoint_id, receipt.inventory_digest)
            if stored is None:
                self.totals.problem("lost", f"receipt of cut {receipt.checkpoint_id} is missing", text)
            elif stored != text.encode():
                self.totals.problem("misreported", f"cut {receipt.checkpoint_id}: the stored receipt differs", text)
            else:
                self._check_promises(store, receipt)

    def _check_promises(self, store: Store, receipt: GenerationCutReceipt) -> None:
        for ack in receipt.prefixes:
            if ack.disposition != "durable_prefix":
                continue
            assert ack.prefix_digest is not None and ack.prefix_token_count is not None
            where = f"cut {receipt.checkpoint_id}, call {ack.model_call_id}"
            try:
                if ack.cut_kind == "terminal_completion":
                    [snapshot] = store.fetch(list(ack.staging_keys))
                    if snapshot.digest != ack.prefix_digest:
                        self.totals.problem("misreported", f"{where}: the terminal record's digest differs", where)
                    continue
                assert ack.effective_output_limit is not None
                continuation = continuation_from(ack)
                admission = CaptureAdmission(
                    rollout_id=f"{ack.rollout_id}-a1",
                    model_call_id=ack.model_call_id,
                    mode="text",
                    generation_cut=continuation,
                )
                prefix = resolve_prefix(admission, None)
                resolve_continuation(store, admission, continuation, prefix, kill_worker.POLICY_VERSION)
                self.totals.prefixes_restored += 1
            except StoreError as exc:
                self.totals.problem("lost", f"{where}: the promised prefix does not restore: {exc}", where)

    def check_no_partial(self, store: Store, *, since: int) -> None:
        """Keys of events after ``since`` point at their own events; cut chunks and receipts are
        all there or all absent (every chunk key is acknowledged by a stored receipt, every key a
        stored receipt acknowledges is staged)."""
        with self._engine.connect() as connection:
            orphans = connection.execute(
                sa.select(staged_keys.c.staging_key)
                .select_from(staged_keys.outerjoin(events, events.c.seq == staged_keys.c.event_seq))
                .where(staged_keys.c.event_seq > since)
                .where(
                    sa.or_(
                        events.c.seq.is_(None),
                        events.c.staging_key != staged_keys.c.staging_key,
                        events.c.rollout_id != staged_keys.c.rollout_id,
                        events.c.model_call_id != staged_keys.c.model_call_id,
                    )
                )
            ).all()
            chunk_keys = set(
                connection.execute(
                    sa.select(staged_keys.c.staging_key)
                    .where(staged_keys.c.event_seq > since)
                    .where(staged_keys.c.staging_key.startswith(GENERATION_CUT_KEY_PREFIX + "/"))
                ).scalars()
            )
            receipt_ids = connection.execute(
                sa.select(cut_receipts.c.checkpoint_id, cut_receipts.c.inventory_digest).where(
                    cut_receipts.c.event_seq > since
                )
            ).all()
        for (key,) in orphans:
            self.totals.problem("partial", f"staged key {key} does not point at its own event", f"partial {key}")
        promised: set[str] = set()
        for checkpoint_id, inventory_digest in receipt_ids:
            stored = store.cut_receipt(checkpoint_id, inventory_digest)
            if stored is None:
                self.totals.problem(
                    "partial", f"cut {checkpoint_id}: its receipt row has no receipt", f"partial {checkpoint_id}"
                )
                continue
            receipt = from_json(stored, GenerationCutReceipt)
            for ack in receipt.prefixes:
                if ack.cut_kind == "active_prefix":
                    promised.update(ack.staging_keys)
        for key in sorted(chunk_keys - promised):
            self.totals.problem(
                "partial", f"chunk {key} is staged but no stored receipt acknowledges it", f"partial {key}"
            )
        if promised:
            staged = {key for (key,) in self._staged(promised)}
            for key in sorted(promised - staged):
                self.totals.problem(
                    "partial", f"chunk {key} is acknowledged by a stored receipt but not staged", f"partial {key}"
                )

    def _staged(self, keys: Iterable[str]) -> list[tuple[str]]:
        found: list[tuple[str]] = []
        with self._engine.connect() as connection:
            for batch in _batches(sorted(keys), 500):
                found += connection.execute(
                    sa.select(staged_keys.c.staging_key).where(staged_keys.c.staging_key.in_(batch))
                ).all()
        return found

    def check_sequence(self, run_id: str, pid: int) -> None:
        """Events before the run are untouched; every event since is the child's, numbered above them."""
        with self._engine.connect() as connection:
            before = connection.execute(
                sa.select(sa.func.count()).select_from(events).where(events.c.seq <= self._last_seq)
            ).scalar_one()
            strangers = connection.execute(
                sa.select(sa.func.count())
                .select_from(events)
                .where(events.c.seq > self._last_seq)
                .where(events.c.writer_pid != pid)
            ).scalar_one()
        if before != self._count:
            self.totals.problem(
                "seq_violations", f"{run_id}: {before} events up to seq {self._last_seq}, was {self._count}"
            )
        if strangers:
            self.totals.problem(
                "seq_violations", f"{run_id}: {strangers} new events above seq {self._last_seq} not the child's"
            )
        self._last_seq, self._count = self._log_position()

    def _log_position(self) -> tuple[int, int]:
        with self._engine.connect() as connection:
            last, count = connection.execute(
                sa.select(sa.func.max(events.c.seq), sa.func.count()).select_from(events)
            ).one()
        return int(last or 0), int(count)

    def check_replay(self, store: Store) -> None:
        report = store.replay()
        if not report.ok:
            self.totals.problem("replay_failures", f"replay differs from the projections: {report.summary()}")


def _fetch_one(store: Store, key: str) -> StagedCallSnapshot | str:
    """The key's snapshot, or why it cannot be fetched."""
    try:
        return store.fetch([key])[0]
    except StoreError as exc:
        return f"{type(exc).__name__}: {exc}"


def _is_expected(ack: Ack) -> bool:
    """A stager's record can be rebuilt from its key: the child must have staged exactly it."""
    rollout, _, thread = ack.rollout_id.rpartition("-s")
    if not rollout or not thread.isdigit() or not ack.model_call_id.startswith("c"):
        return True  # a cut call's terminal record: checked against its fetched record only
    record = kill_worker.stager_record(rollout, int(thread), int(ack.model_call_id[1:]))
    return record.digest == ack.digest and record.staging_key == ack.key


def _batches(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
