"""Medusa: trained heads on the target's last hidden state guess several tokens at once, as a token tree.

The engine hands over the target's last-layer hidden state of every committed position; the newest one
(just before the root) feeds all heads, and head j's top guesses are candidates for depth j + 1.

The tree (Medusa's sparse tree): a node is a tuple of ranks (r1, ..., rd) = head 1's r1-th guess, then
head 2's r2-th, ...; its chance of being accepted is estimated as the product of the heads' rank
accuracies. The candidate nodes are the `max_nodes` best by the accuracies measured on held-out data
(saved with the heads); every step ranks them by the current accuracies, best first (a parent always
scores at least its child, so every prefix of the ranking is a tree).

The accuracies are learned as the text goes (RankAccuracy): P(head j's rank-r guess is right | the tokens
before it were among their heads' guesses), from every run of the heads, whatever part of the tree was
sent, and carried across requests. A summary accepts other guesses than a proof.

Sizing (with a cost model): before the heads run, each number of heads d is priced, the best count of
nodes up to depth d costing the target's forward of them plus d head forwards. When no d beats a plain
step by MARGIN the heads do not run (the step costs nothing extra) until PROBE_EVERY such steps have
passed; then a probe runs the first head to keep learning (every deeper guess counts only after a
first-head hit, so the first head says when guessing is worth pricing again). Once the heads' last runs
are settled (a miss settles at once, a hit only when the text covers the whole run) such steps teach
nothing, so the decision stands unpriced.
Once they ran their cost is spent, and the count of nodes sent is the one maximising
(1 + expected accepted) / forward seconds.

Greedy: node tokens are those ranks' guesses. Sampling: the same shape, but every node's token is drawn
from its head's distribution q (the heads' logits through the request's sampling processor) independently
of all other draws, so siblings are i.i.d. draws with replacement, which the multi-round rule in verify.py
verifies exactly. (Medusa's "typical acceptance" is lossy and not offered.)
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..common.method_options import MedusaOptions
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..models.medusa import MedusaHeads
from ..policy.cost import ForwardCost
from ..policy.speculation import Guessing, best_count, rate_to_beat, smoothed
from .assets import is_path
from .base import Needs, ProposalContext, Proposer, RequestInfo, StepOutput

RANKS = 10  # guesses per head a tree may use
PROBE_EVERY = 16  # skipped steps between runs of the first head that only learn (~2% of a step)
REQUEST_TRIALS = 8.0  # a request starts from the long-run accuracies worth this many trials per head


@dataclass
class TreeShape:
    ranks: list[tuple[int, ...]]  # per guessed node: its path of ranks; parents come first
    parents: list[int]  # per tree node (root = 0 at index 0, parent -1)
    estimates: list[float]  # per guessed node: estimated chance it is accepted


def default_accuracy(heads: int, ranks: int = RANKS) -> list[list[float]]:
    """A prior for heads without measured accuracy: deeper heads and lower ranks are right less often."""
    return [[0.6 * 0.7**j * 0.5**r for r in range(ranks)] for j in range(heads)]


def medusa_tree(accuracy: list[list[float]], max_nodes: int) -> TreeShape:
    """The `max_nodes` rank paths with the highest products of accuracies, best first (see module docstring)."""
    acc = [[min(max(a, 1e-6), 1.0) for a in row] for row in accuracy]

    def estimate(path: tuple[int, ...]) -> float:
        return float(np.prod([acc[d][r] for d, r in enumerate(path)]))

    shape = TreeShape([], [-1], [])
    index: dict[tuple[int, ...], int] = {(): 0}
    frontier = [(-estimate((0,)), (0,))] if acc and acc[0] else []
    while frontier and len(shape.ranks) < max_nodes:
        neg, path = heapq.heappop(frontier)
        index[path] = len(shape.ranks) + 1
        shape.ranks.append(path)
        shape.parents.append(index[path[:-1]])
        shape.estimates.append(-neg)
        depth = len(path)
        if path[-1] + 1 < len(acc[depth - 1]):  # the next sibling
            sibling = (*path[:-1], path[-1] + 1)
            heapq.heappush(frontier, (-estimate(sibling), sibling))
        if depth < len(acc):  # the first child
            heapq.heappush(frontier, (-estimate((*path, 0)), (*path, 0)))
    return shape


class RankAccuracy:
    """Per head and rank: P(the guess is the committed token | the tokens before it were among their heads'
    guesses). Decayed counts over a prior (the held-out accuracy) worth `weight` trials."""

    def __init__(self, prior: np.ndarray, weight: float = 4.0, decay: float = 0.98) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.hits = np.zeros_like(prior)  # [heads, ranks]
        self.trials = np.zeros(len(prior))  # [heads]

    @classmethod
    def of(cls, heads: MedusaHeads) -> RankAccuracy:
        """Starting from the accuracy saved with the heads (or a prior that falls with depth and rank)."""
        saved = heads.config.accuracy or default_accuracy(heads.config.heads)
        prior = np.full((heads.config.heads, min(RANKS, heads.config.draft_vocab_size)), 1e-6)  # distinct guesses
        for j, row in enumerate(saved):
            row = row[: prior.shape[1]]
            prior[j, : len(row)] = np.clip(row, 1e-6, 1.0)
        return cls(prior)

    def rates(self) -> np.ndarray:
        return (self.hits + self.weight * self.prior) / (self.trials[:, None] + self.weight)

    def record(self, top: list[list[int]], actual: list[int]) -> None:
        """top[j]: head j's guesses, best first; actual: the committed tokens at depths 1, 2, ..."""
        self.hits *= self.decay
        self.trials *= self.decay
        for j, (guesses, token) in enumerate(zip(top, actual, strict=False)):
            self.trials[j] += 1
            if token not in guesses:
                break
            self.hits[j, guesses.index(token)] += 1

    def fork(self, trials: float) -> RankAccuracy:
        """A copy starting from these counts, scaled to at most `trials` trials per head (a request's own)."""
        out = RankAccuracy(self.prior, self.weight, self.decay)
        scale = min(1.0, trials / max(float(self.trials.max()), 1e-9))
        out.hits, out.trials = self.hits * scale, self.trials * scale
        return out


class MedusaProposer(Proposer):
    name = "medusa"
    needs = Needs(hidden_layers=(-1,), hidden_context=1)  # the last layer's state at the position before the root

    def __init__(self, heads: MedusaHeads, vocab_size: int, *, cost: ForwardCost | None = None,
                 max_nodes: int = 64, accuracy: RankAccuracy | None = None) -> None:
        """vocab_size: the target's; cost: sizes every step's tree (else all `max_nodes` nodes, `k` deep);
        accuracy: the long-run one, shared by the requests that pass it (else the heads' saved one)."""
        if heads.config.target_vocab_size != vocab_size:
            raise ValueError(f"Medusa heads for a {heads.config.target_vocab_size}-token vocabulary cannot "
                             f"draft for a target with {vocab_size} tokens")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.heads, self.vocab_size, self.cost = heads, vocab_size, cost
        self.shared = accuracy or RankAccuracy.of(heads)
        shape = medusa_tree(self.shared.prior.tolist(), max_nodes)  # the candidates
        self.max_depth = max(len(path) for path in shape.ranks)  # heads the tree uses
        self.ranks = max(r for path in shape.ranks for r in path) + 1
        self.node_head = np.array([len(path) - 1 for path in shape.ranks])
        self.node_rank = np.array([path[-1] for path in shape.ranks])
        self.node_parent = np.array(shape.parents[1:]) - 1  # candidate index, -1: the root
        # per node, the flat (head, rank) index of each step of its path, padded with a cell worth 1.0
        columns = self.shared.prior.shape[1]
        self.path_cells = np.full((len(shape.ranks), self.max_depth), self.shared.prior.size)
        for i, path in enumerate(shape.ranks):
            self.path_cells[i, : len(path)] = [j * columns + r for j, r in enumerate(path)]
        self.head_seconds: float | None = None  # one head's forward, smoothed
        # made with a cost it sizes its trees itself (by the request's cost, RequestInfo.cost, where k="auto" gives
        # one); cheap: without a cost, ask deep and an adaptive policy cuts the tree by depth
        self.guessing = Guessing(cheap=True, sizes_itself=cost is not None, max_depth=self.max_depth)
        self.begin(RequestInfo([0], 0))

    def begin(self, request: RequestInfo) -> None:
        if self.cost is not None and request.cost is not None:
            self.cost = request.cost
        self.hidden: torch.Tensor | None = None
        self.position = -1  # of the hidden state held
        self.accuracy = self.shared.fork(REQUEST_TRIALS)
        self.pending: list[tuple[int, list[list[int]]]] = []  # (index of depth 1, heads' guesses) per run
        self.skipped = 0  # steps since the heads last ran

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        """Keep the last committed position's hidden state: the heads draft from it."""
        if outputs.hidden is None:
            return
        start, states = outputs.start, outputs.hidden[0]
        self.hidden, self.position = states[-1], start + states.shape[0] - 1

    def chances(self) -> np.ndarray:
        """Per candidate: the product of the current accuracies along its path."""
        return np.append(self.accuracy.rates().ravel(), 1.0)[self.path_cells].prod(axis=1)

    def ranked(self, chances: np.ndarray) -> np.ndarray:
        """Every candidate, best first (ties: parents first); those of the first d heads keep this order."""
        return np.lexsort((self.node_head, -chances))

    def within(self, order: np.ndarray, depth: int) -> np.ndarray:
        """The candidates of `order` at most `depth` deep."""
        return order[self.node_head[order] < depth]

    @torch.inference_mode()
    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k, params, generator = context.tokens, context.k, context.params, context.generator
        root = tokens[-1]
        depth = min(k, self.max_depth)
        if self.hidden is None or self.position != len(tokens) - 2 or depth < 1:
            return DraftTree.root_only(root)  # no hidden state for the position before the root (1-token prompt)
        self._learn(tokens)
        if self.cost is not None and 0 < self.skipped < PROBE_EVERY and not self.pending:  # nothing new to decide on
            self.skipped += 1
            return DraftTree.root_only(root)
        context, chances = len(tokens) - 1, self.chances()
        order = self.ranked(chances)
        if self.cost is not None:
            worth = self._heads_worth_running(depth, order, chances, context)
            self.skipped = 0 if worth or self.skipped >= PROBE_EVERY else self.skipped + 1  # 0: the heads run now
            if self.skipped:
                return DraftTree.root_only(root)
            depth = worth or 1  # a probe: the first head alone (all four cost ~8% of a step, not ~2%)
        order = self.within(order, depth)
        started = time.perf_counter()
        logits = self.heads(self.hidden.to(self.heads.out_weight.dtype), depth)  # [depth, draft vocab]
        top = self.heads.vocab_ids[logits.topk(self.ranks, dim=-1).indices].tolist()
        self.head_seconds = smoothed(self.head_seconds, (time.perf_counter() - started) / depth)
        self.pending.append((len(tokens), top))
        if self.cost is not None:  # the heads' cost is spent: send what pays for the target's forward
            order = order[: best_count(chances[order], self.cost, context)[0]]
        index = {-1: 0} | {int(c): i for i, c in enumerate(order, 1)}  # candidate -> tree node (-1: the root)
        parents = [-1] + [index[int(self.node_parent[c])] for c in order]  # a parent always ranks first
        heads = self.node_head[order].tolist()
        if params.greedy:
            guesses = [top[j][r] for j, r in zip(heads, self.node_rank[order].tolist(), strict=True)]
            probs: list[torch.Tensor | None] = [None] * len(guesses)
        else:
            guesses, probs = self._draw(logits, heads, params, generator)
        return DraftTree([root, *guesses], parents, [None, *probs])

    def _draw(self, logits: torch.Tensor, heads: list[int], params, generator) -> tuple[list[int], list]:
        """Every node's token drawn from its head's q, independently; and that q."""
        q = params.probs(self.heads.to_target_vocab(logits))  # [depth, V]
        counts = np.bincount(heads, minlength=len(q)).tolist()
        drawn_from = q.to(generator.device) if generator is not None else q  # the request's generator: the CPU's
        draws = [torch.multinomial(drawn_from[j], n, replacement=True, generator=generator).tolist() if n else []
                 for j, n in enumerate(counts)]
        return [draws[j].pop() for j in heads], [q[j] for j in heads]

    def _heads_worth_running(self, depth: int, order: np.ndarray, chances: np.ndarray, context: int) -> int:
        """How many heads (<= depth) make the best step counting their own cost; 0: none beats a plain step.
        order: every candidate, best first."""
        best, best_rate = 0, rate_to_beat(self.cost, context)
        for d in range(1, depth + 1):
            ranked = chances[self.within(order, d)]
            n, rate = best_count(ranked, self.cost, context, d * (self.head_seconds or 0.0))
            if n and rate > best_rate:
                best, best_rate = d, rate
        return best

    def _learn(self, tokens: list[int]) -> None:
        """Count every run of the heads whose guesses the committed text has settled (a miss, or all depths)."""
        still = []
        for start, top in self.pending:
            actual = tokens[start : start + len(top)]
            if len(actual) == len(top) or any(t not in g for t, g in zip(actual, top, strict=False)):
                for accuracy in (self.accuracy, self.shared):
                    accuracy.record(top, actual)
            else:
                still.append((start, top))
        self.pending = still


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: MedusaOptions, draft: Draft, k: int | str) -> MedusaProposer:
    if not is_path(draft):
        raise ValueError("method 'medusa' drafts with trained heads: pass draft=<their folder>, not a model")
    heads = assets.medusa_heads(draft)
    return MedusaProposer(heads, assets.model.config.vocab_size, cost=assets.cost_model(),
                          accuracy=assets.rank_accuracy(heads))
