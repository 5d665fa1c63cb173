"""A live engine the capture drives: the protocol a decode loop implements, and the loop itself.

``LiveEngine`` is what a worker's engine offers: ``prefill`` a prompt, ``step`` one token at a
time (its id and the natural-log probability the engine sampled it with), and the tokens and
log-probs generated since the prefill.  ``generate`` decodes a tracked call with it within the
call's output limit, making no store call a token: a cut served from another thread (or a
flush, or the completion) reads the engine's tokens itself, so it holds everything decoded so
far; ``decode`` prefills, generates to the end and
completes the call from what was observed.  A continued call is decoded the same way: its
tracked prompt is the continuation's engine prompt (prefix + restored tokens), so the engine
re-prefills it and decodes only the rest.

``store.adapters.transformers.TransformersEngine`` implements the protocol on a Hugging Face
causal LM with a KV cache; ``store.demo.engine.ToyLiveEngine`` on a seeded generator.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from store.errors import CaptureError
from store.wire.records import CommitCoords
from store.worker.active_call import ActiveCall, check_active
from store.worker.capture import RolloutTokenCapture


@runtime_checkable
class LiveEngine(Protocol):
    """A decoding engine, one sequence at a time."""

    @property
    def stop_token_ids(self) -> Collection[int]:
        """Token ids that end a call (``finish_reason="stop"``); they are part of its output."""
        ...

    def prefill(self, prompt_token_ids: Sequence[int]) -> None:
        """Start a sequence from this prompt (any earlier sequence is dropped)."""
        ...

    def step(self) -> tuple[int, float]:
        """Decode the next token: its id and log-prob (natural log, from the log-softmax of the
        logits it was sampled from)."""
        ...

    @property
    def generated_token_ids(self) -> Sequence[int]:
        """Tokens decoded since the last ``prefill``: only growing during a call, and read by
        the capture from another thread while ``step`` runs (a list appended to will do)."""
        ...

    @property
    def generated_logprobs(self) -> Sequence[float]:
        """Their log-probs, aligned with ``generated_token_ids`` (each appended with or after its id)."""
        ...


@dataclass(frozen=True)
class DecodingPlan:
    """What the engine is to do for a tracked call: the prompt to prefill and how far to go."""

    prompt_token_ids: Sequence[int]
    remaining_tokens: int  # the call's whole limit less its restored and already decoded tokens
    finished: str | None  # a restored cut that is the whole answer: its finish reason


def decoding_plan(capture: RolloutTokenCapture, call: ActiveCall) -> DecodingPlan:
    """The engine prompt and budget of a tracked call (``track`` set both)."""
    check_active(call)
    live = capture.cuts.live(call)
    if live is None:
        raise CaptureError(f"{call} is not tracked: track() it before decoding it with an engine")
    if live.effective_output_limit is None:
        raise CaptureError(f"{call} was tracked without an output limit: the engine needs one", "output_limit")
    decoded = len(live.observed()[0])
    remaining = max(0, live.effective_output_limit - live.restored_count - decoded)
    finished = live.finish_reason
    if finished is None and remaining == 0:
        finished = "length"
    return DecodingPlan(live.prompt, 0 if finished else remaining, finished)


def generate(
    capture: RolloutTokenCapture,
    call: ActiveCall,
    engine: LiveEngine,
    *,
    prefill: bool = True,
    max_tokens: int | None = None,
    on_token: Callable[[int, float], None] | None = None,
) -> str | None:
    """Decode a tracked call with ``engine``; its tokens are observed from the engine's lists.

    Prefills the call's engine prompt first (``prefill=False`` goes on from where an earlier
    ``generate`` stopped), then steps until a stop token, the call's output limit, or
    ``max_tokens`` more tokens.  Returns the finish reason (``stop`` or ``length``, also
    observed) when the call finished, None when ``max_tokens`` stopped it first.
    ``on_token(id, logprob)`` runs after each token is observed (a cut would hold it).  While it
    runs, ``observe`` refuses the call: the engine's tokens are taken from its lists.
    """
    todo = decoding_plan(capture, call)
    if todo.finished is not None:
        capture.observe(call, [], [], finish_reason=todo.finished)
        return todo.finished
    if prefill:
        engine.prefill(todo.prompt_token_ids)
    stops = engine.stop_token_ids
    budget = todo.remaining_tokens if max_tokens is None else min(max_tokens, todo.remaining_tokens)
    # The decode loop makes no store call a token: a cut, a flush or a completion reads what the
    # engine decoded from its generated_token_ids/generated_logprobs (attach), under the call's lock.
    live = capture.cuts.attach(call, engine)
    finish: str | None = None
    try:
        for _ in range(budget):
            token, logprob = engine.step()
            if token in stops:
                finish = "stop"
                break
            if on_token is not None:
                on_token(token, logprob)
        else:
            if budget == todo.remaining_tokens:
                finish = "length"
    except BaseException:
        live.detach(None)  # what it decoded is observed; the error is the caller's
        raise
    live.detach(finish)
    if finish == "stop" and on_token is not None:
        on_token(token, logprob)
    return finish


def decode(
    capture: RolloutTokenCapture,
    call: ActiveCall,
    engine: LiveEngine,
    *,
    on_token: Callable[[int, float], None] | None = None,
) -> CommitCoords:
    """Prefill, decode the call to its end and complete it from what was observed."""
    generate(capture, call, engine, on_token=on_token)
    return capture.complete_observed(call)
