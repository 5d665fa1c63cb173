"""A child-process worker for the kill loops (not a test module): it stages and serves cuts
until a failpoint (``store.failpoints``) kills it.

    python tests/kill_worker.py run URL RUN_ID [--records N] [--stagers T]
        One run in this process; the failpoint comes from STORE_FAILPOINT / STORE_FAILPOINT_SKIP.
    python tests/kill_worker.py zygote URL
        Imports everything once, then reads ``RUN <run_id> <failpoint> <skip> <records> <out>``
        lines from stdin; for each it forks a child that arms the failpoint, writes its report
        to ``<out>`` (stderr to ``<out>.err``) and runs; it answers ``PID <run_id> <pid>`` at
        once and ``EXIT <run_id> <status>`` when the child has ended (status: the exit code,
        or minus the signal).  Forking saves the child's ~1 s of imports per kill.

A run's report, one line each, written and flushed only after the call returned:

    ACK <key> <rollout_id> <model_call_id> <digest>   a record staged (ok=True)
    RECEIPT <receipt JSON>                             a cut served
    ERROR <text>                                       anything unexpected (a defect)
    DONE                                               the run ended without being killed

Stager thread ``t`` stages ``stager_record(run_id, t, i)``; the cut thread keeps up to three
live calls of rollout ``<run_id>-cut`` decoding, serves a cut over them (and over the call
it completed last, acknowledged as a terminal completion) after every step, and completes
its oldest call every third step.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for factories

from factories import make_record

from store import (
    ActiveCall,
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    StagedCallRecord,
    Store,
    failpoints,
    open_store,
    to_json,
)

POLICY_VERSION = 3
OUTPUT_LIMIT = 1_000
LIVE_CALLS = 3
STEPS_PER_COMPLETION = 3
ACK_EARLY_VARIABLE = "KILL_WORKER_ACK_EARLY"  # set: a broken worker that acknowledges before staging

_EMIT_LOCK = threading.Lock()


def emit(line: str) -> None:
    with _EMIT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def stager_rollout(run_id: str, thread: int) -> str:
    return f"{run_id}-s{thread}"


def stager_record(run_id: str, thread: int, index: int) -> StagedCallRecord:
    """The record stager ``thread`` stages as its ``index``-th (the parent rebuilds it to check)."""
    return make_record(
        rollout_id=stager_rollout(run_id, thread),
        model_call_id=f"c{index}",
        prompt=(1, 2, 3, index % 997),
        generated=tuple(range(index % 40 + 1)),
        extras={"run": run_id, "thread": thread, "index": index},
    )


def cut_rollout(run_id: str) -> str:
    return f"{run_id}-cut"


def stage_records(store: Store, run_id: str, thread: int, count: int) -> None:
    ack_early = bool(os.environ.get(ACK_EARLY_VARIABLE))
    for index in range(count):
        record = stager_record(run_id, thread, index)
        if ack_early:  # the defect the kill loop must catch: telling before the commit
            emit(f"ACK {record.staging_key} {record.rollout_id} {record.model_call_id} {record.digest}")
        result = store.stage(record)
        if ack_early:
            continue
        if not result.ok:
            emit(f"ERROR stage {record.staging_key} refused: {result.error}")
            return
        emit(f"ACK {result.staging_key} {record.rollout_id} {record.model_call_id} {record.digest}")


class CutPlayer:
    """Live calls of one rollout, decoded a few tokens at a time, cut after every step."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: POLICY_VERSION)
        self.rollout_id = cut_rollout(run_id)
        self.live: list[tuple[ActiveCall, list[int], list[float]]] = []
        self.completed: ActiveCall | None = None
        self.calls = 0
        self.steps = 0

    def start_call(self) -> None:
        index = self.calls
        self.calls += 1
        admission = CaptureAdmission(rollout_id=self.rollout_id, model_call_id=f"m{index}", mode="text")
        call = self.capture.begin_call(admission)
        self.capture.track(call, prompt_token_ids=[7, 8, index % 997], effective_output_limit=OUTPUT_LIMIT)
        self.live.append((call, [], []))

    def step(self) -> None:
        while len(self.live) < LIVE_CALLS:
            self.start_call()
        for call, ids, logprobs in self.live:
            new_ids = [100 + len(ids), 101 + len(ids)]
            new_logprobs = [-0.25, -0.5]
            self.capture.observe(call, new_ids, new_logprobs)
            ids += new_ids
            logprobs += new_logprobs
        self.steps += 1
        self.serve_cut()
        if self.steps % STEPS_PER_COMPLETION == 0:
            self.complete_oldest()

    def serve_cut(self) -> None:
        calls = [call for call, _, _ in self.live]
        if self.completed is not None:
            calls.append(self.completed)
        prefixes = [
            GenerationCutPrefix(
                ticket_id=f"ticket-{call.model_call_id}",
                rollout_id=self.rollout_id,
                attempt_index=0,
                model_call_id=call.model_call_id,
                admitted_at=1000.0 + self.steps,
            )
            for call in calls
        ]
        inventory = GenerationCutInventory.build(
            checkpoint_id=f"{self.rollout_id}-k{self.steps}", server_name="policy", active_prefixes=prefixes
        )
        receipt = self.capture.serve_generation_cut(inventory)
        emit("RECEIPT " + to_json(receipt).decode())

    def complete_oldest(self) -> None:
        call, ids, logprobs = self.live.pop(0)
        self.capture.observe(call, [9], [-1.0], finish_reason="stop")
        coords = self.capture.complete_call(
            call,
            prompt_token_ids=[7, 8, int(call.model_call_id[1:]) % 997],
            generated_token_ids=[*ids, 9],
            generated_logprobs=[*logprobs, -1.0],
        )
        if coords.disposition != "staged":
            emit(f"ERROR complete {call}: {coords.disposition}")
            return
        emit(f"ACK {coords.staging_key} {coords.rollout_id} {coords.model_call_id} {coords.digest}")
        self.completed = call


def run(url: str, run_id: str, records: int, stagers: int) -> int:
    """Stage ``records`` records per stager thread while serving cuts; 0 if it ends unkilled."""
    errors: list[str] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                target()
            except BaseException:
                errors.append(traceback.format_exc())
                emit("ERROR " + traceback.format_exc().replace("\n", " | "))

        return body

    with open_store(url) as store:
        stagers_done = threading.Event()
        player = CutPlayer(store, run_id)

        def play_cuts() -> None:
            while not stagers_done.is_set():
                player.step()

        threads = [
            threading.Thread(target=guarded(lambda t=t: stage_records(store, run_id, t, records)))  # type: ignore[misc]
            for t in range(stagers)
        ]
        cutter = threading.Thread(target=guarded(play_cuts))
        for thread in [*threads, cutter]:
            thread.start()
        for thread in threads:
            thread.join()
        stagers_done.set()
        cutter.join()
        player.capture.close()
    emit("DONE")
    return 2 if errors else 0


def fork_run(url: str, run_id: str, failpoint: str, skip: int, records: int, out: str) -> int:
    """Fork a child that runs with ``failpoint`` armed, reporting into ``out``; returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 70
    try:
        report = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        errors = os.open(out + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(report, 1)
        os.dup2(errors, 2)
        failpoints.arm(failpoint, skip)
        status = run(url, run_id, records, stagers=4)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def zygote(url: str) -> int:
    """Serve fork requests from stdin (see the module docstring)."""
    open_store(url).close()  # loads every lazily imported module (dialect, migrations) once
    print("READY", flush=True)
    for line in sys.stdin:
        command, run_id, failpoint, skip, records, out = line.split()
        assert command == "RUN", line
        pid = fork_run(url, run_id, failpoint, int(skip), int(records), out)
        print(f"PID {run_id} {pid}", flush=True)
        _, wait_status = os.waitpid(pid, 0)
        print(f"EXIT {run_id} {os.waitstatus_to_exitcode(wait_status)}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("url")
    run_parser.add_argument("run_id")
    run_parser.add_argument("--records", type=int, default=100, help="records per stager thread")
    run_parser.add_argument("--stagers", type=int, default=4)
    zygote_parser = sub.add_parser("zygote")
    zygote_parser.add_argument("url")
    args = parser.parse_args()
    if args.command == "zygote":
        return zygote(args.url)
    return run(args.url, args.run_id, args.records, args.stagers)


if __name__ == "__main__":
    sys.exit(main())
