"""Prefix caching: a request that begins as an earlier one's text copies its keys and values instead of prefilling
them, and decodes exactly what it decodes without the cache (greedy and sampled, every method); the entries kept
are the ones a prefill writes (bit for bit on the native kernels); memory stays within its bound."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.engine.prefix_cache import PrefixCache, common_prefix
from specdecode.proposers import NoProposer, PromptLookupProposer
from specdecode.proposers.base import Needs

from .helpers import Oracle, guessing_pays, tiny_model
from .test_gemma import NATIVE_FAMILIES, WINDOW, native_tiny


def kv(tokens: int, fill: float = 0.0, layers: int = 2) -> torch.Tensor:
    return torch.full((layers, 2, 1, tokens, 4), fill)


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([7], [1]) == 0
    assert common_prefix([], [1, 2]) == 0


def test_lookup_finds_the_longest_shared_beginning():
    cache = PrefixCache(1 << 20, min_tokens=4)
    a, b = list(range(20)), list(range(10)) + [99] * 10
    cache.store(a, kv(20, 1.0))
    cache.store(b, kv(20, 2.0))
    hit = cache.lookup(list(range(15)) + [5, 5])
    assert hit is not None and hit.tokens == 15 and hit.kv.shape[3] == 15 and bool((hit.kv == 1.0).all())
    hit = cache.lookup(list(range(10)) + [99, 99, 0])
    assert hit is not None and hit.tokens == 12 and bool((hit.kv == 2.0).all())
    assert cache.lookup([0, 1, 2, 50]) is None  # 3 tokens shared: fewer than min_tokens
    assert cache.lookup([5] * 30) is None
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (4, 2, 27)


def test_a_conversations_next_turn_replaces_its_earlier_one():
    cache = PrefixCache(1 << 20, min_tokens=4)
    first = list(range(10))
    cache.store(first, kv(10))
    cache.store(first + [50, 51, 52], kv(13))
    assert cache.texts == 1 and cache.bytes == kv(13).numel() * 8 // 2  # float32
    cache.store(first[:8], kv(8))  # already covered by a longer text: nothing new kept
    assert cache.texts == 1


def test_memory_stays_within_its_bound_least_recently_used_out():
    one = kv(100).numel() * 4
    cache = PrefixCache(3 * one, min_tokens=4)
    texts = [[i] * 100 for i in range(1, 6)]
    for t in texts[:3]:
        cache.store(t, kv(100))
    assert cache.lookup(texts[0]) is not None  # the oldest is used again: the second goes first
    for t in texts[3:]:
        cache.store(t, kv(100))
        assert cache.bytes <= 3 * one
    assert cache.texts == 3
    assert cache.lookup(texts[0]) is not None and cache.lookup(texts[4]) is not None
    assert cache.lookup(texts[1]) is None and cache.lookup(texts[2]) is None
    cache.store([9] * 400, kv(400))  # larger than the whole budget: not kept, nothing evicted for it
    assert cache.texts == 3 and cache.lookup([9] * 400) is None
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PrefixCache(-1)


def test_texts_stored_while_holding_join_when_it_ends():
    cache = PrefixCache(1 << 20, min_tokens=4)
    with cache.holding():
        cache.store(list(range(10)), kv(10))
        assert cache.lookup(list(range(10))) is None
    assert cache.lookup(list(range(10))) is not None
    with cache.holding(keep=False):
        cache.store(list(range(50, 60)), kv(10))
    assert cache.lookup(list(range(50, 60))) is None


def run(model, prompt, cache, *, proposer=None, k=0, temperature=0.0, seed=0, max_new=30, stats=None):
    """One request through an engine with `cache`: (new tokens, prompt tokens read from the cache); its stats are
    appended to `stats`."""
    new, got = generate_ids(model, prompt, proposer=proposer, k=k, params=SamplingParams(temperature=temperature),
                            seed=seed, max_new_tokens=max_new, cost=guessing_pays(), prefix_cache=cache)
    if stats is not None:
        stats.append(got)
    return new, got.cached_tokens


@pytest.mark.parametrize("method,k,temperature", [("none", 0, 0.0), ("lookup", 4, 0.0), ("oracle", 5, 0.0),
                                                  ("lookup", 3, 0.9), ("none", 0, 1.0)])
def test_a_next_turn_decodes_exactly_what_it_decodes_without_the_cache(method, k, temperature):
    """Turn 1 runs (its entries kept: its prompt's prefill and the tokens its steps verified, trees included); turn
    2 re-sends turn 1's whole text and more: it copies turn 1's entries and its tokens (greedy, or sampled with
    a seed) are exactly those of the same request with no cache."""
    model = tiny_model(3, vocab_size=24)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 24, (20,), generator=g).tolist()
    cache = PrefixCache(1 << 24, min_tokens=4)

    def proposer(full=None):
        return {"none": NoProposer, "lookup": PromptLookupProposer}[method]() if method != "oracle" else \
            Oracle(full or [], right=True, vocab=24)

    truth = prompt + run(model, prompt, None, max_new=60)[0]
    first, cached = run(model, prompt, cache, proposer=proposer(truth), k=k, temperature=temperature, seed=1)
    assert cached == 0 and cache.texts == 1
    (text, kept), = cache._entries.items()  # PyTorch's float64 forward: a fresh prefill's entries, to rounding
    fresh = model.new_cache(len(text))
    model.forward(torch.tensor([list(text)]), fresh, logits_at=None)
    torch.testing.assert_close(kept, fresh.kv[:, :, 0, :, : len(text)], rtol=1e-12, atol=1e-12)
    second_prompt = prompt + first + torch.randint(0, 24, (7,), generator=g).tolist()
    truth2 = second_prompt + run(model, second_prompt, None, max_new=40)[0]
    alone = run(model, second_prompt, None, proposer=proposer(truth2), k=k, temperature=temperature, seed=2)[0]
    again, cached = run(model, second_prompt, cache, proposer=proposer(truth2), k=k, temperature=temperature, seed=2)
    assert cached >= len(prompt) + len(first) - 1  # turn 1's text but (at most) its last token
    assert again == alone
    assert cache.texts == 1  # turn 2's text replaced turn 1's


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_kept_entries_are_bit_for_bit_what_a_prefill_writes(family):
    """On the native kernels an entry does not depend on the forward that wrote it: the entries kept from a
    request decoded with guessed chains (a prefill, then verified steps) equal a fresh prefill's of the same text,
    Gemma's sliding window past its end included."""
    model = native_tiny(family)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 56, (WINDOW + 5,), generator=g).tolist()
    truth = prompt + run(model, prompt, None, max_new=40)[0]
    cache = PrefixCache(1 << 24, min_tokens=4)
    run(model, prompt, cache, proposer=Oracle(truth, right=True, vocab=56), k=4, max_new=40)
    (text, kept), = cache._entries.items()
    assert list(text) == truth[: len(text)] and len(text) >= len(truth) - 1
    fresh = model.new_cache(len(text) + 1)
    model.forward(torch.tensor([list(text)]), fresh, logits_at=None)
    assert torch.equal(kept, fresh.kv[:, :, 0, :, : len(text)])


class ReadsHidden(NoProposer):
    """A proposer that drafts from the hidden states of the last `context` positions (None: all)."""

    def __init__(self, context: int | None) -> None:
        self.needs = Needs(hidden_layers=(0,), hidden_context=context)
        self.first = None  # the first position whose hidden state it got

    def observe(self, tree, verdict, outputs) -> None:
        assert outputs.hidden is not None
        self.first = outputs.start if self.first is None else self.first


@pytest.mark.parametrize("context", [None, 5])
def test_a_proposer_that_reads_hidden_states_gets_the_positions_it_reads(context):
    model = tiny_model(3, vocab_size=24)
    prompt = list(range(1, 21))
    cache = PrefixCache(1 << 24, min_tokens=4)
    run(model, prompt, cache, max_new=5)
    proposer = ReadsHidden(context)
    second = prompt + [3, 4]
    _, cached = run(model, second, cache, proposer=proposer, max_new=5)
    assert cached == (0 if context is None else len(second) - 1 - context) and proposer.first == cached
    _, cached = run(model, second, cache, max_new=5)
    assert cached == len(second) - 1  # a proposer that reads none: all of it (the last request's text)


def test_an_eagle_request_drafts_as_after_a_full_prefill():
    """EAGLE's head reads at most HEAD_CONTEXT positions: a prompt found in the cache prefills those (and reads the
    rest), and the head proposes exactly what it does after a full prefill (the same steps, guesses, output)."""
    from specdecode.proposers.eagle import HEAD_CONTEXT, EagleProposer

    from .test_eagle import random_head, sampling_target

    target = sampling_target()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 8, (HEAD_CONTEXT + 60,), generator=g).tolist()
    cache = PrefixCache(1 << 24, min_tokens=4)
    run(target, prompt, cache, max_new=4)
    stats: list = []
    outputs = [run(target, prompt + [1, 2], c, proposer=EagleProposer(random_head(target, 6, seed=4), target), k=3,
                   max_new=40, stats=stats) for c in (None, cache)]
    assert outputs[0][1] == 0 and outputs[1][1] == len(prompt) + 1 - HEAD_CONTEXT
    assert outputs[0][0] == outputs[1][0]
    alone, cached = stats
    assert (alone.drafted, alone.accepted, alone.target_forwards) == \
        (cached.drafted, cached.accepted, cached.target_forwards) and alone.accepted > 0


def test_a_failed_request_keeps_nothing():
    class Fails(NoProposer):
        def propose(self, context):
            raise RuntimeError("proposer broke")

    model = tiny_model(3, vocab_size=24)
    cache = PrefixCache(1 << 24, min_tokens=4)
    with pytest.raises(RuntimeError, match="proposer broke"):
        run(model, list(range(1, 21)), cache, proposer=Fails(), k=3)
    assert cache.texts == 0


def test_a_hybrid_request_reads_the_cache_but_its_heads_catch_up_window_and_stays_lossless():
    """hybrid's head mostly rests behind suffix's trees: a cached prompt prefills only the window a head catches up
    on after a rest (HIDDEN_LEAD positions), and the output is still plain decoding's."""
    from specdecode.proposers.eagle import HIDDEN_LEAD, EagleProposer
    from specdecode.proposers.suffix import SuffixProposer
    from specdecode.proposers.suffix_eagle import SuffixEagleProposer

    from .test_eagle import random_head, sampling_target

    target = sampling_target()
    prompt = torch.randint(0, 8, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    cache = PrefixCache(1 << 24, min_tokens=4)
    run(target, prompt, cache, max_new=4)
    hybrid = SuffixEagleProposer(SuffixProposer(cost=guessing_pays()),
                                 EagleProposer(random_head(target, 6, seed=4), target, cost=guessing_pays()))
    stats: list = []
    out, cached = run(target, prompt + [1, 2], cache, proposer=hybrid, k=hybrid.guessing.max_depth, max_new=40,
                      stats=stats)
    assert cached == len(prompt) + 1 - HIDDEN_LEAD
    assert out == run(target, prompt + [1, 2], None, max_new=40)[0] and stats[0].accepted > 0
