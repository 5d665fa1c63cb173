"""A cut request over loopback HTTP vs the same serve_generation_cut called directly (issue 13).

Each round starts 64 live calls of 4,096 generated tokens on one store and capture, then cuts
them either with ``capture.serve_generation_cut`` or with a POST to the control route served
by uvicorn on 127.0.0.1 in this process (a real socket, httpx as the client).  Rounds alternate
direct/HTTP (the order flips every pair); the target is the median of the per-pair ratios.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np
import uvicorn
from _bench_common import Report, Target, fmt_seconds, parser, temp_dir

from store import (
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutReceipt,
    RolloutTokenCapture,
    control_app,
    from_json,
    open_store,
    to_json,
)

LIVE_CALLS = 64
LIVE_TOKENS = 4096
PROMPT_TOKENS = 256
TARGET_RATIO = 1.5
TOKEN = "bench-token-0123456789"


def start_calls(capture: RolloutTokenCapture, tag: str, rng: np.random.Generator) -> GenerationCutInventory:
    prefixes = []
    for index in range(LIVE_CALLS):
        rollout = f"{tag}-r{index}"
        call = capture.begin_call(CaptureAdmission(rollout_id=rollout, model_call_id="c0", mode="text"))
        prompt = rng.integers(0, 150_000, PROMPT_TOKENS).tolist()
        capture.track(call, prompt_token_ids=prompt, effective_output_limit=2 * LIVE_TOKENS)
        generated = rng.integers(0, 150_000, LIVE_TOKENS).tolist()
        capture.observe(call, generated, (-rng.random(LIVE_TOKENS)).astype(np.float32).tolist())
        prefixes.append(
            GenerationCutPrefix(
                ticket_id=f"t{index:03d}", rollout_id=rollout, attempt_index=0, model_call_id="c0", admitted_at=1.0
            )
        )
    return GenerationCutInventory.build(checkpoint_id=f"cut-{tag}", server_name="policy", active_prefixes=prefixes)


def check(receipt: GenerationCutReceipt, inventory: GenerationCutInventory) -> None:
    receipt.validate_for(inventory)
    if {ack.prefix_token_count for ack in receipt.prefixes} != {LIVE_TOKENS}:
        raise AssertionError("unexpected acknowledgements")


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=None, help="direct/HTTP pairs (default 6, 2 with --quick)")
    args = p.parse_args()
    pairs = args.pairs or (2 if args.quick else 6)
    rng = np.random.default_rng(args.seed)
    report = Report("bench_http")
    report.params.update(live_calls=LIVE_CALLS, tokens=LIVE_TOKENS, pairs=pairs, transport="uvicorn on 127.0.0.1")
    with temp_dir(args.dir) as folder:
        store = open_store(os.path.join(folder, "http.db"), durability="full")
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, flush_interval=3600.0)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        server = uvicorn.Server(
            uvicorn.Config(control_app(capture, store, TOKEN), log_level="warning", access_log=False)
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        http = httpx.Client(
            base_url=base, timeout=300, headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        )

        def direct(inventory: GenerationCutInventory) -> float:
            start = time.perf_counter()
            receipt = capture.serve_generation_cut(inventory)
            elapsed = time.perf_counter() - start
            check(receipt, inventory)
            return elapsed

        def over_http(inventory: GenerationCutInventory) -> float:
            start = time.perf_counter()
            response = http.post("/ng-control/v1/generation-cut", content=to_json(inventory))
            response.raise_for_status()
            receipt = from_json(response.content, GenerationCutReceipt)
            elapsed = time.perf_counter() - start
            check(receipt, inventory)
            return elapsed

        directs: list[float] = []
        https: list[float] = []
        try:
            over_http(start_calls(capture, "warm", rng))  # first request pays imports and connection setup
            for pair in range(pairs):
                order: list[Any] = [(direct, directs), (over_http, https)]
                for run, into in order if pair % 2 == 0 else reversed(order):
                    into.append(run(start_calls(capture, f"p{pair}-{run.__name__}", rng)))
        finally:
            http.close()
            server.should_exit = True
            thread.join(timeout=30)
            capture.close()
            store.close()
    ratios = [h / d for h, d in zip(https, directs, strict=True)]
    report.table(
        f"one cut of {LIVE_CALLS} live calls x {LIVE_TOKENS} tokens",
        ["path", "median", "min", "max"],
        [
            ["serve_generation_cut (direct)", *(fmt_seconds(f(directs)) for f in (statistics.median, min, max))],
            ["POST over loopback HTTP", *(fmt_seconds(f(https)) for f in (statistics.median, min, max))],
            ["ratio HTTP/direct per pair", *(f"{f(ratios):.3f}x" for f in (statistics.median, min, max))],
        ],
    )
    report.results.update(direct_s=directs, http_s=https, ratios=ratios)
    report.targets.append(Target("http_cut_64x4096_vs_direct", statistics.median(ratios), "<=", TARGET_RATIO))
    report.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
