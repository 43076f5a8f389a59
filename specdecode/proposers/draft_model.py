"""A separate, smaller draft model with the target's tokenizer, drafting a chain token by token.

Its KV cache follows the committed sequence: before each proposal it rolls back to the longest
prefix it already holds and feeds the rest, so rejected guesses cost nothing to undo.
"""

from __future__ import annotations

import time

import torch

from ..models import KVCache, Transformer
from ..sampling import sample
from ..tree import DraftTree
from .base import Proposer


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model: Transformer, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's: q must live on the same support as p
        self.cache: KVCache | None = None
        self.cached: list[int] = []
        self.max_len: int | None = None

    def begin(self, prompt: list[int], max_len: int) -> None:
        # the cache waits for a first guess: many requests never draft (the policy finds it does not pay)
        self.cache, self.cached, self.max_len = None, [], max_len

    def propose(self, tokens, k, params, generator) -> DraftTree:
        if self.max_len is None:
            raise RuntimeError("DraftModelProposer.begin() must be called before propose()")
        if self.cache is None:
            self.cache = self.model.new_cache(self.max_len)
        common = 0
        limit = min(len(self.cached), len(tokens) - 1)  # always feed at least the last token
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        self.cache.rollback(common)
        logits = self._logits(tokens[common:])
        drafted: list[int] = []
        probs: list[torch.Tensor | None] = []
        started = 0.0
        for i in range(k):
            if params.greedy:
                drafted.append(int(logits.argmax()))
                probs.append(None)
            else:
                q = params.probs(logits)
                drafted.append(sample(q, generator))
                probs.append(q)
            if i == 0:  # time the guesses after the first: one token each, the steady cost of a guess
                started = time.perf_counter()
            if i < k - 1:
                logits = self._logits(drafted[-1:])
        self.seconds_per_guess = (time.perf_counter() - started) / (k - 1) if k > 1 else None
        self.cached = tokens + drafted[:-1]
        return DraftTree.chain(tokens[-1], drafted, probs)

    def _logits(self, new_tokens: list[int]) -> torch.Tensor:
        # A draft with a smaller (unpadded) vocabulary cannot embed the target's extra ids; should the target
        # ever emit one, feed a stand-in: only the draft's guesses suffer, never the output.
        draft_vocab = self.model.config.vocab_size
        ids = torch.tensor([[t if t < draft_vocab else 0 for t in new_tokens]], device=self.model.device)
        logits = self.model.forward(ids, self.cache, logits_at=slice(-1, None)).logits[0, -1]
        vocab = self.vocab_size
        if logits.shape[-1] >= vocab:  # padded embedding rows are never real tokens
            return logits[:vocab]
        return torch.cat((logits, logits.new_full((vocab - logits.shape[-1],), float("-inf"))))
