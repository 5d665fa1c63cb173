"""The demo's engines: what each rollout's user turns are, and a ``LiveEngine`` that decodes them.

``ToyEngine`` (the default): a deterministic toy, token ids and log-probs from a generator
seeded by (seed, rollout, position, previous token); nothing to install.  ``TransformersScript``
(``--engine transformers``): the same rollouts decoded by ``store.adapters.transformers`` on a
tiny random-weight Llama built from a config (needs the ``[transformers]`` extra and torch).

Every value depends only on the seed, the rollout and the tokens before it, never on the
process or the policy version, so a call continued after a crash (re-prefilled with prompt +
restored prefix) must end token-identical to the same call decoded without interruption; the
demo checks exactly that (``expected``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from store.worker.engine import LiveEngine

VOCAB = 32_000
TINY_VOCAB = 512  # tiny_llama's vocabulary
USER_TOKENS = (4, 16)  # a user/tool turn's length range: the carried prompt of each call


class Script(Protocol):
    """The rollouts a demo runs: their user turns, an engine per rollout, and the uninterrupted run."""

    @property
    def seed(self) -> int: ...
    @property
    def tokens(self) -> int:
        """Tokens each call generates."""
        ...

    @property
    def turns(self) -> int:
        """Calls per rollout."""
        ...

    @property
    def logprob_tolerance(self) -> float:
        """How far a continued call's log-probs may be from an uninterrupted run's."""
        ...

    @property
    def name(self) -> str:
        """The ``--engine`` name that makes this script (``script_for``)."""
        ...

    def user_turn(self, rollout: int, turn: int) -> list[int]: ...
    def live(self, rollout: int) -> LiveEngine: ...
    def expected(self, rollout: int) -> tuple[list[int], list[float], list[float]]: ...


def _user_turn(seed: int, rollout: int, turn: int, vocab: int) -> list[int]:
    rng = np.random.default_rng([seed, rollout, turn, 0])
    length = int(rng.integers(*USER_TOKENS))
    return [int(token) for token in rng.integers(3, vocab, size=length)]


def uninterrupted(script: Script, rollout: int) -> tuple[list[int], list[float], list[float]]:
    """The whole rollout decoded without interruption: token ids, mask, log-probs (as stored: float32)."""
    ids: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    engine = script.live(rollout)
    for turn in range(script.turns):
        user = script.user_turn(rollout, turn)
        engine.prefill([*ids, *user])
        for _ in range(script.tokens):
            engine.step()
        generated = list(engine.generated_token_ids)
        ids += user + generated
        mask += [0.0] * len(user) + [1.0] * len(generated)
        logprobs += [0.0] * len(user) + [float(np.float32(lp)) for lp in engine.generated_logprobs]
    return ids, mask, logprobs


class ToyLiveEngine:
    """A ``LiveEngine`` whose next token is drawn from (seed, rollout, position, previous token)."""

    def __init__(self, seed: int, rollout: int) -> None:
        self._key = (seed, rollout)
        self._context: list[int] = []
        self._ids: list[int] = []
        self._logprobs: list[float] = []

    @property
    def stop_token_ids(self) -> Collection[int]:
        return ()

    @property
    def generated_token_ids(self) -> Sequence[int]:
        return self._ids

    @property
    def generated_logprobs(self) -> Sequence[float]:
        return self._logprobs

    def prefill(self, prompt_token_ids: Sequence[int]) -> None:
        self._context = [int(token) for token in prompt_token_ids]
        self._ids, self._logprobs = [], []

    def step(self) -> tuple[int, float]:
        position = len(self._context)
        previous = self._context[-1] if self._context else 0
        rng = np.random.default_rng([*self._key, position, previous])
        token = int(rng.integers(3, VOCAB))
        logprob = float(np.float32(-rng.exponential(1.0)))  # binary32 values, as the store keeps them
        self._context.append(token)
        self._ids.append(token)
        self._logprobs.append(logprob)
        return token, logprob


@dataclass(frozen=True)
class ToyEngine:
    """The default script: toy user turns and a ``ToyLiveEngine`` per rollout."""

    seed: int
    tokens: int
    turns: int
    logprob_tolerance: float = 0.0  # toy log-probs are exact

    @property
    def name(self) -> str:
        return "toy"

    def user_turn(self, rollout: int, turn: int) -> list[int]:
        """The new prompt tokens of ``turn`` (the whole prompt of turn 0)."""
        return _user_turn(self.seed, rollout, turn, VOCAB)

    def live(self, rollout: int) -> LiveEngine:
        return ToyLiveEngine(self.seed, rollout)

    def expected(self, rollout: int) -> tuple[list[int], list[float], list[float]]:
        return uninterrupted(self, rollout)


@dataclass(frozen=True)
class TransformersScript:
    """``--engine transformers``: a tiny random-weight Llama (seeded, built from a config) decodes."""

    seed: int
    tokens: int
    turns: int
    # Measured at most ~2e-5 (a prefill sums in another order than the KV-cached steps), in float32.
    logprob_tolerance: float = 2e-4
    _model: list[Any] = field(default_factory=list, compare=False, repr=False)

    @property
    def name(self) -> str:
        return "transformers"

    def user_turn(self, rollout: int, turn: int) -> list[int]:
        return _user_turn(self.seed, rollout, turn, TINY_VOCAB)

    def live(self, rollout: int) -> LiveEngine:
        from store.adapters.transformers import TransformersEngine

        engine: LiveEngine = TransformersEngine(self.model(), seed=self.seed * 1_000_003 + rollout)
        return engine

    def expected(self, rollout: int) -> tuple[list[int], list[float], list[float]]:
        return uninterrupted(self, rollout)

    def model(self) -> Any:
        """The model, built once per process (the same seed gives the same weights in every process)."""
        if not self._model:
            import torch

            from store.adapters.transformers import tiny_llama

            torch.set_num_threads(1)  # a tiny model decodes fastest on one thread, and leaves cores to the others
            self._model.append(tiny_llama(self.seed))
        return self._model[0]


def script_for(engine: str, seed: int, tokens: int, turns: int) -> Script:
    """The demo's script by ``--engine`` name."""
    if engine == "toy":
        return ToyEngine(seed, tokens, turns)
    if engine == "transformers":
        return TransformersScript(seed, tokens, turns)
    raise ValueError(f"unknown engine {engine!r} (toy or transformers)")
