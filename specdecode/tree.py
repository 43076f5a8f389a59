"""DraftTree: the candidate tokens of one step, as a tree rooted at the last committed token.

Node 0 is the root: the last committed token, whose keys/values are not cached yet. Every other node
is a guess for the token after its parent. A chain is a tree with one child per node.
Each guessed node records the draft distribution q it was drawn from (None = a point mass on the
token, e.g. an n-gram lookup or a greedy draft), which is what lossless sampling needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # parents[0] == -1; parents[i] < i
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # q per node (root: None)
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
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> DraftTree:
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
        return cls(tokens, parents)

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

    def depths(self) -> torch.Tensor:
        depth = [0] * len(self.tokens)
        for i, p in enumerate(self.parents[1:], start=1):
            depth[i] = depth[p] + 1
        return torch.tensor(depth)

    def attention_mask(self) -> torch.Tensor | None:
        """[n, n] bool: node i sees itself and its ancestors. None for a chain (plain causal)."""
        if self.is_chain:
            return None
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask
