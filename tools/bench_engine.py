"""Time per generated token of a real engine with capture, against the same engine decoding bare.

    python tools/bench_engine.py [--rounds 7] [--tokens 512] [--quick] [--json]

The engine is ``store.adapters.transformers`` on ``tiny_llama`` (vocab 512, hidden 64, 2
layers; random weights, seeded; one torch thread), decoding one call of ``--tokens`` tokens
from a 16-token prompt.  Captured: the call is admitted and tracked and decoded by
``store.worker.engine.generate`` (which makes no store call a token: cuts and flushes take the
engine's tokens from its lists on their own threads), the periodic flush thread stages a chunk
every 0.25 s (``flush_threshold_tokens=16``), and a cut of the call is served every 64 tokens
on a second thread (as a control route would), each one a durable commit.  Bare: the same
engine, same seed, the same tokens, no store.  Floor: the same engine with only the work any
durable cut must do on the second thread every 64 tokens (the new tokens' bytes, a SHA-256 of
the generation so far, one raw SQLite commit of them with the store's pragmas).  Each round
decodes one bare, one captured and one floor call, in alternating order, on fresh files; the
target is on the median of the per-round ratios (captured / bare).

The CPU ratio (process CPU time of every thread, cuts and flushes included, over the bare
decode's) is reported beside the wall-clock one: on a shared machine it is the steadier figure.
So is the decode thread's own CPU (what the store's threads cost it beyond the GIL: caches and
the cores they share).  Where the store's cost goes is measured in the same run: each flush and
each cut on their own threads (wall and thread CPU time of ``flush_due`` passes that staged, and
of ``serve_generation_cut``), and ``observe`` per token alone, for a loop of one's own that
calls it (``generate`` does not).  Needs torch and the
``[transformers]`` extra (install torch first: ``pip install torch==2.13.0``).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _bench_common import Report, Target, fmt_seconds, parser, temp_dir

from store import (
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    generate,
    open_store,
)
from store.adapters.transformers import TransformersEngine, tiny_llama

TARGET_RATIO = 1.03
CUT_EVERY = 64
PROMPT = [3 + (7 * i) % 500 for i in range(16)]


class Timed:
    """Wall and thread CPU time of each call of a method, recorded on whichever thread runs it."""

    def __init__(self, target: Any, name: str) -> None:
        self.seconds: list[float] = []
        self.cpu: list[float] = []
        original = getattr(target, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, used = time.perf_counter(), time.thread_time()
            result = original(*args, **kwargs)
            if result or name != "flush_due":  # only flush passes that staged something
                self.seconds.append(time.perf_counter() - start)
                self.cpu.append(time.thread_time() - used)
            return result

        setattr(target, name, timed)


def bare(model: Any, tokens: int, cpu: list[float], decode_cpu: list[float]) -> tuple[float, list[int]]:
    engine = TransformersEngine(model, seed=5)
    start, used, own = time.perf_counter(), time.process_time(), time.thread_time()
    engine.prefill(PROMPT)
    for _ in range(tokens):
        engine.step()
    decode_cpu.append(time.thread_time() - own)
    cpu.append(time.process_time() - used)
    return time.perf_counter() - start, list(engine.generated_token_ids)


def captured(
    model: Any, tokens: int, path: str, costs: dict[str, list[float]], cpu: list[float], decode_cpu: list[float]
) -> tuple[float, list[int]]:
    engine = TransformersEngine(model, seed=5)
    with open_store(path) as store:
        capture = RolloutTokenCapture(
            store=store, weight_version_fn=lambda: 1, flush_threshold_tokens=16, flush_interval=0.25
        )
        flushes = Timed(capture.cuts, "flush_due")
        cuts = Timed(capture, "serve_generation_cut")
        wanted = threading.Semaphore(0)
        done = threading.Event()
        call = capture.begin_call(CaptureAdmission(rollout_id="r", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=PROMPT, effective_output_limit=tokens)

        def cutter() -> None:  # the control route: one cut per request, off the decode thread
            number = 0
            while True:
                wanted.acquire()
                if done.is_set():
                    return
                number += 1
                ticket = GenerationCutPrefix(
                    ticket_id="t", rollout_id="r", attempt_index=0, model_call_id="c0", admitted_at=call.admitted_at
                )
                inventory = GenerationCutInventory.build(
                    checkpoint_id=f"ck-{number}", server_name="w", active_prefixes=[ticket]
                )
                capture.serve_generation_cut(inventory)

        thread = threading.Thread(target=cutter, daemon=True)
        thread.start()
        count = 0

        def on_token(_token: int, _logprob: float) -> None:
            nonlocal count
            count += 1
            if count % CUT_EVERY == 0:
                wanted.release()

        start, used, own = time.perf_counter(), time.process_time(), time.thread_time()
        generate(capture, call, engine, on_token=on_token)
        elapsed = time.perf_counter() - start
        decode_cpu.append(time.thread_time() - own)  # the decode thread's own
        cpu.append(time.process_time() - used)  # every thread of the process: cuts and flushes too
        done.set()
        wanted.release()
        thread.join(60)
        coords = capture.complete_observed(call)
        assert coords.disposition == "staged", coords
        capture.close()
        costs["flush"] += flushes.seconds
        costs["flush_cpu"] += flushes.cpu
        costs["cut"] += cuts.seconds
        costs["cut_cpu"] += cuts.cpu
    return elapsed, list(engine.generated_token_ids)


def floor(model: Any, tokens: int, path: str, cpu: list[float]) -> tuple[float, list[int]]:
    """The same engine with only a cut's mandatory work on a second thread every 64 tokens: the
    bytes of the tokens decoded since the last cut (ids as u64, log-probs as f32), a SHA-256 of
    the whole generation so far (the prefix digest an acknowledgement carries), and one raw
    SQLite transaction writing those bytes, committed with the store's pragmas (WAL,
    ``synchronous=FULL``).  No store, no records: what any durable cut must at least cost."""
    import hashlib
    import sqlite3

    import numpy as np

    engine = TransformersEngine(model, seed=5)
    connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("CREATE TABLE chunks (seq INTEGER PRIMARY KEY, ids BLOB, logprobs BLOB, digest BLOB)")
    wanted = threading.Semaphore(0)
    done = threading.Event()
    sent = 0

    def cutter() -> None:
        nonlocal sent
        while True:
            wanted.acquire()
            if done.is_set():
                return
            ids = list(engine.generated_token_ids)
            logprobs = list(engine.generated_logprobs)
            new_ids = np.asarray(ids[sent:], dtype=np.uint64).tobytes()
            new_logprobs = np.asarray(logprobs[sent:], dtype=np.float32).tobytes()
            digest = hashlib.sha256(np.asarray(PROMPT + ids, dtype=np.uint64).tobytes()).digest()
            sent = len(ids)
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "INSERT INTO chunks (ids, logprobs, digest) VALUES (?, ?, ?)", (new_ids, new_logprobs, digest)
            )
            connection.execute("COMMIT")

    thread = threading.Thread(target=cutter, daemon=True)
    thread.start()
    start, used = time.perf_counter(), time.process_time()
    engine.prefill(PROMPT)
    for count in range(1, tokens + 1):
        engine.step()
        if count % CUT_EVERY == 0:
            wanted.release()
    elapsed = time.perf_counter() - start
    cpu.append(time.process_time() - used)
    done.set()
    wanted.release()
    thread.join(60)
    connection.close()
    return elapsed, list(engine.generated_token_ids)


def observe_cost(tokens: int, folder: str) -> float:
    """Seconds per token of ``observe`` alone, one token at a time (what the decode thread adds)."""
    with open_store(os.path.join(folder, "observe.db")) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
        call = capture.begin_call(CaptureAdmission(rollout_id="o", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=PROMPT, effective_output_limit=tokens)
        start = time.perf_counter()
        for index in range(tokens):
            capture.observe(call, (index,), (-0.5,))
        elapsed = time.perf_counter() - start
        capture.close()
    return elapsed / tokens


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="bare/captured rounds (default 7, 2 with --quick)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per call (default 512, 128 with --quick)")
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 7)
    tokens = args.tokens or (128 if args.quick else 512)
    torch.set_num_threads(1)
    model = tiny_llama(0)
    report = Report("bench_engine")
    report.params.update(
        model="tiny_llama (vocab 512, hidden 64, 2 layers)", tokens=tokens, rounds=rounds, cut_every=CUT_EVERY
    )
    bare_s: list[float] = []
    captured_s: list[float] = []
    costs: dict[str, list[float]] = {"flush": [], "flush_cpu": [], "cut": [], "cut_cpu": []}
    floor_s: list[float] = []
    bare_cpu: list[float] = []
    captured_cpu: list[float] = []
    floor_cpu: list[float] = []
    bare_decode_cpu: list[float] = []
    captured_decode_cpu: list[float] = []
    with temp_dir(args.dir) as folder:
        bare(model, 32, [], [])  # warm up torch's kernels
        for number in range(rounds):
            path = os.path.join(folder, f"round-{number}.db")
            order = ["bare", "captured", "floor"] if number % 2 == 0 else ["floor", "captured", "bare"]
            for kind in order:
                if kind == "bare":
                    seconds, bare_ids = bare(model, tokens, bare_cpu, bare_decode_cpu)
                    bare_s.append(seconds)
                elif kind == "captured":
                    seconds, captured_ids = captured(model, tokens, path, costs, captured_cpu, captured_decode_cpu)
                    captured_s.append(seconds)
                else:
                    seconds, floor_ids = floor(model, tokens, path + "-floor", floor_cpu)
                    floor_s.append(seconds)
            assert bare_ids == captured_ids == floor_ids, "capture changed what the engine decoded"
        per_observe = observe_cost(20_000, folder)
    ratios = [c / b for c, b in zip(captured_s, bare_s, strict=True)]
    cpu_ratios = [c / b for c, b in zip(captured_cpu, bare_cpu, strict=True)]
    decode_ratios = [c / b for c, b in zip(captured_decode_cpu, bare_decode_cpu, strict=True)]
    floor_ratios = [f / b for f, b in zip(floor_s, bare_s, strict=True)]
    per_token_bare = statistics.median(bare_s) / tokens
    cuts_per_call = len(costs["cut"]) / rounds
    flushes_per_call = len(costs["flush"]) / rounds
    summary = (statistics.median, min, max)
    report.table(
        f"one call of {tokens} tokens, {rounds} rounds (median, min, max)",
        ["", "median", "min", "max"],
        [
            ["bare decode", *(fmt_seconds(f(bare_s)) for f in summary)],
            ["captured decode", *(fmt_seconds(f(captured_s)) for f in summary)],
            ["ratio captured/bare per round", *(f"{f(ratios):.3f}x" for f in summary)],
            ["CPU ratio (all threads) per round", *(f"{f(cpu_ratios):.3f}x" for f in summary)],
            ["decode thread's own CPU ratio per round", *(f"{f(decode_ratios):.3f}x" for f in summary)],
            ["floor: a cut's bare work / bare", *(f"{f(floor_ratios):.3f}x" for f in summary)],
        ],
    )
    bare_call = statistics.median(bare_s)

    def row(label: str, wall: list[float], cpu: list[float], per_call: float) -> list[Any]:
        if not wall:
            return [label, "-", "-", f"{per_call:.1f}", "-"]
        share = sum(cpu) / rounds / bare_call
        wall_each, cpu_each = fmt_seconds(statistics.median(wall)), fmt_seconds(statistics.median(cpu))
        return [label, wall_each, cpu_each, f"{per_call:.1f}", f"{share:.2%}"]

    report.table(
        "where the store's cost goes (thread CPU: what competes with the decode for the GIL and the cores)",
        ["part", "wall per item", "CPU per item", "items per call", "CPU share of the bare call"],
        [
            [
                "generate's decode loop: store calls per token",
                "0",
                "-",
                tokens,
                "-",
            ],
            row("periodic flush (flush thread)", costs["flush"], costs["flush_cpu"], flushes_per_call),
            row(f"cut every {CUT_EVERY} tokens (control thread)", costs["cut"], costs["cut_cpu"], cuts_per_call),
            [
                "observe() per token, for a loop that calls it (alone)",
                fmt_seconds(per_observe),
                "-",
                "-",
                f"{per_observe / per_token_bare:.2%}",
            ],
        ],
    )
    report.results.update(
        bare_s=bare_s,
        captured_s=captured_s,
        ratios=ratios,
        cpu_ratios=cpu_ratios,
        decode_cpu_ratios=decode_ratios,
        floor_s=floor_s,
        floor_ratios=floor_ratios,
        per_token_bare_s=per_token_bare,
        observe_s=per_observe,
        flush_s=costs["flush"],
        flush_cpu_s=costs["flush_cpu"],
        cut_s=costs["cut"],
        cut_cpu_s=costs["cut_cpu"],
    )
    report.targets.append(Target("captured_vs_bare_per_token", statistics.median(ratios), "<=", TARGET_RATIO))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
