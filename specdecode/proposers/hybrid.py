"""Hybrid: prompt-lookup continuations and a model draft's chain in one tree, verified in one forward.

Lookup guesses are free and excellent where text repeats (code edits, quotes, extraction); a model
draft guesses everywhere else. Together the target checks both and keeps whichever path it agrees with.

To the engine's policy the hybrid is cheap (the lookup costs nothing, so it may ask deep and cut the
tree afterwards); the model draft's depth is decided here by `draft_policy`, an adaptive policy of its
own that learns the draft's cost per guess and acceptance, so a draft that does not pay stops running
while lookup guesses carry on (FixedK(0) when a search already found it cannot pay: lookup alone).
Without a draft policy (fixed K) the draft guesses k tokens every step.

Greedy: the paths merge into a trie (shared prefixes verified once). Sampling: the draft's chain, drawn
from q, stays a separate sibling after the lookup branches even where a first token coincides; the
multi-round rule then stays exact because every sibling is tried against the residual left by the
ones before it, whatever distribution each sibling came from.
"""

from __future__ import annotations

import time

from ..policy import AdaptiveK, FixedK, Policy, StepRecord
from ..tree import DraftTree
from .base import Capabilities, Proposer
from .prompt_lookup import PromptLookupProposer

DRAFTED = 10  # added to the bucket when the model draft contributed: such trees are accepted differently


class HybridProposer(Proposer):
    name = "hybrid"
    capabilities = Capabilities(cheap=True)

    def __init__(self, lookup: PromptLookupProposer, draft: Proposer, draft_policy: Policy | None = None) -> None:
        self.lookup, self.draft, self.draft_policy = lookup, draft, draft_policy
        self._last: tuple[DraftTree, list[int], float] | None = None  # the draft's chain, tokens before, seconds

    def bind(self, cost, acceptance) -> None:
        """The model draft's depth gets a cost-aware policy of its own (no guesses where it cannot pay)."""
        self.draft.bind(cost, acceptance)
        self.draft_policy = AdaptiveK(cost, acceptance("draft"), cheap=False) if self.draft.capabilities.pays \
            else FixedK(0)

    def begin(self, prompt: list[int], max_len: int) -> None:
        self.lookup.begin(prompt, max_len)
        self.draft.begin(prompt, max_len)
        self._last = None

    def propose(self, tokens, k, params, generator) -> DraftTree:
        paths, n = self.lookup.match(tokens, k)
        policy = self.draft_policy
        depth = k if policy is None else policy.depth_to_propose(len(tokens), k)
        if depth == 0:
            return DraftTree.from_paths(tokens[-1], paths, bucket=n)
        started = time.perf_counter()
        chain = self.draft.propose(tokens, depth, params, generator)
        self._last = (chain, list(tokens), time.perf_counter() - started)
        drafted = chain.tokens[1:]
        if params.greedy:
            return DraftTree.from_paths(tokens[-1], [*paths, drafted], bucket=n + DRAFTED)
        lookup = DraftTree.from_paths(tokens[-1], paths)
        offset = len(lookup.tokens)
        parents = [0 if p == 0 else p - 1 + offset for p in chain.parents[1:]]  # re-root the chain
        return DraftTree(lookup.tokens + drafted, lookup.parents + parents,
                         lookup.draft_probs + chain.draft_probs[1:], bucket=n + DRAFTED)

    def observe(self, tree, verdict, extra_logits) -> None:
        if self._last is None or self.draft_policy is None:
            return
        chain, before, seconds = self._last
        self._last = None
        committed = before + [tree.tokens[i] for i in verdict.path[1:]] + [verdict.next_token]
        self.draft_policy.observe(StepRecord(chain, chain, len(before), committed, len(before) - 1, seconds,
                                             self.draft.seconds_per_guess))
        self.draft_policy.remember()
