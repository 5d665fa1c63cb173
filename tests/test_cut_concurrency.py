"""Concurrent generation cuts (fault test 5): cuts whose inventories name the same live calls
in different orders, racing the calls' completions, must all finish and acknowledge only what
is durable."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from capture_helpers import Versions

from store import (
    ActiveCall,
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutReceipt,
    RolloutTokenCapture,
    Store,
    capture_key,
)

CALLS = 6
CUT_THREADS = 4
CUTS_PER_THREAD = 12
DEADLINE = 60.0  # seconds for every thread together; a deadlock fails the test instead of hanging it


@contextmanager
def fine_grained_switching() -> Iterator[None]:
    """Let the interpreter switch threads far more often, so lock-order races show up."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_all(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Run each target in its own daemon thread; fail if any is still running at the deadline."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported by the test, not lost in the thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(target), daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + DEADLINE
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"{len(stuck)} thread(s) never finished: serving cuts deadlocked"
    return errors


def shuffled_inventory(rng: random.Random, checkpoint_id: str, calls: list[str]) -> GenerationCutInventory:
    """All calls, with ticket ids assigned at random: the inventory's order is the tickets' order."""
    order = calls[:]
    rng.shuffle(order)
    prefixes = [
        GenerationCutPrefix(
            ticket_id=f"t{position:02d}", rollout_id="r0", attempt_index=0, model_call_id=call, admitted_at=1.0
        )
        for position, call in enumerate(order)
    ]
    return GenerationCutInventory.build(checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=prefixes)


def test_concurrent_cuts_over_shared_calls_in_different_orders_never_deadlock(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=Versions(3))
    names = [f"c{i}" for i in range(CALLS)]
    calls: dict[str, ActiveCall] = {}
    for name in names:
        call = capture.begin_call(CaptureAdmission(rollout_id="r0", model_call_id=name, mode="text"))
        capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=64)
        capture.observe(call, [10, 11], [-0.5, -0.25])
        calls[name] = call
    receipts: list[tuple[GenerationCutInventory, GenerationCutReceipt]] = []
    completed: dict[str, str | None] = {}

    def cutter(thread: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(thread)
            for n in range(CUTS_PER_THREAD):
                sent = shuffled_inventory(rng, f"checkpoint-{thread}-{n}", names)
                receipts.append((sent, capture.serve_generation_cut(sent)))
                capture.observe(calls[names[rng.randrange(CALLS)]], [20 + n], [-0.125])

        return run

    def completer() -> None:
        rng = random.Random(99)
        for name in rng.sample(names, CALLS // 2):
            capture.observe(calls[name], [40], [-1.0], finish_reason="stop")
            coords = capture.complete_call(
                calls[name], prompt_token_ids=[1, 2], generated_token_ids=[10, 11, 40], generated_logprobs=[-1.0] * 3
            )
            completed[name] = coords.digest

    with fine_grained_switching():
        errors = run_all([cutter(thread) for thread in range(CUT_THREADS)] + [completer])
    assert errors == []
    assert len(receipts) == CUT_THREADS * CUTS_PER_THREAD
    acknowledged: set[str] = set()
    for sent, receipt in receipts:
        receipt.validate_for(sent)
        for ack in receipt.prefixes:
            if ack.disposition != "durable_prefix":
                continue
            assert capture_key(ack.rollout_id, ack.attempt_index) == "r0"
            acknowledged.update(ack.staging_keys)
            if ack.cut_kind == "terminal_completion":
                assert ack.prefix_digest == completed[ack.model_call_id]
    # Every acknowledged key is staged and verifies (fetch re-hashes each digest).
    assert len(store.fetch(sorted(acknowledged))) == len(acknowledged)
    assert all(digest is not None for digest in completed.values())
    capture.close()
    assert store.replay().ok
