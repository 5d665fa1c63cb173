"""Benchmark: NeMo Gym 0.7.0's own ``RolloutTokenCapture`` staging into the store, against the
same capture staging into Gym's own ``TokenCaptureStore`` (one JSONL line per call, fsynced).

Both sides run Gym's capture code unchanged (it builds each ``StagedCallRecord`` and its
digests in Python) on the same calls (same ids, tokens and log-probs), one or 16 threads each
completing its own calls; only the sink differs:

* ``store``: ``RolloutTokenCapture(sink=store)``, a SQLite store with ``durability="full"``
  (every stage durable when it returns; concurrent stages share commits);
* ``gym file``: a ``StagingSink`` that writes each record as Gym's ``TokenEntry`` through
  ``TokenCaptureStore.append`` (Gym's own file store: flock, state file, the line fsynced before
  it returns) -- the only durable store Gym 0.7.0 ships.

Each round runs one short block of each (``--block`` calls per thread), every block on fresh
files, the order flipped every round; the ratio is taken per round (Gym's time over the
store's) and the report gives the median, min and max of the per-round ratios, for the whole
call (``complete_call``, capture plus sink) and for the sink alone (time inside ``stage``);
and, for scale, the same records prebuilt by Gym's capture before the clock and staged straight
into each sink from the same threads (``prebuilt records, sink only``: no Gym capture code
holding the interpreter lock between stages); and the ceiling of the whole-call ratio, Gym's
time over that of the same capture into a sink that does nothing (``a sink doing nothing``):
Gym's capture code is on both sides, so no sink, however fast, can pass it.

    .venv/bin/python tools/bench_gym_capture.py [--quick] [--json] [--rounds R] [--block B] [--tokens P,G]

Needs ``nemo_gym`` (``make real-clients``). Target (issue 32): the store >= 2x Gym's file store
at 1 and 16 threads.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, fsync_seconds, parser, temp_dir

from store import open_store

try:
    from nemo_gym.token_id_capture import TokenCaptureStore, TokenEntry
    from nemo_gym.token_id_capture.staging import CaptureAdmission, RolloutTokenCapture, StageResult
except ImportError:  # pragma: no cover - reported, not raised
    print("bench_gym_capture needs NeMo Gym 0.7.0 (make real-clients)", file=sys.stderr)
    raise SystemExit(2) from None

THREADS = (1, 16)
CALLS_PER_ROLLOUT = 4


class GymFileSink:
    """Gym's own durable file store behind Gym's capture: each staged record is written as the
    ``TokenEntry`` of the same call (carried prompt, generated ids and log-probs), fsynced."""

    def __init__(self, root: str) -> None:
        self._files = TokenCaptureStore(root)

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        carried = [i for i, mask in enumerate(record.token_mask_delta) if mask == 0.0]
        boundary = len(carried)
        entry = TokenEntry(
            rollout_id=record.rollout_id,
            model_call_id=record.model_call_id,
            prompt_token_ids=record.token_ids_delta[:boundary],
            generation_token_ids=record.token_ids_delta[boundary:],
            generation_log_probs=record.generation_log_probs_delta[boundary:],
            parent_call_id=record.parent_call_id,
            cum_len=record.cum_len,
            digest=record.cumulative_hash,
        )
        self._files.append(entry)
        return StageResult(ok=True, staging_key=f"{record.rollout_id}/{record.model_call_id}")


class Timed:
    """A sink wrapper that adds up the seconds spent inside ``stage`` (per thread, no lock)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self._local = threading.local()
        self.totals: list[list[float]] = []
        self._lock = threading.Lock()

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        total = getattr(self._local, "total", None)
        if total is None:
            total = self._local.total = [0.0]
            with self._lock:
                self.totals.append(total)
        start = time.perf_counter()
        try:
            return self._sink.stage(record)
        finally:
            total[0] += time.perf_counter() - start

    def seconds(self) -> float:
        return sum(total[0] for total in self.totals)


Call = tuple[str, str, list[int], list[int], list[float]]


def make_calls(tag: str, threads: int, block: int, prompt: int, generated: int, seed: int) -> list[list[Call]]:
    """Each thread's calls: text roots, ``CALLS_PER_ROLLOUT`` to a rollout, random tokens."""
    rng = random.Random(seed)
    work: list[list[Call]] = []
    for thread in range(threads):
        calls: list[Call] = []
        for index in range(block):
            rollout = f"{tag}-t{thread}-r{index // CALLS_PER_ROLLOUT}"
            ids = [rng.randrange(150_000) for _ in range(prompt + generated)]
            logprobs = [-rng.random() * 4 for _ in range(generated)]
            calls.append((rollout, f"c{index % CALLS_PER_ROLLOUT}", ids[:prompt], ids[prompt:], logprobs))
        work.append(calls)
    return work


def run_block(sink: Any, work: list[list[Call]]) -> tuple[float, float]:
    """Wall seconds for every thread to complete its calls through Gym's capture, and the
    seconds spent inside the sink (summed over threads, divided by the thread count)."""
    timed = Timed(sink)
    capture = RolloutTokenCapture(sink=timed, weight_version_fn=lambda: 1)
    failures: list[str] = []
    barrier = threading.Barrier(len(work) + 1)

    def worker(calls: list[Call]) -> None:
        barrier.wait()
        for rollout, call_id, prompt, generated, logprobs in calls:
            call = capture.begin_call(CaptureAdmission(rollout_id=rollout, model_call_id=call_id, mode="text"))
            coords = capture.complete_call(
                call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=logprobs
            )
            if coords.disposition != "staged":
                failures.append(f"{rollout}/{call_id}")

    threads = [threading.Thread(target=worker, args=(calls,)) for calls in work]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"{len(failures)} calls were not staged, first {failures[0]}")
    return wall, timed.seconds() / len(work)


class _Keep:
    """A sink that keeps what Gym's capture hands it (to build the prebuilt records)."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        self.records.append(record)
        return StageResult(ok=True, staging_key=f"{record.rollout_id}/{record.model_call_id}")


def prebuilt(work: list[list[Call]]) -> list[list[Any]]:
    """Gym's own ``StagedCallRecord`` of every call, built by Gym's capture before the clock."""
    out = []
    for calls in work:
        keep = _Keep()
        capture = RolloutTokenCapture(sink=keep, weight_version_fn=lambda: 1)
        for rollout, call_id, prompt, generated, logprobs in calls:
            call = capture.begin_call(CaptureAdmission(rollout_id=rollout, model_call_id=call_id, mode="text"))
            capture.complete_call(
                call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=logprobs
            )
        out.append(keep.records)
    return out


def run_sink_block(sink: Any, records: list[list[Any]]) -> float:
    """Wall seconds for every thread to stage its prebuilt records into the sink."""
    barrier = threading.Barrier(len(records) + 1)

    def worker(mine: list[Any]) -> None:
        barrier.wait()
        for record in mine:
            if not sink.stage(record).ok:
                raise RuntimeError(f"{record.rollout_id}/{record.model_call_id} was refused")

    threads = [threading.Thread(target=worker, args=(mine,)) for mine in records]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    p.add_argument("--block", type=int, default=24, help="calls per thread in one block (default 24)")
    p.add_argument("--tokens", default="512,128", help="prompt,generated tokens per call (default 512,128)")
    args = p.parse_args()
    rounds, block = (3, 8) if args.quick else (args.rounds, args.block)
    prompt, generated = (int(part) for part in args.tokens.split(","))
    logging.getLogger("nemo_gym").setLevel(logging.ERROR)
    report = Report(
        "bench_gym_capture",
        {"rounds": rounds, "block": block, "prompt": prompt, "generated": generated, "threads": list(THREADS)},
    )
    rows = []
    with temp_dir(args.dir) as base:
        report.notes.append(f"fsync on the benchmark's file system: {fsync_seconds(base) * 1e3:.2f} ms")
        for threads in THREADS:
            ratios: dict[str, list[float]] = {"call": [], "sink": [], "prebuilt": [], "ceiling": []}
            seconds: dict[str, list[float]] = {"store": [], "gym": []}
            for round_index in range(rounds):
                tag = f"b{threads}-{round_index}"
                work = make_calls(tag, threads, block, prompt, generated, args.seed + round_index)
                results: dict[str, tuple[float, float]] = {}
                order: list[tuple[str, Callable[[str], Any]]] = [
                    ("store", lambda at: open_store(os.path.join(at, "store.db"))),
                    ("gym", GymFileSink),
                ]
                if round_index % 2:
                    order.reverse()
                # The ceiling: Gym's capture into a sink that does nothing (its own Python alone),
                # its block in the alternating order too.
                nothing: tuple[str, Callable[[str], Any]] = ("none", lambda at: _Keep())
                whole = [*order, nothing] if round_index % 2 == 0 else [nothing, *order]
                for name, make in whole:
                    folder = os.path.join(base, f"{tag}-{name}")
                    os.makedirs(folder)
                    sink = make(folder)
                    try:
                        results[name] = run_block(sink, work)
                    finally:
                        if name == "store":
                            sink.close()
                records = prebuilt(make_calls(f"{tag}p", threads, block, prompt, generated, args.seed + round_index))
                sink_only: dict[str, float] = {}
                for name, make in order:
                    folder = os.path.join(base, f"{tag}-{name}-prebuilt")
                    os.makedirs(folder)
                    sink = make(folder)
                    try:
                        sink_only[name] = run_sink_block(sink, records)
                    finally:
                        if name == "store":
                            sink.close()
                ratios["prebuilt"].append(sink_only["gym"] / sink_only["store"])
                ratios["call"].append(results["gym"][0] / results["store"][0])
                ratios["ceiling"].append(results["gym"][0] / results["none"][0])
                ratios["sink"].append(results["gym"][1] / results["store"][1])
                calls = threads * block
                seconds["store"].append(results["store"][0] / calls)
                seconds["gym"].append(results["gym"][0] / calls)
            labels = {
                "call": "whole call",
                "sink": "sink alone",
                "prebuilt": "prebuilt records, sink only",
                "ceiling": "whole call, a sink doing nothing",
            }
            for what in ("call", "sink", "prebuilt", "ceiling"):
                values = ratios[what]
                median = statistics.median(values)
                rows.append(
                    [
                        f"x{threads} {labels[what]}",
                        f"{median:.2f}x",
                        f"{min(values):.2f}x",
                        f"{max(values):.2f}x",
                        f"{statistics.median(seconds['store']) * 1e3:.2f} ms" if what == "call" else "",
                        f"{statistics.median(seconds['gym']) * 1e3:.2f} ms" if what == "call" else "",
                    ]
                )
                report.results[f"x{threads}_{what}"] = {"median": median, "min": min(values), "max": max(values)}
                if what == "ceiling":
                    continue  # no target: the most any sink could reach on the whole call
                report.targets.append(
                    Target(f"store vs Gym file store, {threads} thread(s), {what}", median, ">=", 2.0)
                )
    report.table(
        "Gym's time over the store's, per round (wall time per call, medians, in the last two columns)",
        ["pair", "median", "min", "max", "store /call", "gym /call"],
        rows,
    )
    report.emit(args.json)


if __name__ == "__main__":
    main()
