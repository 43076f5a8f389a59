"""The proposer interface: who guesses the next tokens. Proposers never see the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree


class Proposer(ABC):
    name: str = "proposer"

    def begin(self, prompt: list[int], max_len: int) -> None:  # noqa: B027 - optional hook
        """A new request starts; `max_len` bounds prompt + generated + drafted tokens."""

    @abstractmethod
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree:
        """Guess up to `k` tokens deep after `tokens` (everything committed so far, root = tokens[-1])."""


class NoProposer(Proposer):
    """Plain decoding through the same engine: the baseline."""

    name = "none"

    def propose(self, tokens, k, params, generator) -> DraftTree:
        return DraftTree.root_only(tokens[-1])
