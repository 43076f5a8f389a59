"""DraftTree: the candidate tokens of one step, as a tree rooted at the last committed token.

Node 0 is the root: the last committed token, whose keys/values are not cached yet. Every other node
is a guess for the token after its parent. A chain is a tree with one child per node.
Each guessed node records the draft distribution q it was drawn from (None = a point mass on the
token, e.g. an n-gram lookup or a greedy draft), which is what lossless sampling needs.

A proposer may also ride extra nodes along in the same target forward (lookahead decoding's Jacobi
window): they see the committed prefix, the root and each other as `extra.mask` says, no guess ever
sees them, nothing about them is verified and their cache entries are dropped after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass
class ExtraNodes:
    tokens: list[int]
    offsets: list[int]  # position - root position (>= 1)
    mask: torch.Tensor  # [m, m] bool: extra node i sees extra node j (the root and prefix always)


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # parents[0] == -1; parents[i] < i
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # q per node (root: None)
    bucket: int = 0  # the proposer's confidence class (e.g. n-gram length matched): acceptance is tracked per class
    extra: ExtraNodes | None = None
    _children: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a DraftTree needs a root (parent -1) and one parent per token")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError("every node's parent must come before it")
        if not self.draft_probs:
            self.draft_probs = [None] * len(self.tokens)

    # -------------------------------------------------------------------------------- constructors
    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        return cls([root], [-1])

    @classmethod
    def chain(cls, root: int, tokens: Sequence[int], probs: Sequence[torch.Tensor | None] | None = None) -> DraftTree:
        n = len(tokens)
        return cls([root, *tokens], list(range(-1, n)), [None, *(probs or [None] * n)])

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]], bucket: int = 0) -> DraftTree:
        """Merge token paths (point-mass guesses) into a trie; shared prefixes become one branch."""
        tokens, parents = [root], [-1]
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for tok in path:
                key = (node, tok)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = index[key]
        return cls(tokens, parents, bucket=bucket)

    # ------------------------------------------------------------------------------------ geometry
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        if self._children is None:
            kids: list[list[int]] = [[] for _ in self.tokens]
            for i, p in enumerate(self.parents[1:], start=1):
                kids[p].append(i)
            self._children = kids
        return self._children[node]

    def depths(self, start: int = 0) -> torch.Tensor:
        """Each node's depth, plus `start` (absolute positions after `start` cached tokens)."""
        return torch.tensor([start + d for d in self._depth_list()])

    def _depth_list(self) -> list[int]:
        depth = [0] * len(self.tokens)
        for i, p in enumerate(self.parents[1:], start=1):
            depth[i] = depth[p] + 1
        return depth

    @property
    def depth(self) -> int:
        return max(self._depth_list())  # asked after every step: no tensor

    def forward_sizes(self) -> list[int]:
        """[d]: tokens the target sees when the tree is `cut` at depth d (the root alone at depth 0; else the nodes
        at most d deep and any extra nodes)."""
        depths = self._depth_list()
        per_depth = [0] * (max(depths) + 1)
        for d in depths:
            per_depth[d] += 1
        extra = len(self.extra.tokens) if self.extra is not None else 0
        return [1] + [n + extra for n in accumulate(per_depth)][1:]

    def paths(self) -> list[list[int]]:
        """Guessed tokens from the root to each leaf."""
        to_node = self.node_paths()
        return [to_node[i] for i in range(len(self.tokens)) if not self.children(i) and to_node[i]]

    def node_paths(self) -> list[list[int]]:
        """Per node, the guessed tokens from the root down to it (the root's: none; parents come before children)."""
        out: list[list[int]] = [[]]
        for i in range(1, len(self.tokens)):
            out.append(out[self.parents[i]] + [self.tokens[i]])
        return out

    def truncate(self, depth: int) -> DraftTree:
        """The nodes at most `depth` guesses deep (parents come first, so indices stay ordered)."""
        depths = self._depth_list()
        if max(depths) <= depth:
            return self
        keep = [i for i, d in enumerate(depths) if d <= depth]
        new_index = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            [self.tokens[i] for i in keep],
            [-1] + [new_index[self.parents[i]] for i in keep[1:]],
            [self.draft_probs[i] for i in keep],
            bucket=self.bucket,
            extra=self.extra,
        )

    def cut(self, depth: int) -> DraftTree:
        """What the target verifies when a policy keeps `depth` guesses: at depth 0 a plain step (no extra nodes)."""
        return self.truncate(depth) if depth else DraftTree.root_only(self.tokens[0])

    def without_extra(self) -> DraftTree:
        return self if self.extra is None else DraftTree(self.tokens, self.parents, self.draft_probs, self.bucket)

    def forward_inputs(self, start: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """Tokens, absolute positions and [n, n] mask (None = causal chain) for the target forward at `start`."""
        positions, mask = self.depths(start), self.attention_mask()
        if self.extra is None:
            return self.tokens, positions, mask
        n, m = len(self.tokens), len(self.extra.tokens)
        full = torch.zeros(n + m, n + m, dtype=torch.bool)
        full[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask
        full[n:, 0] = True
        full[n:, n:] = self.extra.mask | torch.eye(m, dtype=torch.bool)
        positions = torch.cat((positions, start + torch.tensor(self.extra.offsets, dtype=positions.dtype)))
        return self.tokens + self.extra.tokens, positions, full

    def attention_mask(self) -> torch.Tensor | None:
        """[n, n] bool: node i sees itself and its ancestors. None for a chain (plain causal)."""
        if self.is_chain:
            return None
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask
