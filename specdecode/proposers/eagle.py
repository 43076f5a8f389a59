"""EAGLE: a trained head drafts from the target's own hidden states (see models/eagle.py).

Greedy: an EAGLE-2 dynamic tree. Each depth expands the `topk` most probable children of the `topk`
best frontier nodes (by cumulative draft probability, one head forward per depth), and the `nodes`
best nodes overall are sent for verification; a child never scores above its parent, so that set is
always a tree. Sampling: a chain drawn from the head's distribution q (after the same temperature /
top-k / top-p as the target), which the one lossless core verifies exactly.

The head keeps a KV cache of its own: entries for committed positions hold target features and stay;
draft entries sit after them and are dropped at the next proposal.
"""

from __future__ import annotations

import torch

from ..models import Transformer
from ..models.eagle import EagleHead
from ..sampling import sample
from ..tree import DraftTree
from .base import Proposer


class EagleProposer(Proposer):
    name = "eagle"
    cheap = False

    def __init__(self, head: EagleHead, target: Transformer, *, topk: int = 4, nodes: int = 12) -> None:
        head.check_target(target)
        if topk < 1 or nodes < 1:
            raise ValueError(f"eagle needs topk >= 1 and nodes >= 1, got topk={topk}, nodes={nodes}")
        self.head, self.embed = head, target.embed
        self.vocab_size = target.config.vocab_size
        self.topk, self.nodes = topk, nodes
        self.hidden_layers = tuple(head.config.target_layers)
        self.features: torch.Tensor | None = None  # [max_len, H]: fused target features per committed position
        self.known = 0  # positions with features
        self.cached = 0  # committed entries in the head's cache

    def tree_size(self, depth: int) -> int:
        """Tokens a proposal of this depth sends to the target, the root included (for the cost model)."""
        return 1 + min(self.nodes, self.topk * depth)

    def begin(self, prompt: list[int], max_len: int) -> None:
        h = self.head.config.block.hidden_size
        self.features = torch.zeros(max_len, h, dtype=self.head.lm_head.weight.dtype, device=self.head.device)
        self.cache = self.head.new_cache(max_len + self.nodes * 4 + 64)
        self.known = self.cached = 0

    def observe_hidden(self, start: int, hidden: list[torch.Tensor]) -> None:
        fused = self.head.fuse_features([h.to(self.head.device) for h in hidden])
        self.features[start : start + fused.shape[0]] = fused
        self.known = start + fused.shape[0]
        self.cached = min(self.cached, start)  # entries past a rewritten feature are stale

    def _run(self, features: torch.Tensor, tokens: list[int], positions: list[int], mask: torch.Tensor | None):
        ids = torch.tensor([tokens], device=self.head.device)
        logits, hidden = self.head(features[None], self.embed(ids).to(features.dtype), self.cache,
                                   torch.tensor(positions, device=self.head.device), mask)
        return logits[0], hidden[0]

    def propose(self, tokens, k, params, generator) -> DraftTree:
        root = len(tokens) - 1  # entry t reads (feature t, token t + 1): the last one is entry root - 1
        if k < 1 or root < 1 or self.known < root:
            return DraftTree.root_only(tokens[-1])
        self.cache.rollback(min(self.cached, root - 1))  # at least the root's entry runs
        start = self.cache.length
        logits, hidden = self._run(self.features[start:root], tokens[start + 1 :], list(range(start, root)), None)
        self.cached = root
        logits, hidden = logits[-1], hidden[-1]
        if params.greedy:
            return self._tree(tokens[-1], root, logits, hidden, k)
        return self._chain(tokens[-1], root, logits, hidden, k, params, generator)

    def _full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        full = draft_logits.new_full((self.vocab_size,), float("-inf"))
        full[self.head.d2t] = draft_logits
        return full

    def _chain(self, root_token, root, logits, hidden, k, params, generator) -> DraftTree:
        drafted, probs = [], []
        for depth in range(1, k + 1):
            q = params.probs(self._full_logits(logits).float())
            drafted.append(sample(q, generator))
            probs.append(q)
            if depth < k:
                logits, hidden = self._run(hidden[None], drafted[-1:], [root - 1 + depth], None)
                logits, hidden = logits[-1], hidden[-1]
        return DraftTree.chain(root_token, drafted, probs)

    def _tree(self, root_token, root, logits, hidden, k) -> DraftTree:
        """EAGLE-2: grow by cumulative log-probability, then keep the `nodes` best."""
        tokens: list[int] = []  # target ids of the candidate nodes
        parents: list[int] = []  # -1: a child of the root
        scores: list[float] = []
        slots: list[int] = []  # cache index of each expanded node's head entry (-1: not expanded)
        topk = min(self.topk, self.head.config.draft_vocab_size)

        def add_children(parent: int, logp: torch.Tensor, base: float) -> list[int]:
            values, ids = logp.topk(topk)
            new = []
            for v, i in zip(values.tolist(), self.head.d2t[ids].tolist(), strict=True):
                tokens.append(i)
                parents.append(parent)
                scores.append(base + v)
                slots.append(-1)
                new.append(len(tokens) - 1)
            return new

        frontier = add_children(-1, logits.float().log_softmax(-1), 0.0)
        parent_hidden = {-1: hidden}
        for depth in range(2, k + 1):
            frontier = sorted(frontier, key=lambda n: -scores[n])[:topk]
            start = self.cache.length
            mask = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)
            mask[:, : self.cached] = True
            for row, node in enumerate(frontier):
                slots[node] = start + row
                mask[row, start + row] = True
                p = parents[node]
                while p >= 0:
                    mask[row, slots[p]] = True
                    p = parents[p]
            feats = torch.stack([parent_hidden[parents[n]] for n in frontier])
            positions = [root - 1 + depth - 1] * len(frontier)
            out, hid = self._run(feats, [tokens[n] for n in frontier], positions, mask)
            logp = out.float().log_softmax(-1)
            new = []
            for row, node in enumerate(frontier):
                parent_hidden[node] = hid[row]
                new += add_children(node, logp[row], scores[node])
            frontier = new
        # a child never scores above its parent and the sort is stable, so parents come first
        chosen: set[int] = set()
        for n in sorted(range(len(tokens)), key=lambda n: -scores[n]):
            if len(chosen) == self.nodes:
                break
            if parents[n] < 0 or parents[n] in chosen:
                chosen.add(n)
        keep = sorted(chosen)  # creation order: parents before children
        index = {node: i + 1 for i, node in enumerate(keep)}
        return DraftTree([root_token] + [tokens[n] for n in keep],
                         [-1] + [0 if parents[n] < 0 else index[parents[n]] for n in keep])
