"""A separate, smaller draft model with the target's tokenizer, drafting a chain token by token.

Its KV cache follows the committed sequence: before each proposal it rolls back to the longest
prefix it already holds and feeds the rest, so rejected guesses cost nothing to undo.

Cascade (`lookup`): a free proposer (prompt lookup) guesses for the draft model, which checks a run of its
guesses in one forward instead of one forward per token, exactly as the target checks the draft: greedy, the
chain is the draft's own greedy chain; sampled, each guess is kept with probability q(guess) and otherwise
replaced by a draw from q without it, so every drafted token is still an exact draw from q (recorded for the
target's verification).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..common.method_options import DraftOptions
from ..core.sampling import SamplingParams, greedy_token, sample
from ..core.tree import DraftTree
from ..models import KVCache, Transformer
from .base import ProposalContext, Proposer, RequestInfo
from .prompt_lookup import PromptLookupProposer

CASCADE_GUESSES = 4  # most lookup guesses the draft model checks in one forward


class DraftModelProposer(Proposer):
    """A model's chain of guesses. Its proposals depend on the token sequence alone (its cache resynchronizes itself
    from the tokens), so it may draft ahead for a sequence the target has not verified yet (async_draft)."""

    name = "draft"

    def __init__(self, model: Transformer, vocab_size: int, lookup: PromptLookupProposer | None = None) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's: q must live on the same support as p
        self.lookup = lookup  # a cascade's free proposer, guessing for the draft model
        self.cache: KVCache | None = None
        self.cached: list[int] = []
        self.max_len: int | None = None
        self.last_logits: list[torch.Tensor] = []  # the draft's logits at each drafted token of the last proposal
        # the steady cost of a guess in the last proposal (the first forward also caught up on the committed text:
        # not counted); None: fewer than two guesses
        self.seconds_per_guess: float | None = None

    def begin(self, request: RequestInfo) -> None:
        # the cache waits for a first guess: many requests never draft (the policy finds it does not pay)
        self.cache, self.cached, self.max_len = None, [], request.max_len
        if self.lookup is not None:
            self.lookup.begin(request)

    def propose(self, context: ProposalContext) -> DraftTree:
        tree = self.draft(context.tokens, context.k, context.params, context.generator)
        context.seconds_per_guess = self.seconds_per_guess
        return tree

    def draft(self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
              stop: Callable[[list[int]], bool] | None = None) -> DraftTree:
        """A chain of up to k guesses after `tokens`; `stop(drafted so far)`, asked before each draft forward, cuts
        it short."""
        if self.max_len is None:
            raise RuntimeError("DraftModelProposer.begin() must be called before propose()")
        if self.cache is None:
            self.cache = self.model.new_cache(self.max_len)
        common = 0
        limit = min(len(self.cached), len(tokens) - 1)  # always feed at least the last token
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        self.cache.rollback(common)
        logits = self._logits(tokens[common:])[-1]
        drafted: list[int] = []
        probs: list[torch.Tensor | None] = []
        self.last_logits = []
        started = time.perf_counter()
        while len(drafted) < k:
            q = None if params.greedy else params.probs(logits)
            guesses = self._guesses(tokens, drafted, k, logits, q)
            rejected = None
            if guesses:  # a cascade: the draft checks the lookup's guesses in one forward
                after = self._logits(guesses, last=len(guesses))  # after[i]: the draft's logits after guess i
                kept = 0
                for guess in guesses:
                    if len(drafted) == k:
                        break
                    if not self._keeps(guess, logits, q, generator):
                        rejected = guess
                        break
                    drafted.append(guess)
                    probs.append(q)
                    self.last_logits.append(logits)
                    logits, kept = after[kept], kept + 1
                    q = None if params.greedy else params.probs(logits)
                self.cache.rollback(self.cache.length - (len(guesses) - kept))  # entries of the kept guesses stay
                if len(drafted) == k:
                    break
            drafted.append(self._pick(logits, q, generator, exclude=rejected))
            probs.append(q)
            self.last_logits.append(logits)
            if len(drafted) == k or (stop is not None and stop(drafted)):
                break
            logits = self._logits(drafted[-1:])[-1]
        self.seconds_per_guess = (time.perf_counter() - started) / (len(drafted) - 1) if len(drafted) > 1 else None
        self.cached = tokens + drafted[:-1]
        return DraftTree.chain(tokens[-1], drafted, probs)

    def _guesses(self, tokens: list[int], drafted: list[int], k: int, logits: torch.Tensor,
                 q: torch.Tensor | None) -> list[int]:
        """A cascade's lookup guesses for the next tokens, worth a forward only if the draft may keep the first."""
        if self.lookup is None or len(drafted) >= k - 1:
            return []
        paths, _ = self.lookup.match(tokens, min(CASCADE_GUESSES, k - len(drafted)), drafted)
        if not paths or len(paths[0]) < 2:
            return []
        first = paths[0][0]
        if (q is None and greedy_token(logits) != first) or (q is not None and float(q[first]) == 0.0):
            return []
        return paths[0]

    @staticmethod
    def _keeps(guess: int, logits: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None) -> bool:
        """Whether the draft keeps a lookup guess: greedy, its own choice; sampled, with probability q(guess)."""
        if q is None:
            return greedy_token(logits) == guess
        device = generator.device if generator is not None else q.device
        return float(torch.rand((), generator=generator, dtype=torch.float64, device=device)) < float(q[guess])

    @staticmethod
    def _pick(logits: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None,
              exclude: int | None = None) -> int:
        """The draft's own token; after a rejected guess, sampled from q without it (greedy: the argmax, which the
        rejected guess was not)."""
        if q is None:
            return greedy_token(logits)
        if exclude is not None:
            q = q.clone()
            q[exclude] = 0.0
            q = q / q.sum()
        return sample(q, generator)

    def _logits(self, new_tokens: list[int], last: int = 1) -> torch.Tensor:
        """Feed `new_tokens` to the draft's cache; its logits over the target's vocabulary after each of the `last`
        of them ([last, V])."""
        # A draft with a smaller (unpadded) vocabulary cannot embed the target's extra ids; should the target
        # ever emit one, feed a stand-in: only the draft's guesses suffer, never the output.
        draft_vocab = self.model.config.vocab_size
        ids = torch.tensor([[t if t < draft_vocab else 0 for t in new_tokens]], device=self.model.device)
        assert self.cache is not None
        logits = self.model.forward(ids, self.cache, logits_at=slice(-last, None)).logits[0]
        vocab = self.vocab_size
        if logits.shape[-1] >= vocab:  # padded embedding rows are never real tokens
            return logits[:, :vocab]
        return torch.cat((logits, logits.new_full((last, vocab - logits.shape[-1]), float("-inf"))), -1)


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: DraftOptions, draft: Draft, k: int | str) -> DraftModelProposer:
    if draft is None:
        raise ValueError("method 'draft' needs a draft model: pass draft=<registry name, HF dir or .gguf>")
    return DraftModelProposer(assets.draft_model(draft).model, assets.model.config.vocab_size)
