"""The coordinator side of the demo: start workers, cut, kill, restore, audit, export, verify."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.demo.engine import Script, script_for
from store.store import Store, open_store
from store.wire.codec import from_json, to_json
from store.wire.cut_records import GenerationCutInventory, GenerationCutPrefix, GenerationCutReceipt

TURNS = 3  # calls per rollout; the cut lands in turn 1 or 2
CHECKPOINT = "checkpoint-1"
POLICY_VERSION = 1  # the dead workers' weights; the fresh ones serve the checkpoint's version 2
REPLY_TIMEOUT = 120.0
LOG_TIMEOUT = 30.0  # for the coordinator to log a worker joining or lost
LIMITS = {"rollouts": (1, 64), "workers": (1, 8), "tokens": (8, 4096)}

Step = Callable[[str], object]


def require_transformers() -> None:
    """``--engine transformers`` runs torch and transformers in the workers: refuse, naming what
    to install, when either is missing."""
    import importlib.util

    from store.errors import ConfigurationError
    from store.install import extra_hint

    missing = []
    for module in ("torch", "transformers"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module blocked in sys.modules, or a broken install
            found = False
        if not found:
            missing.append(module)
    if missing:
        raise ConfigurationError(
            f"the transformers engine needs torch and the [transformers] extra ({' and '.join(missing)} "
            f"missing): pip install torch==2.13.0 (or the torch build for your machine), then "
            f"{extra_hint('transformers')}; nothing was created"
        )


class DemoError(Exception):
    """Something in the demo did not go as it must (a worker failed, a check did not verify)."""


class Events(logging.Handler):
    """What the coordinator observes: workers joining and lost (its log lines), attempts superseded.

    A handler on the ``store.coordinator`` logger: the real ``Coordinator`` (issue 9) logs each
    worker joining and each one lost without notice; those lines are counted here and shown
    as demo steps.  The superseded attempts are retired with ``Store.retire`` once every cut
    call has been continued (``_retire``).
    """

    def __init__(self, say: Step) -> None:
        super().__init__(logging.INFO)
        self.joined: list[int] = []
        self.lost: list[int] = []
        self.superseded: list[str] = []
        self.lines: list[str] = []
        self._say = say
        self._changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        pid = getattr(record, "worker_pid", None)
        line = record.getMessage()
        with self._changed:
            self.lines.append(line)
            if isinstance(pid, int) and "joined as worker" in line:
                self.joined.append(pid)
            elif isinstance(pid, int) and record.levelno >= logging.WARNING and "lost without notice" in line:
                self.lost.append(pid)
            self._changed.notify_all()
        self._say(f"coordinator: {line}")

    def wait(self, seen: Callable[[], bool], timeout: float) -> bool:
        """Wait until the coordinator has logged what ``seen`` looks for."""
        with self._changed:
            return self._changed.wait_for(seen, timeout)

    def attempt_superseded(self, capture_key: str) -> None:
        self.superseded.append(capture_key)


@contextlib.contextmanager
def coordinator(path: str, workers: int, events: Events) -> Iterator[tuple[str, Store]]:
    """A real checkpoint coordinator (``store.coordinator``) logging worker events into the
    store; yields its socket path (for the workers' ``WorkerClient.connect``) and the store."""
    from store.coordinator import Coordinator

    logger = logging.getLogger("store.coordinator")
    level = logger.level
    logger.addHandler(events)
    logger.setLevel(logging.INFO)
    socket_path = os.path.join(tempfile.mkdtemp(prefix="staging-demo-"), "coordinator.sock")
    try:
        with open_store(path) as store, Coordinator(socket_path, expected_workers=workers, store=store):
            yield socket_path, store
    finally:
        logger.removeHandler(events)
        logger.setLevel(level)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(socket_path))


@dataclass
class Summary:
    store: str
    export: str
    run: str = ""  # this run's rollouts are ``{run}-r{index}``
    rollouts: int = 0
    calls: int = 0
    records: int = 0
    tokens_staged: int = 0
    tokens_reused: int = 0  # restored from cut prefixes: never decoded again
    tokens_regenerated: int = 0  # decoded before the kill, after the cut: lost, decoded again
    tokens_after_restore: int = 0  # decoded by the fresh workers in the cut calls (regenerated included)
    continuations_validated: int = 0
    workers_lost: int = 0  # lost without notice, as the coordinator logged them
    workers_rejoined: int = 0  # fresh workers the coordinator logged joining
    coordinator_log: list[str] = field(default_factory=list)  # its join/stop/lost lines
    attempts_retired: int = 0  # dead attempts' capture keys fenced with Store.retire
    late_writes_refused: int = 0  # a late write from a dead attempt, refused by its fence
    audit_ok: bool = False
    audit_problems: int = 0
    exported_rows: int = 0  # the export holds every rollout of the store (earlier runs' too)
    exported_rollouts: int = 0
    rollouts_identical: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_options(rollouts: int, workers: int, tokens: int) -> None:
    for name, value in (("rollouts", rollouts), ("workers", workers), ("tokens", tokens)):
        low, high = LIMITS[name]
        if not low <= value <= high:
            raise ValueError(f"--{name} must be between {low} and {high}, got {value}")


class Worker:
    """One worker process and the JSON lines it reports."""

    def __init__(self, path: str, job: dict[str, Any]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "store.demo.worker", path, json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, event: str) -> dict[str, Any]:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DemoError(f"worker {self.process.pid} sent no {event!r} in {REPLY_TIMEOUT:.0f} s") from None
            if line is None:
                self.process.wait(timeout=30)
                assert self.process.stderr is not None
                tail = self.process.stderr.read().strip().splitlines()[-1:] or ["no output"]
                raise DemoError(f"worker {self.process.pid} exited ({self.process.returncode}): {tail[0]}")
            message: dict[str, Any] = json.loads(line)
            if message.get("event") == event:
                return message

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def kill(self) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        return self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _spawn(path: str, jobs: list[dict[str, Any]], started: list[Worker]) -> list[Worker]:
    """Start one worker per job, each registered in ``started`` as soon as its process exists.

    The processes are started by a helper thread: a Ctrl-C raises in the main thread only, so
    it can never land between a worker's fork and its registration, and ``run_demo``'s
    cleanup then kills every worker that was started (none is left running).
    """
    made: list[Worker] = []
    failed: list[BaseException] = []
    finished = threading.Event()  # not Thread.join: in 3.11 an interrupted join marks the thread ended

    def start() -> None:
        try:
            for job in jobs:
                worker = Worker(path, job)
                started.append(worker)
                made.append(worker)
        except BaseException as exc:  # handed to the main thread below
            failed.append(exc)
        finally:
            finished.set()

    threading.Thread(target=start, name="demo-spawner", daemon=True).start()
    try:
        finished.wait()
    finally:
        finished.wait()  # after a Ctrl-C too: the worker being started is registered before cleanup
    if failed:
        raise failed[0]
    return made


def _plans(run: str, rollouts: int, tokens: int, seed: int) -> list[dict[str, Any]]:
    """Each rollout's id, its cut turn (1 or 2) and how far that turn decodes before the cut."""
    plans = []
    for index in range(rollouts):
        cut_after = max(1, tokens * (1 + (index + seed) % 3) // 4)  # a quarter, half or three quarters
        plans.append(
            {
                "index": index,
                "rollout_id": f"{run}-r{index}",
                "cut_turn": 1 + (index + seed) % (TURNS - 1),
                "cut_after": cut_after,
            }
        )
    return plans


def _run_id(path: str) -> str:
    """``runN``: a new name for each demo run into the same store (re-running needs no cleanup)."""
    with open_store(path) as store:
        ids = {summary.rollout_id.split("-")[0] for summary in store.rollouts()}
    number = 1
    while f"run{number}" in ids:
        number += 1
    return f"run{number}"


def run_demo(
    path: str,
    *,
    rollouts: int,
    workers: int,
    tokens: int,
    seed: int,
    step: Step | None = None,
    engine_kind: str = "toy",
) -> Summary:
    """Run the whole story; ``step(label)`` is told of each phase.  Failures are in ``summary.failures``.

    ``engine_kind``: ``toy`` (the default) or ``transformers`` (a tiny random-weight Llama; needs
    the ``[transformers]`` extra and torch)."""
    check_options(rollouts, workers, tokens)
    if engine_kind == "transformers":
        require_transformers()  # before any file or worker: a missing extra creates nothing
    started = time.perf_counter()
    say = step or (lambda _label: None)
    if Path(path).exists():  # add a run only to a store: another file is refused untouched
        open_store(path, read_only=True).close()
    Path(path).parent.mkdir(exist_ok=True)  # the store's own folder only: a missing parent is refused
    run = _run_id(path)
    engine = script_for(engine_kind, seed, tokens, TURNS)
    plans = _plans(run, rollouts, tokens, seed)
    workers = min(workers, rollouts)
    shares = [plans[i::workers] for i in range(workers)]
    export_path = str(Path(path).with_suffix(".jsonl"))
    summary = Summary(
        store=str(Path(path).resolve()), export=str(Path(export_path).resolve()), run=run, rollouts=rollouts
    )
    events = Events(say)
    started_workers: list[Worker] = []
    try:
        with coordinator(path, workers, events) as (socket_path, store):
            _serve_crash_restore(path, socket_path, store, events, engine, plans, shares, started_workers, summary, say)
    finally:
        for worker in started_workers:
            worker.close()
    summary.coordinator_log = list(events.lines)
    _verify(path, export_path, engine, plans, summary, say)
    summary.seconds = round(time.perf_counter() - started, 2)
    return summary


def _serve_crash_restore(
    path: str,
    socket_path: str,
    store: Store,
    events: Events,
    engine: Script,
    plans: list[dict[str, Any]],
    shares: list[list[dict[str, Any]]],
    started_workers: list[Worker],
    summary: Summary,
    say: Step,
) -> None:
    """Attempt 0 serves and is cut, every worker is killed, attempt 1 restores; then the dead
    attempt is retired.  Workers register with the coordinator at ``socket_path``."""
    job = {"seed": engine.seed, "tokens": engine.tokens, "turns": TURNS, "socket": socket_path, "engine": engine.name}
    workers = len(shares)
    say(f"starting {workers} workers (attempt 0, policy version {POLICY_VERSION})")
    first = _spawn(
        path, [dict(job, phase="serve", version=POLICY_VERSION, rollouts=share) for share in shares], started_workers
    )
    inflight = [worker.expect("inflight") for worker in first]
    say(f"{CHECKPOINT}: cutting {len(plans)} calls mid-decoding")
    acks: dict[str, str] = {}
    for number, (worker, report) in enumerate(zip(first, inflight, strict=True)):
        inventory = GenerationCutInventory.build(
            checkpoint_id=CHECKPOINT,
            server_name=f"worker-{number}",
            active_prefixes=[
                GenerationCutPrefix(
                    ticket_id=f"ticket-{call['rollout_id']}",
                    rollout_id=call["rollout_id"],
                    attempt_index=0,
                    model_call_id=call["model_call_id"],
                    admitted_at=float(call["admitted_at"]),
                )
                for call in report["calls"]
            ],
        )
        worker.send(to_json(inventory).decode())
        receipt = from_json(worker.expect("receipt")["receipt"].encode(), GenerationCutReceipt)
        receipt.validate_for(inventory)
        for ack in receipt.prefixes:
            acks[ack.rollout_id] = to_json(ack).decode()
        summary.tokens_regenerated += int(worker.expect("decoding")["lost"])
    say(f"killing every worker with SIGKILL ({len(first)} processes)")
    killed = []
    for worker in first:
        if worker.kill() == -signal.SIGKILL:
            killed.append(worker.process.pid)
        else:
            summary.failures.append(f"worker {worker.process.pid} was not killed by SIGKILL")
    events.wait(lambda: set(killed) <= set(events.lost), LOG_TIMEOUT)
    summary.workers_lost = len(set(killed) & set(events.lost))
    if summary.workers_lost != len(first):
        summary.failures.append(f"the coordinator logged {summary.workers_lost} of {len(first)} killed workers lost")
    say(f"starting {workers} fresh workers (attempt 1, policy version {POLICY_VERSION + 1})")
    fresh = _spawn(
        path,
        [
            dict(
                job,
                phase="resume",
                version=POLICY_VERSION + 1,
                rollouts=[dict(plan, ack=acks[plan["rollout_id"]]) for plan in share],
            )
            for share in shares
        ],
        started_workers,
    )
    for worker, share in zip(fresh, shares, strict=True):
        for _ in share:
            done = worker.expect("done")
            summary.tokens_reused += done["restored"]
            summary.tokens_after_restore += done["decoded"]
            summary.continuations_validated += 1 if done["restored"] else 0
            events.attempt_superseded(done["rollout_id"])
        if worker.process.wait(timeout=REPLY_TIMEOUT) != 0:
            summary.failures.append(f"fresh worker {worker.process.pid} exited {worker.process.returncode}")
    pids = {worker.process.pid for worker in fresh}
    events.wait(lambda: pids <= set(events.joined), LOG_TIMEOUT)
    summary.workers_rejoined = len(pids & set(events.joined))
    if summary.workers_rejoined != len(fresh):
        summary.failures.append(f"the coordinator logged {summary.workers_rejoined} of {len(fresh)} fresh workers")
    say(f"retiring the dead attempt of {len(events.superseded)} rollouts; one late write tried")
    _retire(store, events.superseded, plans[0], engine, summary)


def _retire(store: Store, superseded: list[str], plan: dict[str, Any], engine: Script, summary: Summary) -> None:
    """Fence the dead attempt's capture keys, then play its worker once more: a zombie of
    attempt 0 admits and finishes its cut call.  The fence must refuse it and write nothing."""
    from store.demo.worker import Turns
    from store.errors import RolloutFencedError
    from store.worker.capture import RolloutTokenCapture

    retired = store.retire(superseded)
    summary.attempts_retired = len(retired.removed)
    if retired.absent:
        summary.failures.append(f"retired capture keys that held nothing: {', '.join(retired.absent)}")
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: POLICY_VERSION, flush_interval=3600.0)
    dead = plan["rollout_id"]
    try:
        turns = Turns(capture, engine, plan["index"], dead)
        chain = store.fetch([f"{dead}/c{turn}" for turn in range(plan["cut_turn"])])
        turns.history = [int(token) for record in chain for token in record.token_ids_delta]
        turns.parent = (chain[-1].model_call_id, chain[-1].chain_hash)
        before = store.call(dead, f"c{plan['cut_turn']}")
        turns.play(plan["cut_turn"])
    except RolloutFencedError:
        if store.call(dead, f"c{plan['cut_turn']}") == before:
            summary.late_writes_refused += 1
        else:
            summary.failures.append(f"{dead}: a refused late write changed the call")
    else:
        summary.failures.append(f"{dead}: a late write from the retired attempt was accepted")
    finally:
        capture.close()


def _verify(
    path: str, export_path: str, engine: Script, plans: list[dict[str, Any]], summary: Summary, say: Step
) -> None:
    """Audit, export, and check every exported rollout against the same rollout decoded without a crash."""
    wanted = [plan["rollout_id"] for plan in plans]
    with open_store(path, read_only=True) as store:
        say("auditing the store")
        audit = store.audit()
        summary.audit_ok, summary.audit_problems = audit.ok, audit.problems_total
        if not audit.ok:
            summary.failures.append(f"the audit found {audit.problems_total} problem(s): {audit.problems[0]}")
        for plan in plans:
            lineage = store.lineage(plan["rollout_id"])
            if lineage is None:
                summary.failures.append(f"{plan['rollout_id']} is not in the store")
                continue
            summary.calls += sum(1 for call in lineage.calls if call.state == "completed")
            cut = next((c for c in lineage.calls if c.resumes is not None), None)
            if cut is None or cut.resumes is None or cut.resumes.generation_token_count < 1:
                summary.failures.append(f"{plan['rollout_id']}: no call continued a cut")
        keys = [key.staging_key for key in store.staged_keys() if _ours(key.rollout_id, wanted)]
        records = store.fetch_chunks(keys)
        summary.records = len(records)
        summary.tokens_staged = sum(chunk.snapshot.delta_len for chunk in records)
        say(f"exporting every rollout of the store to {export_path}")
        report = store.export_jsonl(export_path)  # the whole store, so the file matches it after every run
    summary.exported_rows = report.rows
    for failure in report.failures:
        summary.failures.append(f"{failure.rollout_id} was not exported: {failure.code}: {failure.detail}")
    summary.exported_rollouts = report.rollouts
    rows = {}
    with open(export_path, encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            rows[row["rollout_id"]] = row
    for plan in plans:
        row = rows.get(plan["rollout_id"])
        ids, mask, logprobs = engine.expected(plan["index"])
        if row is None:
            summary.failures.append(f"{plan['rollout_id']}: no exported row")
        elif (row["token_ids"], row["token_mask"]) != (ids, mask) or not _close(
            row["logprobs"], logprobs, engine.logprob_tolerance
        ):
            summary.failures.append(f"{plan['rollout_id']}: exported tokens differ from an uninterrupted run")
        else:
            summary.rollouts_identical += 1


def _close(found: list[float], wanted: list[float], tolerance: float) -> bool:
    """Log-probs equal (the toy's), or within the engine's tolerance (a re-prefill sums in another order)."""
    if tolerance == 0.0:
        return found == wanted
    return len(found) == len(wanted) and all(abs(a - b) <= tolerance for a, b in zip(found, wanted, strict=True))


def _ours(capture: str, rollout_ids: list[str]) -> bool:
    """Whether a key's call belongs to this run (a cut chunk's key row names its call's capture key)."""
    return any(capture == rid or capture.startswith(f"{rid}-a") for rid in rollout_ids)
