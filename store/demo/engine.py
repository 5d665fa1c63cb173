"""A deterministic toy inference engine: token ids and log-probs from a seeded generator.

Every value depends only on (seed, rollout, turn, position), never on the process or the
policy version, so a call continued after a crash must end token-identical to the same
call decoded without interruption; the demo checks exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 32_000
USER_TOKENS = (4, 16)  # a user/tool turn's length range: the carried prompt of each call


@dataclass(frozen=True)
class ToyEngine:
    seed: int
    tokens: int  # tokens each call generates
    turns: int  # calls per rollout

    def _rng(self, rollout: int, turn: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, rollout, turn, stream])

    def user_turn(self, rollout: int, turn: int) -> list[int]:
        """The new prompt tokens of ``turn`` (the whole prompt of turn 0)."""
        rng = self._rng(rollout, turn, 0)
        length = int(rng.integers(*USER_TOKENS))
        return [int(token) for token in rng.integers(1, VOCAB, size=length)]

    def generate(self, rollout: int, turn: int, start: int, stop: int) -> tuple[list[int], list[float]]:
        """Generated tokens ``[start, stop)`` of the call and their log-probs (binary32 values)."""
        rng = self._rng(rollout, turn, 1)
        ids = rng.integers(1, VOCAB, size=self.tokens)
        logprobs = (-rng.exponential(1.0, size=self.tokens)).astype(np.float32)
        return [int(v) for v in ids[start:stop]], [float(v) for v in logprobs[start:stop]]

    def expected(self, rollout: int) -> tuple[list[int], list[float], list[float]]:
        """The whole rollout decoded without interruption: token ids, mask, log-probs."""
        ids: list[int] = []
        mask: list[float] = []
        logprobs: list[float] = []
        for turn in range(self.turns):
            user = self.user_turn(rollout, turn)
            generated, lps = self.generate(rollout, turn, 0, self.tokens)
            ids += user + generated
            mask += [0.0] * len(user) + [1.0] * len(generated)
            logprobs += [0.0] * len(user) + lps
        return ids, mask, logprobs
