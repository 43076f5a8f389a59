"""Lookahead decoding (Fu et al. 2024): Jacobi iterations ride along in the verification forward.

The proposer keeps a 2D window of `ngram - 1` levels x `window` columns of guessed tokens. Each step the
levels go to the target as extra nodes of the DraftTree, laid out so that one forward is one Jacobi
iteration: the target's argmax after the last level becomes the next level. Each column then reads
level 0, 1, ..., new top to bottom as an n-gram the target produced in one (guessed) context, and goes
into a pool keyed by its first token; n-grams of the committed text go there too. Guesses for the next
tokens are the pool's continuations of the root, verified as a trie of point masses, so both greedy
and sampled decoding stay exact whatever the window holds.

Layout of extra node (r, c) (level r, column c; index r * window + c): offset 1 + r + c after the root;
it sees level 0 columns 0..c and levels 1..r of its own column, i.e. the pseudo-sequence
root, L0[0..c], L1[c], ..., Lr[c], whose positions are consecutive.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING

import torch

from ..common.method_options import LookaheadOptions
from ..core.sampling import greedy_tokens
from ..core.tree import DraftTree, ExtraNodes
from ..core.verify import Verdict
from ..policy.speculation import Guessing
from .base import ProposalContext, Proposer, RequestInfo, StepOutput


class LookaheadProposer(Proposer):
    name = "lookahead"
    guessing = Guessing(cheap=True)

    def __init__(self, window: int = 4, ngram: int = 3, guesses: int = 4, text_ngrams: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window (Jacobi columns) must be >= 1, got {window}")
        if ngram < 2:
            raise ValueError(f"ngram (tokens per n-gram: the root plus ngram - 1 guesses) must be >= 2, got {ngram}")
        if guesses < 1:
            raise ValueError(f"guesses (pool continuations verified per step) must be >= 1, got {guesses}")
        self.window, self.ngram, self.guesses, self.text_ngrams = window, ngram, guesses, text_ngrams
        self.cap = 4 * guesses  # continuations kept per first token
        self._begin([0], None)

    def begin(self, request: RequestInfo) -> None:
        self._begin(request.prompt, request.max_len)

    def _begin(self, prompt: list[int], max_len: int | None) -> None:
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.seen_in_text: set[tuple[int, ...]] = set()  # n-grams the committed text contains
        self.max_len = max_len
        self._ingested = 0  # committed tokens whose ending n-grams are in the pool
        # Level 0 starts as random prompt tokens (as the reference does: plausible, and no model call);
        # further levels fill one per step, so every level is a genuine Jacobi iterate of the one below.
        rng = random.Random(0)  # fixed: a request's guesses do not depend on what ran before it
        self.levels: list[list[int]] = [[rng.choice(prompt) for _ in range(self.window)]]
        self._extra: ExtraNodes | None = None  # what the last propose sent, to recognise it in observe
        if self.text_ngrams:
            self._ingest_text(prompt)

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k = context.tokens, context.k
        if self.text_ngrams:
            self._ingest_text(tokens)
        paths = [list(cont[:k]) for cont in self.pool.get(tokens[-1], [])[: self.guesses]] if k > 0 else []
        # bucket: whether the best guess already occurred in the text (1) or only came from the window (2),
        # which the adaptive policy finds are accepted at quite different rates
        bucket = 0 if not paths else 1 if (tokens[-1], *self.pool[tokens[-1]][0]) in self.seen_in_text else 2
        tree = DraftTree.from_paths(tokens[-1], paths, bucket=bucket)
        extra = self._window_nodes()
        # The window needs cache room after the guesses; near a tight cache it is left out this step.
        if self.max_len is None or len(tokens) - 1 + len(tree) + len(extra.tokens) <= self.max_len:
            tree.extra = self._extra = extra
        return tree

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        if tree is None or tree.extra is None or tree.extra is not self._extra:
            return  # the policy dropped the window this step: keep it as it is
        self._extra = None
        w = self.window
        assert outputs.extra_logits is not None  # the window rode along: the engine returns its logits
        new = greedy_tokens(outputs.extra_logits[-w:])  # the target's next token after each top-level node
        if len(self.levels) < self.ngram - 1:  # still filling the window
            self.levels.append(new)
            return
        for c in range(w):  # each column plus its new token is an n-gram the target produced
            self._add(self.levels[0][c], (*(level[c] for level in self.levels[1:]), new[c]))
        self.levels = [*self.levels[1:], new]

    # ------------------------------------------------------------------------------------ helpers
    def _window_nodes(self) -> ExtraNodes:
        tokens = [tok for level in self.levels for tok in level]
        return ExtraNodes(tokens, *window_layout(self.window, len(self.levels)))

    def _ingest_text(self, tokens: list[int]) -> None:
        n = self.ngram
        for end in range(max(self._ingested, n), len(tokens) + 1):
            self._add(tokens[end - n], tuple(tokens[end - n + 1 : end]))
            self.seen_in_text.add(tuple(tokens[end - n : end]))
        self._ingested = max(self._ingested, len(tokens))

    def _add(self, first: int, cont: tuple[int, ...]) -> None:
        """Most recent first, no duplicates, at most `cap` per first token."""
        conts = self.pool.setdefault(first, [])
        if cont in conts:
            conts.remove(cont)
        conts.insert(0, cont)
        del conts[self.cap :]


@functools.cache  # a handful of (window, levels) pairs: building the mask each step was 2% of a step
def window_layout(window: int, levels: int) -> tuple[list[int], torch.Tensor]:
    """Offsets and mask of a window of `levels` levels x `window` columns (see the module docstring); read only."""
    offsets = [1 + r + c for r in range(levels) for c in range(window)]
    mask = torch.zeros(levels * window, levels * window, dtype=torch.bool)
    for r in range(levels):
        for c in range(window):
            i = r * window + c
            mask[i, :c] = True  # level 0, earlier columns
            mask[i, c : i : window] = True  # own column, lower levels (level 0 included)
    return offsets, mask


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: LookaheadOptions, draft: Draft, k: int | str) -> Proposer:
    return LookaheadProposer(window=options.window, ngram=options.ngram, guesses=options.guesses)
