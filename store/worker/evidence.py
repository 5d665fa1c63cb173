"""Completion evidence: what a cut needs to acknowledge a call that completed before the cut
reached it (wire-contract 5.5), used at most ``ttl`` seconds after the completion, on the
capture's clock.

Memory is only a cache of the log (the terminal record keeps the call's limit and finish
reason, and its event's time is the completion's time on the same clock), so evidence is
dropped from memory freely: past its TTL, oldest first, and beyond ``HELD_MAX`` entries.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from store.queries.reads import StoredCompletion
from store.store import Store
from store.wire.digest import EMPTY_EXTRAS_DIGEST

CallKey = tuple[str, str]  # (capture key, model call id)


@dataclass
class Evidence:
    """How one call completed: its terminal key and digest, generated count and finish."""

    staging_key: str
    digest: str
    extras_digest: str
    generated_tokens: int
    effective_output_limit: int | None
    finish_reason: str | None
    stop_reason: str | int | None
    at: float  # when it completed, on the capture's clock (its event's time in the log)

    @property
    def restorable(self) -> bool:
        """A restore rebuilds the terminal record with extras null (5.6): with extras it cannot match."""
        return (
            self.extras_digest == EMPTY_EXTRAS_DIGEST
            and self.effective_output_limit is not None
            and self.finish_reason is not None
        )

    @classmethod
    def stored(cls, completion: StoredCompletion) -> Evidence:
        return cls(
            completion.staging_key,
            completion.digest,
            completion.extras_digest,
            completion.generated_tokens,
            completion.effective_output_limit,
            completion.finish_reason,
            completion.stop_reason,
            completion.recorded_at,
        )


class EvidenceCache:
    """The evidence of recent completions, in completion order, read back from the log on a miss."""

    HELD_MAX = 4096  # entries held in memory at most; older evidence is read from the log

    def __init__(self, store: Store, ttl: float) -> None:
        self._store = store
        self._ttl = ttl
        self._held: OrderedDict[CallKey, Evidence] = OrderedDict()
        self._lock = threading.Lock()

    def fresh(self, at: float, now: float) -> bool:
        """At most the TTL old (exactly the TTL old still counts)."""
        return now - at <= self._ttl

    def put(self, key: CallKey, evidence: Evidence) -> None:
        with self._lock:
            self._held.pop(key, None)  # re-inserted last: the order stays completion order
            self._held[key] = evidence
            self._prune(evidence.at)

    def get(self, key: CallKey, now: float) -> Evidence | None:
        """Fresh evidence of the call: from memory, else from the log (so a restarted worker can
        still acknowledge a call its predecessor completed); None past the TTL."""
        with self._lock:
            self._prune(now)
            evidence = self._held.get(key)
            if evidence is not None and not self.fresh(evidence.at, now):  # the clock stepped back
                del self._held[key]
                evidence = None
        if evidence is None:
            stored = self._store.completion(*key)
            if stored is not None and self.fresh(stored.recorded_at, now):
                evidence = Evidence.stored(stored)
        return evidence

    def prune(self, now: float) -> None:
        with self._lock:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """(Holding the lock.)  Drop expired evidence and what is over the bound, oldest first;
        amortised O(1) a completion, since each entry is dropped once."""
        held = self._held
        while held:
            oldest = next(iter(held.values()))
            if self.fresh(oldest.at, now) and len(held) <= self.HELD_MAX:
                break
            held.popitem(last=False)

    def held(self) -> dict[CallKey, Evidence]:
        """A copy of what is held in memory now (the log holds the rest)."""
        with self._lock:
            return dict(self._held)
