"""Greedy speculative decoding is lossless: token for token the target's own greedy output.

Float64 tiny models make argmax ties impossible in practice, so any difference is a real bug
(a wrong mask, position, cache compaction, verification or stop rule), not rounding.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import torch

from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import Generation, generate_ids, start
from specdecode.models import BatchKVCache, Transformer
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers import (
    AsyncDraftProposer,
    Drafter,
    DraftModelProposer,
    HybridProposer,
    LayerSkipProposer,
    NoProposer,
    PromptLookupProposer,
    Proposer,
)
from specdecode.proposers.base import RequestInfo

from .helpers import TEST_DEVICE, ask, guessing_pays, noisy_copy, prefix_layers, resize_vocab, tiny_model

VOCAB = 56
NEW = 40
DRAFTER = Drafter()  # the worker thread that drafts ahead for the asynchronous methods


def naive_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """The reference: recompute the whole sequence every step, no cache reuse, no engine."""
    ids = list(prompt)
    for _ in range(n):
        out = model.forward(torch.tensor([ids], device=model.device), model.new_cache(len(ids)),
                            logits_at=slice(-1, None))
        ids.append(int(out.logits[0, -1].argmax()))
    return ids[len(prompt):]


def make_prompts() -> list[list[int]]:
    rng = random.Random(1234)
    prompts = [[rng.randrange(VOCAB)] for _ in range(2)]  # one token: no prefill at all
    prompts += [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 33)]
    for n in (4, 6, 8, 10):  # repeated n-grams, as in code or quoting: prompt lookup finds matches
        base = [rng.randrange(VOCAB) for _ in range(n)]
        prompts.append(base + base + base[: n // 2])
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB).to(TEST_DEVICE)


@pytest.fixture(scope="module")
def draft(target: Transformer) -> Transformer:
    return noisy_copy(target, seed=1, noise=0.05)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    return [naive_greedy(target, prompt, NEW) for prompt in PROMPTS]


def test_plain_engine_equals_naive_greedy(target: Transformer, reference: list[list[int]]) -> None:
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        out, stats = generate_ids(target, prompt, max_new_tokens=NEW)
        assert out == expected
        assert stats.drafted == 0 and stats.target_forwards == NEW and stats.new_tokens == NEW
        assert generate_ids(target, prompt, proposer=NoProposer(), max_new_tokens=NEW, k=4)[0] == expected
    # the reference is not degenerate: mostly varied text, with some repeats for prompt lookup to find
    assert sum(len(set(r)) > 10 for r in reference) >= len(reference) - 1


class KeepSpy:
    """Counts cache compactions that kept a non-first tree branch (the gather path of BatchKVCache.keep)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gathers = 0
        original = BatchKVCache.keep

        def keep(cache: BatchKVCache, row: int, start: int, indices) -> None:
            self.gathers += list(indices) != list(range(len(indices)))
            original(cache, row, start, indices)

        monkeypatch.setattr(BatchKVCache, "keep", keep)


METHODS: dict[str, Callable[[Transformer, Transformer], Proposer]] = {
    "prompt-lookup": lambda target, draft: PromptLookupProposer(),
    "prompt-lookup-tree": lambda target, draft: PromptLookupProposer(branches=3),
    "draft": lambda target, draft: DraftModelProposer(draft, VOCAB),
    "draft-shallow": lambda target, draft: DraftModelProposer(prefix_layers(target, 1), VOCAB),
    "draft-smaller-vocab": lambda target, draft: DraftModelProposer(resize_vocab(draft, VOCAB - 8), VOCAB),
    "draft-larger-vocab": lambda target, draft: DraftModelProposer(resize_vocab(draft, VOCAB + 8), VOCAB),
    "hybrid": lambda target, draft: HybridProposer(PromptLookupProposer(branches=2),
                                                   DraftModelProposer(prefix_layers(target, 1), VOCAB)),
    # prompt lookup guesses for the draft, which checks them in one forward
    "draft-cascade": lambda target, draft: DraftModelProposer(draft, VOCAB, lookup=PromptLookupProposer()),
    # drafting ahead while the target verifies: hits, misses and cut-short chains all happen
    "draft-async": lambda target, draft: AsyncDraftProposer(DraftModelProposer(draft, VOCAB), DRAFTER),
    "draft-async-cascade": lambda target, draft: AsyncDraftProposer(
        DraftModelProposer(draft, VOCAB, lookup=PromptLookupProposer()), DRAFTER, patient=True),
    "layer-skip-async": lambda target, draft: AsyncDraftProposer(LayerSkipProposer(target, [1]), DRAFTER),
    # the draft's own depth policy: a made-up cost where the draft is worth it only when it is often right
    "hybrid-draft-policy": lambda target, draft: HybridProposer(
        PromptLookupProposer(), DraftModelProposer(draft, VOCAB),
        AdaptiveK(CostModel([1, 64], [0, 1000], [[1.0, 7.3], [1.0, 7.3]]), AcceptanceStats(), cheap=False)),
}


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return guessing_pays()


@pytest.mark.parametrize("k", [1, 2, 4, 8, "auto"])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculative_equals_plain(target, draft, reference, cost, monkeypatch, method: str, k) -> None:
    spy = KeepSpy(monkeypatch)
    proposer = METHODS[method](target, draft)
    drafted = accepted = 0
    shared = AcceptanceStats()  # what the adaptive policy learns carries over from prompt to prompt
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        policy = AdaptiveK(cost, shared, cheap=proposer.guessing.cheap) if k == "auto" else k
        out, stats = generate_ids(target, prompt, proposer=proposer, k=policy, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        assert stats.new_tokens == NEW and stats.accepted + stats.target_forwards >= NEW
        drafted += stats.drafted
        accepted += stats.accepted
    # both outcomes happened, so the equality covered accepted guesses as well as corrections
    assert 0 < accepted < drafted
    if method == "prompt-lookup-tree" and k != 1:
        assert spy.gathers > 0, "no non-first branch was ever accepted: the tree path went untested"


def test_draft_acceptance_is_high(target, draft) -> None:
    """The noisy draft is a useful stand-in for a real one: most guesses right, but not all."""
    _, stats = generate_ids(target, PROMPTS[4], proposer=DraftModelProposer(draft, VOCAB), k=4, max_new_tokens=NEW)
    assert 0.4 < stats.acceptance_rate < 1.0


def test_draft_times_its_guesses_apart_from_catching_up(draft, monkeypatch) -> None:
    """The adaptive policy prices a guess by the draft's own timing: a first proposal that also feeds the whole
    prompt to the draft must not make every later guess look dear (it would stop probing for good)."""
    proposer = DraftModelProposer(draft, VOCAB)
    feed = proposer._logits
    monkeypatch.setattr(proposer, "_logits", lambda new: (time.sleep(0.01 * len(new)), feed(new))[1])
    prompt = [t % VOCAB for t in range(40)]
    proposer.begin(RequestInfo(prompt, 128))
    asked = ask(prompt, 1)
    proposer.propose(asked)
    assert asked.seconds_per_guess is None  # one guess: only the catch-up forward, nothing to time apart
    proposer.begin(RequestInfo(prompt, 128))
    asked = ask(prompt, 3)
    proposer.propose(asked)  # feeds 40 tokens (0.4 s), then 2 x 1 token
    assert asked.seconds_per_guess is not None and 0.01 <= asked.seconds_per_guess < 0.1


# ----------------------------------------------------------------------------------- stop conditions


def run(target: Transformer, prompt: list[int], proposer: Proposer, **kwargs) -> Generation:
    gen = start(target, prompt, proposer=proposer, params=SamplingParams(), **kwargs)
    chunks = list(gen)
    assert [t for c in chunks for t in c] == gen.new_tokens  # the stream adds up to the result
    return gen


def first_occurrences(tokens: list[int]) -> list[int]:
    return [i for i, t in enumerate(tokens) if t not in tokens[:i]]


def test_stop_token_inside_an_accepted_run(target: Transformer, reference: list[list[int]]) -> None:
    """Draft == target: every guess is accepted, so the stop token lands mid-run and the rest must go."""
    prompt, expected = PROMPTS[3], reference[3]
    k = 8
    candidates = [i for i in first_occurrences(expected) if i >= 2 and i % (k + 1) != k]
    assert len(candidates) >= 3
    for i in candidates[:3]:
        gen = run(target, prompt, DraftModelProposer(target, VOCAB), k=k, max_new_tokens=NEW,
                  stop_token_ids={expected[i]})
        assert gen.new_tokens == expected[: i + 1] and gen.finish_reason == "stop"
        stats = gen.stats
        # every guess was right, but the ones after the stop token were cut and do not count as accepted
        assert stats.accepted == len(gen.new_tokens) - stats.target_forwards + 1 < stats.drafted


def test_first_of_several_stop_tokens_wins(target: Transformer, reference: list[list[int]]) -> None:
    prompt, expected = PROMPTS[3], reference[3]
    firsts = first_occurrences(expected)
    a, b = expected[firsts[3]], expected[firsts[6]]
    for proposer, k in ((DraftModelProposer(target, VOCAB), 8), (PromptLookupProposer(branches=3), 4),
                        (NoProposer(), 1)):
        gen = run(target, prompt, proposer, k=k, max_new_tokens=NEW, stop_token_ids={b, a})
        assert gen.new_tokens == expected[: firsts[3] + 1] and gen.finish_reason == "stop"


def test_stop_token_as_first_generated_token(target: Transformer, reference: list[list[int]]) -> None:
    gen = run(target, PROMPTS[5], DraftModelProposer(target, VOCAB), k=4, max_new_tokens=NEW,
              stop_token_ids={reference[5][0]})
    assert gen.new_tokens == reference[5][:1] and gen.finish_reason == "stop"


@pytest.mark.parametrize("k", list(range(0, 10)))
def test_max_new_tokens_is_exact(target: Transformer, reference: list[list[int]], k: int) -> None:
    prompt, expected = PROMPTS[6], reference[6]
    for max_new in (1, 2, 3, 5, 9, 10, 11, 19):
        for proposer in (DraftModelProposer(target, VOCAB), PromptLookupProposer(branches=2)):
            gen = run(target, prompt, proposer, k=k, max_new_tokens=max_new)
            assert gen.new_tokens == expected[:max_new], (proposer.name, max_new)
            assert gen.finish_reason == "length" and gen.stats.new_tokens == max_new


# ----------------------------------------------------------------------------------- argument checks


def test_context_length_is_enforced(target: Transformer) -> None:
    context = target.config.max_position_embeddings
    prompt = [1, 2, 3] * ((context - 10) // 3)
    with pytest.raises(ValueError, match=r"exceeds the model's context of 512 tokens"):
        generate_ids(target, prompt, max_new_tokens=context - len(prompt) + 1)
    # exactly filling the context is fine, with guesses right up to the last position
    out, _ = generate_ids(target, prompt, proposer=PromptLookupProposer(), k=8, max_new_tokens=context - len(prompt))
    assert len(out) == context - len(prompt)


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"k": -1}, "k "),
])
def test_bad_generation_arguments(target: Transformer, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate_ids(target, [1, 2, 3], **kwargs)


def test_empty_prompt(target: Transformer) -> None:
    with pytest.raises(ValueError, match="empty"):
        generate_ids(target, [], max_new_tokens=4)


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("inf")}, {"temperature": float("nan")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2},
    {"top_k": -1}, {"top_k": 2.5},
])
def test_sampling_params_reject_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_accept_edges() -> None:
    assert SamplingParams(temperature=0).greedy
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0)
    assert not params.greedy
    probs = params.probs(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) / 0.7, -1))
