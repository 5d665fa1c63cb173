"""A capture's lifecycle (issue 22, items 12-14): completion evidence honours its TTL on an
injected clock, a completion never retires a newer admission of the same call, and the
periodic flush thread never outlives its store or its capture.

Interleavings are made deterministic by pausing a store write from a test hook (an
instance attribute shadowing ``Store.stage``/``stage_all``), never by sleeping.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from capture_helpers import FakeClock, writes_nothing
from factories import make_record

from store import (
    CaptureAdmission,
    CaptureError,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    StageResult,
    Store,
    StoreClosedError,
    open_store,
)
from store.wire.cut_records import chunk_staging_key
from store.worker.evidence import EvidenceCache

JOIN_SECONDS = 30.0  # a hang fails the test instead of hanging the run
FLUSH_THREAD = "staging-store-flush"


def flush_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == FLUSH_THREAD and t.is_alive()}


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    """Every flush thread a test starts is gone when it ends."""
    before = flush_threads()
    yield
    assert not flush_threads() - before, "a flush thread outlived its test"


def admission(rollout_id: str = "r0", model_call_id: str = "c0") -> CaptureAdmission:
    return CaptureAdmission(rollout_id=rollout_id, model_call_id=model_call_id, mode="text")


def inventory(checkpoint_id: str, calls: list[tuple[str, str]]) -> GenerationCutInventory:
    prefixes = [
        GenerationCutPrefix(
            ticket_id=f"t{index:03d}", rollout_id=rollout, attempt_index=0, model_call_id=call, admitted_at=1.0
        )
        for index, (rollout, call) in enumerate(calls)
    ]
    return GenerationCutInventory.build(checkpoint_id=checkpoint_id, server_name="policy", active_prefixes=prefixes)


def complete_one(capture: RolloutTokenCapture, rollout_id: str, tokens: list[int] | None = None) -> None:
    call = capture.begin_call(admission(rollout_id))
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    generated = tokens or [3]
    capture.observe(call, generated, [-0.5] * len(generated), finish_reason="stop")
    assert capture.complete_observed(call).disposition == "staged"


def sqlite_events(path: str) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        (count,) = connection.execute("SELECT count(*) FROM events").fetchone()
    connection.close()
    return int(count)


class PausedWrite:
    """Pauses one store write (the first that ``matches``) until ``release``; the others pass."""

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

    def wait_entered(self) -> None:
        assert self.entered.wait(JOIN_SECONDS), "the write to pause was never reached"

    def release(self) -> None:
        self.released.set()


def start(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a thread; its result or exception lands in the returned list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# --- 12: completion evidence honours its TTL ---------------------------------------------------------


def test_completion_evidence_is_dropped_once_its_ttl_passes(store: Store) -> None:
    """300 completed calls with a 0.5 s TTL are not held once the clock passed it (issue 22, 12)."""
    clock = FakeClock()
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, completion_evidence_ttl=0.5, clock=clock)
    for index in range(300):
        complete_one(capture, f"r{index}")
    assert len(capture.cuts.evidence.held()) == 300
    clock.advance(1.0)
    complete_one(capture, "late")  # every completion drops what expired before it
    assert len(capture.cuts.evidence.held()) == 1
    clock.advance(1.0)
    capture.flush_due()  # so does each pass of the flush thread, the capture's clock tick
    assert len(capture.cuts.evidence.held()) == 0
    capture.close()


def test_expired_evidence_is_never_used_from_memory_or_the_log(store: Store) -> None:
    clock = FakeClock()
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, completion_evidence_ttl=10.0, clock=clock)
    complete_one(capture, "r0")
    clock.advance(10.0)  # exactly the TTL old: still fresh
    [fresh] = capture.serve_generation_cut(inventory("ckpt-1", [("r0", "c0")])).prefixes
    assert fresh.cut_kind == "terminal_completion"
    # A restarted worker reads the same evidence from the log, stamped by the same clock.
    restarted = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, completion_evidence_ttl=10.0, clock=clock)
    [from_log] = restarted.serve_generation_cut(inventory("ckpt-2", [("r0", "c0")])).prefixes
    assert from_log.cut_kind == "terminal_completion" and from_log.staging_keys == fresh.staging_keys
    clock.advance(0.5)
    for serving, checkpoint in ((capture, "ckpt-3"), (restarted, "ckpt-4")):
        [expired] = serving.serve_generation_cut(inventory(checkpoint, [("r0", "c0")])).prefixes
        assert expired.disposition == "durable_failure"
    assert len(capture.cuts.evidence.held()) == 0
    capture.close()
    restarted.close()


def test_evidence_held_in_memory_is_bounded_and_the_log_serves_the_rest(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(EvidenceCache, "HELD_MAX", 4)
    clock = FakeClock()
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, clock=clock)
    for index in range(10):
        complete_one(capture, f"r{index}")
        clock.advance(1.0)
    assert len(capture.cuts.evidence.held()) == 4
    # The oldest call's evidence left memory, not the worker: the log still has it.
    [oldest] = capture.serve_generation_cut(inventory("ckpt-1", [("r0", "c0")])).prefixes
    assert oldest.cut_kind == "terminal_completion" and oldest.staging_keys == ("r0/c0",)
    capture.close()


def test_the_clock_stamps_admissions_and_completions_in_the_log(store: Store) -> None:
    clock = FakeClock(start=1_000_000.0)
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, clock=clock)
    call = capture.begin_call(admission())
    assert call.admitted_at == 1_000_000.0
    clock.advance(2.0)
    capture.complete_call(call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5])
    completion = store.completion("r0", "c0")
    assert completion is not None and completion.recorded_at == 1_000_002.0
    capture.close()


@pytest.mark.parametrize("bad", [None, 3.0, "time.time"])
def test_the_clock_must_be_callable(store: Store, bad: Any) -> None:
    with pytest.raises(CaptureError, match="clock must be callable"):
        RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, clock=bad)


def test_a_clock_that_gives_no_time_refuses_without_writing_or_using_up_the_call(store: Store) -> None:
    times: list[Any] = [1.0, 2.0]
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1, clock=lambda: times[0])
    call = capture.begin_call(admission())
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    capture.observe(call, [3], [-0.5], finish_reason="stop")
    for bad in (float("nan"), float("inf"), "now", None):
        times[0] = bad
        with writes_nothing(store), pytest.raises(CaptureError, match="clock must return seconds"):
            capture.begin_call(admission("r1"))
        with writes_nothing(store), pytest.raises(CaptureError, match="clock must return seconds"):
            capture.complete_observed(call)
        assert not call.completed and capture.cuts.live(call) is not None
    times[0] = 3  # an int is seconds too
    assert capture.complete_observed(call).disposition == "staged"
    capture.close()


# --- 13: a completion never retires a newer admission of the same call ----------------------------


@pytest.mark.parametrize("finish", ["complete_observed", "complete_call", "fail_call"])
def test_a_running_completion_leaves_a_newer_admission_of_the_call_tracked(
    store: Store, monkeypatch: pytest.MonkeyPatch, finish: str
) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    old = capture.begin_call(admission())
    capture.track(old, prompt_token_ids=[1, 2], effective_output_limit=8)
    capture.observe(old, [3, 4], [-0.5, -0.25], finish_reason="stop")
    writes = {"fail_call": "record_failure"}.get(finish, "stage")
    paused = PausedWrite(getattr(store, writes), lambda *args, **kwargs: True)
    monkeypatch.setattr(store, writes, paused)
    if finish == "complete_call":
        completing = lambda: capture.complete_call(  # noqa: E731
            old, prompt_token_ids=[1, 2], generated_token_ids=[3, 4], generated_logprobs=[-0.5, -0.25]
        )
    else:
        completing = {
            "complete_observed": lambda: capture.complete_observed(old),
            "fail_call": lambda: capture.fail_call(old, reason="gave up"),
        }[finish]
    thread, outcome = start(completing)
    paused.wait_entered()
    # While the first completion is still running, the same call is admitted and tracked again.
    new = capture.begin_call(admission())
    capture.track(new, prompt_token_ids=[1, 2], effective_output_limit=8)
    capture.observe(new, [3], [-0.5])
    paused.release()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive() and outcome and not isinstance(outcome[0], BaseException), outcome
    live = capture.cuts.live(new)
    assert live is not None and live.call is new, "the old call's completion retired the new admission"
    capture.observe(new, [4], [-0.25], finish_reason="stop")  # observe keeps working on the new call
    generated, _ = live.observed()
    assert list(generated) == [3, 4]
    assert capture.cuts.live(old) is None  # the old call is not the one tracked
    coords = capture.complete_observed(new)
    if finish == "fail_call":  # the call had failed: a later completion does not settle it
        assert coords.disposition == "staged"
    else:  # the same tokens again: the identical record, staged once
        assert coords.disposition == "staged" and coords.digest == outcome[0].digest
    assert capture.cuts.live(new) is None
    capture.close()


def test_tracking_the_call_again_replaces_the_older_admission(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    old = capture.begin_call(admission())
    capture.track(old, prompt_token_ids=[1, 2], effective_output_limit=8)
    new = capture.begin_call(admission())
    capture.track(new, prompt_token_ids=[1, 2], effective_output_limit=8)
    with pytest.raises(CaptureError, match="newer admission"):
        capture.observe(old, [3], [-0.5])  # its tokens must not land in the new call's buffers
    with pytest.raises(CaptureError, match="not tracked"):
        capture.complete_observed(old)
    capture.observe(new, [3], [-0.5], finish_reason="stop")
    assert capture.complete_observed(new).disposition == "staged"
    capture.close()


# --- 14: the flush thread never outlives its store or its capture --------------------------------


def new_flushing_capture(store: Store, interval: float = 0.01) -> RolloutTokenCapture:
    return RolloutTokenCapture(
        store=store, weight_version_fn=lambda: 1, flush_threshold_tokens=1, flush_interval=interval
    )


def test_closing_the_store_stops_an_idle_flush_thread(store_url: str, no_thread_left: None) -> None:
    store = open_store(store_url)
    capture = new_flushing_capture(store, interval=3600.0)  # idle: it never touches the store
    flusher = capture.cuts._flusher
    assert flusher is not None and flusher.is_alive()
    store.close()
    assert not flusher.is_alive(), "the flush thread outlived its closed store"
    capture.close()  # still fine after the store went


def test_closing_the_capture_stops_its_flush_thread(store: Store, no_thread_left: None) -> None:
    capture = new_flushing_capture(store, interval=3600.0)
    flusher = capture.cuts._flusher
    assert flusher is not None
    capture.close()
    assert not flusher.is_alive()
    capture.close()  # twice is fine


def test_a_flush_in_progress_at_close_finishes_and_nothing_is_written_after(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, no_thread_left: None
) -> None:
    path = os.path.join(tmp_path, "store.db")
    store = open_store(path)
    capture = new_flushing_capture(store)
    call = capture.begin_call(admission())
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    on_flusher = lambda *args, **kwargs: threading.current_thread().name == FLUSH_THREAD  # noqa: E731
    paused = PausedWrite(store.stage_all, on_flusher)
    monkeypatch.setattr(store, "stage_all", paused)
    capture.observe(call, [3, 4], [-0.5, -0.25])
    paused.wait_entered()  # the flush thread is inside its write
    closing, outcome = start(store.close)
    closing.join(0.05)
    assert closing.is_alive(), "close() returned while a flush was being written"
    paused.release()
    closing.join(JOIN_SECONDS)
    assert not closing.is_alive() and outcome == [None], outcome
    assert capture.cuts._flusher is not None and not capture.cuts._flusher.is_alive()
    written = sqlite_events(path)
    capture.observe(call, [5], [-0.5])  # more tokens due; nothing may flush them now
    with pytest.raises(StoreClosedError):
        capture.flush_due()
    assert sqlite_events(path) == written
    capture.close()
    with open_store(path) as reopened:  # the flush in progress committed whole
        [chunk] = reopened.fetch([chunk_staging_key("periodic-000000000001", "r0", "c0", 0)])
        assert list(chunk.token_ids_delta) == [1, 2, 3, 4]
        assert reopened.audit().ok


def test_a_flush_refused_by_a_closed_store_keeps_its_tokens_buffered(store: Store) -> None:
    capture = RolloutTokenCapture(
        store=store, weight_version_fn=lambda: 1, flush_threshold_tokens=1, flush_interval=3600.0
    )
    call = capture.begin_call(admission())
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    capture.observe(call, [3], [-0.5])
    store.close()
    with pytest.raises(StoreClosedError):
        capture.flush_due()
    live = capture.cuts.live(call)
    assert live is not None and live.unstaged() == 1 and live.frozen is None and not live.own_keys
    capture.close()


def test_a_capture_refuses_a_store_already_closed(store_url: str, no_thread_left: None) -> None:
    store = open_store(store_url)
    store.close()
    with pytest.raises(StoreClosedError):
        new_flushing_capture(store)


def test_a_forked_child_refuses_the_parents_capture(store: Store, no_thread_left: None) -> None:
    """The child has no flush thread and does not own the parent's live calls: it makes its own capture."""
    capture = new_flushing_capture(store, interval=3600.0)
    call = capture.begin_call(admission())
    capture.track(call, prompt_token_ids=[1, 2], effective_output_limit=8)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                capture.observe(call, [3], [-0.5])
            except CaptureError as exc:
                code = 0 if exc.code == "forked" else 2
            capture.close()  # closing the inherited capture in the child is harmless
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    capture.observe(call, [3], [-0.5])  # the parent's capture is untouched
    capture.close()


def test_stage_accepts_a_recorded_at_and_refuses_a_bad_one(store: Store) -> None:
    record = make_record(rollout_id="r0", model_call_id="c0", weight_version=1)
    for bad in (float("nan"), "now", 1):
        with pytest.raises(Exception, match="recorded_at"):
            store.stage(record, recorded_at=bad)  # type: ignore[arg-type]
    result: StageResult = store.stage(record, recorded_at=5.0)
    assert result.ok
    completion = store.completion("r0", "c0")
    assert completion is not None and completion.recorded_at == 5.0
