"""A vLLM worker process (tests/test_vllm_engine.py): JSON lines on stdout, one ``AsyncLLM``.

``python vllm_worker.py serve STORE MODEL``: policy version 1, greedy.  Three rollouts decode
concurrently on one ``AsyncLLM`` (``VllmEngine``), each a text call ``c0`` then token_in children.
Each rollout completes ``c0`` and admits ``c1``; once ``c1`` has ``CUT_AT`` tokens observed, its
observation waits (vLLM decodes on) and the worker reports ``inflight`` with each call's
admission time and observed count.  A second thread reads a cut inventory from stdin and serves
it (``receipt``); rollouts ``a`` and ``b`` are named in it, ``c`` is not.  Then ``a`` and ``b``
observe ``AFTER_CUT`` more tokens (lost with the process), the worker reports ``decoding`` and
waits to be killed.

``python vllm_worker.py resume STORE MODEL``: a fresh process at policy version 2.  ``a`` and
``b`` continue ``c1`` from the store alone (``continue_latest_cut``: attempt 1, key ``R-a1``),
decoding only the rest from prompt + restored prefix, then decode ``c2``.  ``c``'s ``c1``, which
no cut reached, is decoded again under ``c-a1`` with ``c/c0`` (staged by attempt 0) as its parent.
Then the same rollouts decode without interruption as ``ref-a``, ``ref-b``, ``ref-c``
(``reference``), and a call ``t/c0`` is cut from a second thread while it decodes freely and
completes (``thread_cut``); a call with a stop token ends on it (``stop``); a call during which
vLLM's weight version changes is ``capture_failed`` and the next call, all under the new
version, is staged (``weight_update``); a prompt longer than the model takes is
``capture_failed`` (``too_long``).  It reports ``done``, and
exits after a line on stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import vllm_support

vllm_support.apply_vllm_env()

from store import (  # noqa: E402
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    capture_key,
    from_json,
    open_store,
    to_json,
)
from store.adapters.vllm_engine import VllmEngine  # noqa: E402
from store.worker.active_call import ActiveCall  # noqa: E402

ROLLOUTS = ("a", "b", "c")
CUT = ("a", "b")  # the rollouts the cut names
TURNS = 3
LIMIT = 48  # each call's whole output limit
CUT_AT = 12  # c1's observation waits for the cut after this many tokens
AFTER_CUT = 8  # observed after the cut, then lost with the process
THREAD_LIMIT = 160  # the call cut from a second thread in ``resume``


def user(rollout: str, turn: int) -> list[int]:
    """A user turn: <|user|>, four words, <|assistant|> (the first also starts with <s>)."""
    index = ROLLOUTS.index(rollout[-1])
    words = [21 + (97 * index + 31 * turn + 13 * i) % 480 for i in range(4)]
    return [*([vllm_support.BOS_ID] if turn == 0 else []), 5, *words, 6]


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class Rollout:
    """A rollout's calls under one capture key, keeping the token history (token_in children)."""

    def __init__(self, capture: RolloutTokenCapture, engine: VllmEngine, name: str, key: str) -> None:
        self.capture, self.engine, self.name, self.key = capture, engine, name, key
        self.history: list[int] = []
        self.parent: tuple[str, str] | None = None  # (model_call_id, chain hash)

    async def admit(self, turn: int) -> ActiveCall:
        if self.parent is None:
            admission = CaptureAdmission(rollout_id=self.key, model_call_id=f"c{turn}", mode="text")
        else:
            admission = CaptureAdmission(
                rollout_id=self.key,
                model_call_id=f"c{turn}",
                parent_call_id=self.parent[0],
                prev_len=len(self.history),
                mode="token_in",
                required_prefix_token_ids=self.history,
                parent_chain_hash=self.parent[1],
            )
        prompt = [*self.history, *user(self.name, turn)]
        return await self.engine.admit(self.capture, admission, prompt_token_ids=prompt, effective_output_limit=LIMIT)

    async def finish(self, call: ActiveCall, on_tokens: Any = None) -> None:
        coords = await self.engine.decode(self.capture, call, on_tokens=on_tokens)
        assert coords.disposition == "staged" and coords.staging_key is not None, coords
        [record] = self.capture.store.fetch([coords.staging_key])
        self.history = [*map(int, call.prefix_token_ids), *map(int, record.token_ids_delta)]
        self.parent = (coords.model_call_id, coords.chain_hash or "")

    async def play(self, turn: int) -> None:
        await self.finish(await self.admit(turn))


async def serve(path: str, model: str) -> None:
    engine = VllmEngine.from_model(model, sampling={"temperature": 0.0}, enable_prefix_caching=False)
    loop = asyncio.get_running_loop()
    cut_done = asyncio.Event()
    with open_store(path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, flush_threshold_tokens=4)
        rollouts = {name: Rollout(capture, engine, name, name) for name in ROLLOUTS}
        inflight: dict[str, dict[str, Any]] = {}
        observed = dict.fromkeys(ROLLOUTS, 0)
        all_waiting = asyncio.Event()
        lost_done = asyncio.Event()

        def gate(name: str, call: ActiveCall) -> Any:
            async def on_tokens(ids: Any, _logprobs: Any) -> None:
                observed[name] += len(ids)
                if observed[name] < CUT_AT:
                    return
                if name not in inflight:
                    inflight[name] = {"admitted_at": call.admitted_at, "observed": observed[name]}
                    if len(inflight) == len(ROLLOUTS):
                        all_waiting.set()
                    await cut_done.wait()  # nothing more is observed until the cut is durable
                if name in CUT and observed[name] < inflight[name]["observed"] + AFTER_CUT:
                    return  # decoding on after the cut
                if all(n in inflight and observed[n] >= inflight[n]["observed"] + AFTER_CUT for n in CUT):
                    lost_done.set()
                await asyncio.Event().wait()  # the call is in flight when the process dies

            return on_tokens

        async def rollout(name: str) -> None:
            await rollouts[name].play(0)
            call = await rollouts[name].admit(1)
            await rollouts[name].finish(call, gate(name, call))

        def serve_cut() -> None:  # the control route's thread
            inventory = from_json(sys.stdin.readline().strip().encode(), GenerationCutInventory)
            receipt = capture.serve_generation_cut(inventory)
            emit("receipt", receipt=json.loads(to_json(receipt)))
            loop.call_soon_threadsafe(cut_done.set)

        tasks = [asyncio.ensure_future(rollout(name)) for name in ROLLOUTS]
        await asyncio.wait([asyncio.ensure_future(all_waiting.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                task.result()  # a rollout that failed says why
        emit("inflight", calls=inflight, pid=os.getpid())
        threading.Thread(target=serve_cut, daemon=True).start()
        await lost_done.wait()
        emit("decoding", observed=observed)
        await asyncio.Event().wait()  # killed here


async def resume(path: str, model: str) -> None:
    engine = VllmEngine.from_model(model, sampling={"temperature": 0.0}, enable_prefix_caching=False)
    report: dict[str, Any] = {}
    with open_store(path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 2)

        async def continued(name: str) -> None:
            rollout = Rollout(capture, engine, name, capture_key(name, 1))
            call = capture.continue_latest_cut(name, "c1")  # admitted, validated, tracked
            resumed = call.continuation
            assert resumed is not None
            decoded: list[int] = []
            await rollout.finish(call, lambda ids, _lps: decoded.extend(ids))
            report[name] = {"restored": len(resumed.restored_token_ids), "decoded": len(decoded)}
            for turn in range(2, TURNS):
                await rollout.play(turn)

        async def again(name: str) -> None:
            # No cut reached c1: it is decoded again under the next attempt's key, its parent the
            # last call attempt 0 completed (c0, staged under the rollout's own key).
            assert store.latest_cut(name, "c1") is None
            rollout = Rollout(capture, engine, name, capture_key(name, 1))
            [parent] = store.fetch([f"{name}/c0"])
            rollout.history = [int(token) for token in parent.token_ids_delta]
            rollout.parent = (parent.model_call_id, parent.chain_hash)
            for turn in range(1, TURNS):
                await rollout.play(turn)
            report[name] = {"restored": 0}

        await asyncio.gather(*(continued(name) if name in CUT else again(name) for name in ROLLOUTS))
        emit("continued", calls=report)

        async def reference(name: str) -> None:
            rollout = Rollout(capture, engine, name, f"ref-{name}")
            for turn in range(TURNS):
                await rollout.play(turn)

        await asyncio.gather(*(reference(name) for name in ROLLOUTS))
        emit("reference")
        emit("thread_cut", **await thread_cut(capture, engine))
        emit("stop", **await stop_token(capture, engine))
        emit("weight_update", **await weight_update(capture, engine))
        call = capture.begin_call(CaptureAdmission(rollout_id="long", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=[7] * 5000, effective_output_limit=8)  # max_model_len is 4096
        coords = await engine.decode(capture, call)
        info = store.call("long", "c0")
        emit("too_long", disposition=coords.disposition, state=info and info.state)
        capture.close()
    emit("done", pid=os.getpid())
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    engine.shutdown()
    engine.shutdown()  # again: nothing to do
    with open_store(path) as store:
        capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 2)
        call = capture.begin_call(CaptureAdmission(rollout_id="late", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=user("a", 0), effective_output_limit=4)
        try:
            await engine.generate(capture, call)
        except Exception as exc:  # reported to the test
            emit("after_shutdown", error=f"{type(exc).__name__}: {exc}")
        capture.close()


async def thread_cut(capture: RolloutTokenCapture, engine: VllmEngine) -> dict[str, Any]:
    """A call decoding freely is cut from a second thread once it has 8 tokens; it completes."""
    call = capture.begin_call(CaptureAdmission(rollout_id="t", model_call_id="c0", mode="text"))
    capture.track(call, prompt_token_ids=user("a", 0), effective_output_limit=THREAD_LIMIT)
    observed: list[int] = []
    started = threading.Event()
    result: dict[str, Any] = {}

    def on_tokens(ids: Any, _logprobs: Any) -> None:
        observed.extend(ids)
        if len(observed) >= 8:
            started.set()

    def cut() -> None:
        started.wait(300)
        ticket = GenerationCutPrefix(
            ticket_id="t", rollout_id="t", attempt_index=0, model_call_id="c0", admitted_at=call.admitted_at
        )
        inventory = GenerationCutInventory.build(checkpoint_id="thread", server_name="w", active_prefixes=[ticket])
        before = len(observed)
        [ack] = capture.serve_generation_cut(inventory).prefixes
        after = asyncio.run_coroutine_threadsafe(count(), loop).result(60)
        result.update(before=before, after=after, ack=json.loads(to_json(ack)))

    loop = asyncio.get_running_loop()

    async def count() -> int:  # read on the loop: every token a cut could have taken is counted
        return len(observed)

    cutter = threading.Thread(target=cut)
    cutter.start()
    coords = await engine.decode(capture, call, on_tokens=on_tokens)
    await asyncio.get_running_loop().run_in_executor(None, cutter.join)
    return {**result, "staging_key": coords.staging_key, "disposition": coords.disposition, "decoded": len(observed)}


def main() -> None:
    phase, store_path, model_path = sys.argv[1:4]
    try:
        asyncio.run({"serve": serve, "resume": resume}[phase](store_path, model_path))
    except BaseException:
        # Say why, then take vLLM's processes down with this one (they would keep it waiting).
        traceback.print_exc()
        sys.stderr.flush()
        children = vllm_support.vllm_descendants(os.getpid())
        segments = vllm_support.shm_segments(children)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        time.sleep(1)
        vllm_support.remove_shm(segments)
        os._exit(1)


async def stop_token(capture: RolloutTokenCapture, engine: VllmEngine) -> dict[str, Any]:
    """The same greedy call twice: unstopped, then with its sixth token as a stop token."""
    found: dict[str, Any] = {}
    for name, stops in (("free", []), ("stopped", None)):
        call = capture.begin_call(CaptureAdmission(rollout_id=f"s-{name}", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=user("b", 0), effective_output_limit=20)
        if stops is None:
            stops = [found["free"]["generated"][5]]
        finish = await engine.generate(capture, call, stop_token_ids=stops)
        coords = capture.complete_observed(call)
        [record] = capture.store.fetch([coords.staging_key or ""])
        info = capture.store.call(f"s-{name}", "c0")
        generated = [int(token) for token in record.token_ids_delta[len(user("b", 0)) :]]
        found[name] = {"finish": finish, "generated": generated, "stops": stops, "state": info and info.state}
    return found


async def weight_update(capture: RolloutTokenCapture, engine: VllmEngine) -> dict[str, Any]:
    """vLLM's weight version is changed (``update_weight_version``) while a call decodes, after
    its fourth token: the call is refused; a call decoded after it, under one version, is staged."""
    found: dict[str, Any] = {}
    failures: list[str] = []

    class Failures(logging.Handler):  # the capture logs why a call failed
        def emit(self, record: logging.LogRecord) -> None:
            failures.append(record.getMessage())

    handler = Failures()
    logging.getLogger("store.capture").addHandler(handler)
    try:
        for name in ("across", "after"):
            call = capture.begin_call(CaptureAdmission(rollout_id=f"w-{name}", model_call_id="c0", mode="text"))
            capture.track(call, prompt_token_ids=user("a", 0), effective_output_limit=24)
            seen: list[int] = []

            async def on_tokens(ids: Any, _logprobs: Any, name: str = name, seen: list[int] = seen) -> None:
                before = len(seen)
                seen.extend(ids)
                if name == "across" and before < 4 <= len(seen):
                    await engine.llm.update_weight_version("w2")

            coords = await engine.decode(capture, call, on_tokens=on_tokens)
            info = capture.store.call(f"w-{name}", "c0")
            found[name] = {"disposition": coords.disposition, "state": info and info.state, "observed": len(seen)}
    finally:
        logging.getLogger("store.capture").removeHandler(handler)
    found["failures"] = failures
    return found


if __name__ == "__main__":
    main()
