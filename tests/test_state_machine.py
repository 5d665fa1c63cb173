"""Random sequences of worker operations against a small in-memory model (issue 6, fault test 1).

A hypothesis ``RuleBasedStateMachine`` drives one store and one worker capture through
admissions, decoding (``observe``, and ``generate`` over an engine whose tokens the capture
pulls, cut from another thread inside the engine's step), cuts (also two at once over shared calls), periodic flushes,
completions, failures, crashes (all process state dropped, the store reopened), checkpoints
that cut every live call just before a crash, restores that continue a cut call as the next
attempt (sometimes under a newer policy version; a restored call is cut and restored again;
by Gym's admission, by ``continue_cut`` from the ack, or by ``continue_latest_cut`` from the store
alone), completions from what was observed (``complete_observed``), an engine that decodes past
the output limit (no cut may acknowledge it; a restored call's track() refuses the remaining
limit), repeated inventories, and forks; and the capture's own lifecycle
(``machine_lifecycle``): a fake clock the machine advances past completion evidence's TTL, the
same call begun and tracked again while its completion is still running, and the store closed
under a live flush thread (mid-write or idle), then reopened.  After every step:

* every acknowledged key fetches and verifies as *its* record (rollout, call, digest, tokens);
* the projections equal a replay of the log;
* the store-wide audit finds nothing (checksums, digests, chains, continuations, keys);
* keys a completion withdrew are gone;
* a continued call's record carries the oldest policy version of its parts;
* sequence numbers only grow;
* a committed ledger row is in its rollout's manifest (refused while retired, gone once deleted);
* retain keeps exactly a commit's retain set of a capture key (the other keys are gone), except
  the cut keys an unfinished call still builds on (its own, or a later attempt's continuation);
* a retired capture key refuses a late write (``RolloutFencedError``) and writes nothing, a
  forgotten one no longer does, and a deleted rollout's keys are gone (its tombstones explain
  the gap to the audit, and replay still equals the projections);
* the workers projection shows every policy worker that joined the coordinator as connected,
  stopped or lost, as the machine made it, and the coordinator counts the connected ones;
* completion evidence held in memory is never older than its TTL on the capture's clock, and a
  cut acknowledges a completed call as a terminal completion exactly while its evidence is fresh;
* every completed rollout linearizes (``Store.linearize``) and exports (``Store.export_jsonl``)
  to exactly the model's tokens and oldest policy version; a failed one is refused as
  ``capture_poisoned``, one that generated nothing as ``empty_generation``.

Every operation a later issue adds (audit, retention, coordinator) joins this machine; the
complete-record transport's (Gym's put, begin_call, mark_incomplete, freeze, drop) come from
``machine_transport.TransportRules``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
from capture_helpers import FakeClock, continuation_from
from coordinator_helpers import wait_for
from factories import make_record
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machine_lifecycle import EVIDENCE_TTL, JOIN_SECONDS, OUTPUT_LIMIT, LifecycleRules
from machine_transport import TransportRules
from profiles import examples
from rollouts import manifest_row
from shipping_helpers import assert_target_reads_like_source

from store import (
    ActiveCall,
    CallRecord,
    CaptureAdmission,
    CaptureError,
    CaptureLedgerCommit,
    CommitCoords,
    Coordinator,
    GenerationCutError,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    InvalidRecordError,
    ReadOnlyStoreError,
    ReceiptVerificationError,
    RolloutFencedError,
    RolloutTokenCapture,
    Store,
    UnknownKeyError,
    WorkerClient,
    capture_key,
    generate,
    open_store,
    to_json,
)
from store.coordinator import worker_log

try:  # NeMo Gym 0.7.0's records, for the rule that stages Gym's own record (left out without Gym)
    from nemo_gym.token_id_capture.staging import records as gym_records
except ImportError:
    gym_records = None

FLUSH_THRESHOLD = 3


@dataclass
class Expected:
    """What an acknowledged key must fetch as."""

    rollout_id: str
    model_call_id: str
    digest: str | None = None  # known for terminal records; cut chunks are checked by restore
    token_ids: list[int] | None = None
    weight_version: int | None = None


@dataclass
class LiveModel:
    """The model of one in-flight call."""

    rollout_id: str  # the rollout (without attempt)
    attempt: int
    model_call_id: str
    call: ActiveCall
    prompt: list[int]  # engine prompt: carried tokens, plus restored tokens when continued
    restored: list[int] = field(default_factory=list)  # generated tokens restored from a cut
    generated: list[int] = field(default_factory=list)  # tokens decoded by this attempt
    version: int = 0  # this attempt's stamped policy version
    oldest_version: int = 0  # the oldest policy version of its parts

    @property
    def key(self) -> tuple[str, str]:
        return capture_key(self.rollout_id, self.attempt), self.model_call_id


@dataclass
class LostCall:
    """A live call whose process died; restorable when a cut acknowledged a durable prefix."""

    model: LiveModel
    ack: GenerationCutPrefixAck
    tokens: list[int]  # carry + restored + generated tokens the ack made durable


def has_live(machine: StoreMachine) -> bool:
    return bool(machine.live)


class StoreMachine(LifecycleRules, TransportRules, RuleBasedStateMachine):
    steps: ClassVar[Counter[str]] = Counter()  # rules run, over every sequence (for the soak's report)

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.mkdtemp(prefix="store-machine-")
        self.path = os.path.join(self.folder, "store.db")
        self.version = 3
        self.clock = FakeClock()  # the capture's clock: only the advance_clock rule moves it
        self.completed_at: dict[tuple[str, str], float] = {}  # call -> its completion's time on the clock
        self._open()
        self.target = open_store(os.path.join(self.folder, "target.db"))  # what the ship rule ships into
        self.shipped_upto = 0  # the source's events up to this seq were shipped
        self.acked: dict[str, Expected] = {}
        self.cleared: set[str] = set()
        self.live: dict[tuple[str, str], LiveModel] = {}
        self.acks: dict[tuple[str, str], tuple[GenerationCutPrefixAck, list[int]]] = {}
        self.lost: list[LostCall] = []
        # Calls a crash left unfinished in the log (admitted, never completed or failed).
        self.crashed_calls: set[tuple[str, str]] = set()
        # Restored calls -> the staging keys of the cut they continued (their cuts build on them).
        self.continuations: dict[tuple[str, str], tuple[str, ...]] = {}
        self.receipts: list[tuple[GenerationCutInventory, bytes]] = []
        self.counter = 0
        self.forks = 0
        self.closed_under_flusher = False
        self.overran = False
        self.last_seq = 0
        self.finished: dict[str, tuple[list[int], int]] = {}  # rollout -> (its tokens, oldest version)
        self.finished_calls: dict[str, tuple[int, int]] = {}  # rollout -> (attempt, generated tokens)
        self.failed: set[str] = set()
        # A rollout ended since linearize, export or the lineage views last ran.
        self.unread_endings = self.unexported_endings = self.unviewed_endings = False
        self.untrainable: set[str] = set()
        self.attempt_keys: dict[str, set[str]] = {}  # rollout -> every capture key it used
        self.fenced: set[str] = set()  # retired capture keys
        self.deleted: set[str] = set()  # staging keys of deleted rollouts, or dropped by retain
        self.ledger_rows: dict[str, list[CallRecord]] = {}  # capture key -> its committed ledger rows
        self.deleted_since_compact = False
        self.worker_states: list[str] = []  # every worker that ever joined, in join order

    def _open(self) -> None:
        self.store: Store = open_store(self.path)
        self.capture = RolloutTokenCapture(
            store=self.store,
            weight_version_fn=lambda: self.version,
            flush_threshold_tokens=FLUSH_THRESHOLD,
            flush_interval=3600.0,  # passes run only when a rule calls flush_due()
            completion_evidence_ttl=EVIDENCE_TTL,
            clock=self.clock,
        )
        # The policy server's coordinator lives and dies with the process, as the store does.
        socket_path = os.path.join(self.folder, "policy.sock")
        self.coordinator = Coordinator(socket_path, expected_workers=2, store=self.store, message_timeout=5)
        # The store records one join of a process per window (worker_log.EventLimit); this process
        # plays every worker, so the join rule moves the window's clock and the model follows it.
        self.join_clock = 0.0
        self.last_recorded_join: float | None = None
        self.coordinator._events = worker_log.EventLimit(
            self.coordinator.max_connections, clock=lambda: self.join_clock
        )
        self.coordinator.start()
        # connected: (client, place in worker_states; None when its join was not recorded)
        self.clients: list[tuple[WorkerClient, int | None]] = []

    def _close_process(self) -> None:
        """Everything in the process goes: workers stay "connected" in the log (no one saw them go)."""
        self._close_peers()
        self.capture.close()
        self.store.close()

    def _close_peers(self) -> None:
        self.coordinator.close()
        for client, _ in self.clients:
            client._peer.close()  # type: ignore[union-attr]

    def _next(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def teardown(self) -> None:
        self.steps["sequences"] += 1
        self._close_process()
        self.target.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # --- rules ---------------------------------------------------------------------------------

    def _pick(self, data: st.DataObject) -> LiveModel:
        return self.live[data.draw(st.sampled_from(sorted(self.live)))]

    def _picks(self, data: st.DataObject, min_size: int) -> list[tuple[str, str]]:
        keys = sorted(self.live)
        return data.draw(st.lists(st.sampled_from(keys), min_size=min_size, max_size=min(4, len(keys)), unique=True))

    @initialize(prompt=st.lists(st.integers(0, 2**32), min_size=1, max_size=4))
    def first_call(self, prompt: list[int]) -> None:
        self.admit(prompt)

    @rule(prompt=st.lists(st.integers(0, 2**32), min_size=1, max_size=4), new_policy=st.booleans())
    def admit(self, prompt: list[int], new_policy: bool = False) -> None:
        """Admit a new rollout's call (after the trainer published a new policy version, sometimes)."""
        self.steps["admit"] += 1
        self.version += new_policy
        rollout_id, call_id = self._next("r"), "c0"
        call = self.capture.begin_call(CaptureAdmission(rollout_id=rollout_id, model_call_id=call_id, mode="text"))
        self.capture.track(call, prompt_token_ids=prompt, effective_output_limit=OUTPUT_LIMIT)
        model = LiveModel(rollout_id, 0, call_id, call, list(prompt), version=self.version, oldest_version=self.version)
        self.live[model.key] = model
        self.attempt_keys[rollout_id] = {model.key[0]}

    @precondition(has_live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2**40), min_size=1, max_size=5))
    def observe(self, data: st.DataObject, tokens: list[int]) -> None:
        self.steps["observe"] += 1
        self._decode(self._pick(data), tokens)

    @precondition(has_live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2**40), min_size=1, max_size=5), cut_at=st.integers(0, 5))
    def generate_with_a_cut_inside_a_step(self, data: st.DataObject, tokens: list[int], cut_at: int) -> None:
        """``generate`` decodes with an engine whose tokens the capture pulls; a cut of the same
        call is served from another thread while the engine is inside a step (its token in its
        lists, not yet returned to the loop)."""
        self.steps["generate"] += 1
        model = self._pick(data)
        tokens = tokens[: OUTPUT_LIMIT - len(model.restored) - len(model.generated) - 1]  # not to the limit
        if not tokens:
            return
        machine, base = self, list(model.generated)
        failures: list[BaseException] = []

        def cut() -> None:
            try:
                inventory = machine._inventory([model.key], False, reverse=False)
                receipt = machine.capture.serve_generation_cut(inventory)
                machine._note_receipt(inventory, receipt)
                machine.check_terminal_acks(receipt)
            except BaseException as exc:  # reported on the machine's thread
                failures.append(exc)

        class Engine:
            stop_token_ids = ()

            def __init__(self) -> None:
                self.generated_token_ids: list[int] = []
                self.generated_logprobs: list[float] = []

            def prefill(self, prompt_token_ids: Sequence[int]) -> None:
                self.generated_token_ids, self.generated_logprobs = [], []

            def step(self) -> tuple[int, float]:
                token = tokens[len(self.generated_token_ids)]
                self.generated_token_ids.append(token)
                self.generated_logprobs.append(-(token % 7) / 4)
                model.generated = [*base, *self.generated_token_ids]
                if len(self.generated_token_ids) == cut_at + 1:
                    thread = threading.Thread(target=cut, daemon=True)
                    thread.start()
                    thread.join(JOIN_SECONDS)
                    assert not thread.is_alive(), "a cut inside the engine's step deadlocked"
                return token, self.generated_logprobs[-1]

        assert generate(self.capture, model.call, Engine(), max_tokens=len(tokens)) is None
        if failures:
            raise failures[0]

    def _decode(self, model: LiveModel, tokens: list[int]) -> None:
        room = OUTPUT_LIMIT - len(model.restored) - len(model.generated)
        tokens = tokens[:room]
        self.capture.observe(model.call, tokens, [-(t % 7) / 4 for t in tokens])
        model.generated += tokens

    @precondition(has_live)
    @rule()
    def flush(self) -> None:
        self.steps["flush"] += 1
        self.capture.flush_due()

    @precondition(has_live)
    @rule(data=st.data(), include_done=st.booleans())
    def cut(self, data: st.DataObject, include_done: bool) -> None:
        self.steps["cut"] += 1
        keys = self._picks(data, 1)
        for key in keys:  # the engine decoded a little more since the last step
            self._decode(self.live[key], data.draw(st.lists(st.integers(0, 2**32), max_size=2)))
        inventory = self._inventory(keys, include_done, reverse=False)
        receipt = self.capture.serve_generation_cut(inventory)
        self._note_receipt(inventory, receipt)
        self.check_terminal_acks(receipt)

    @precondition(lambda self: len(self.live) >= 2)
    @rule(data=st.data())
    def two_cuts_at_once(self, data: st.DataObject) -> None:
        self.steps["two_cuts_at_once"] += 1
        keys = self._picks(data, 2)
        inventories = [self._inventory(keys, False, reverse=False), self._inventory(keys, False, reverse=True)]
        receipts: list[GenerationCutReceipt | BaseException | None] = [None, None]

        def serve(index: int) -> None:
            try:
                receipts[index] = self.capture.serve_generation_cut(inventories[index])
            except BaseException as exc:  # reported below
                receipts[index] = exc

        threads = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(2)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often, so the two cuts interleave
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(JOIN_SECONDS)
        finally:
            sys.setswitchinterval(interval)
        assert not any(thread.is_alive() for thread in threads), "two concurrent cuts deadlocked"
        for inventory, receipt in zip(inventories, receipts, strict=True):
            assert isinstance(receipt, GenerationCutReceipt), receipt
            self._note_receipt(inventory, receipt)

    def _inventory(self, keys: list[tuple[str, str]], include_done: bool, *, reverse: bool) -> GenerationCutInventory:
        """An inventory naming ``keys`` (ticket order reversed on request, so locks are taken in another order)."""
        chosen = [key for key in keys if key in self.live]
        if include_done:
            chosen += [key for key in self.acked_terminal_calls() if key not in chosen][:2]
        checkpoint = self._next("ckpt-")
        prefixes = []
        ordered = list(reversed(chosen)) if reverse else chosen
        for index, (capture, call_id) in enumerate(ordered):
            rollout_id, attempt = _split_capture_key(capture)
            prefixes.append(
                GenerationCutPrefix(
                    ticket_id=f"t{index:03d}",
                    rollout_id=rollout_id,
                    attempt_index=attempt,
                    model_call_id=call_id,
                    admitted_at=1000.0 + index,
                )
            )
        return GenerationCutInventory.build(checkpoint_id=checkpoint, server_name="policy", active_prefixes=prefixes)

    def acked_terminal_calls(self) -> list[tuple[str, str]]:
        return [
            (expected.rollout_id, expected.model_call_id)
            for key, expected in self.acked.items()
            if not key.startswith("__") and expected.digest is not None and expected.rollout_id not in self.fenced
        ]

    def _note_receipt(self, inventory: GenerationCutInventory, receipt: GenerationCutReceipt) -> None:
        receipt.validate_for(inventory)
        self.receipts.append((inventory, to_json(receipt)))
        for ack in receipt.prefixes:
            if ack.disposition != "durable_prefix":
                continue
            key = (capture_key(ack.rollout_id, ack.attempt_index), ack.model_call_id)
            for staging_key in ack.staging_keys:
                self.acked.setdefault(staging_key, Expected(key[0], key[1]))
                self.cleared.discard(staging_key)
            model = self.live.get(key)
            if ack.cut_kind == "active_prefix" and model is not None:
                assert ack.prefix_token_count is not None
                durable = ack.prefix_token_count - len(model.restored)
                tokens = [*model.prompt, *model.generated[:durable]]
                previous = self.acks.get(key)
                if previous is None or len(previous[0].staging_keys) <= len(ack.staging_keys):
                    self.acks[key] = (ack, tokens)

    @precondition(has_live)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 2**32), max_size=3), observed=st.booleans())
    def complete(self, data: st.DataObject, tail: list[int], observed: bool) -> None:
        """Complete with every token again (``complete_call``) or from what was observed."""
        self.steps["complete_observed" if observed else "complete"] += 1
        model = self._pick(data)
        key = model.key
        del self.live[key]
        self.acks.pop(key, None)
        tail = tail[: OUTPUT_LIMIT - len(model.restored) - len(model.generated)]
        generated = [*model.generated, *tail]
        self.capture.observe(model.call, tail, [-(t % 7) / 4 for t in tail], finish_reason="stop")
        live = self.capture.cuts.live(model.call)
        own = [] if live is None else [k for k in live.own_keys if k not in live.acknowledged]
        if observed:
            coords = self.capture.complete_observed(model.call)
        else:
            coords = self.capture.complete_call(
                model.call,
                prompt_token_ids=model.prompt,
                generated_token_ids=generated,
                generated_logprobs=[-(t % 7) / 4 for t in generated],
            )
        self._note_completion(model, coords, generated, own)

    def _note_completion(self, model: LiveModel, coords: CommitCoords, generated: list[int], own: list[str]) -> None:
        """What a staged completion of ``model`` (with ``generated`` after its restored tokens) made true."""
        key = model.key
        assert coords.disposition == "staged", coords
        assert coords.staging_key == f"{key[0]}/{key[1]}"
        assert coords.weight_version == model.oldest_version
        self.acked[coords.staging_key] = Expected(
            key[0],
            key[1],
            digest=coords.digest,
            token_ids=[*model.prompt, *generated],
            weight_version=model.oldest_version,
        )
        self.completed_at[key] = self.clock.now
        if model.restored or generated:
            self.finished[model.rollout_id] = ([*model.prompt, *generated], model.oldest_version)
            self.finished_calls[model.rollout_id] = (model.attempt, len(model.restored) + len(generated))
        else:
            self.untrainable.add(model.rollout_id)  # nothing generated: no training row (empty_generation)
        for withdrawn in own:
            self.cleared.add(withdrawn)
            self.acked.pop(withdrawn, None)
        self.unread_endings = self.unexported_endings = self.unviewed_endings = True

    @precondition(has_live)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        self.steps["fail"] += 1
        model = self._pick(data)
        key = model.key
        del self.live[key]
        self.acks.pop(key, None)
        coords = self.capture.fail_call(model.call, reason="the engine gave up")
        self.failed.add(model.rollout_id)
        self.unread_endings = self.unexported_endings = self.unviewed_endings = True
        assert coords.disposition == "capture_failed"
        info = self.store.call(*key)
        assert info is not None and info.state == "failed"

    @precondition(lambda self: bool(self.live) and not self.overran)  # once a sequence: it ends a call
    @rule(data=st.data(), extra=st.integers(1, 3))
    def overrun(self, data: st.DataObject, extra: int) -> None:
        """The engine decodes past the call's output limit: no cut may acknowledge those tokens
        (it is refused and writes nothing), and the call can only fail."""
        self.steps["overrun"] += 1
        self.overran = True
        model = self._pick(data)
        key = model.key
        room = OUTPUT_LIMIT - len(model.restored) - len(model.generated)
        tokens = [7] * (room + extra)
        self.capture.observe(model.call, tokens, [-0.5] * len(tokens))
        before = self.store.replay().events
        with pytest.raises(GenerationCutError, match="past the call's output limit"):
            self.capture.serve_generation_cut(self._inventory([key], False, reverse=False))
        assert self.store.replay().events == before, "a refused cut wrote to the log"
        del self.live[key]
        self.acks.pop(key, None)
        coords = self.capture.complete_observed(model.call)
        assert coords.disposition == "capture_failed", coords
        self.failed.add(model.rollout_id)
        self.unread_endings = self.unexported_endings = self.unviewed_endings = True

    @precondition(has_live)
    @rule()
    def crash(self) -> None:
        """Drop all process state: live calls die; those with an acknowledged cut can be restored."""
        self.steps["crash"] += 1
        self._crash()

    @precondition(has_live)
    @rule(data=st.data())
    def checkpoint_then_crash(self, data: st.DataObject) -> None:
        """What cuts are for: a checkpoint cuts every call mid-decoding, then the worker dies.

        (Reached through separate cut and crash rules, a restorable call was rare: five restores
        in 600 random sequences.)  Every call that decoded a token gets a durable prefix.
        """
        self.steps["checkpoint_then_crash"] += 1
        keys = sorted(self.live)
        for key in keys:
            self._decode(self.live[key], data.draw(st.lists(st.integers(0, 2**32), min_size=1, max_size=3)))
        inventory = self._inventory(keys, False, reverse=bool(data.draw(st.booleans())))
        receipt = self.capture.serve_generation_cut(inventory)
        self._note_receipt(inventory, receipt)
        for key in keys:
            model = self.live[key]
            ack = self.acks.get(key)
            assert ack is not None, f"the checkpoint left {key} without a durable prefix: {receipt.prefixes}"
            assert ack[1] == [*model.prompt, *model.generated], "the cut must hold every token decoded so far"
        self._crash()

    def _crash(self, *, closed: bool = False) -> None:
        """The process dies (``closed``: it already closed its store and peers); the store reopens."""
        self.crashed_calls.update(self.live)
        for key, model in self.live.items():
            acked = self.acks.get(key)
            if acked is not None:
                self.lost.append(LostCall(model, acked[0], acked[1]))
        self.live.clear()
        self.acks.clear()
        if not closed:
            self._close_process()
        self._open()

    @precondition(lambda self: bool(self.lost))
    @rule(data=st.data(), new_policy=st.booleans(), via=st.sampled_from(["admission", "continue_cut", "latest_cut"]))
    def restore(self, data: st.DataObject, new_policy: bool, via: str) -> None:
        """Continue a lost call's acknowledged cut as the next attempt, resolved from the log: by
        the admission Gym sends, from the ack (``continue_cut``), or from the store alone."""
        self.steps[f"restore_{via}"] += 1
        self.version += new_policy
        lost = self.lost.pop(data.draw(st.integers(0, len(self.lost) - 1)))
        source, ack = lost.model, lost.ack
        assert ack.prefix_digest is not None and ack.prefix_token_count is not None
        assert ack.effective_output_limit is not None
        continuation = continuation_from(ack)
        attempt = source.attempt + 1
        if via == "admission":
            admission = CaptureAdmission(
                rollout_id=capture_key(source.rollout_id, attempt),
                model_call_id=source.model_call_id,
                mode="text",
                generation_cut=continuation,
            )
            call = self.capture.begin_call(admission)
            resumed = call.continuation
            assert resumed is not None
            if resumed.remaining_output_limit != OUTPUT_LIMIT:  # the limit rule: never the remaining one
                with pytest.raises(CaptureError) as refused:
                    self.capture.track(call, effective_output_limit=resumed.remaining_output_limit)
                assert refused.value.code == "output_limit"
            self.capture.track(
                call, prompt_token_ids=resumed.engine_prompt_token_ids, effective_output_limit=OUTPUT_LIMIT
            )
        elif via == "continue_cut":
            call = self.capture.continue_cut(ack)  # tracked with the continuation's prompt and limit
        else:
            latest = self.store.latest_cut(source.rollout_id, source.model_call_id)
            assert latest is not None and latest.attempt_index == source.attempt
            assert (latest.prefix_digest, latest.staging_keys) == (ack.prefix_digest, ack.staging_keys)
            call = self.capture.continue_latest_cut(source.rollout_id, source.model_call_id)
        assert (call.capture_key, call.model_call_id) == (capture_key(source.rollout_id, attempt), source.model_call_id)
        resumed = call.continuation
        assert resumed is not None
        assert list(resumed.engine_prompt_token_ids) == lost.tokens, "the restore must give back the cut's tokens"
        restored = lost.tokens[len(source.prompt) - len(source.restored) :]
        assert list(resumed.restored_token_ids) == restored
        carry = lost.tokens[: len(lost.tokens) - len(restored)]
        model = LiveModel(
            source.rollout_id,
            attempt,
            source.model_call_id,
            call,
            [*carry, *restored],
            restored=restored,
            version=self.version,
            oldest_version=min(source.oldest_version, self.version),
        )
        self.live[model.key] = model
        self.continuations[model.key] = continuation.staging_keys
        self.attempt_keys[source.rollout_id].add(model.key[0])

    # --- retention: retire, forget, delete --------------------------------------------------------

    def _quiet_keys(self) -> list[str]:
        """Capture keys with no live call (a lost call's key is quiet: restore only reads it)."""
        live = {key[0] for key in self.live}
        return sorted(key for keys in self.attempt_keys.values() for key in keys if key not in live)

    def _deletable(self) -> list[str]:
        """Rollouts whose every attempt is quiet and none of whose cuts a restore still needs."""
        busy = {model.rollout_id for model in self.live.values()} | {lost.model.rollout_id for lost in self.lost}
        return sorted(rollout for rollout in self.attempt_keys if rollout not in busy)

    def _retirable(self) -> list[str]:
        return [key for key in self._quiet_keys() if key not in self.fenced]

    @precondition(lambda self: bool(self._retirable()))
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        """Retire an attempt (as a restore does); a second retire is a no-op."""
        self.steps["retire"] += 1
        key = data.draw(st.sampled_from(self._retirable()))
        [preview] = self.store.removal_preview([key])  # what --dry-run lists
        assert not preview.fenced, preview
        removal = self.store.retire([key])
        assert removal.removed + removal.absent == [key]
        assert (removal.removed == [key]) == (preview.outcome("retire") == "removed"), (preview, removal)
        assert self.store.removal_preview([key])[0].fenced
        self.fenced.add(key)
        assert self.store.retire([key]).removed + self.store.retire([key]).absent == [key]

    @precondition(lambda self: bool(self.fenced))
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        self.steps["forget"] += 1
        key = data.draw(st.sampled_from(sorted(self.fenced)))
        assert self.store.forget([key]).removed == [key]
        self.fenced.discard(key)
        assert self.store.forget([key]).absent == [key]

    @precondition(lambda self: bool(self._deletable()))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        """Delete every attempt of a finished rollout: its keys go, and so do its fences."""
        self.steps["delete"] += 1
        rollout = data.draw(st.sampled_from(self._deletable()))
        keys = sorted(self.attempt_keys.pop(rollout))
        previews = self.store.removal_preview(keys)  # what --dry-run lists
        assert [p.fenced for p in previews] == [key in self.fenced for key in keys], previews
        removal = self.store.delete(keys)
        assert sorted(removal.removed + removal.absent) == keys
        assert sorted(removal.removed) == [p.capture_key for p in previews if p.outcome("delete") == "removed"]
        assert all((p.events, p.fenced) == (0, False) for p in self.store.removal_preview(keys))
        assert self.store.delete(keys).absent == keys  # nothing left, no fence: absent
        for staging_key, expected in list(self.acked.items()):
            if expected.rollout_id in keys:
                del self.acked[staging_key]
                self.deleted.add(staging_key)
        self.fenced.difference_update(keys)
        self.deleted_since_compact = True
        for capture in keys:
            self.ledger_rows.pop(capture, None)
        for table in (self.finished, self.finished_calls):
            table.pop(rollout, None)
        self.failed.discard(rollout)
        self.untrainable.discard(rollout)

    def _retainable(self) -> list[str]:
        """Quiet capture keys holding cut keys that no restore still needs (a lost continued call's
        cut starts with keys of the attempt it continued: those are needed too)."""
        needed = {lost.model.key[0] for lost in self.lost}
        needed |= {self.acked[k].rollout_id for lost in self.lost for k in lost.ack.staging_keys if k in self.acked}
        with_cuts = {expected.rollout_id for key, expected in self.acked.items() if key.startswith("__")}
        return [key for key in self._quiet_keys() if key not in needed and key in with_cuts]

    @precondition(lambda self: bool(self._retainable()))
    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        """A commit's retain set: the terminal keys and some cut keys; the others are withdrawn."""
        self.steps["retain"] += 1
        key = data.draw(st.sampled_from(self._retainable()))
        owned = sorted(staging_key for staging_key, expected in self.acked.items() if expected.rollout_id == key)
        cuts = [staging_key for staging_key in owned if staging_key.startswith("__")]
        keep = [staging_key for staging_key in owned if not staging_key.startswith("__")]
        if cuts:
            keep += data.draw(st.lists(st.sampled_from(cuts), unique=True))
        # A call still decoding builds its next cut on its staged chunks, so the store keeps
        # them even when a retain set leaves them out, unless the capture key is retired; a
        # call a crash left unfinished looks the same in the log.  Cut keys of calls that ended go.
        # The same holds for a cut a later attempt continued: its unfinished call (on a capture key
        # not retired) builds its own cuts on the cut's keys, whoever owns them.
        unfinished = self.live.keys() | self.crashed_calls
        built_on = {
            k
            for call, keys in self.continuations.items()
            if call in unfinished and call[0] not in self.fenced
            for k in keys
        }
        live = {
            k
            for k in cuts
            if (self.acked[k].rollout_id, self.acked[k].model_call_id) in unfinished and key not in self.fenced
        } | (set(cuts) & built_on)
        removal = self.store.retain(keep, capture_keys=[key])
        dropped = set(owned) - set(keep) - live
        assert dropped <= set(removal.removed) and not set(removal.removed) & (set(keep) | live)
        assert removal.absent == []
        for staging_key in dropped:
            del self.acked[staging_key]
            self.deleted.add(staging_key)

    def _uncommitted(self) -> list[str]:
        """Terminal keys of unfenced capture keys that have no ledger row yet."""
        committed = {row.staging_key for rows in self.ledger_rows.values() for row in rows}
        return [
            key
            for key, expected in sorted(self.acked.items())
            if not key.startswith("__")
            and expected.digest is not None
            and expected.rollout_id not in self.fenced
            and key not in committed
        ]

    @precondition(lambda self: bool(self._uncommitted()))
    @rule(data=st.data())
    def ledger_commit(self, data: st.DataObject) -> None:
        """Gym commits a finished call's ledger row (token-free); the same commit again is a no-op."""
        self.steps["ledger_commit"] += 1
        key = data.draw(st.sampled_from(self._uncommitted()))
        [snapshot] = self.store.fetch([key])
        commit = CaptureLedgerCommit(
            rollout_id=snapshot.rollout_id, record=manifest_row(snapshot), staging_chain=(key,)
        )
        ledger = self.store.ledger()
        ledger.record(commit)
        ledger.record(commit)
        self.ledger_rows.setdefault(snapshot.rollout_id, []).append(commit.record)

    def _restageable(self) -> list[str]:
        return sorted(
            key
            for key, expected in self.acked.items()
            if not key.startswith("__") and expected.digest is not None and expected.rollout_id not in self.fenced
        )

    @precondition(lambda self: gym_records is not None and bool(self._restageable()))
    @rule(data=st.data())
    def gym_restage(self, data: st.DataObject) -> None:
        """NeMo Gym's own record of a staged call (fetched as Gym's snapshot), staged again: Gym's
        ``StageResult``, ok, nothing new; a schema-3 record is one Gym 0.7.0 cannot read."""
        self.steps["gym_restage"] += 1
        key = data.draw(st.sampled_from(self._restageable()))
        [own] = self.store.fetch([key])
        if own.schema_version != 2:
            with pytest.raises(InvalidRecordError, match="refuses"):
                self.store.fetch([key], snapshot_type=gym_records.StagedCallSnapshot)
            return
        [snapshot] = self.store.fetch([key], snapshot_type=gym_records.StagedCallSnapshot)
        assert snapshot.digest == own.digest == self.acked[key].digest
        result = self.store.stage(gym_records.StagedCallRecord.model_validate(snapshot.model_dump()))
        assert type(result) is gym_records.StageResult
        assert (result.ok, result.staging_key) == (True, key)

    @precondition(lambda self: self.deleted_since_compact)
    @rule()
    def compact(self) -> None:
        """Give a delete's space back (only after one: compaction is not free)."""
        self.steps["compact"] += 1
        self.deleted_since_compact = False
        report = self.store.compact()
        assert report.bytes_after <= report.bytes_before + 64 * 1024  # never grows past a page or two

    @precondition(lambda self: bool(self.receipts))
    @rule()
    def reserve_an_old_inventory(self) -> None:
        """The same inventory gets the identical receipt, also after a restart."""
        self.steps["reserve_an_old_inventory"] += 1
        inventory, receipt = self.receipts[len(self.receipts) // 2]
        assert to_json(self.capture.serve_generation_cut(inventory)) == receipt

    @precondition(lambda self: self.forks < 2)  # forking is slow; twice a sequence is enough
    @rule(prompt=st.lists(st.integers(0, 2**32), min_size=1, max_size=3))
    def fork(self, prompt: list[int]) -> None:
        """A forked child stages through the parent's store; the parent sees its record."""
        self.steps["fork"] += 1
        self.forks += 1
        record = make_record(rollout_id=self._next("fork"), model_call_id="c0", prompt=prompt, weight_version=1)
        pid = os.fork()
        if pid == 0:  # the child: stage, and leave without running any of the parent's cleanup
            code = 1
            try:
                code = 0 if self.store.stage(record).ok else 2
            finally:
                os._exit(code)
        status = _wait_for(pid)
        assert status == 0, f"the forked child could not stage (exit status {status})"
        self.acked[record.staging_key] = Expected(
            record.rollout_id,
            record.model_call_id,
            digest=record.digest,
            token_ids=list(record.token_ids_delta),
            weight_version=1,
        )

    @precondition(lambda self: self.unread_endings)
    @rule()
    def linearize(self) -> None:
        """Every finished rollout linearizes to exactly its tokens, across its attempts; a failed one never."""
        self.steps["linearize"] += 1
        self.unread_endings = False
        for rollout_id, (tokens, version) in self.finished.items():
            result = self.store.linearize(rollout_id)
            [row] = result.rows
            assert row.rollout_id == rollout_id
            assert list(row.token_ids) == tokens
            assert row.weight_versions == [version]
        refusals = [(rollout_id, "capture_poisoned") for rollout_id in self.failed]
        refusals += [(rollout_id, "empty_generation") for rollout_id in self.untrainable]
        for rollout_id, code in refusals:
            try:
                self.store.linearize(rollout_id)
            except ReceiptVerificationError as exc:
                assert exc.code == code, exc
            else:
                raise AssertionError(f"rollout {rollout_id} linearized; expected {code}")

    @precondition(lambda self: self.unviewed_endings)
    @rule()
    def lineage_views(self) -> None:
        """Rollouts, call trees and policy-version views agree with what the machine finished."""
        self.steps["lineage_views"] += 1
        self.unviewed_endings = False
        summaries = self.store.rollouts()
        listed = {summary.rollout_id for summary in summaries}
        for summary in summaries:  # each rollout names exactly its retired attempts
            assert set(summary.fenced) == set(summary.attempts) & self.fenced, summary
        stale = {(call.rollout_id, call.capture_key) for call in self.store.stale(self.version + 1, 0).calls}
        for rollout_id, (attempt, generated) in self.finished_calls.items():
            assert rollout_id in listed
            lineage = self.store.lineage(rollout_id)
            assert lineage is not None
            [call] = [c for c in lineage.calls if c.capture_key == capture_key(rollout_id, attempt)]
            assert (call.state, call.generated_tokens) == ("completed", generated)
            assert (call.resumes is not None) == (attempt > 0)  # every later attempt continued a cut
            if call.resumes is not None:
                assert call.resumes.attempt < attempt
            [versions] = self.store.rollout_versions(rollout_id)
            assert versions.generated_tokens == generated  # a continued cut's tokens count once
            assert sum(self.store.version_tokens(rollout_id).values()) == generated
            if generated:  # every version so far is behind version + 1
                assert (rollout_id, capture_key(rollout_id, attempt)) in stale

    @precondition(lambda self: bool(self.fenced))
    @rule()
    def lineage_of_retired_attempts(self) -> None:
        """A retired attempt's calls are marked retired; an unfinished one is never shown in flight."""
        self.steps["lineage_of_retired_attempts"] += 1
        for rollout_id, keys in sorted(self.attempt_keys.items()):
            if not keys & self.fenced:
                continue
            lineage = self.store.lineage(rollout_id)
            assert lineage is not None
            for row in lineage.calls:
                assert row.retired == (row.capture_key in self.fenced), row
                assert not row.retired or row.state in ("completed", "failed", "retired"), row

    @rule()
    def read_only_view(self) -> None:
        """A read-only store beside the writer: the same keys and calls, and every write refused."""
        self.steps["read_only_view"] += 1
        listed = {key.staging_key: key for key in self.store.staged_keys()}
        for key, expected in self.acked.items():
            if key not in self.cleared:
                found = listed[key]
                assert (found.rollout_id, found.model_call_id) == (expected.rollout_id, expected.model_call_id)
        assert not self.cleared & set(listed)
        with open_store(self.path, read_only=True) as reader:
            assert {key.staging_key for key in reader.staged_keys()} == set(listed)
            assert reader.calls() == self.store.calls()
            with pytest.raises(ReadOnlyStoreError):
                reader.record_failure("read-only", "c0", "must not be written")
        assert self.store.call("read-only", "c0") is None

    @precondition(lambda self: self.unexported_endings)
    @rule()
    def export(self) -> None:
        """The export holds one line per finished rollout, with its tokens; refused rollouts name their code."""
        self.steps["export"] += 1
        self.unexported_endings = False
        written = io.BytesIO()
        report = self.store.export_jsonl(written)
        lines = {line["rollout_id"]: line for line in map(json.loads, written.getvalue().splitlines())}
        for rollout_id, (tokens, version) in self.finished.items():
            assert lines[rollout_id]["token_ids"] == tokens
            assert lines[rollout_id]["weight_versions"] == [version]
        codes = {failure.rollout_id: failure.code for failure in report.failures}
        for rollout_id in self.failed:
            assert codes[rollout_id] == "capture_poisoned"
        for rollout_id in self.untrainable:
            assert codes[rollout_id] == "empty_generation"
        assert report.rows == len(lines)

    @rule()
    def ship(self) -> None:
        """Ship the store at any point into the target: it then reads exactly like the store."""
        self.steps["ship"] += 1
        seen: list[tuple[int, int]] = []
        report = self.store.ship(self.target, progress=lambda done, total: seen.append((done, total)))
        assert report.ok, report.summary()
        assert report.last_seq >= self.shipped_upto and seen[-1][0] == seen[-1][1] == report.read
        self.shipped_upto = report.last_seq
        assert_target_reads_like_source(self.store, self.target)

    @rule(limit=st.integers(min_value=1, max_value=4))
    def ship_bounded(self, limit: int) -> None:
        """A ship of at most ``limit`` events: it says how many of the source's are left, and
        later ships finish the job (the ``ship`` rule checks the target then)."""
        self.steps["ship_bounded"] += 1
        report = self.store.ship(self.target, limit=limit, deadline=60.0)
        assert report.ok, report.summary()
        assert report.read <= limit and report.last_seq >= self.shipped_upto
        self.shipped_upto = report.last_seq
        with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True) as connection:
            (left,) = connection.execute("SELECT count(*) FROM events WHERE seq > ?", (report.last_seq,)).fetchone()
        connection.close()
        assert report.remaining == left
        assert report.stopped == ("limit" if left else None)

    @rule()
    def follow_then_stop(self) -> None:
        """A follower in a thread catches up while this thread reads the store, then stops when asked."""
        self.steps["follow"] += 1
        stop = threading.Event()
        outcome: list[object] = []
        follower = threading.Thread(
            target=lambda: outcome.append(self.store.follow(self.target, stop=stop, interval=0.01))
        )
        follower.start()
        try:
            deadline = time.monotonic() + JOIN_SECONDS
            while time.monotonic() < deadline:
                self.store.calls()  # a read of the same store while the follower ships from it
                if self.store.ship(self.target).read == 0:  # nothing left: the follower caught up
                    break
        finally:
            stop.set()
            follower.join(JOIN_SECONDS)
        assert not follower.is_alive(), "the follower did not stop"
        [report] = outcome
        assert report.ok and report.stopped == "stopped"  # type: ignore[attr-defined]
        self.shipped_upto = max(self.shipped_upto, report.last_seq)  # type: ignore[attr-defined]
        assert_target_reads_like_source(self.store, self.target)

    # --- invariants ----------------------------------------------------------------------------

    # --- policy workers come and go (store.coordinator) ---------------------------------------------

    @precondition(lambda self: len(self.clients) < 3)
    @rule(later=st.booleans())
    def join(self, later: bool) -> None:
        """A worker joins, a window after the last recorded join or within it (then the store
        records neither its join nor its leave: ``worker_log.EventLimit``)."""
        self.steps["join"] += 1
        if later:
            self.join_clock += worker_log.EVENT_WINDOW
        last = self.last_recorded_join
        recorded = last is None or self.join_clock - last >= worker_log.EVENT_WINDOW
        # The test process plays every worker: a lost coordinator must not SIGTERM it.
        client = WorkerClient.connect(self.coordinator.socket_path, message_timeout=5, shutdown_on_loss=False)
        if recorded:
            self.last_recorded_join = self.join_clock
            self.clients.append((client, len(self.worker_states)))
            self.worker_states.append("connected")  # logged before register was answered
        else:
            self.clients.append((client, None))

    @precondition(lambda self: bool(self.clients))
    @rule(data=st.data(), clean=st.booleans())
    def leave(self, data: st.DataObject, clean: bool) -> None:
        """A worker stops cleanly, or is lost without a goodbye (its connection just drops)."""
        self.steps["stop" if clean else "lose"] += 1
        client, position = self.clients.pop(data.draw(st.integers(0, len(self.clients) - 1)))
        if clean:
            client.stop()
        else:
            client._peer.close()  # type: ignore[union-attr]  # no goodbye: as if the process died
        if position is not None:
            self.worker_states[position] = "stopped" if clean else "lost"
        # The coordinator logs a leave as it sees the connection close: give it a moment.
        wait_for(lambda: [w.state for w in self.store.workers()] == self.worker_states)
        wait_for(lambda: self.coordinator.status()["connected"] == len(self.clients))

    @invariant()
    def acknowledged_keys_fetch_as_their_records(self) -> None:
        if not self.acked:
            return
        keys = sorted(self.acked)
        for key, snapshot in zip(keys, self.store.fetch(keys), strict=True):
            expected = self.acked[key]
            assert snapshot.staging_key == f"{snapshot.rollout_id}/{snapshot.model_call_id}" or key.startswith("__")
            assert (snapshot.rollout_id, snapshot.model_call_id) == (expected.rollout_id, expected.model_call_id)
            if expected.digest is not None:
                assert snapshot.digest == expected.digest
            if expected.token_ids is not None:
                assert list(snapshot.token_ids_delta) == expected.token_ids
            if expected.weight_version is not None:
                assert snapshot.weight_version == expected.weight_version

    @invariant()
    def cleared_keys_are_gone(self) -> None:
        for key in self.cleared:
            try:
                self.store.fetch([key])
            except UnknownKeyError:
                continue
            raise AssertionError(f"withdrawn key {key!r} is still served")

    @invariant()
    def fences_refuse_late_writes_and_deleted_keys_are_gone(self) -> None:
        for key in sorted(self.fenced):
            late = make_record(rollout_id=key, model_call_id=self._next("late"), weight_version=1)
            try:
                self.store.stage(late)
            except RolloutFencedError:
                continue
            raise AssertionError(f"a late write for retired {key!r} was accepted")
        for staging_key in sorted(self.deleted):
            try:
                self.store.fetch([staging_key])
            except UnknownKeyError:
                continue
            raise AssertionError(f"deleted key {staging_key!r} is still served")

    @invariant()
    def ledger_manifests_hold_the_committed_rows(self) -> None:
        ledger = self.store.ledger()
        for capture, rows in sorted(self.ledger_rows.items()):
            if capture in self.fenced:
                try:
                    ledger.manifest(capture)
                except RolloutFencedError:
                    continue
                raise AssertionError(f"the manifest of retired {capture!r} was served")
            assert ledger.manifest(capture).records == rows
            assert ledger.has_rows(capture)

    @invariant()
    def projections_equal_a_replay(self) -> None:
        report = self.store.replay()
        assert report.ok, report.summary()

    @invariant()
    def the_audit_is_ok(self) -> None:
        """An operator's audit, with a progress bar: it reaches the whole log and finds nothing."""
        seen: list[tuple[int, int]] = []
        report = self.store.audit(progress=lambda done, total: seen.append((done, total)))
        assert report.ok, report.summary()
        assert seen[-1] == (report.counts["events"], report.counts["events"])
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)

    @invariant()
    def the_workers_projection_follows_the_workers(self) -> None:
        assert [w.state for w in self.store.workers()] == self.worker_states
        assert self.coordinator.status()["connected"] == len(self.clients)

    def shipped_events_stay_shipped_once(self) -> None:
        """The target holds one event per source event shipped so far, each under its identity."""
        with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True) as connection:
            query = "SELECT count(*) FROM events WHERE seq <= ?"
            (source_events,) = connection.execute(query, (self.shipped_upto,)).fetchone()
        connection.close()
        with sqlite3.connect(f"file:{os.path.join(self.folder, 'target.db')}?mode=ro", uri=True) as connection:
            (identities,) = connection.execute("SELECT count(*) FROM shipped_events").fetchone()
            (events,) = connection.execute("SELECT count(*) FROM events").fetchone()
        connection.close()
        assert identities == source_events and events <= identities

    @invariant()
    def sequence_numbers_only_grow(self) -> None:
        with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True) as connection:
            (last,) = connection.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
        connection.close()
        assert last >= self.last_seq
        self.last_seq = last


def _split_capture_key(capture: str) -> tuple[str, int]:
    rollout_id, _, attempt = capture.rpartition("-a")
    if rollout_id and attempt.isdigit():
        return rollout_id, int(attempt)
    return capture, 0


def _wait_for(pid: int) -> int:
    deadline = time.monotonic() + JOIN_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


StoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STORE_MACHINE_EXAMPLES") or examples(30)),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreMachine = StoreMachine.TestCase
