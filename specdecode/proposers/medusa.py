"""Medusa: trained heads on the target's last hidden state guess several tokens at once, as a token tree.

The engine hands over the target's last-layer hidden state of every committed position; the newest one
(just before the root) feeds all heads, and head j's top guesses are candidates for depth j + 1.

The tree (Medusa's sparse tree): a node is a tuple of ranks (r1, ..., rd) = head 1's r1-th guess, then
head 2's r2-th, ...; its estimated chance of being accepted is the product of the heads' measured rank
accuracies (saved with the heads). Best-first from the root, the nodes with the highest estimates are
taken, up to `max_nodes` (a parent always scores at least its child, so every prefix is a tree).

Sizing (with a cost model, the way EAGLE-2 sizes by draft confidence): a node's chance is its estimate times
a calibration, accepted guesses per estimated guess, learned from how far each tree run would have matched
the committed text (all its nodes, sent or not) and carried across requests. Before the heads run, each
number of heads d is priced: the best count of nodes up to depth d costs the target's forward of them plus
d heads. When no d beats a plain step, the heads do not run (the step costs nothing extra), except every
PROBE_EVERY-th such step, which runs them all to keep the calibration current. Once they ran their cost is
spent, and the count of nodes sent is the one maximising (1 + expected accepted) / forward seconds.

Greedy: node tokens are those ranks' guesses. Sampling: the same shape, but every node's token is drawn
from its head's distribution q (the heads' logits through the request's sampling processor) independently
of all other draws, so siblings are i.i.d. draws with replacement, which the multi-round rule in verify.py
verifies exactly. (Medusa's "typical acceptance" is lossy and not offered.)
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..policy import Calibration, CostModel, best_count, match_length, smoothed
from ..training.medusa import MedusaHeads
from ..tree import DraftTree
from .base import Proposer

RANKS = 10  # guesses per head a tree may use
PROBE_EVERY = 16  # skipped steps between runs of the heads that only learn (all heads: ~8% of a step)
REQUEST_WEIGHT = 4.0  # a request starts from the long-run calibration worth this many estimated guesses


@dataclass
class TreeShape:
    ranks: list[tuple[int, ...]]  # per guessed node: its path of ranks; parents come first
    parents: list[int]  # per tree node (root = 0 at index 0, parent -1)
    estimates: list[float]  # per guessed node: estimated chance it is accepted

    def within(self, depth: int) -> TreeShape:
        """The nodes at most `depth` deep (still best first, parents first)."""
        keep = [i for i, path in enumerate(self.ranks) if len(path) <= depth]
        index = {0: 0} | {i + 1: j + 1 for j, i in enumerate(keep)}  # tree node: old index -> new
        return TreeShape([self.ranks[i] for i in keep], [-1] + [index[self.parents[i + 1]] for i in keep],
                         [self.estimates[i] for i in keep])

    @cached_property
    def head(self) -> torch.Tensor:  # per node: the head that guesses it
        return torch.tensor([len(path) - 1 for path in self.ranks], dtype=torch.long)

    @cached_property
    def rank(self) -> torch.Tensor:  # per node: which of its head's guesses
        return torch.tensor([path[-1] for path in self.ranks], dtype=torch.long)

    @cached_property
    def chances(self) -> np.ndarray:
        return np.array(self.estimates)

    def paths(self, guesses: list[int]) -> list[list[int]]:
        """Per node: the tokens from the root's first child down to it."""
        out: list[list[int]] = []
        for token, parent in zip(guesses, self.parents[1:], strict=True):
            out.append([*(out[parent - 1] if parent else []), token])
        return out


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


class MedusaProposer(Proposer):
    name = "medusa"
    cheap = True  # without a cost model: ask deep, an adaptive policy cuts the tree by depth
    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, vocab_size: int, *, cost: CostModel | None = None,
                 max_nodes: int = 64, calibration: dict[bool, Calibration] | None = None) -> None:
        """vocab_size: the target's; cost: sizes every step's tree (else up to `max_nodes` nodes, `k` deep);
        calibration: the long-run one per mode (greedy, sampled), shared by the requests that pass it."""
        if heads.config.target_vocab_size != vocab_size:
            raise ValueError(f"Medusa heads for a {heads.config.target_vocab_size}-token vocabulary cannot "
                             f"draft for a target with {vocab_size} tokens")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.heads, self.vocab_size, self.cost = heads, vocab_size, cost
        self.shared = calibration if calibration is not None else {True: Calibration(), False: Calibration()}
        accuracy = heads.config.accuracy or default_accuracy(heads.config.heads)
        vocab = heads.config.draft_vocab_size  # a head has no more distinct guesses than that
        full = medusa_tree([row[:vocab] for row in accuracy], max_nodes)
        self.max_depth = max(len(path) for path in full.ranks)  # heads the tree uses
        self.shapes = {d: full.within(d) for d in range(1, self.max_depth + 1)}
        self.ranks = max(r for path in full.ranks for r in path) + 1
        self.head_seconds: float | None = None  # one head's forward, smoothed
        self.begin([0], 0)

    @property
    def sizes_itself(self) -> bool:
        return self.cost is not None

    def begin(self, prompt: list[int], max_len: int) -> None:
        self.hidden: torch.Tensor | None = None
        self.position = -1  # of the hidden state held
        self.calibration = {mode: c.fork(REQUEST_WEIGHT) for mode, c in self.shared.items()}
        self.pending: list[tuple[int, list[list[int]], float, bool]] = []  # start, paths, estimated, greedy
        self.skipped = 0  # steps since the heads last ran

    def observe_hidden(self, start: int, hidden: list[torch.Tensor]) -> None:
        states = hidden[0]
        self.hidden, self.position = states[-1], start + states.shape[0] - 1

    @torch.inference_mode()
    def propose(self, tokens, k, params, generator) -> DraftTree:
        root = tokens[-1]
        depth = min(k, self.max_depth)
        if self.hidden is None or self.position != len(tokens) - 2 or depth < 1:
            return DraftTree.root_only(root)  # no hidden state for the position before the root (1-token prompt)
        self._learn(tokens)
        context, alpha = len(tokens) - 1, self.calibration[params.greedy].alpha
        if self.cost is not None:
            worth = self._heads_worth_running(depth, alpha, context)
            self.skipped = 0 if worth or self.skipped + 1 >= PROBE_EVERY else self.skipped + 1
            if self.skipped:
                return DraftTree.root_only(root)
            depth = worth or depth  # a probe runs every head: it is for learning
        shape = self.shapes[depth]
        started = time.perf_counter()
        guesses, probs = self._guess(shape, depth, params, generator)
        self.head_seconds = smoothed(self.head_seconds, (time.perf_counter() - started) / depth)
        self.pending.append((len(tokens), shape.paths(guesses), sum(shape.estimates), params.greedy))
        n = len(guesses)
        if self.cost is not None:  # the heads' cost is spent: send what pays for the target's forward
            n = best_count(np.minimum(alpha * shape.chances, 1.0), self.cost, context)[0]
        return DraftTree([root, *guesses[:n]], shape.parents[: n + 1], [None, *probs[:n]])

    def _heads_worth_running(self, depth: int, alpha: float, context: int) -> int:
        """How many heads (<= depth) make the best step counting their own cost; 0: none beats a plain step."""
        best, best_rate = 0, 1.0 / self.cost.forward_seconds(1, context)
        for d in range(1, depth + 1):
            chances = np.minimum(alpha * self.shapes[d].chances, 1.0)
            n, rate = best_count(chances, self.cost, context, d * (self.head_seconds or 0.0))
            if n and rate > best_rate:
                best, best_rate = d, rate
        return best

    def _guess(self, shape: TreeShape, heads: int, params, generator) -> tuple[list[int], list]:
        """Every node's token from the first `heads` heads, and the distribution it was drawn from (sampling)."""
        hidden = self.hidden.to(self.heads.out_weight.dtype)
        if params.greedy:
            top = self.heads.vocab_ids[self.heads(hidden, heads).topk(self.ranks, dim=-1).indices]  # [heads, ranks]
            return top[shape.head, shape.rank].tolist(), [None] * len(shape.ranks)
        q = params.probs(self.heads.target_logits(hidden, heads))  # [heads, V]
        counts = torch.bincount(shape.head, minlength=heads).tolist()
        draws = [torch.multinomial(q[j], n, replacement=True, generator=generator).tolist() if n else []
                 for j, n in enumerate(counts)]
        nodes = shape.head.tolist()
        return [draws[j].pop() for j in nodes], [q[j] for j in nodes]

    def _learn(self, tokens: list[int]) -> None:
        """Calibrate on every tree the heads made, as far as the committed text now shows it would have matched."""
        still = []
        for start, paths, estimated, greedy in self.pending:
            matched, length = match_length(paths, tokens[start:])
            if matched < min(length, len(tokens) - start) or matched == length:  # settled
                for calibration in (self.calibration[greedy], self.shared[greedy]):
                    calibration.record(matched, estimated)
            else:
                still.append((start, paths, estimated, greedy))
        self.pending = still
