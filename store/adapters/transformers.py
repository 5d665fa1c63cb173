"""A real reference engine: a Hugging Face causal LM decoding with a KV cache (the ``[transformers]`` extra).

``TransformersEngine`` implements ``store.worker.engine.LiveEngine``: ``prefill`` runs the
model over the prompt once and keeps its KV cache; each ``step`` samples the next token from
the model's logits and returns its log-prob from their log-softmax (float32, as the store keeps
them), then feeds only that token through the cache on the next step.  A continued call
re-prefills prompt + restored prefix and decodes only the rest.

Sampling is reproducible across processes: the token at absolute position ``p`` of a sequence is
drawn by inverse CDF with a uniform number from a generator seeded by ``(seed, p)``, so an
interrupted call continued from its cut draws the same numbers as the same call decoded without
interruption.  (Its logits then come from a prefill instead of the cache: float32 sums in
another order, which moves a log-prob by about 1e-6 and could change a token only if the draw
fell within that distance of a boundary of the cumulative distribution.)

``tiny_llama(seed)`` builds a small Llama with random weights from a config: nothing is
downloaded (the Hugging Face Hub is switched offline before transformers is imported).

torch is not a dependency of the extra (a bare ``torch`` requirement resolves to a CUDA build);
install the build you want first, for example ``pip install torch==2.13.0`` for the CPU wheel.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Collection, Sequence
from typing import Any

from store.errors import ConfigurationError

# Never reach the Hub: the reference engine builds its model from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - exercised where the extra is not installed
    from store.install import extra_hint

    raise ImportError(
        "store.adapters.transformers needs torch and transformers: pip install torch==2.13.0 "
        f"(or the torch build for your machine), then {extra_hint('transformers')}"
    ) from exc

_MASK64 = 2**64 - 1


def tiny_llama(
    seed: int = 0,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    initializer_range: float = 0.3,
) -> Any:
    """A small ``LlamaForCausalLM`` with seeded random weights, built from a config (no download).

    ``initializer_range`` 0.3 (not Llama's 0.02) gives logits with a spread, so log-probs range
    over several nats instead of all being close to ``-log(vocab_size)``.
    """
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=8192,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model: Any = transformers.LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()  # no dropout; inference only
    return model


class TransformersEngine:
    """``LiveEngine`` over a causal LM: KV-cached decoding, seeded inverse-CDF sampling."""

    def __init__(
        self,
        model: Any,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        stop_token_ids: Collection[int] = (),
    ) -> None:
        if type(seed) is not int or not 0 <= seed <= _MASK64:
            raise ConfigurationError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if type(temperature) not in (int, float) or not temperature > 0:
            raise ConfigurationError(f"temperature must be a positive number, got {temperature!r}")
        self.model = model
        # Inputs go where the model's weights are (``model.to("cuda")``); a tensor made on the
        # CPU for a model on a GPU fails its first forward.
        self._device = getattr(model, "device", None) or torch.device("cpu")
        self.seed = seed
        self.temperature = float(temperature)
        self._stops = frozenset(int(token) for token in stop_token_ids)
        self._vocab = int(model.config.vocab_size)
        # transformers 5 names the cache argument ``cache``; earlier releases ``past_key_values``.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._cache: Any = None
        self._logits: Any = None
        self._pending: int | None = None  # the last sampled token, not yet fed through the model
        self._position = 0  # absolute position of the next token to sample
        self._ids: list[int] = []
        self._logprobs: list[float] = []

    @property
    def stop_token_ids(self) -> Collection[int]:
        return self._stops

    @property
    def generated_token_ids(self) -> Sequence[int]:
        return self._ids

    @property
    def generated_logprobs(self) -> Sequence[float]:
        return self._logprobs

    def prefill(self, prompt_token_ids: Sequence[int]) -> None:
        ids = [int(token) for token in prompt_token_ids]
        if not ids:
            raise ConfigurationError("prefill needs at least one prompt token")
        if any(not 0 <= token < self._vocab for token in ids):
            raise ConfigurationError(f"prompt token ids must be in [0, {self._vocab})")
        self._cache = transformers.DynamicCache()
        self._logits = self._forward(ids)
        self._pending = None
        self._position = len(ids)
        self._ids, self._logprobs = [], []

    def step(self) -> tuple[int, float]:
        if self._logits is None:
            raise ConfigurationError("step() before prefill()")
        if self._pending is not None:
            self._logits = self._forward([self._pending])
        logprobs = torch.log_softmax(self._logits.float(), dim=-1)
        scaled = logprobs if self.temperature == 1.0 else torch.log_softmax(self._logits.float() / self.temperature, -1)
        cumulative = torch.cumsum(torch.exp(scaled.double()), dim=-1)
        # The uniform number is drawn on the CPU (the same in every process and on every device).
        uniform = float(torch.rand((), generator=self._generator(self._position), dtype=torch.float64))
        draw = cumulative[-1] * uniform
        token = min(int(torch.searchsorted(cumulative, draw, right=True)), self._vocab - 1)
        logprob = float(logprobs[token])
        self._pending = token
        self._position += 1
        self._ids.append(token)
        self._logprobs.append(logprob)
        return token, logprob

    def _forward(self, ids: list[int]) -> Any:
        with torch.inference_mode():
            output = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self._device),
                use_cache=True,
                **{self._cache_argument: self._cache},
            )
        return output.logits[0, -1]

    def _generator(self, position: int) -> Any:
        """A generator for the token at ``position``: the same in every process for the same seed."""
        mixed = (self.seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _MASK64
        mixed ^= mixed >> 31
        return torch.Generator().manual_seed(mixed)
