"""A draft model whose acceptance is set, for benchmarks: speed against acceptance without a draft trained to match.

llama.cpp (`--spec-synthetic-acceptance-rates` / `-length`) and vLLM (`rejection_sample_method="synthetic"`) set
acceptance in the verification: the target keeps the first guesses with the chosen probability whatever they are, so
their output is not the model's. Here the verification stays the real one (the output stays plain decoding's) and the
draft's guesses are set instead: the draft model runs its real forwards (its cost is real), but the token it drafts at
position p is the target's own greedy token there (known from a plain run of the same prompt, done first) when a coin
of probability `rate` says so, and a wrong one otherwise; the draft then feeds that token to its KV cache, as a real
draft that had chosen it would. A chain's guess is verified only when every guess before it was accepted, so each
verified guess is accepted with probability `rate` (the conditional acceptance per token; llama.cpp's rates list is
its powers: rate, rate^2, ...).

Coins belong to positions (drawn once, from `seed`), not to calls: a chain drafted ahead (async_draft) for a position
gets the same token as a chain drafted for it later, and each position is verified at most once (accepted, it is
committed; refused, the target's token is committed in its place), so the coins verified are independent draws.
Greedy only: a sampled request's target draws its own tokens, which no earlier run knows.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.sampling import SamplingParams, greedy_token
from ..core.tree import DraftTree
from ..proposers.draft_model import DraftModelProposer


class EmulatedDraft(DraftModelProposer):
    """`draft`'s model drafting, each guess replaced by the target's greedy token with probability `rate`.

    truth: the plain run's whole sequence (prompt and output) of the request this proposer serves; past its end the
    draft's own tokens stand (a request as long as the plain run never verifies them)."""

    def __init__(self, draft: DraftModelProposer, truth: list[int], rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the emulated acceptance rate must be in [0, 1], got {rate}")
        if draft.lookup is not None:
            raise ValueError("an emulated draft drafts token by token: no cascade (its lookup guesses would be "
                             "checked by the draft model, not set by the rate)")
        super().__init__(draft.model, draft.vocab_size)
        self.truth, self.rate = list(truth), rate
        self.right = np.random.default_rng(seed).random(len(self.truth)) < rate  # the coin of each position
        self.log: list[tuple[int, list[int]]] = []  # (position of the first guess, guesses): each chain drafted
        self._next = 0  # the position of the next guess `_pick` makes

    def draft(self, tokens, k, params: SamplingParams, generator, stop=None) -> DraftTree:
        if not params.greedy:
            raise ValueError("an emulated acceptance needs greedy decoding (the target's tokens come from a plain "
                             "greedy run)")
        self._next = len(tokens)
        tree = super().draft(tokens, k, params, generator, stop)
        self.log.append((len(tokens), tree.tokens[1:]))
        return tree

    def _pick(self, logits: torch.Tensor, q, generator, exclude=None) -> int:  # type: ignore[override]
        """The draft's own greedy token is computed (its cost is real), then set: the target's with the position's
        coin, else a token the target does not emit there."""
        own = greedy_token(logits)
        position, self._next = self._next, self._next + 1
        if position >= len(self.truth):
            return own
        truth = self.truth[position]
        if self.right[position]:
            return truth
        return own if own != truth else (truth + 1) % self.vocab_size

    def tally(self) -> tuple[int, int]:
        """(guesses verified, guesses accepted) over the chains drafted, each verified up to its first wrong guess,
        that one included: what the target saw where every chain drafted was verified whole (a fixed k, drafting in
        step; chains drafted ahead for outcomes that did not come true were never verified)."""
        verified = accepted = 0
        for first, guesses in self.log:
            right = next((i for i, t in enumerate(guesses) if first + i >= len(self.truth)
                          or t != self.truth[first + i]), len(guesses))
            verified, accepted = verified + min(len(guesses), right + 1), accepted + right
        return verified, accepted
