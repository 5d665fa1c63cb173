"""The complete-record transport in the random-sequence state machine (issue 32, item 7).

``TransportRules`` is mixed into ``test_state_machine.StoreMachine``: Gym's put -> freeze ->
drop cycle, intents and incomplete marks through ``TokenTransport`` on the machine's store,
interleaved with everything else the machine does (crashes reopen the store, ships copy the
transport's events, forks, retention), against a model of each rollout: its entries, intents,
mark, snapshot, drop and version.  Every outcome is the model's (written, a no-op, or the
specific refusal with nothing written), and after every step each rollout's entries read back
byte for byte (``entries_now``); replay and the audit (the machine's own invariants) cover the
transport's projections.  Entries are put as JSON mappings, so the machine runs without Gym.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from store import (
    EntryConflictError,
    RolloutDroppedError,
    RolloutFrozenError,
    StoreError,
    TokenTransport,
    token_digest,
)

if TYPE_CHECKING:
    from test_state_machine import StoreMachine

CALLS = ("call-0", "call-1", "call-2")


@dataclass
class TransportModel:
    """What one rollout of the transport must hold."""

    entries: dict[str, str] = field(default_factory=dict)  # call -> sha of its sorted JSON
    intents: set[str] = field(default_factory=set)  # calls begun without an entry yet
    incomplete: bool = False
    snapshot: str | None = None  # the snapshot id once frozen
    dropped: bool = False
    version: int = 0


def entry_json(rollout_id: str, call: str, seed: int) -> dict[str, Any]:
    """A ``TokenEntry``'s JSON form, its token digest Gym's."""
    prompt = [seed % 1000, 7, 8]
    generation = [seed % 97, 3]
    return {
        "schema_version": 1,
        "rollout_id": rollout_id,
        "model_call_id": call,
        "model": "machine",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.1, -0.25],
        "output_items": [],
        "created_at": 1700000000.0 + seed,
        "cum_len": len(prompt) + len(generation),
        "digest": token_digest(prompt + generation),
        "parent_resolution": "root",
    }


def sha(entry: Any) -> str:
    """The SHA-256 of the fields ``entry_json`` sets (read back through Gym, an entry also has
    the defaults of the fields it left out)."""
    data = entry.model_dump(mode="json") if hasattr(entry, "model_dump") else entry
    shown = {name: data[name] for name in ENTRY_FIELDS}
    return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()


ENTRY_FIELDS = tuple(entry_json("r", "c", 0))


class TransportRules:
    """The transport's rules and invariant (uses the machine's ``store`` and ``_next``)."""

    transport_rollouts: dict[str, TransportModel]

    def _transport(self: StoreMachine) -> TokenTransport:
        return TokenTransport(self.store)  # over the store the machine has open now (reopened by crashes)

    def _transport_rollout(self: StoreMachine, data: st.DataObject) -> str:
        if not hasattr(self, "transport_rollouts"):
            self.transport_rollouts = {}
        known = sorted(self.transport_rollouts)
        if known and data.draw(st.booleans(), label="existing rollout"):
            return data.draw(st.sampled_from(known), label="rollout")
        rollout_id = self._next("tr-")
        self.transport_rollouts[rollout_id] = TransportModel()
        return rollout_id

    def _expect(self: StoreMachine, action: Any, refusal: type[StoreError] | None) -> Any:
        """Run ``action``; it must raise ``refusal`` (and write nothing) or return."""
        before = self.store.replay().events if refusal is not None else None
        if refusal is None:
            return action()
        try:
            action()
        except refusal:
            assert self.store.replay().events == before, "a refused transport call wrote"
            return None
        raise AssertionError(f"expected {refusal.__name__}")

    @rule(data=st.data(), call=st.sampled_from(CALLS), seed=st.integers(0, 3))
    def transport_put(self: StoreMachine, data: st.DataObject, call: str, seed: int) -> None:
        rollout_id = self._transport_rollout(data)
        model = self.transport_rollouts[rollout_id]
        entry = entry_json(rollout_id, call, seed)
        held = model.entries.get(call)
        refusal: type[StoreError] | None = None
        if model.dropped:
            refusal = RolloutDroppedError
        elif held is not None and held != sha(entry):
            refusal = EntryConflictError
        elif held is None and model.snapshot is not None:
            refusal = RolloutFrozenError
        written = self._expect(lambda: self._transport().put_now(entry), refusal)
        if refusal is None:
            assert written is (held is None)
            if written:
                model.entries[call] = sha(entry)
                model.intents.discard(call)
                model.version += 1

    @rule(data=st.data(), call=st.sampled_from(CALLS))
    def transport_begin_call(self: StoreMachine, data: st.DataObject, call: str) -> None:
        rollout_id = self._transport_rollout(data)
        model = self.transport_rollouts[rollout_id]
        refusal = RolloutDroppedError if model.dropped else RolloutFrozenError if model.snapshot else None
        self._expect(lambda: self._transport().begin_call_now(rollout_id, call), refusal)
        if refusal is None and call not in model.entries and call not in model.intents:
            model.intents.add(call)
            model.version += 1

    @rule(data=st.data(), call=st.sampled_from(("", *CALLS)))
    def transport_mark_incomplete(self: StoreMachine, data: st.DataObject, call: str) -> None:
        rollout_id = self._transport_rollout(data)
        model = self.transport_rollouts[rollout_id]
        refusal = RolloutDroppedError if model.dropped else None
        self._expect(lambda: self._transport().mark_incomplete_now(rollout_id, call), refusal)
        if refusal is None:
            model.incomplete = True
            model.version += 1

    @rule(data=st.data())
    def transport_freeze(self: StoreMachine, data: st.DataObject) -> None:
        rollout_id = self._transport_rollout(data)
        model = self.transport_rollouts[rollout_id]
        if model.dropped:
            self._expect(lambda: self._transport().freeze_now(rollout_id), RolloutDroppedError)
            return
        snapshot = self._transport().freeze_now(rollout_id)
        if model.snapshot is None:
            model.version += 1
            model.snapshot = snapshot.snapshot_id
        assert (snapshot.snapshot_id, snapshot.version) == (model.snapshot, model.version)
        assert {sha(entry) for entry in snapshot.entries} == set(model.entries.values())
        assert snapshot.incomplete == (model.incomplete or bool(model.intents))

    @precondition(
        lambda self: any(m.snapshot and not m.dropped for m in getattr(self, "transport_rollouts", {}).values())
    )
    @rule(data=st.data(), stale=st.sampled_from(["exact", "version", "snapshot"]))
    def transport_drop(self: StoreMachine, data: st.DataObject, stale: str) -> None:
        frozen = sorted(r for r, m in self.transport_rollouts.items() if m.snapshot and not m.dropped)
        rollout_id = data.draw(st.sampled_from(frozen), label="frozen rollout")
        model = self.transport_rollouts[rollout_id]
        assert model.snapshot is not None
        snapshot_id, version = model.snapshot, model.version
        if stale == "version":
            version -= 1
        elif stale == "snapshot":
            snapshot_id = "f" * 32
        expected = stale == "exact"
        assert self._transport().drop_now(rollout_id, snapshot_id=snapshot_id, version=version) is expected
        if expected:
            model.dropped = True
            model.version += 1

    @invariant()
    def transport_entries_read_back(self: StoreMachine) -> None:
        transport = self._transport()
        for rollout_id, model in getattr(self, "transport_rollouts", {}).items():
            entries = transport.entries_now(rollout_id)
            held = {(e["model_call_id"] if isinstance(e, dict) else e.model_call_id): sha(e) for e in entries}
            assert held == model.entries, rollout_id
