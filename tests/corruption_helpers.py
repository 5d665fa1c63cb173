"""A small store with one event of every kind, and probes that judge every read after damage.

Shared by ``tests/test_corruption.py`` and ``tools/soak_corruption.py``.  A probe reads every
staged key (``fetch`` and ``fetch_chunks``), every completion, the cut receipt and the replay,
and sorts each outcome: the right answer, a ``StoreError`` (detected), or a violation (another
key's record, a raw exception, a wrong answer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from factories import make_record

from store import (
    CaptureAdmission,
    CorruptRecordError,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    StagedCallSnapshot,
    Store,
    StoreError,
)
from store.queries import StoredCompletion
from store.replay import ReplayReport


@dataclass(frozen=True)
class Expected:
    """What an undamaged store answers."""

    records: dict[str, tuple[str, str, str, list[int]]]  # key -> rollout, call, digest, token ids
    completions: dict[tuple[str, str], StoredCompletion]
    receipt: tuple[str, str, bytes]  # checkpoint id, inventory digest, receipt JSON


def populate(store: Store) -> Expected:
    """Records staged directly and through a capture: admissions, a cut chunk and its receipt,
    terminal records (one with completion evidence) and a failed call."""
    records = [
        make_record(rollout_id="r1", model_call_id="c1", extras={"tool": "search", "n": [1, 2]}),
        make_record(rollout_id="r1", model_call_id="c2", generated=(30, 31, 32)),
        make_record(rollout_id="r2", model_call_id="c1", generated=(2**40, 7)),
    ]
    for record in records:
        assert store.stage(record).ok
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 3)
    try:
        call = capture.begin_call(CaptureAdmission(rollout_id="r3", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=[10, 11], effective_output_limit=8)
        capture.observe(call, [12, 13], [-0.5, -0.25])
        ticket = GenerationCutPrefix(
            ticket_id="t-r3-c0", rollout_id="r3", attempt_index=0, model_call_id="c0", admitted_at=1.0
        )
        inventory = GenerationCutInventory.build(
            checkpoint_id="checkpoint-1", server_name="policy", active_prefixes=[ticket]
        )
        capture.serve_generation_cut(inventory)
        capture.complete_call(
            call, prompt_token_ids=[10, 11], generated_token_ids=[12, 13, 14], generated_logprobs=[-0.5, -0.25, -1.0]
        )
        failed = capture.begin_call(CaptureAdmission(rollout_id="r4", model_call_id="c0", mode="text"))
        capture.fail_call(failed, reason="engine error")
    finally:
        capture.close()
    keys = [f"{call.rollout_id}/{call.model_call_id}" for call in store.calls() if call.state == "completed"]
    keys += ["__generation_cut__/checkpoint-1/r3/c0/0"]
    snapshots = store.fetch(keys)
    completion = store.completion("r3", "c0")
    receipt = store.cut_receipt("checkpoint-1", inventory.inventory_digest)
    assert completion is not None and receipt is not None and store.replay().ok
    return Expected(
        records={key: _identity(snapshot) for key, snapshot in zip(keys, snapshots, strict=True)},
        completions={("r3", "c0"): completion},
        receipt=("checkpoint-1", inventory.inventory_digest, receipt),
    )


def _identity(snapshot: StagedCallSnapshot) -> tuple[str, str, str, list[int]]:
    return snapshot.rollout_id, snapshot.model_call_id, snapshot.digest, snapshot.token_ids_delta.tolist()


@dataclass
class Outcome:
    """What one probe saw: reads that detected damage (by name) and violations (must stay empty)."""

    detected: dict[str, BaseException] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Reads that answered "nothing" for what exists: lost, not misreported.  Damage to an index
    # (not the row) can do it without any read noticing; only SQLite's integrity_check sees that.
    missing: list[str] = field(default_factory=list)
    replay_differs: bool = False

    def read(self, name: str, action: Callable[[], Any], check: Callable[[Any], str | None]) -> None:
        try:
            value = action()
        except StoreError as exc:
            self.detected[name] = exc
            return
        except Exception as exc:  # a raw error out of a public entry point: a violation
            self.violations.append(f"{name}: raw {type(exc).__name__}: {exc}")
            return
        if isinstance(value, ReplayReport):
            self.replay_differs = not value.ok
        problem = check(value)
        if problem is not None:
            self.violations.append(f"{name}: {problem}")

    def corrupt(self, name: str) -> bool:
        return isinstance(self.detected.get(name), CorruptRecordError)

    @property
    def found(self) -> bool:
        """Whether any read noticed damage (an error, or a replay that differs)."""
        return bool(self.detected) or self.replay_differs


def probe(store: Store, expected: Expected, *, each_key: bool = True) -> Outcome:
    """Every read of the sample store; each answer is right, a StoreError, or a violation.

    ``each_key=False`` first fetches all keys at once and reads them one by one only when that fails.
    """
    outcome = Outcome()
    if not each_key:
        together = Outcome()
        keys = list(expected.records)
        wanted = [expected.records[key] for key in keys]
        together.read("fetch", lambda: [_identity(s) for s in store.fetch(keys)], _all_same(wanted))
        together.read("fetch_chunks", lambda: [_identity(s) for s, _ in store.fetch_chunks(keys)], _all_same(wanted))
        outcome.violations += together.violations
        each_key = bool(together.detected)
    for key, identity in expected.records.items() if each_key else ():
        outcome.read(f"fetch {key}", lambda key=key: store.fetch([key])[0], _same_record(identity))  # type: ignore[misc]
        outcome.read(
            f"fetch_chunks {key}",
            lambda key=key: store.fetch_chunks([key])[0][0],  # type: ignore[misc]
            _same_record(identity),
        )
    for (rollout_id, model_call_id), completion in expected.completions.items():
        outcome.read(
            f"completion {rollout_id}/{model_call_id}",
            lambda r=rollout_id, c=model_call_id: store.completion(r, c),  # type: ignore[misc]
            lambda found, completion=completion: _same_completion(outcome, found, completion),  # type: ignore[misc]
        )
    checkpoint_id, inventory_digest, receipt = expected.receipt
    outcome.read(
        "cut_receipt",
        lambda: store.cut_receipt(checkpoint_id, inventory_digest),
        lambda found: _same_receipt(outcome, found, receipt),
    )
    outcome.read("calls", store.calls, lambda found: None)
    outcome.read("replay", store.replay, lambda report: None)
    return outcome


def _same_receipt(outcome: Outcome, found: bytes | None, receipt: bytes) -> str | None:
    if found is None:
        outcome.missing.append("cut_receipt")
        return None
    return None if found == receipt else f"another receipt: {found!r:.80}"


def _all_same(wanted: list[tuple[str, str, str, list[int]]]) -> Callable[[Any], str | None]:
    return lambda found: None if found == wanted else "other records than those asked"


def _same_record(identity: tuple[str, str, str, list[int]]) -> Callable[[StagedCallSnapshot], str | None]:
    def check(snapshot: StagedCallSnapshot) -> str | None:
        found = _identity(snapshot)
        return None if found == identity else f"another record: {found[:3]} instead of {identity[:3]}"

    return check


def _same_completion(outcome: Outcome, found: StoredCompletion | None, completion: StoredCompletion) -> str | None:
    if found is None:
        outcome.missing.append("completion")  # the damaged row no longer reads as one: evidence lost, nothing false
        return None
    return None if found == completion else f"another completion: {found}"
