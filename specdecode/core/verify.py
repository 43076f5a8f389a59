"""THE lossless core: verify a DraftTree against the target's logits for each of its nodes.

Greedy: walk down while a child holds the target's argmax; the argmax at the stop node is the
correction (or the bonus token after a fully accepted path).

Sampling (SpecInfer's multi-round rejection sampling, which for a chain is the classic rule):
at a node with target distribution p, try its children in order. Child x drawn from q is accepted with
probability min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)) and the next child is tried.
When no child is accepted, the next token is drawn from the current p. A point-mass guess (q = None)
has q(x) = 1, so it is accepted with probability p(x) and rejection zeroes p(x).
This is exact when each child was drawn from its q independently of its rejected siblings
(deterministic guesses, or draws with replacement), which is what every proposer here produces.

Structured output (grammar.py): each node's logits are masked with the grammar's state at that node as the walk
reaches it (only nodes on the accepted path are ever masked), and the state follows the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sampling import SamplingParams, greedy_token, greedy_tokens, sample
from .tree import DraftTree

if TYPE_CHECKING:
    from .grammar import Constraint


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes, root first
    next_token: int  # the target's own token after the path: correction or bonus

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    constraint: Constraint | None = None, greedy: list[int] | None = None,
) -> Verdict:
    """logits: [n, V], row i = the target's logits after node i; constraint: a grammar the tokens must follow
    (advanced here by every token of the verdict, the next token included); greedy: each row's first maximum where
    it is known already (the native kernel reads it with the logits), else it is taken from the logits."""
    if params.greedy:
        verdict = _verify_greedy(tree, logits, constraint, greedy)
    else:
        verdict = _verify_sampled(tree, logits, params, generator, constraint)
    if constraint is not None:
        constraint.advance(verdict.next_token)
    return verdict


def _verify_greedy(tree: DraftTree, logits: torch.Tensor, constraint: Constraint | None,
                   greedy: list[int] | None = None) -> Verdict:
    best = None if constraint is not None else greedy if greedy is not None else greedy_tokens(logits)
    node, path = 0, [0]
    while True:
        target_token = best[node] if best is not None else greedy_token(constraint.mask(logits[node]))
        child = next((c for c in tree.children(node) if tree.tokens[c] == target_token), None)
        if child is None:
            return Verdict(path, target_token)
        if constraint is not None:
            constraint.advance(target_token)
        path.append(child)
        node = child


def _verify_sampled(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    constraint: Constraint | None,
) -> Verdict:
    node, path = 0, [0]
    while True:
        p = params.probs(logits[node] if constraint is None else constraint.mask(logits[node]))
        accepted = None
        for child in tree.children(node):
            x, q = tree.tokens[child], tree.draft_probs[child]
            q_x = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * q_x < float(p[x]):  # u < p(x)/q(x), without dividing
                accepted = child
                break
            p = residual(p, x, q)
        if accepted is None:
            return Verdict(path, sample(p, generator))
        if constraint is not None:
            constraint.advance(tree.tokens[accepted])
        path.append(accepted)
        node = accepted


def residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution left after rejecting a draw x ~ q."""
    if q is None:
        rest = p.clone()
        rest[x] = 0.0
    else:
        rest = (p - q.to(p.dtype)).clamp_min_(0.0)
    total = rest.sum()
    # Rejection has probability 0 when nothing is left (p <= q everywhere means p == q), so the
    # fallback only guards against rounding; p itself is then the right distribution.
    return rest / total if total > 0 else p
