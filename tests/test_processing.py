"""Logit bias, min_tokens and penalties (processing.py): each tree node processed with its own history, exactly as a
one-token-at-a-time reference processes it, and greedy speculation under them equal to plain decoding under them
(the sampled case is in test_distribution); log-probabilities reported from the verification forward."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from specdecode.core.logits_processing import process
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import DraftTree
from specdecode.engine.loop import generate_ids, start
from specdecode.proposers import DraftModelProposer, LookaheadProposer, PromptLookupProposer

from .helpers import noisy_copy, tiny_model
from .test_lossless import PROMPTS, VOCAB


def reference(logits: torch.Tensor, history: list[int], prompt_len: int, params: SamplingParams,
              stops: tuple[int, ...] = ()) -> torch.Tensor:
    """One position's logits processed the plain way: the history is every token before it."""
    x = logits.double().clone()
    for token, bias in params.logit_bias:
        x[token] += bias
    if len(history) - prompt_len < params.min_tokens:
        for token in stops:
            x[token] = -math.inf
    for token in set(history):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token, count in Counter(history[prompt_len:]).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


EVERYTHING = SamplingParams(logit_bias={3: 2.5, 7: -1.0}, presence_penalty=0.7, frequency_penalty=0.4,
                            repetition_penalty=1.6, min_tokens=6)


@pytest.mark.parametrize("params", [EVERYTHING, SamplingParams(repetition_penalty=0.7),
                                    SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5),
                                    SamplingParams(logit_bias={0: -math.inf})])
def test_each_tree_node_is_processed_with_its_own_history(params: SamplingParams) -> None:
    rng = random.Random(0)
    vocab, prompt_len = 12, 5
    tokens = [rng.randrange(vocab) for _ in range(9)]  # a prompt of 5, 4 generated (the last is the tree's root)
    tree = DraftTree.from_paths(tokens[-1], [[3, 3, 5], [3, 9], [4, 3, 3, 3], [tokens[2]]])
    logits = torch.randn(len(tree), vocab, generator=torch.Generator().manual_seed(1))
    got = process(logits, tree, tokens, prompt_len, params, stop_token_ids=(5, 9))
    for node, path in enumerate(tree.node_paths()):
        expected = reference(logits[node], tokens + path, prompt_len, params, stops=(5, 9))
        torch.testing.assert_close(got[node].double(), expected, rtol=1e-5, atol=1e-5, msg=f"node {node}")
    assert process(logits, tree, tokens, prompt_len, SamplingParams()) is logits  # nothing asked: untouched


def naive_processed_greedy(model, prompt: list[int], n: int, params: SamplingParams,
                           stops: tuple[int, ...]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        out = model.forward(torch.tensor([ids]), model.new_cache(len(ids)), logits_at=slice(-1, None))
        token = int(reference(out.logits[0, -1], ids, len(prompt), params, stops).argmax())
        ids.append(token)
        if token in stops:
            break
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab_size=VOCAB)


@pytest.mark.parametrize("method", ["prompt-lookup-tree", "draft", "lookahead"])
def test_greedy_speculation_under_processing_equals_plain_processed_decoding(target, method) -> None:
    proposers = {"prompt-lookup-tree": lambda: PromptLookupProposer(branches=3),
                 "draft": lambda: DraftModelProposer(noisy_copy(target, seed=1, noise=0.05), VOCAB),
                 "lookahead": lambda: LookaheadProposer(window=3, ngram=3, guesses=3)}
    changed = drafted = 0
    for prompt in PROMPTS[4:]:
        plain = generate_ids(target, prompt, max_new_tokens=24)[0]
        stop = plain[2]  # min_tokens keeps the model from stopping at its third token
        params = SamplingParams(logit_bias={plain[0]: -3.0, 5: 1.0}, presence_penalty=0.3, frequency_penalty=0.2,
                                repetition_penalty=1.2, min_tokens=8)
        expected = naive_processed_greedy(target, prompt, 24, params, (stop,))
        changed += expected != plain
        out, stats = generate_ids(target, prompt, proposer=proposers[method](), k=4, max_new_tokens=24,
                                  params=params, stop_token_ids=(stop,))
        assert out == expected, prompt
        assert generate_ids(target, prompt, max_new_tokens=24, params=params, stop_token_ids=(stop,))[0] == expected
        drafted += stats.drafted
    assert changed >= 3 and drafted > 0  # the processing changed the text, and guesses were verified under it


def test_impossible_processing_parameters_say_what_is_allowed() -> None:
    for kwargs, message in [({"presence_penalty": 2.5}, "presence_penalty must be in"),
                            ({"frequency_penalty": -3}, "frequency_penalty must be in"),
                            ({"repetition_penalty": 0}, "repetition_penalty must be in"),
                            ({"min_tokens": -1}, "min_tokens must be"),
                            ({"min_p": 1.5}, "min_p must be in"),
                            ({"logit_bias": {-1: 1.0}}, "logit_bias maps token ids"),
                            ({"logit_bias": {2: math.nan}}, "logit_bias maps token ids")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    tree = DraftTree.root_only(1)
    with pytest.raises(ValueError, match="outside the vocabulary of 8 tokens"):
        process(torch.zeros(1, 8), tree, [1], 1, SamplingParams(logit_bias={8: 1.0}))


def test_min_p_drops_what_is_far_below_the_best() -> None:
    probs = SamplingParams(temperature=1.0, min_p=0.2).probs(torch.tensor([2.0, 1.0, 0.0, -3.0]))
    # relative to the best token's probability: 1, e^-1 (0.37), e^-2 (0.14), e^-5: the last two dropped
    assert probs[2] == 0 and probs[3] == 0 and probs[:2].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["prompt-lookup-tree", "draft"])
def test_logprobs_with_speculation_are_the_targets_at_each_committed_token(target, method) -> None:
    """Each token's log-probability (and its likeliest alternatives) from the verification forward: what a full
    forward over the text gives at that position, whichever tree node the token was accepted at."""
    make = {"prompt-lookup-tree": lambda: PromptLookupProposer(branches=3),
            "draft": lambda: DraftModelProposer(noisy_copy(target, seed=1, noise=0.05), VOCAB)}[method]
    accepted = 0
    for prompt in PROMPTS[4:]:
        gen = start(target, prompt, proposer=make(), k=4, max_new_tokens=20, logprobs=3)
        for _ in gen:
            pass
        new, accepted = gen.new_tokens, accepted + gen.stats.accepted
        assert len(gen.request.token_logprobs) == len(new) == 20
        full = target.forward(torch.tensor([prompt + new]), target.new_cache(len(prompt) + 20)).logits[0]
        expected = torch.log_softmax(full[len(prompt) - 1 : -1].float(), dim=-1)
        for i, entry in enumerate(gen.request.token_logprobs):
            assert entry.token == new[i] and entry.logprob == pytest.approx(float(expected[i, new[i]]), abs=1e-5)
            best = expected[i].topk(3)
            assert [t for t, _ in entry.top] == best.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert accepted > 0  # tokens accepted inside trees were reported too
    with pytest.raises(ValueError, match="logprobs must be in"):
        start(target, PROMPTS[4], logprobs=21)
