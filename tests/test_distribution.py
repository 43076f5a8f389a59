"""Sampled speculative decoding is lossless: generated tokens follow the target's exact distribution.

A tiny-vocabulary target lets us enumerate the exact joint distribution of the first few generated
tokens (with the same temperature / top-k / top-p processing the engine applies). Thousands of
speculative samples (fixed seeds, so the outcome is deterministic) are compared with it by a
chi-square goodness-of-fit test. A negative control swaps in a wrong rejection rule and checks that
the same test rejects it, so a pass means something.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

import specdecode.core.verify
from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers import (
    AsyncDraftProposer,
    Drafter,
    DraftModelProposer,
    HybridProposer,
    PromptLookupProposer,
    Proposer,
)

from .helpers import TEST_DEVICE, FrozenCost, noisy_copy, tiny_model
from .test_processing import reference

V = 8
# Token 0 appears three times, each followed by a different token: prompt lookup guesses 7 (most
# recent match, then 6 after it), and as a tree the siblings 7, 5, 6. With this target those guesses
# have probabilities ~0.16, 0.09, 0.25 (and 6 after 7 ~0.56): accepted sometimes, rejected sometimes.
PROMPT = [0, 6, 7, 0, 5, 2, 0, 7, 6, 0]
ALPHA = 1e-4  # per-test false-alarm rate; the negative controls land many orders of magnitude below
DRAFTER = Drafter()  # drafts ahead for the asynchronous cases


@pytest.fixture(scope="module")
def target() -> Transformer:
    """One layer is enough for the context to matter, and keeps thousands of generations cheap."""
    return tiny_model(3, head_gain=3.0, vocab_size=V, num_layers=1, hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1, head_dim=16).to(TEST_DEVICE)


@pytest.fixture(scope="module")
def draft(target: Transformer) -> Transformer:
    return noisy_copy(target, seed=5, noise=0.3)  # q clearly differs from p


def exact_joint(target: Transformer, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(first n generated tokens), enumerated with full forwards and the engine's logits processing."""
    joint: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, mass in joint.items():
            if mass == 0:
                continue
            ids = prompt + list(prefix)
            logits = target.forward(torch.tensor([ids], device=target.device), target.new_cache(len(ids)),
                                    logits_at=slice(-1, None))
            last = logits.logits[0, -1]
            if params.processes:  # bias and penalties, the plain way: this prefix is the whole history
                last = reference(last, ids, len(prompt), params)
            probs = params.probs(last).tolist()
            for token, p in enumerate(probs):
                grown[prefix + (token,)] = mass * p
        joint = grown
    return joint


def chi_square(counts: Counter, joint: dict[tuple, float], samples: int) -> tuple[float, float]:
    """(p-value, total variation distance) of the counts against the exact joint.

    Cells with expected count < 5 are pooled into one so the chi-square approximation holds.
    """
    outside = [seq for seq in counts if joint.get(seq, 0.0) == 0.0]
    assert not outside, f"sampled impossible sequences {outside[:5]}: the support is wrong"
    cells = sorted(joint, key=joint.get)
    observed, expected = [], []
    pool_obs, pool_exp = 0, 0.0
    for seq in cells:
        exp = joint[seq] * samples
        if exp < 5:
            pool_obs += counts.get(seq, 0)
            pool_exp += exp
        else:
            observed.append(counts.get(seq, 0))
            expected.append(exp)
    if pool_exp >= 5:
        observed.append(pool_obs)
        expected.append(pool_exp)
    elif pool_exp > 0:  # too little to stand alone: merge into the smallest kept cell (cells are ascending)
        observed[0] += pool_obs
        expected[0] += pool_exp
    assert len(observed) >= 4, "too few cells for a meaningful test"
    total_variation = 0.5 * sum(abs(counts.get(seq, 0) / samples - joint[seq]) for seq in joint)
    return float(chisquare(observed, expected).pvalue), total_variation


@dataclass
class Case:
    proposer: Callable[[Transformer, Transformer], Proposer]
    params: SamplingParams
    tokens: int  # generated tokens compared; 3 lets a chain guess 2 deep (k is clamped to tokens - 1)
    samples: int = 3000
    adaptive: bool = False  # depth chosen by AdaptiveK, which learns across the samples


# Verifying costs 1 + 0.25 per extra token: the adaptive policy's choices depend on what it has seen.
STEEP = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 16.75], [1.0, 16.75]])


CASES = {
    "prompt-lookup": Case(lambda t, d: PromptLookupProposer(), SamplingParams(temperature=1.0), 3),
    "prompt-lookup-tree": Case(lambda t, d: PromptLookupProposer(branches=3), SamplingParams(temperature=1.0), 2),
    "prompt-lookup-tree-top-k": Case(lambda t, d: PromptLookupProposer(branches=3),
                                     SamplingParams(temperature=0.8, top_k=4), 3),
    "draft": Case(lambda t, d: DraftModelProposer(d, V), SamplingParams(temperature=1.0), 3),
    "draft-top-p": Case(lambda t, d: DraftModelProposer(d, V), SamplingParams(temperature=1.2, top_k=6, top_p=0.8),
                        2),
    "prompt-lookup-tree-auto": Case(lambda t, d: PromptLookupProposer(branches=3), SamplingParams(temperature=1.0),
                                    3, adaptive=True),
    "hybrid": Case(lambda t, d: HybridProposer(PromptLookupProposer(branches=2), DraftModelProposer(d, V)),
                   SamplingParams(temperature=1.0), 3),
    "hybrid-auto": Case(lambda t, d: HybridProposer(PromptLookupProposer(), DraftModelProposer(d, V),
                                                    AdaptiveK(STEEP, AcceptanceStats(), cheap=False)),
                        SamplingParams(temperature=1.0), 3, adaptive=True),
    "draft-auto": Case(lambda t, d: DraftModelProposer(d, V), SamplingParams(temperature=1.0), 3, adaptive=True),
    # prompt lookup guesses for the draft (kept with probability q, else a draw from q without the guess)
    "draft-cascade": Case(lambda t, d: DraftModelProposer(d, V, lookup=PromptLookupProposer()),
                          SamplingParams(temperature=1.0), 3),
    # chains drafted ahead, taken when the outcome they guessed came true (patient: the same hits every run)
    "draft-async": Case(lambda t, d: AsyncDraftProposer(DraftModelProposer(d, V), DRAFTER, patient=True),
                        SamplingParams(temperature=1.0), 4),
    "draft-async-cascade-top-k": Case(lambda t, d: AsyncDraftProposer(
        DraftModelProposer(d, V, lookup=PromptLookupProposer()), DRAFTER, patient=True),
        SamplingParams(temperature=0.8, top_k=5), 3),
    # bias and penalties processed per tree node with its own history; the drafts' q stay unprocessed
    "prompt-lookup-tree-penalties": Case(lambda t, d: PromptLookupProposer(branches=3), SamplingParams(
        temperature=1.0, logit_bias={6: 0.8, 3: -1.5}, presence_penalty=0.6, frequency_penalty=0.5,
        repetition_penalty=1.4), 3),
    "draft-penalties": Case(lambda t, d: DraftModelProposer(d, V), SamplingParams(
        temperature=0.9, top_k=6, min_p=0.05, presence_penalty=-0.4, frequency_penalty=0.8, repetition_penalty=0.8),
        3),
}


def sample_counts(target: Transformer, draft: Transformer, case: Case, samples: int) -> tuple[Counter, dict]:
    proposer = case.proposer(target, draft)
    counts: Counter = Counter()
    totals = Counter()
    shared = AcceptanceStats()
    for seed in range(samples):
        k = AdaptiveK(STEEP, shared, cheap=proposer.guessing.cheap) if case.adaptive else 4
        out, stats = generate_ids(target, PROMPT, proposer=proposer, k=k, max_new_tokens=case.tokens,
                                  params=case.params, seed=seed)
        assert len(out) == case.tokens
        counts[tuple(out)] += 1
        totals.update(drafted=stats.drafted, accepted=stats.accepted)
    return counts, totals


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_target_distribution(target: Transformer, draft: Transformer, name: str):
    case = CASES[name]
    joint = exact_joint(target, PROMPT, case.params, case.tokens)
    counts, totals = sample_counts(target, draft, case, case.samples)
    # guesses were made, and both accepted and rejected: the test saw every branch of the rule
    assert 0 < totals["accepted"] < totals["drafted"], totals
    pvalue, tv = chi_square(counts, joint, case.samples)
    assert pvalue > ALPHA, f"{name}: chi-square p = {pvalue:.2e}, total variation {tv:.3f}"
    assert tv < 0.1


def test_guesses_are_informative(target: Transformer) -> None:
    """The prompt-lookup guesses have middling target probability (else accept/reject would be trivial)."""
    p = exact_joint(target, PROMPT, SamplingParams(temperature=1.0), 1)
    for guess in (7, 5, 6):
        assert 0.05 < p[(guess,)] < 0.6


@pytest.mark.parametrize("name", ["prompt-lookup-tree", "draft-top-p"])
def test_negative_control_wrong_rule_is_detected(target, draft, monkeypatch, name: str) -> None:
    """Resampling from p itself after a rejection (skipping the residual max(0, p - q)) must be caught."""
    monkeypatch.setattr(specdecode.core.verify, "residual", lambda p, x, q: p)
    case = CASES[name]
    samples = 1000  # the wrong rule is off by ~0.2 in total variation: far fewer samples suffice
    counts, totals = sample_counts(target, draft, case, samples)
    assert totals["accepted"] < totals["drafted"]  # rejections happened, so the wrong rule was exercised
    pvalue, tv = chi_square(counts, exact_joint(target, PROMPT, case.params, case.tokens), samples)
    assert pvalue < 1e-8, f"the wrong rule went unnoticed: p = {pvalue:.2e}, total variation {tv:.3f}"


def test_negative_control_cascade_keeping_every_guess_is_detected(target, draft, monkeypatch) -> None:
    """A cascade whose draft keeps every lookup guess (instead of with probability q) drafts tokens that are not
    draws from the q it reports: the test must catch it."""
    monkeypatch.setattr(DraftModelProposer, "_keeps", staticmethod(lambda guess, logits, q, generator: True))
    case, samples = CASES["draft-cascade"], 1000
    counts, _ = sample_counts(target, draft, case, samples)
    pvalue, tv = chi_square(counts, exact_joint(target, PROMPT, case.params, case.tokens), samples)
    assert pvalue < 1e-8, f"the wrong rule went unnoticed: p = {pvalue:.2e}, total variation {tv:.3f}"


def test_chi_square_helper_accepts_exact_counts_and_rejects_a_shift() -> None:
    """The helper itself: ideal counts pass, a small shift of mass between two cells fails."""
    joint = {seq: 1 / 16 for seq in itertools.product(range(4), repeat=2)}
    ideal = Counter({seq: 250 for seq in joint})
    assert chi_square(ideal, joint, 4000)[0] > 0.99
    shifted = ideal.copy()
    shifted[(0, 0)] += 100
    shifted[(1, 1)] -= 100
    assert chi_square(shifted, joint, 4000)[0] < 1e-6
    with pytest.raises(AssertionError, match="impossible"):
        chi_square(Counter({(9, 9): 1}), joint, 1)
