"""Lookahead decoding: the Jacobi window's mask and positions, losslessness, and edge cases."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import DraftTree
from specdecode.core.verify import Verdict
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers import LookaheadProposer
from specdecode.proposers.base import RequestInfo, StepOutput

from .helpers import ask, tiny_model
from .test_distribution import ALPHA, PROMPT, STEEP, V, chi_square, exact_joint
from .test_lossless import NEW, PROMPTS, VOCAB, naive_greedy

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    threads = torch.get_num_threads()  # module fixtures run before conftest's one-thread fixture
    torch.set_num_threads(1)
    try:
        return [naive_greedy(target, prompt, NEW) for prompt in PROMPTS]
    finally:
        torch.set_num_threads(threads)


def last_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    out = model.forward(torch.tensor([ids]), model.new_cache(len(ids)), logits_at=slice(-1, None))
    return out.logits[0, -1]


def fill_window(proposer: LookaheadProposer, tokens: list[int], steps: int, seed: int) -> None:
    """Advance the window through observe with made-up logits, so its levels hold arbitrary tokens."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tree = proposer.propose(ask(tokens, 3))
        assert tree.extra is not None
        proposer.observe(tree, Verdict([0], 0), StepOutput(tokens, len(tokens) - 1,
                         extra_logits=torch.randn(len(tree.extra.tokens), VOCAB, generator=gen)))


# ---------------------------------------------------------------------------------- mask / positions


@pytest.mark.parametrize("window,ngram", [(1, 2), (3, 2), (4, 3), (3, 5)])
def test_window_mask_and_positions(target: Transformer, window: int, ngram: int) -> None:
    """Each node's logits in the one tree forward equal a plain forward over exactly what it should see."""
    prompt = PROMPTS[6]
    proposer = LookaheadProposer(window, ngram, guesses=3)
    proposer.begin(RequestInfo(prompt, 10_000))
    fill_window(proposer, prompt, ngram, seed=window * 10 + ngram)  # all levels filled, then one slide
    tree = proposer.propose(ask(prompt, 3))
    extra = tree.extra
    assert extra is not None and len(extra.tokens) == (ngram - 1) * window
    assert tree.num_drafted > 0  # prompt n-grams give guesses for the root: both branches are checked

    tokens, positions, mask = tree.forward_inputs(len(prompt) - 1)
    cache = target.new_cache(len(prompt) + len(tokens))
    target.forward(torch.tensor([prompt[:-1]]), cache, logits_at=None)
    logits = target.forward(torch.tensor([tokens]), cache, positions=positions, tree_mask=mask).logits[0]

    for i, path in enumerate(tree.node_paths()[1:], start=1):  # guesses see their ancestors only, never the window
        torch.testing.assert_close(logits[i], last_logits(target, prompt + path), atol=1e-9, rtol=0)

    n, levels = len(tree), [extra.tokens[r * window : (r + 1) * window] for r in range(ngram - 1)]
    top = []
    for r in range(ngram - 1):
        for c in range(window):
            # node (r, c) continues the pseudo-sequence root, L0[0..c], L1[c], ..., Lr[c]
            seen = levels[0][: c + 1] + [levels[q][c] for q in range(1, r + 1)]
            expected = last_logits(target, prompt + seen)
            torch.testing.assert_close(logits[n + r * window + c], expected, atol=1e-9, rtol=0)
            if r == ngram - 2:
                top.append(int(expected.argmax()))

    # observe: the target's argmax after the top level is the new top level, and each column plus it an n-gram
    proposer.observe(tree, Verdict([0], 0), StepOutput(prompt, len(prompt) - 1, extra_logits=logits[n:]))
    assert proposer.levels[-1] == top
    assert proposer.levels[:-1] == levels[1:]
    for c in range(window):
        gram = (*(level[c] for level in levels[1:]), top[c])
        assert gram in proposer.pool[levels[0][c]]


# ------------------------------------------------------------------------------------ greedy equality

CONFIGS = [  # (window, ngram, guesses, text_ngrams)
    (4, 3, 4, True),
    (4, 3, 4, False),  # guesses come from the Jacobi window alone
    (1, 2, 1, False),
    (5, 4, 3, True),
]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_greedy_lookahead_equals_plain(target, reference, config: tuple, k: int) -> None:
    proposer = LookaheadProposer(*config)
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        out, stats = generate_ids(target, prompt, proposer=proposer, k=k, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted += stats.drafted
        accepted += stats.accepted
    # guesses were both accepted and rejected (without text n-grams: the window's n-grams are right sometimes)
    assert 0 < accepted < drafted, (accepted, drafted)


def test_window_ngrams_alone_are_useful(target, reference) -> None:
    """Without text n-grams the pool holds only window n-grams, and some turn up in the greedy text."""
    proposer = LookaheadProposer(4, 3, 4, text_ngrams=False)
    out, stats = generate_ids(target, PROMPTS[3], proposer=proposer, k=2, max_new_tokens=NEW)
    assert out == reference[3] and stats.accepted > 0
    text = PROMPTS[3] + out
    grams = {tuple(text[i : i + 3]) for i in range(len(text) - 2)}
    assert any((first, *cont) in grams for first, conts in proposer.pool.items() for cont in conts)


class CountingLookahead(LookaheadProposer):
    """Counts the steps whose window reached the target, and those the policy dropped it in."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = [0, 0]  # [with window, without]

    def observe(self, tree, verdict, outputs) -> None:
        self.steps[tree.extra is None] += 1
        super().observe(tree, verdict, outputs)


@pytest.mark.parametrize("cost", ["measured", "steep"])
def test_greedy_lookahead_with_adaptive_k(target, reference, cost: str) -> None:
    """AdaptiveK cuts the guesses or drops the window (steep costs: always, when there are guesses)."""
    model = CostModel.measure(target, repeats=1) if cost == "measured" else STEEP
    proposer, shared = CountingLookahead(), AcceptanceStats()
    for prompt, expected in zip(PROMPTS[2:7], reference[2:7], strict=True):
        policy = AdaptiveK(model, shared, cheap=True)
        out, _ = generate_ids(target, prompt, proposer=proposer, k=policy, max_new_tokens=NEW)
        assert out == expected
    if cost == "steep":  # (the measured costs depend on the machine's load: no assertion on them)
        assert proposer.steps[1] > 0


def test_dropped_window_stays_usable() -> None:
    """A root-only tree (the policy dropped the window) leaves the window as it was."""
    proposer = LookaheadProposer(window=3, ngram=3)
    prompt = [5, 6, 7, 5, 6]
    proposer.begin(RequestInfo(prompt, 1000))
    fill_window(proposer, prompt, 1, seed=0)
    levels = [list(level) for level in proposer.levels]
    stale = proposer.propose(ask(prompt, 2))
    proposer.observe(DraftTree.root_only(prompt[-1]), Verdict([0], 1), StepOutput(prompt, len(prompt) - 1))
    assert proposer.levels == levels
    fresh = proposer.propose(ask(prompt, 2))
    logits = torch.randn(len(fresh.extra.tokens), VOCAB, generator=torch.Generator().manual_seed(0))
    # not the tree of the last proposal: ignored
    proposer.observe(stale, Verdict([0], 1), StepOutput(prompt, len(prompt) - 1, extra_logits=logits))
    assert proposer.levels == levels
    proposer.observe(fresh, Verdict([0], 1), StepOutput(prompt, len(prompt) - 1, extra_logits=logits))
    assert proposer.levels == [levels[1], logits[-3:].argmax(-1).tolist()]

# -------------------------------------------------------------------------------------- distribution


@pytest.fixture(scope="module")
def small_target() -> Transformer:
    """The tiny-vocabulary target of test_distribution."""
    return tiny_model(3, head_gain=3.0, vocab_size=V, num_layers=1, hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1, head_dim=16)


def test_sampled_lookahead_matches_target_distribution(small_target: Transformer) -> None:
    params, tokens, samples = SamplingParams(temperature=1.0), 3, 2000
    proposer = LookaheadProposer(window=3, ngram=2, guesses=3)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(samples):
        out, stats = generate_ids(small_target, PROMPT, proposer=proposer, k=4, max_new_tokens=tokens,
                                  params=params, seed=seed)
        counts[tuple(out)] += 1
        drafted += stats.drafted
        accepted += stats.accepted
    assert 0 < accepted < drafted
    pvalue, tv = chi_square(counts, exact_joint(small_target, PROMPT, params, tokens), samples)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}, total variation {tv:.3f}"
    assert tv < 0.1


# ---------------------------------------------------------------------------------------- edge cases


def test_one_token_prompt(target: Transformer) -> None:
    prompt = [7]
    out, _ = generate_ids(target, prompt, proposer=LookaheadProposer(), k=4, max_new_tokens=20)
    assert out == naive_greedy(target, prompt, 20)


def test_k_zero_and_one_new_token(target: Transformer, reference) -> None:
    out, stats = generate_ids(target, PROMPTS[6], proposer=LookaheadProposer(), k=0, max_new_tokens=NEW)
    assert out == reference[6] and stats.drafted == 0
    for k in (0, 4):
        out, stats = generate_ids(target, PROMPTS[6], proposer=LookaheadProposer(), k=k, max_new_tokens=1)
        assert out == reference[6][:1] and stats.target_forwards == 1


def test_window_too_big_for_the_cache_is_left_out(target: Transformer, reference) -> None:
    """300 window nodes do not fit the cache's room for guesses: the window is skipped, not overflowed."""
    out, _ = generate_ids(target, PROMPTS[6], proposer=LookaheadProposer(window=100, ngram=4), k=4,
                          max_new_tokens=NEW)
    assert out == reference[6]


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 0}, "window"),
    ({"ngram": 1}, "ngram"),
    ({"guesses": 0}, "guesses"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=rf"{match} .*must be >= \d, got"):
        LookaheadProposer(**kwargs)
