"""Prompt lookup: guess that the text after an earlier occurrence of the last n-gram repeats.

Matches are searched in the prompt and the generated text, longest n-gram first and most recent
occurrence first. With `branches` > 1 the continuations of several matches form a tree.
Guesses are point masses (q = 1 on the guessed token), which keeps sampling exact.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..tree import DraftTree
from .base import Capabilities, Proposer


class PromptLookupProposer(Proposer):
    name = "prompt-lookup"
    capabilities = Capabilities(cheap=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches

    def propose(self, tokens, k, params, generator) -> DraftTree:
        paths, n = self.match(tokens, k)
        return DraftTree.from_paths(tokens[-1], paths, bucket=n)  # longer matches are accepted more often

    def continuations(self, tokens: list[int], k: int) -> list[list[int]]:
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[list[int]], int]:
        """Continuations of the longest n-gram that matches, and n (0 when nothing matches)."""
        seq = np.asarray(tokens)
        length = len(seq)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows start at 0..length-n-1: each has at least one token after it to guess
            windows = sliding_window_view(seq[:-1], n)
            starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            paths: list[list[int]] = []
            for start in starts[::-1]:
                path = seq[start + n : start + n + k].tolist()
                if path not in paths:
                    paths.append(path)
                    if len(paths) == self.branches:
                        break
            if paths:
                return paths, n
        return [], 0
