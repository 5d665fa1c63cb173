"""The capture-lifecycle dimensions of the random-sequence state machine (issue 22, 12-14).

``LifecycleRules`` is mixed into ``test_state_machine.StoreMachine`` and uses its model
(``live``, ``acked``, ``completed_at``, ``clock`` ...).  It adds what the machine lacked:

* time: a fake clock the machine advances (the capture's only clock), with completion
  evidence's TTL checked after every step and in every cut that names a completed call;
* one call's concurrency with itself: the same call begun and tracked again while its
  completion is still running (paused inside its store write, so the interleaving is exact);
* close under a live thread: the store closed while a capture's flush thread is idle or in the
  middle of a write, then reopened; nothing acknowledged is lost, the flush in progress is
  whole, no flush thread is left and nothing is written after the close.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from store import (
    CaptureAdmission,
    CommitCoords,
    GenerationCutReceipt,
    RolloutTokenCapture,
    StoreClosedError,
    capture_key,
)
from store.wire.cut_records import chunk_staging_key
from store.worker.evidence import EvidenceCache

if TYPE_CHECKING:
    from test_state_machine import StoreMachine

OUTPUT_LIMIT = 48
EVIDENCE_TTL = 20.0  # seconds on the machine's clock
JOIN_SECONDS = 30.0  # a hang fails the step instead of hanging the run
FLUSH_THREAD = "staging-store-flush"


def flush_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == FLUSH_THREAD and t.is_alive()}


class PausedWrite:
    """Stands in for one store method: the first call that ``matches`` waits inside it until
    ``release``, then every call goes through to the real method."""

    def __init__(self, real: Callable[..., Any], matches: Callable[..., bool]) -> None:
        self.real, self.matches = real, matches
        self.entered, self.released = threading.Event(), threading.Event()
        self._armed = True
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            pause = self._armed and self.matches(*args, **kwargs)
            self._armed = self._armed and not pause
        if pause:
            self.entered.set()
            assert self.released.wait(JOIN_SECONDS), "the paused write was never released"
        return self.real(*args, **kwargs)


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Start ``target`` in a thread; its result (or the exception it raised) lands in the list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # the rule reports it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def sqlite_events(path: str) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        (count,) = connection.execute("SELECT count(*) FROM events").fetchone()
    connection.close()
    return int(count)


class LifecycleRules:
    """Rules and invariants over the capture's clock, re-admission and close (see the module)."""

    # --- time --------------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, 5.0, EVIDENCE_TTL, EVIDENCE_TTL + 1.0, 3 * EVIDENCE_TTL]))
    def advance_clock(self: StoreMachine, seconds: float) -> None:
        """Time passes; the flush thread's next pass (its tick) comes with it.  Then a checkpoint
        names finished calls: each is a terminal completion exactly while its evidence is fresh."""
        self.steps["advance_clock"] += 1
        self.clock.advance(seconds)
        self.capture.flush_due()
        if self.acked_terminal_calls():
            inventory = self._inventory([], True, reverse=False)
            receipt = self.capture.serve_generation_cut(inventory)
            self._note_receipt(inventory, receipt)
            self.check_terminal_acks(receipt)

    @invariant()
    def completion_evidence_honours_its_ttl(self: StoreMachine) -> None:
        """Memory holds no evidence past its TTL (the clock moves only with a pass), and is bounded."""
        held = self.capture.cuts.evidence.held()
        assert len(held) <= EvidenceCache.HELD_MAX
        for key, evidence in held.items():
            age = self.clock.now - evidence.at
            assert age <= EVIDENCE_TTL, f"evidence of {key} is held {age} s old, past its TTL {EVIDENCE_TTL}"
            assert evidence.at == self.completed_at.get(key), (key, evidence.at, self.completed_at.get(key))

    def check_terminal_acks(self: StoreMachine, receipt: GenerationCutReceipt) -> None:
        """A call that completed through the capture is acknowledged as a terminal completion
        exactly while its evidence is fresh (from memory or, after a crash, from the log)."""
        for ack in receipt.prefixes:
            key = (capture_key(ack.rollout_id, ack.attempt_index), ack.model_call_id)
            if key in self.live:
                continue
            at = self.completed_at.get(key)
            fresh = at is not None and self.clock.now - at <= EVIDENCE_TTL
            kind = ack.cut_kind if ack.disposition == "durable_prefix" else None
            if at is not None:  # how often each side of the TTL was asked (the soak reports it)
                self.steps["terminal_ack_fresh" if fresh else "terminal_ack_expired"] += 1
            assert kind == ("terminal_completion" if fresh else None), (key, at, self.clock.now, ack)

    # --- the same call begun again while its completion runs ---------------------------------------

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), same_tokens=st.booleans())
    def begin_again_while_completing(self: StoreMachine, data: st.DataObject, same_tokens: bool) -> None:
        """A call's completion is paused inside its store write; meanwhile the same call is
        admitted and tracked again (a retried request).  The completion must leave the newer
        admission tracked, and ``observe`` must keep working on it.  Decoding the same tokens
        again stages the identical record (once); different tokens are refused by the store,
        and the call's capture fails (its rollout is poisoned, as a conflicting answer must)."""
        self.steps["begin_again_same" if same_tokens else "begin_again_other"] += 1
        model = self._pick(data)
        key = model.key
        del self.live[key]
        self.acks.pop(key, None)
        generated = model.generated
        self.capture.observe(model.call, [], [], finish_reason="stop")
        live = self.capture.cuts.live(model.call)
        own = [] if live is None else [k for k in live.own_keys if k not in live.acknowledged]
        paused = PausedWrite(self.store.stage, lambda *args, **kwargs: True)
        self.store.stage = paused  # type: ignore[method-assign]
        try:
            completing, outcome = in_thread(lambda: self.capture.complete_observed(model.call))
            assert paused.entered.wait(JOIN_SECONDS), "the completion never reached its store write"
            again = self.capture.begin_call(model.call.admission, weight_version=model.version)
            self.capture.track(again, prompt_token_ids=model.prompt, effective_output_limit=OUTPUT_LIMIT)
            tokens = list(generated) if same_tokens else [*generated[:-1], (generated[-1] + 1) if generated else 5]
            tokens = tokens[: OUTPUT_LIMIT - len(model.restored)]
            half = len(tokens) // 2
            self.capture.observe(again, tokens[:half], logprobs(tokens[:half]))
        finally:
            paused.released.set()
            del self.store.stage
        completing.join(JOIN_SECONDS)
        assert not completing.is_alive(), "the paused completion never finished"
        [coords] = outcome
        assert isinstance(coords, CommitCoords), coords
        self._note_completion(model, coords, generated, own)
        # The first completion retired only its own call: the newer admission is still tracked.
        tracked = self.capture.cuts.live(again)
        assert tracked is not None and tracked.call is again, "a completion retired the newer admission"
        assert self.capture.cuts.live(model.call) is None
        self.capture.observe(again, tokens[half:], logprobs(tokens[half:]), finish_reason="stop")
        second = self.capture.complete_observed(again)
        if tokens == generated:
            assert second.disposition == "staged" and second.digest == coords.digest, second
            self.completed_at[key] = self.clock.now
            return
        assert second.disposition == "capture_failed", second
        info = self.store.call(*key)
        assert info is not None and info.state == "failed"
        self.failed.add(model.rollout_id)
        self.finished.pop(model.rollout_id, None)
        self.finished_calls.pop(model.rollout_id, None)
        self.untrainable.discard(model.rollout_id)

    # --- the store closed under a live flush thread -----------------------------------------------

    @precondition(lambda self: not self.closed_under_flusher)  # once a sequence: it ends the process
    @rule(data=st.data(), mid_write=st.booleans())
    def close_under_a_live_flusher(self: StoreMachine, data: st.DataObject, mid_write: bool) -> None:
        """A second capture on the store flushes every 5 ms; the store is closed while its flush
        thread is idle or paused inside a write.  ``close()`` waits for that write, which commits
        whole; it returns with no flush thread left, and nothing is written after it.  The
        process then ends as in a crash, and the store is reopened."""
        self.steps["close_mid_flush" if mid_write else "close_idle_flusher"] += 1
        self.closed_under_flusher = True
        before = flush_threads()
        flushing = RolloutTokenCapture(
            store=self.store,
            weight_version_fn=lambda: self.version,
            flush_threshold_tokens=1,
            flush_interval=0.005,
            clock=self.clock,
        )
        rollout_id = self._next("flushed")
        call = flushing.begin_call(CaptureAdmission(rollout_id=rollout_id, model_call_id="c0", mode="text"))
        flushing.track(call, prompt_token_ids=[1, 2], effective_output_limit=OUTPUT_LIMIT)
        self.attempt_keys[rollout_id] = {rollout_id}
        self.crashed_calls.add((rollout_id, "c0"))  # it never finishes: the process ends under it
        tokens = data.draw(st.lists(st.integers(0, 2**32), min_size=1, max_size=4))
        flusher = flushing.cuts._flusher
        assert flusher is not None and flusher.is_alive()
        paused = PausedWrite(self.store.stage_all, lambda *args, **kwargs: threading.current_thread() is flusher)
        if mid_write:
            self.store.stage_all = paused  # type: ignore[method-assign]
        flushing.observe(call, tokens, logprobs(tokens))
        self._close_peers()  # the rest of the process goes first, as in _close_process
        try:
            if mid_write:
                assert paused.entered.wait(JOIN_SECONDS), "the flush thread never reached its write"
            closing, outcome = in_thread(self.store.close)
            if mid_write:
                closing.join(0.02)
                assert closing.is_alive(), "close() returned while a flush was being written"
        finally:
            paused.released.set()
        closing.join(JOIN_SECONDS)
        if mid_write:
            del self.store.stage_all
        assert not closing.is_alive() and outcome == [None], outcome
        assert not flusher.is_alive(), "the flush thread outlived its closed store"
        main_flusher = self.capture.cuts._flusher
        assert main_flusher is not None and not main_flusher.is_alive(), "the machine's flush thread outlived the store"
        assert not flush_threads() - before, "a flush thread outlived the store"
        written = sqlite_events(self.path)
        flushing.observe(call, [7], [-0.5])  # due again; nothing may write it now
        try:
            flushing.flush_due()
        except StoreClosedError:
            pass
        else:
            raise AssertionError("a flush pass ran against a closed store")
        flushing.close()
        self.capture.close()
        assert sqlite_events(self.path) == written, "something was written after close()"
        self._crash(closed=True)
        # The flush in progress committed whole: its chunk holds every token it froze.
        key = chunk_staging_key("periodic-000000000001", rollout_id, "c0", 0)
        staged = {info.staging_key for info in self.store.staged_keys()}
        if mid_write:
            assert key in staged, "the flush in progress at close() was lost"
        if key in staged:
            [chunk] = self.store.fetch([key])
            assert list(chunk.token_ids_delta) == [1, 2, *tokens]


def logprobs(tokens: list[int]) -> list[float]:
    return [-(t % 7) / 4 for t in tokens]
