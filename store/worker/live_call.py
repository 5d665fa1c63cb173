"""A live call's buffers (wire-contract 5.3): the tokens observed or pulled from its engine,
at most one frozen buffer (a cut's or a flush's, being staged) and the sealed prefix."""

from __future__ import annotations

import array
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from store.errors import CaptureError, GenerationCutError
from store.wire.columns import FloatColumn, TokenIds
from store.worker.active_call import ActiveCall


@dataclass
class FrozenBuffer:
    """The tokens a cut or a flush took out of the active buffer to stage (``owner``: which)."""

    owner: str
    sequence: int
    ids: array.array[int]
    logprobs: array.array[float]


class LiveCall:
    """The buffers of one in-flight call: active, at most one frozen, and the sealed prefix."""

    def __init__(self, call: ActiveCall, prompt: TokenIds, effective_output_limit: int | None) -> None:
        self.call = call
        self.prompt = prompt
        self.effective_output_limit = effective_output_limit
        self.lifecycle = threading.RLock()  # cut, flush, terminal and abort
        self.data = threading.Lock()  # token observation
        self.active_ids: array.array[int] = array.array("Q")
        self.active_logprobs: array.array[float] = array.array("d")
        self.buffer_sequence = 0
        self.frozen: FrozenBuffer | None = None
        self.sealed_ids: array.array[int] = array.array("Q")
        self.sealed_logprobs: array.array[float] = array.array("d")
        continuation = call.admission.generation_cut if call.generation_cut is not None else None
        self.keys: list[str] = list(continuation.staging_keys) if continuation else []
        self.own_keys: list[str] = []
        self.acknowledged: set[str] = set()
        self.restored_count = continuation.generation_token_count if continuation else 0
        # Restored, sealed, frozen and active tokens: what the output limit bounds.
        self.observed_count = self.restored_count
        # A restored cut that had finished is the whole answer (5.8): the call finished that way.
        self.finish_reason: str | None = continuation.terminal_finish_reason if continuation else None
        self.stop_reason: str | int | None = continuation.terminal_stop_reason if continuation else None
        self.observation_error: str | None = None
        self.terminal = False
        self.source: Any = None  # the LiveEngine generate() decodes this call with (``attach``)
        self.source_stops: frozenset[int] = frozenset()
        self.pulled = 0  # how many of its generated tokens are in the buffers

    @property
    def carry(self) -> int:
        """Delta positions before this call's newly generated tokens."""
        return len(self.prompt) - self.call.admission.prev_len

    def observe(
        self, ids: Sequence[int], logprobs: Sequence[float], finish: str | None, stop: str | int | None
    ) -> None:
        # The decode loop's call, once a token: its common shape (one token, no finish reason)
        # touches as little as it can, as the engine's own work has the caches between calls.
        if finish is None and len(ids) == 1 and len(logprobs) == 1:
            with self.data:
                if self.source is not None:
                    self._attached_error()
                if self.terminal:
                    return
                limit = self.effective_output_limit
                if limit is not None and self.observed_count + 1 > limit:
                    self._past_limit(self.observed_count + 1, limit)
                    return
                logprobs_before = len(self.active_logprobs)
                try:  # array.append takes what array() would: an int id, a float(-able) log-prob
                    self.active_logprobs.append(logprobs[0])
                    self.active_ids.append(ids[0])
                except (TypeError, OverflowError, ValueError) as exc:
                    del self.active_logprobs[logprobs_before:]
                    self.observation_error = f"unreadable engine output: {exc}"
                    return
                self.observed_count += 1
            return
        with self.data:
            if self.source is not None:
                self._attached_error()
            self._append(ids, logprobs, finish, stop)

    def _append(
        self, ids: Sequence[int], logprobs: Sequence[float], finish: str | None, stop: str | int | None
    ) -> None:
        """Observed tokens into the active buffer, or the observation error they are (``data`` held)."""
        if self.terminal:
            return
        if len(ids) != len(logprobs):
            self.observation_error = "unaligned delta output: token ids and log-probs differ in length"
            return
        if finish is not None and finish not in ("stop", "length"):
            self.observation_error = f"unsupported finish reason {finish!r}"
            return
        if finish is not None and self.finish_reason is not None and finish != self.finish_reason:
            self.observation_error = f"conflicting finish reasons {self.finish_reason!r} and {finish!r}"
            return
        try:
            new_ids = array.array("Q", ids)
            new_logprobs = array.array("d", logprobs)
        except (TypeError, OverflowError, ValueError) as exc:
            self.observation_error = f"unreadable engine output: {exc}"
            return
        limit = self.effective_output_limit
        total = self.observed_count + len(new_ids)
        if limit is not None and total > limit:
            self._past_limit(total, limit)
            return
        self.active_ids.extend(new_ids)
        self.active_logprobs.extend(new_logprobs)
        self.observed_count = total
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, stop

    # an engine generate() decodes with: its tokens are pulled, not pushed a token at a time ----

    def attach(self, engine: Any) -> None:
        """From now on the tokens ``engine`` decodes (past those it holds now) are this call's,
        read from its ``generated_token_ids``/``generated_logprobs`` whenever the buffers are."""
        with self.data:
            if self.source is not None:
                raise CaptureError(f"{self.call} is being decoded by generate() already")
            self.source = engine
            self.source_stops = frozenset(engine.stop_token_ids)
            self.pulled = min(len(engine.generated_token_ids), len(engine.generated_logprobs))

    def detach(self, finish: str | None) -> None:
        """Every token the engine decoded is observed, with ``finish`` (one step: a cut never
        sees a stop token without its finish reason)."""
        with self.data:
            self._pull(through_stop=True)
            engine, self.source = self.source, None
            if self.observation_error is None and len(engine.generated_token_ids) != len(engine.generated_logprobs):
                self.observation_error = (
                    "unaligned engine output: its generated_token_ids and generated_logprobs differ in length"
                )
            if finish is not None:
                self._append((), (), finish, None)

    def _pull(self, through_stop: bool = False) -> None:
        """The engine's tokens not yet in the buffers (``data`` held).  A stop token waits for
        ``detach``, which records it with its finish reason."""
        engine = self.source
        if engine is None or self.terminal or self.observation_error is not None:
            return
        ids, logprobs = engine.generated_token_ids, engine.generated_logprobs
        count = min(len(ids), len(logprobs))  # the engine appends an id, then its log-prob
        if count <= self.pulled:
            return
        new_ids = ids[self.pulled : count]
        if not through_stop and self.source_stops:
            for index, token in enumerate(new_ids):
                if token in self.source_stops:
                    count = self.pulled + index
                    new_ids = new_ids[:index]
                    break
        self._append(new_ids, logprobs[self.pulled : count], None, None)
        self.pulled = count

    def _attached_error(self) -> None:
        raise CaptureError(
            f"{self.call} is being decoded by generate(), which observes its engine's tokens itself; "
            "observe() it once generate() returns"
        )

    def _past_limit(self, total: int, limit: int) -> None:
        self.observation_error = (
            f"{total} generated tokens observed, past the call's output limit {limit} "
            "(track() was given the call's whole limit; the engine must stop at it)"
        )

    def observed(self) -> tuple[TokenIds, FloatColumn]:
        """Every token observed since ``track`` (sealed, frozen, active; not the restored prefix)."""
        with self.data:
            self._pull()
            parts = [self.sealed_ids, *([self.frozen.ids] if self.frozen is not None else []), self.active_ids]
            lp_parts = [
                self.sealed_logprobs,
                *([self.frozen.logprobs] if self.frozen is not None else []),
                self.active_logprobs,
            ]
            ids = np.concatenate([np.frombuffer(part, np.uint64) for part in parts])
            lps = np.concatenate([np.frombuffer(part, np.float64) for part in lp_parts])
        return TokenIds(ids), FloatColumn.coerce(lps, "observed log-probs")

    def unstaged(self) -> int:
        with self.data:
            self._pull()
            return len(self.active_ids)

    def freeze(self, owner: str) -> FrozenBuffer:
        with self.data:
            self._pull()
            if self.frozen is not None:
                raise GenerationCutError(f"a buffer of this call is already frozen by {self.frozen.owner}")
            self.frozen = FrozenBuffer(owner, self.buffer_sequence, self.active_ids, self.active_logprobs)
            self.active_ids, self.active_logprobs = array.array("Q"), array.array("d")
            self.buffer_sequence += 1
            return self.frozen

    def cumulative(self) -> tuple[TokenIds, FloatColumn]:
        """Everything generated so far that a cut would make durable: sealed + frozen."""
        assert self.frozen is not None
        ids = np.concatenate([np.frombuffer(self.sealed_ids, np.uint64), np.frombuffer(self.frozen.ids, np.uint64)])
        lps = np.concatenate(
            [np.frombuffer(self.sealed_logprobs, np.float64), np.frombuffer(self.frozen.logprobs, np.float64)]
        )
        return TokenIds(ids), FloatColumn.coerce(lps, "generated log-probs")

    def seal(self, key: str | None) -> None:
        with self.data:
            assert self.frozen is not None
            self.sealed_ids.extend(self.frozen.ids)
            self.sealed_logprobs.extend(self.frozen.logprobs)
            self.frozen = None
            if key is not None:
                self.keys.append(key)
                self.own_keys.append(key)

    def rollback(self) -> None:
        with self.data:
            if self.frozen is None:
                return
            self.frozen.ids.extend(self.active_ids)
            self.frozen.logprobs.extend(self.active_logprobs)
            self.active_ids, self.active_logprobs = self.frozen.ids, self.frozen.logprobs
            self.buffer_sequence = self.frozen.sequence  # the buffer was given back: its number is free
            self.frozen = None
