"""Sampling parameters and the one logits processor applied to target and draft alike (temperature, top-k,
top-p, min-p); what depends on the generated tokens (bias, min_tokens, penalties) is processing.py's, applied to
the target alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

# a temperature below this is greedy decoding (as vLLM's): logits / 1e-320 overflow to inf, and a softmax of them is
# NaN; at such temperatures the distribution is the argmax's anyway but for ties closer than the logits' precision
SAMPLING_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01  # below it, a seen token's logit / the penalty overflows float32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below SAMPLING_EPS) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 = off
    # processing.py, with each tree node's history: {token id: bias added to its logit} (a dict is accepted)
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    presence_penalty: float = 0.0  # minus this for every token the output holds
    frequency_penalty: float = 0.0  # minus this for each time the output holds it
    repetition_penalty: float = 1.0  # seen tokens (prompt and output): logit / this if positive, x this if not
    min_tokens: int = 0  # stop tokens banned until this many tokens were generated

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        if any(t < 0 or math.isnan(b) or b == math.inf for t, b in bias):
            raise ValueError("logit_bias maps token ids >= 0 to finite biases (or -inf to ban a token)")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10] (1 = off), got "
                             f"{self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def processes(self) -> bool:
        """Whether the target's logits are processed by what was generated (processing.py)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed distribution over the last dim: temperature, then top-k, then top-p, then min-p.

        Computed in float64 so the target's p and the draft's q are compared at full precision.
        """
        x = logits.to(torch.float64) / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
            drop_sorted = before >= self.top_p  # keep the smallest prefix reaching top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        if self.min_p:
            probs = probs.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


# what LLM.generate takes by name besides temperature, top_k and top_p (its own keywords)
SAMPLING_OPTIONS = frozenset(f.name for f in fields(SamplingParams)) - {"temperature", "top_k", "top_p"}


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's first maximal index (NaN counts as the maximum), as torch.argmax gives it, through NumPy on the
    CPU: PyTorch's CPU argmax is not vectorised, NumPy's is, and a plain step is short enough for the difference to
    show (benchmarks/results/comment-timings.md). logits: [n, V]."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def greedy_token(logits: torch.Tensor) -> int:
    """greedy_tokens of one row [V]."""
    return greedy_tokens(logits[None])[0]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is not None and generator.device != probs.device:  # a request's CPU generator, a GPU's probs: the
        probs = probs.to(generator.device)  # draws stay the seed's on any device
    return int(torch.multinomial(probs, 1, generator=generator))
