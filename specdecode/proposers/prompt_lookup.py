"""Prompt lookup: guess that the text after an earlier occurrence of the last n-gram repeats.

Matches are searched in the prompt and the generated text, longest n-gram first and most recent
occurrence first. With `branches` > 1 the continuations of several matches form a tree.
Guesses are point masses (q = 1 on the guessed token), which keeps sampling exact.

Every n-gram's end positions are kept in a dict, extended as tokens commit, so a step costs a few
dictionary lookups whatever the text's length: proposing must stay a small part of a step, and a scan of the whole
text grows with it (what the scan cost: benchmarks/results/comment-timings.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common.method_options import PromptLookupOptions
from ..core.tree import DraftTree
from ..policy.speculation import Guessing
from .base import ProposalContext, Proposer, RequestInfo


class PromptLookupProposer(Proposer):
    name = "prompt-lookup"
    guessing = Guessing(cheap=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token, ascending
        self._indexed: list[int] = []  # the tokens indexed so far

    def begin(self, request: RequestInfo) -> None:
        self._ends, self._indexed = {}, []

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens = context.tokens
        paths, n = self.match(tokens, context.k)
        return DraftTree.from_paths(tokens[-1], paths, bucket=n)  # longer matches are accepted more often

    def continuations(self, tokens: list[int], k: int) -> list[list[int]]:
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int, drafted: list[int] | None = None) -> tuple[list[list[int]], int]:
        """Continuations of the longest n-gram that matches, and n (0 when nothing matches). drafted: tokens guessed
        after `tokens` (a cascade's model draft): the n-gram ending them is matched in `tokens`, which alone are
        indexed (so the index keeps growing with the committed text instead of restarting each guess)."""
        self._index(tokens)
        length = len(tokens)
        text = tokens + drafted if drafted else tokens
        for n in range(min(self.max_ngram, len(text) - 1), self.min_ngram - 1, -1):
            paths: list[list[int]] = []
            for end in reversed(self._ends.get(tuple(text[-n:]), ())):
                if end >= length - 1:  # the text's own end: nothing after it to guess
                    continue
                path = tokens[end + 1 : end + 1 + k]
                if path not in paths:
                    paths.append(path)
                    if len(paths) == self.branches:
                        break
            if paths:
                return paths, n
        return [], 0

    def _index(self, tokens: list[int]) -> None:
        """File the n-grams ending at each token not indexed yet (from scratch if `tokens` is another text)."""
        done = len(self._indexed)
        if done > len(tokens) or (done and tokens[done - 1] != self._indexed[-1]):
            self._ends, self._indexed, done = {}, [], 0
        self._indexed.extend(tokens[done:])
        text, ends = self._indexed, self._ends
        for end in range(done, len(text)):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                ends.setdefault(tuple(text[end - n + 1 : end + 1]), []).append(end)


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: PromptLookupOptions, draft: Draft, k: int | str) -> Proposer:
    branches = options.branches
    if branches is None:
        branches = assets.auto_branches() if k == "auto" else 1
    return PromptLookupProposer(max_ngram=options.max_ngram, min_ngram=options.min_ngram, branches=branches)
