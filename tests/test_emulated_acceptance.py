"""The benchmark's emulated acceptance (specdecode/bench/emulated.py): the draft model runs, its guesses are set to the
target's greedy tokens with probability `rate`; verification is the real one. Greedy output equals plain decoding;
the target accepts exactly the guesses the emulation made right; the conditional acceptance measured over hundreds of
verified guesses lies within four standard deviations of the rate asked for."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.bench.emulated import EmulatedDraft
from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers import DraftModelProposer, PromptLookupProposer
from specdecode.proposers.async_draft import AsyncDraftProposer, Drafter

from .helpers import guessing_pays, prefix_layers, tiny_model

VOCAB, NEW = 56, 96


@pytest.fixture(scope="module")
def models():
    target = tiny_model(seed=11, num_layers=3)
    return target, prefix_layers(target, 1)


@pytest.fixture(scope="module")
def runs(models) -> list[list[int]]:
    """Each prompt's whole plain greedy sequence (prompt and output): what the emulation reads as the truth."""
    target, _ = models
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (6,), generator=gen).tolist() for _ in range(4)]
    return [prompt + generate_ids(target, prompt, max_new_tokens=NEW, k=0)[0] for prompt in prompts]


def emulated(models, truth: list[int], rate: float, seed: int = 0) -> EmulatedDraft:
    return EmulatedDraft(DraftModelProposer(models[1], VOCAB), truth, rate, seed)


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.8, 1.0])
def test_acceptance_is_the_rate_and_output_plain_decoding(models, runs, rate: float) -> None:
    target = models[0]
    verified = accepted = 0
    for seed, truth in enumerate(runs):
        prompt = truth[:6]
        proposer = emulated(models, truth, rate, seed)
        out, stats = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert prompt + out == truth, rate
        v, a = proposer.tally()
        # the target kept exactly the guesses the emulation set right, and saw every guess drafted
        assert (a, sum(len(g) for _, g in proposer.log)) == (stats.accepted, stats.drafted)
        verified, accepted = verified + v, accepted + a
    assert verified >= 250
    bound = 4 * math.sqrt(rate * (1 - rate) / verified)
    assert abs(accepted / verified - rate) <= bound, (accepted, verified, rate)


def test_the_draft_model_runs_and_its_cache_holds_the_set_guesses(models, runs) -> None:
    """Every guess costs the draft a forward (its cost is the real draft's), and the draft's KV cache continues from
    the guesses it made, as a real draft's does: after a chain, it holds the committed tokens and the guesses."""
    target, draft = models
    calls = []
    original = draft.forward

    def counted(ids, cache, **kw):
        calls.append(ids.shape[1])
        return original(ids, cache, **kw)

    draft.forward = counted
    try:
        proposer = emulated(models, runs[0], 0.7)
        generate_ids(target, runs[0][:6], proposer=proposer, k=4, max_new_tokens=NEW)
    finally:
        del draft.forward
    assert len(calls) >= sum(len(g) for _, g in proposer.log)  # one forward a guess (the first also catches up)
    first, guesses = proposer.log[-1]
    assert proposer.cached == runs[0][:first] + guesses[:-1]


def test_drafting_ahead_and_auto_k_stay_lossless_and_take_the_same_guesses(models, runs) -> None:
    target, _ = models
    truth = runs[1]
    _, sync = generate_ids(target, truth[:6], proposer=emulated(models, truth, 0.7), k=4, max_new_tokens=NEW)
    drafter = Drafter(1)
    try:
        ahead = AsyncDraftProposer(emulated(models, truth, 0.7), drafter, patient=True)
        out, stats = generate_ids(target, truth[:6], proposer=ahead, k=4, max_new_tokens=NEW)
    finally:
        drafter.close()
    assert truth[:6] + out == truth and stats.ahead_hits > 0
    assert (stats.accepted, stats.drafted) == (sync.accepted, sync.drafted)  # coins belong to positions
    policy = AdaptiveK(guessing_pays(), AcceptanceStats(), cheap=False)
    out, stats = generate_ids(target, truth[:6], proposer=emulated(models, truth, 0.7), k=policy,
                              max_new_tokens=NEW)
    assert truth[:6] + out == truth and stats.accepted > 0


def test_bad_emulations_are_refused(models, runs) -> None:
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\], got 1.5"):
        emulated(models, runs[0], 1.5)
    cascade = DraftModelProposer(models[1], VOCAB, lookup=PromptLookupProposer())
    with pytest.raises(ValueError, match="no cascade"):
        EmulatedDraft(cascade, runs[0], 0.5)
    with pytest.raises(ValueError, match="needs greedy decoding"):
        generate_ids(models[0], runs[0][:6], proposer=emulated(models, runs[0], 0.5), k=4, max_new_tokens=8,
                     params=SamplingParams(temperature=1.0), seed=0)
