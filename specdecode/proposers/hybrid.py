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

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.method_options import HybridOptions
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..models.published_io import EAGLE1, EAGLE3, OURS_EAGLE, detect_layout
from ..policy.speculation import AdaptiveK, FixedK, Guessing, Policy, StepRecord
from . import draft_model, layer_skip
from .base import ProposalContext, Proposer, RequestInfo, StepOutput
from .eagle import EagleProposer
from .prompt_lookup import PromptLookupProposer
from .suffix import SuffixProposer
from .suffix_eagle import SuffixEagleProposer

if TYPE_CHECKING:
    from .assets import Assets, Draft

DRAFTED = 10  # added to the bucket when the model draft contributed: such trees are accepted differently


class HybridProposer(Proposer):
    name = "hybrid"
    guessing = Guessing(cheap=True)

    def __init__(self, lookup: PromptLookupProposer, draft: Proposer, draft_policy: Policy | None = None) -> None:
        self.lookup, self.draft, self.draft_policy = lookup, draft, draft_policy
        # the draft's chain, tokens before, seconds, its measure of a guess
        self._last: tuple[DraftTree, list[int], float, float | None] | None = None

    def begin(self, request: RequestInfo) -> None:
        """Under k="auto" the model draft's depth gets a cost-aware policy of its own (no guesses where it cannot
        pay)."""
        if request.cost is not None and request.acceptance is not None:
            self.draft_policy = AdaptiveK(request.cost, request.acceptance("draft"), cheap=False) \
                if self.draft.guessing.pays else FixedK(0)
        self.lookup.begin(request)
        self.draft.begin(request)
        self._last = None

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k, params = context.tokens, context.k, context.params
        paths, n = self.lookup.match(tokens, k)
        policy = self.draft_policy
        depth = k if policy is None else policy.depth_to_propose(len(tokens), k)
        if depth == 0:
            return DraftTree.from_paths(tokens[-1], paths, bucket=n)
        started = time.perf_counter()
        asked = replace(context, k=depth, seconds_per_guess=None, drafted_ahead=None)
        chain = self.draft.propose(asked)
        self._last = (chain, list(tokens), time.perf_counter() - started, asked.seconds_per_guess)
        drafted = chain.tokens[1:]
        if params.greedy:
            return DraftTree.from_paths(tokens[-1], [*paths, drafted], bucket=n + DRAFTED)
        lookup = DraftTree.from_paths(tokens[-1], paths)
        offset = len(lookup.tokens)
        parents = [0 if p == 0 else p - 1 + offset for p in chain.parents[1:]]  # re-root the chain
        return DraftTree(lookup.tokens + drafted, lookup.parents + parents,
                         lookup.draft_probs + chain.draft_probs[1:], bucket=n + DRAFTED)

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        if tree is None or verdict is None or self._last is None or self.draft_policy is None:
            return
        chain, before, seconds, per_guess = self._last
        self._last = None
        committed = before + [tree.tokens[i] for i in verdict.path[1:]] + [verdict.next_token]
        self.draft_policy.observe(StepRecord(chain, chain, len(before), committed, len(before) - 1, seconds,
                                             per_guess))
        self.draft_policy.remember()


def eagle_head_dir(draft: Draft) -> bool:
    """Whether `draft` names a folder holding an EAGLE head (specdecode's or a published one), not a draft model."""
    if not isinstance(draft, str | os.PathLike) or not Path(draft).expanduser().is_dir():
        return False
    try:
        return detect_layout(draft) in (OURS_EAGLE, EAGLE3, EAGLE1)
    except (ValueError, FileNotFoundError):  # a model's checkpoint (or no weights at all): not a head
        return False


def build(assets: Assets, options: HybridOptions, draft: Draft, k: int | str) -> Proposer:
    """Suffix decoding and an EAGLE head in one tree: the given head's folder, or the head shipped for the model
    where no draft is given; else prompt lookup and a model draft: the given one, else the layer-skipped target."""
    head = eagle_head_dir(draft)
    if head or (draft is None and assets.has_eagle_head()):
        cost = assets.cost_model()
        online = assets.online_head(draft if head else None) if options.online_draft else None
        return SuffixEagleProposer(SuffixProposer(assets.suffix_cache(), nodes=options.nodes, cost=cost),
                                   EagleProposer(assets.eagle_head(draft if head else None), assets.model,
                                                 topk=options.topk, nodes=options.nodes, cost=cost, online=online))
    if draft is not None:
        model_draft: Proposer = draft_model.build(assets, draft_model.DraftOptions(), draft, "auto")
    else:
        model_draft = layer_skip.build(assets, layer_skip.LayerSkipOptions(options.skip_layers), None, "auto")
    return HybridProposer(PromptLookupProposer(options.max_ngram, options.min_ngram, options.branches or 1),
                          model_draft)
