"""Medusa: trained heads on the target's last hidden state guess several tokens at once, as a token tree.

The engine hands over the target's last-layer hidden state of every committed position; the newest one
(just before the root) feeds all heads, and head j's top guesses are candidates for depth j + 1.

The tree (Medusa's sparse tree): a node is a tuple of ranks (r1, ..., rd) = head 1's r1-th guess, then
head 2's r2-th, ...; its estimated chance of being accepted is the product of the heads' measured rank
accuracies (saved with the heads). Best-first from the root, the nodes with the highest estimates are
taken (a parent always scores at least its child, so the set is a tree), and how many is decided by the
cost model: the count maximising (1 + expected accepted) / forward seconds, up to `max_nodes`.

Greedy: node tokens are those ranks' guesses. Sampling: the same shape, but every node's token is drawn
from its head's distribution q (the heads' logits through the request's sampling processor) independently
of all other draws, so siblings are i.i.d. draws with replacement, which the multi-round rule in verify.py
verifies exactly. (Medusa's "typical acceptance" is lossy and not offered.)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ..policy import CostModel
from ..training.medusa import MedusaHeads
from ..tree import DraftTree
from .base import Proposer

RANKS = 10  # guesses per head a tree may use


@dataclass
class TreeShape:
    ranks: list[tuple[int, ...]]  # per guessed node: its path of ranks; parents come first
    parents: list[int]  # per tree node (root = 0 at index 0, parent -1)
    estimates: list[float]  # per guessed node: estimated chance it is accepted

    def cut(self, nodes: int) -> TreeShape:
        return TreeShape(self.ranks[:nodes], self.parents[: nodes + 1], self.estimates[:nodes])


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


def best_size(shape: TreeShape, cost: CostModel, context: int) -> int:
    """Guessed nodes maximising (1 + expected accepted) / forward seconds (0: guessing does not pay)."""
    expected = np.concatenate(([0.0], np.cumsum(shape.estimates)))
    rates = [(1 + expected[n]) / cost.forward_seconds(n + 1, context) for n in range(len(expected))]
    return int(np.argmax(rates))


class MedusaProposer(Proposer):
    name = "medusa"
    cheap = True  # the heads cost a few small matmuls: ask deep, the policy cuts the tree by depth
    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, vocab_size: int, *, cost: CostModel | None = None,
                 max_nodes: int = 64) -> None:
        """vocab_size: the target's; cost: sizes the tree per request (else `max_nodes` nodes)."""
        if heads.config.target_vocab_size != vocab_size:
            raise ValueError(f"Medusa heads for a {heads.config.target_vocab_size}-token vocabulary cannot "
                             f"draft for a target with {vocab_size} tokens")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.heads, self.vocab_size, self.cost = heads, vocab_size, cost
        accuracy = heads.config.accuracy or default_accuracy(heads.config.heads)
        vocab = heads.config.draft_vocab_size  # a head has no more distinct guesses than that
        self.full_shape = medusa_tree([row[:vocab] for row in accuracy], max_nodes)
        self.ranks = max(r for path in self.full_shape.ranks for r in path) + 1
        self._use(self.full_shape)
        self.begin([0], 0)

    def _use(self, shape: TreeShape) -> None:
        self.shape = shape
        self.depth = torch.tensor([len(path) - 1 for path in shape.ranks], dtype=torch.long)  # head per node
        self.rank = torch.tensor([path[-1] for path in shape.ranks], dtype=torch.long)

    def begin(self, prompt: list[int], max_len: int) -> None:
        self.hidden: torch.Tensor | None = None
        self.position = -1  # of the hidden state held
        if self.cost is not None:  # a typical context for this request: the prompt and some answer
            self._use(self.full_shape.cut(best_size(self.full_shape, self.cost, len(prompt) + 128)))

    def observe_hidden(self, start: int, hidden: list[torch.Tensor]) -> None:
        states = hidden[0]
        self.hidden, self.position = states[-1], start + states.shape[0] - 1

    @torch.inference_mode()
    def propose(self, tokens, k, params, generator) -> DraftTree:
        root = tokens[-1]
        shape = self.shape
        if self.hidden is None or self.position != len(tokens) - 2 or k < 1 or not shape.ranks:
            return DraftTree.root_only(root)  # no hidden state for the position before the root (1-token prompt)
        depth = self.depth
        if params.greedy:
            logits = self.heads(self.hidden.to(self.heads.out_weight.dtype))  # [K, Vd]
            top = self.heads.vocab_ids[logits.topk(self.ranks, dim=-1).indices]
            guesses, probs = top[depth, self.rank].tolist(), [None] * len(shape.ranks)
        else:
            q = params.probs(self.heads.target_logits(self.hidden.to(self.heads.out_weight.dtype)))  # [K, V]
            counts = torch.bincount(depth, minlength=q.shape[0]).tolist()
            draws = [torch.multinomial(q[j], n, replacement=True, generator=generator).tolist() if n else []
                     for j, n in enumerate(counts)]
            guesses = [draws[j].pop() for j in depth.tolist()]
            probs = [q[j] for j in depth.tolist()]
        tree = DraftTree([root, *guesses], list(shape.parents), [None, *probs])
        return tree.truncate(k)
