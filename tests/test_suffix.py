"""Suffix decoding: the suffix index (matches, eviction, threads), the proposer's trees (own text before the global
cache's, sizes from frequencies and the cost model), and losslessness: greedy token for token in float64 across
depths and tree sizes, sampled against the exact distribution."""

from __future__ import annotations

import itertools
import random
import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import FixedK
from specdecode.proposers import SuffixCache, SuffixProposer, suffix_index
from specdecode.proposers.base import ProposalContext, RequestInfo, StepOutput
from specdecode.proposers.suffix import GLOBAL_BUCKET, MAX_DEPTH
from specdecode.proposers.suffix_index import SEPARATOR, SuffixIndex, TextIndex

from .helpers import FrozenCost, ask, end_request, guessing_pays, tiny_model
from .test_distribution import ALPHA, chi_square, exact_joint
from .test_lossless import NEW, PROMPTS, VOCAB

GREEDY = SamplingParams()


# ------------------------------------------------------------------------------------------------ index
def test_index_finds_the_longest_suffix_and_what_followed() -> None:
    index = SuffixIndex()
    index.add_sequence([1, 2, 3, 4, 5, 6])
    index.add_sequence([9, 2, 3, 4, 7, 8])
    index.add_sequence([3, 4, 5, 0])
    match = index.match([8, 9, 2, 3, 4], depth=3)  # "9 2 3 4" occurred once: the longest wins
    assert match.length == 4 and match.continuations.tolist() == [[7, 8, SEPARATOR]]
    match = index.match([0, 3, 4], depth=2)  # "3 4" three times; nothing longer
    assert match.length == 2 and sorted(match.continuations.tolist()) == [[5, 0], [5, 6], [7, 8]]
    assert index.match([6], depth=2) is None  # the end of a sequence: nothing followed it
    assert index.match([42], depth=2) is None


def test_index_never_matches_or_continues_across_sequences() -> None:
    index = SuffixIndex()
    index.add_sequence([1, 2])
    index.add_sequence([3, 4])
    assert index.match([1, 2], depth=2) is None  # 3 follows 2 in the buffer, not in any sequence
    match = index.match([7, 2, 3], depth=3)  # "2 3" spans the boundary: only "3" matches
    assert match.length == 1 and match.continuations.tolist() == [[4, SEPARATOR, SEPARATOR]]


def test_a_growing_sequence_is_matched_but_its_own_end_is_not() -> None:
    index = SuffixIndex()
    index.extend([5, 6, 7])
    index.extend([5, 6])
    match = index.match([5, 6, 7, 5, 6], depth=4)
    assert match.length == 2 and match.continuations.tolist() == [[7, 5, 6, SEPARATOR]]


@pytest.mark.parametrize("vocab", [3, 20, 500])
def test_a_request_text_index_answers_as_the_suffix_index(vocab) -> None:
    """The request's own index (dicts, no numpy) finds the same match length, occurrences and continuations as the
    suffix index over the same text, at every length as the text grows (repetitive texts: many occurrences, long
    matches; a small max_occurrences cuts them)."""
    rng = random.Random(vocab)
    for max_occurrences in (64, 5):
        reference, text_index = SuffixIndex(max_occurrences=max_occurrences), TextIndex(max_occurrences=max_occurrences)
        text: list[int] = []
        pieces = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
        for _ in range(60):
            grow = rng.choice(pieces) if rng.random() < 0.6 else [rng.randrange(vocab)]
            text += grow
            reference.extend(grow)
            text_index.extend(grow)
            for depth in (1, 6):
                want, got = reference.match(text, depth), text_index.match(text, depth)
                assert (want is None) == (got is None)
                if want is not None:
                    rows, counts = want.distinct(depth)
                    assert got.length == want.length
                    assert got.distinct(depth) == ([[t for t in r if t != SEPARATOR] for r in rows], counts)
    with pytest.raises(ValueError, match="its own text"):
        text_index.match(text[:-1], 3)


def test_eviction_bounds_memory_and_forgets_the_oldest() -> None:
    index = SuffixIndex(max_tokens=1000)
    rng = random.Random(0)
    sequences = [[rng.randrange(5000) for _ in range(rng.randrange(20, 120))] for _ in range(400)]
    sizes = []
    for seq in sequences:
        index.add_sequence(seq)
        assert index.live_tokens <= 1000
        sizes.append(index.nbytes)
    assert index.evicted_sequences > 300
    assert max(sizes[100:]) < 3 * sizes[100]  # bounded: no growth with the sequences added after the budget filled
    assert max(sizes) < 200_000
    kept = index.tokens()
    assert kept == sequences[-len(kept) :]  # whole sequences, newest last
    old = sequences[0]
    match = index.match(old[:10], depth=5)  # forgotten text is not offered
    assert match is None or old[10:15] not in match.continuations.tolist()
    new = sequences[-1]
    assert index.match(new[:10], depth=5).continuations.tolist()[0] == new[10:15]
    index.add_sequence(list(range(3000)))  # longer than the budget: its last 1000 tokens stay
    assert index.tokens() == [list(range(2000, 3000))]


def brute_match(sequences: list[list[int]], context: list[int], depth: int, max_match: int, most: int):
    """SuffixIndex.match read off its definition, over the live sequences: (length, sorted continuations) or None."""
    for n in (3, 1):
        if len(context) < n:
            continue
        end = context[-n:]
        filed = [(seq, i) for seq in sequences for i in range(n - 1, len(seq)) if seq[i - n + 1 : i + 1] == end]
        found = [(seq, i) for seq, i in filed[-most:] if i + 1 < len(seq)]  # the most recent, then those continued
        if found:
            break
    else:
        return None
    lengths = []
    for seq, i in found:
        length = 0
        while length < min(max_match, len(context)) and length <= i and seq[i - length] == context[-1 - length]:
            length += 1
        lengths.append(length)
    longest = max(lengths)
    rows = [(seq[i + 1 : i + 1 + depth] + [SEPARATOR] * depth)[:depth]
            for (seq, i), length in zip(found, lengths, strict=True) if length == longest]
    return longest, sorted(rows)


@pytest.mark.parametrize("most", [64, 2])
def test_index_answers_as_its_definition_across_seals_and_evictions(most, monkeypatch) -> None:
    """Positions sorted into the arrays (seals, merged with what was sorted before), evicted ones dropped, recent ones
    still unsorted: every match equals a brute-force search of the live sequences (a small `most` checks that the
    most recent occurrences are the ones kept)."""
    rng = random.Random(most)
    monkeypatch.setattr(suffix_index, "_SEAL_AT", 40)  # sorted in often, while most of what was sorted is live
    index = SuffixIndex(max_tokens=400, max_match=6, max_occurrences=most)
    pieces = [[rng.randrange(12) for _ in range(rng.randrange(2, 9))] for _ in range(8)]
    sealed = 0
    for _ in range(250):
        seq = [t for _ in range(rng.randrange(1, 8)) for t in rng.choice(pieces)][: rng.randrange(3, 60)]
        before = len(index._levels[3].keys)
        index.add_sequence(seq)
        sealed += len(index._levels[3].keys) != before
        live = index.tokens()
        for _ in range(4):
            source = rng.choice(live)
            cut = rng.randrange(1, len(source) + 1)
            context = [rng.randrange(12) for _ in range(rng.randrange(3))] + source[max(0, cut - 8) : cut]
            match = index.match(context, 4)
            got = None if match is None else (match.length, sorted(match.continuations.tolist()))
            assert got == brute_match(live, context, 4, 6, most)
    assert sealed > 25 and index.evicted_sequences > 100


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_match": 0}, {"max_occurrences": 0}])
def test_index_refuses_bad_sizes(kwargs) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        SuffixIndex(**kwargs)


def test_concurrent_updates_from_threads_leave_the_cache_whole() -> None:
    """Server threads add finished outputs while others match: every sequence stays intact and findable."""
    cache = SuffixCache(max_tokens=20_000)
    per_thread, threads = 60, 6
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(per_thread):
                seq = [seed * 1000 + i] + [rng.randrange(50) for _ in range(rng.randrange(5, 60))] + [seed * 1000 + i]
                proposer = SuffixProposer(cache)
                proposer.begin(RequestInfo(seq[:3], 1000))
                proposer.propose(ask(seq[:3], 8))
                end_request(proposer, seq[:3] + seq)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(s,)) for s in range(1, threads + 1)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors
    assert cache.lookups == per_thread * threads
    stored = cache.index.tokens()
    assert len(stored) == per_thread * threads  # nothing evicted at this budget, nothing lost
    for seq in stored:
        marker = seq[0]
        assert seq[-1] == marker and 1000 <= marker < 1000 * (threads + 1)  # no interleaving inside a sequence
        found = cache.index.match(seq[:1], depth=len(seq) - 1)  # its marker is unique: exactly its continuation
        assert found.continuations.tolist() == [seq[1:]]


# -------------------------------------------------------------------------------------------- proposer
def test_the_requests_own_text_comes_before_the_global_cache() -> None:
    cache = SuffixCache()
    cache.index.add_sequence([1, 2, 3, 30, 31, 32])  # earlier outputs continue "1 2 3" with 30 ...
    prompt = [1, 2, 3, 10, 11, 12, 7, 1, 2, 3]  # ... this request's own text with 10
    proposer = SuffixProposer(cache)
    proposer.begin(RequestInfo(prompt, 100))
    one = proposer.propose(ask(prompt, 1))
    assert one.tokens == [3, 10]
    both = proposer.propose(ask(prompt, 3))  # a deeper budget: own path first, global one beside it
    assert both.paths()[0] == [10, 11] and [30] in both.paths() or [30, 31] in both.paths()
    assert cache.hits == 2


def test_global_searches_rest_while_they_add_nothing_and_resume_on_a_hit() -> None:
    """A global search whose guesses add no accepted token rests the next ones (0, 1, 2, 4 ... steps); a step whose
    accepted tokens only the global cache offered ends the rest."""
    from specdecode.core.verify import Verdict
    from specdecode.proposers.suffix import GLOBAL_MAX_REST

    cache = SuffixCache()
    cache.index.add_sequence([1, 2, 3, 30, 31])
    proposer = SuffixProposer(cache)
    text = [9, 8, 1, 2, 3]
    proposer.begin(RequestInfo(text, 100))
    searched = []
    for _ in range(40):  # the global guess 30 is never accepted
        tree = proposer.propose(ask(text, 2))
        searched.append(proposer.searched_global)
        proposer.observe(tree, Verdict([0], 5), StepOutput(text, len(text) - 1))
    rests = [len(run) for run in "".join("x" if s else "." for s in searched).split("x")[1:-1]]
    assert rests[:5] == [0, 1, 2, 4, 8] and max(rests) <= GLOBAL_MAX_REST
    while not proposer.searched_global:
        tree = proposer.propose(ask(text, 2))
    proposer.observe(tree, Verdict([0, 1], 31), StepOutput(text, len(text) - 1))  # node 1 (30, global only) accepted
    assert proposer.global_rest == 0 and proposer.global_backoff == 0 and cache.accepted == 1
    assert proposer.propose(ask(text, 2)) and proposer.searched_global


def test_the_global_cache_is_searched_only_where_it_may_hold_the_texts_last_3_tokens() -> None:
    """Its filter is never wrong about a trigram it holds (also after eviction and sorting); a text whose last 3
    tokens it never saw costs no search and no rest, yet counts as a lookup that missed."""
    from specdecode.core.verify import Verdict

    rng = random.Random(0)
    index = SuffixIndex(max_tokens=20_000)
    for _ in range(300):  # ~52k tokens through a 20k budget: sorted in and evicted many times over
        index.add_sequence([rng.randrange(300) for _ in range(rng.randrange(50, 300))])
    held = {tuple(seq[i : i + 3]) for seq in index.tokens() for i in range(len(seq) - 2)}
    assert all(index.may_have(list(trigram)) for trigram in held)
    absent = [t for t in ((rng.randrange(300), rng.randrange(300), rng.randrange(300)) for _ in range(5000))
              if t not in held]
    assert sum(index.may_have(list(t)) for t in absent) < 0.2 * len(absent)  # a filter, not a yes to everything

    cache = SuffixCache()
    cache.index.add_sequence([1, 2, 30, 31])  # "1 2" continues with 30, but no 3 tokens of the text are there
    proposer = SuffixProposer(cache)
    text = [9, 8, 1, 2]
    proposer.begin(RequestInfo(text, 100))
    for _ in range(5):
        tree = proposer.propose(ask(text, 2))
        assert not proposer.searched_global and 30 not in tree.tokens and proposer.global_rest == 0
        proposer.observe(tree, Verdict([0], 5), StepOutput(text, len(text) - 1))
    assert (cache.lookups, cache.hits) == (5, 0)
    text = [9, 1, 2, 30]  # now its last 3 tokens are there: searched
    proposer.begin(RequestInfo(text, 100))
    assert proposer.propose(ask(text, 2)).tokens[1:] == [31] and proposer.searched_global


def test_held_outputs_join_the_cache_after_the_block_each_distinct_once() -> None:
    cache = SuffixCache()
    stats = cache.fork()
    with cache.holding():
        for output in ([1, 2, 3], [1, 2, 3], [4, 5]):
            cache.finish(output, stats)
        assert cache.index.tokens() == []  # none of this block's runs finds another's answer
    assert cache.index.tokens() == [[1, 2, 3], [4, 5]]
    with cache.holding(keep=False):
        cache.finish([6, 7], stats)
    cache.finish([8], stats)
    assert cache.index.tokens() == [[1, 2, 3], [4, 5], [8]]


def test_suffix_sends_nothing_where_no_guess_can_pay_and_stays_lossless(target, reference) -> None:
    """Under a cost where no guess can pay, every step searches (its own text's matches keep teaching the reach) and
    sends a plain step: nothing drafted, the output plain decoding's."""
    dear = FrozenCost([1, 2, 64], [0, 1000], [[1.0, 3.0, 64.0], [1.0, 3.0, 64.0]])
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        proposer = SuffixProposer(None, cost=dear)
        ran = []
        candidates = proposer.candidates
        proposer.candidates = lambda *a, candidates=candidates, ran=ran: ran.append(1) or candidates(*a)
        out, stats = generate_ids(target, prompt, proposer=proposer, k=MAX_DEPTH, max_new_tokens=NEW)
        assert out == expected and stats.drafted == 0
        assert len(ran) >= NEW - 1, len(ran)


def test_frequencies_rank_the_branches() -> None:
    """Continuations seen more often rank first, and a tree's size follows them (k nodes without a cost model)."""
    cache = SuffixCache()
    for _ in range(3):
        cache.index.add_sequence([3, 4, 5, 6, 7])
    cache.index.add_sequence([3, 4, 5, 8, 9])
    proposer = SuffixProposer(cache)
    proposer.begin(RequestInfo([0, 3, 4, 5], 100))
    tree = proposer.propose(ask([0, 3, 4, 5], 3))
    assert tree.tokens == [5, 6, 7, 8]  # 6 (3 of 4), 7 after it (3 of 4), then 8 (1 of 4)
    assert tree.parents == [-1, 0, 1, 0]


def test_the_cost_model_sizes_the_tree() -> None:
    """Sure guesses under a cheap forward: a deep tree. The same guesses under a dear one: a plain step."""
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8] * 2
    cheap = CostModel([1, 64], [0, 1000], [[1.0, 1.2], [1.0, 1.2]])
    dear = CostModel([1, 64], [0, 1000], [[1.0, 64.0], [1.0, 64.0]])
    sizes = {}
    for name, cost in (("cheap", cheap), ("dear", dear)):
        proposer = SuffixProposer(None, cost=cost)
        for _ in range(3):  # copying holds: what the reach learns
            proposer.begin(RequestInfo(text[:14], 100))
            for n in range(14, len(text)):
                proposer.propose(ask(text[:n], 16))
            end_request(proposer, text)
        proposer.begin(RequestInfo(text[:14], 100))
        sizes[name] = proposer.propose(ask(text[:14], 16)).num_drafted
    assert sizes["cheap"] >= 8 and sizes["dear"] == 0


def test_finish_adds_the_output_to_the_global_cache_once() -> None:
    cache = SuffixCache()
    target = tiny_model(0, vocab_size=VOCAB)
    out, _ = generate_ids(target, PROMPTS[5], proposer=SuffixProposer(cache), max_new_tokens=12, k=4)
    assert cache.index.tokens() == [out]


def test_bad_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="nodes >= 1"):
        SuffixProposer(None, nodes=0)


# ----------------------------------------------------------------------------------------- losslessness
@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def reference(target):
    """Plain decoding through the engine (test_lossless checks it equals recomputing every step)."""
    return [generate_ids(target, prompt, max_new_tokens=NEW)[0] for prompt in PROMPTS]


CHEAP = guessing_pays()


@pytest.mark.parametrize("k, nodes", [(1, 24), (2, 1), (4, 4), (8, 3), (8, 24), ("auto", 24), ("auto", 2)])
def test_greedy_suffix_equals_plain(target, reference, k, nodes) -> None:
    """Every prompt twice: the second time its own earlier output is in the global cache, so guesses from both
    sources are accepted (and rejected)."""
    cache = SuffixCache()
    drafted = accepted = 0
    for _ in range(2):
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            proposer = SuffixProposer(cache, nodes=nodes, cost=CHEAP if k == "auto" else None)
            policy = FixedK(proposer.guessing.max_depth) if k == "auto" else k
            out, stats = generate_ids(target, prompt, proposer=proposer, k=policy, max_new_tokens=NEW, cost=CHEAP)
            assert out == expected, f"prompt {prompt}"
            drafted += stats.drafted
            accepted += stats.accepted
    assert 0 < accepted < drafted
    assert cache.accepted > 0, "no guess only the global cache offered was ever accepted"


V = 8
PROMPT = [0, 6, 7, 0, 5, 2, 0, 7, 6, 0]


@pytest.mark.parametrize("sized", [False, True])
def test_sampled_suffix_matches_the_target_distribution(sized: bool) -> None:
    """T = 1: a tree of point masses from the request's text (0 -> 6, 5, 7) and the global cache's (0 -> 1, 3)."""
    target = tiny_model(3, head_gain=3.0, vocab_size=V, num_layers=1, hidden_size=32, intermediate_size=64,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    params, tokens, samples = SamplingParams(temperature=1.0), 3, 2000
    joint = exact_joint(target, PROMPT, params, tokens)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(samples):
        cache = SuffixCache()  # the same cache every time: outputs of other samples must not leak in
        cache.index.add_sequence([7, 6, 0, 1, 2, 7, 6, 0, 3, 4, 0, 1])
        proposer = SuffixProposer(cache, cost=CHEAP if sized else None)
        k = FixedK(proposer.guessing.max_depth) if sized else 4
        out, stats = generate_ids(target, PROMPT, proposer=proposer, k=k, max_new_tokens=tokens, params=params,
                                  seed=seed, cost=CHEAP)
        counts[tuple(out)] += 1
        drafted += stats.drafted
        accepted += stats.accepted
    assert 0 < accepted < drafted
    pvalue, tv = chi_square(counts, joint, samples)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}, total variation {tv:.3f}"
    assert tv < 0.1


def test_sampled_tree_offers_several_branches() -> None:
    """The sampled test above exercises siblings (else it would only test chains)."""
    cache = SuffixCache()
    cache.index.add_sequence([7, 6, 0, 1, 2, 7, 6, 0, 3, 4, 0, 1])
    proposer = SuffixProposer(cache, nodes=8)
    proposer.begin(RequestInfo(PROMPT, 100))
    tree = proposer.propose(ProposalContext(PROMPT, 8, SamplingParams(temperature=1.0), None))
    first = sorted(tree.tokens[c] for c in tree.children(0))
    assert len(first) >= 3 and np.isin([1, 7], first).all()


def test_server_metrics_report_the_shared_cache() -> None:
    from specdecode.server.metrics import Metrics

    cache = SuffixCache()
    metrics = Metrics()
    holder: list[SuffixCache] = []
    metrics.watch_suffix(lambda: holder[0] if holder else None)
    assert b"specdecode_suffix_cache_tokens 0.0" in metrics.render()  # no cache yet: zeros, not an error
    holder.append(cache)
    cache.index.add_sequence([1, 2, 3, 4])
    proposer = SuffixProposer(cache)
    proposer.begin(RequestInfo([9, 1, 2, 3], 10))
    proposer.propose(ask([9, 1, 2, 3], 2))
    text = metrics.render().decode()
    assert "specdecode_suffix_cache_tokens 4.0" in text and "specdecode_suffix_cache_hit_rate 1.0" in text
    assert "specdecode_suffix_cache_sequences 1.0" in text


# ------------------------------------------------------------------------------ hybrid: suffix + EAGLE head
def eagle_for(model):
    import torch

    from specdecode.models.eagle import EagleConfig, EagleHead
    from specdecode.proposers import EagleProposer

    vocab = torch.arange(model.config.vocab_size)
    with torch.random.fork_rng():  # the head's random part: a test's outcome must not hang on the tests before it
        torch.manual_seed(0)
        head = EagleHead(EagleConfig.for_target(model.config, model.config.vocab_size)).double()
    head.init_from_target(model, vocab)
    return EagleProposer(head, model, topk=3, nodes=12, cost=CHEAP)


def hybrid(model, cache: SuffixCache):
    from specdecode.proposers.suffix_eagle import SuffixEagleProposer

    return SuffixEagleProposer(SuffixProposer(cache, cost=CHEAP), eagle_for(model))


def test_greedy_hybrid_equals_plain_and_uses_both_sources(target, reference) -> None:
    cache = SuffixCache()
    drafted = accepted = 0
    heads = 0
    for _ in range(2):
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            proposer = hybrid(target, cache)
            depth = FixedK(proposer.guessing.max_depth)
            out, stats = generate_ids(target, prompt, proposer=proposer, k=depth, cost=CHEAP, max_new_tokens=NEW)
            assert out == expected, f"prompt {prompt}"
            drafted += stats.drafted
            accepted += stats.accepted
            heads += proposer.eagle.calibration[True][1] > 0  # the head's trees were verified and calibrated
    assert 0 < accepted < drafted
    assert heads > 0 and cache.accepted > 0


def test_the_head_costs_at_most_its_share_of_decoding_time_beyond_what_it_saves(target, reference,
                                                                                 monkeypatch) -> None:
    """Next to a target whose forward is priced at a microsecond the head's real milliseconds never pay: once its
    first run has spent the budget, runs wait for HEAD_SHARE of the decoding time to pay for them (here: never
    within the test); with an unbounded share it runs as its own rest rule allows (and that rule rests it). Next to
    a forward priced at a second, every guess of its own that is accepted pays for its runs: it is never held back.
    What it saved in one request does not pay for its runs in the next; what it owes does. Output is plain
    decoding's throughout."""
    import specdecode.proposers.eagle as eagle_module
    import specdecode.proposers.suffix_eagle as hybrid_module
    from specdecode.proposers.suffix_eagle import SuffixEagleProposer

    fast = FrozenCost([1, 64], [0, 1000], [[1e-6, 1.5e-6], [1e-6, 1.5e-6]])
    dear = FrozenCost([1, 64], [0, 1000], [[1.0, 1.5], [1.0, 1.5]])
    # the head's clock advances 0.1 ms a reading, whatever the machine's load (its trees are sized and its runs
    # charged by it): far above what a step adds to the budget next to the fast forward (1e-9 s), far below it next
    # to the dear one (1e-3 s)
    clock = itertools.count(step=1e-4)
    fixed = SimpleNamespace(perf_counter=lambda: next(clock))
    monkeypatch.setattr(hybrid_module, "time", fixed)
    monkeypatch.setattr(eagle_module, "time", fixed)

    def head_runs(cost: FrozenCost, share: float):
        monkeypatch.setattr(hybrid_module, "HEAD_SHARE", share)
        eagle = eagle_for(target)
        eagle.cost = cost
        proposer = SuffixEagleProposer(SuffixProposer(None, cost=cost), eagle)
        runs = []
        propose = eagle.propose
        monkeypatch.setattr(eagle, "propose", lambda *args: runs.append(1) or propose(*args))
        for prompt, expected in zip(PROMPTS * 2, reference * 2, strict=True):
            out, _ = generate_ids(target, prompt, proposer=proposer, k=FixedK(MAX_DEPTH), cost=cost,
                                  max_new_tokens=NEW)
            assert out == expected
        return len(runs), eagle.resting.backoff

    (budgeted, _), (unbounded, backoff) = head_runs(fast, hybrid_module.HEAD_SHARE), head_runs(fast, 1e9)
    assert backoff > 0  # by its own rule it rests: its steps do not pay
    assert budgeted == 1 and unbounded >= 5, (budgeted, unbounded)
    paying, free = head_runs(dear, hybrid_module.HEAD_SHARE)[0], head_runs(dear, 1e9)[0]
    assert paying == free > unbounded, (paying, free, unbounded)

    proposer = SuffixEagleProposer(SuffixProposer(None, cost=dear), eagle_for(target))
    for carried, starts in ((0.01, 0.0), (-0.01, -0.01)):  # a request inherits the head's debts, not its savings
        proposer.eagle.head.head_budget = carried
        proposer.begin(RequestInfo(PROMPTS[0], 100))
        assert proposer.budget == starts


def test_sampled_hybrid_matches_the_target_distribution() -> None:
    target = tiny_model(3, head_gain=3.0, vocab_size=V, num_layers=1, hidden_size=32, intermediate_size=64,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    params, tokens, samples = SamplingParams(temperature=1.0), 3, 2000
    joint = exact_joint(target, PROMPT, params, tokens)
    counts: Counter = Counter()
    drafted = accepted = 0
    proposer = hybrid(target, SuffixCache())
    proposer.suffix.cache = None  # the request's own text only: samples must not teach each other
    for seed in range(samples):
        depth = FixedK(proposer.guessing.max_depth)
        out, stats = generate_ids(target, PROMPT, proposer=proposer, k=depth, cost=CHEAP, max_new_tokens=tokens,
                                  params=params, seed=seed)
        counts[tuple(out)] += 1
        drafted += stats.drafted
        accepted += stats.accepted
    assert 0 < accepted < drafted
    pvalue, tv = chi_square(counts, joint, samples)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}, total variation {tv:.3f}"
    assert tv < 0.1


def test_a_longer_match_class_starts_from_the_rates_of_the_next_shorter() -> None:
    """A class of longer matches with nothing learned yet is continued at least as often as the next shorter class
    (a copy climbs through every class), not from the bare prior; a global class never borrows a local one's."""
    proposer = SuffixProposer(None)
    for _ in range(30):
        proposer.stats.record(3, 8, 8)
    assert proposer.reach(4)[5] > 0.5  # from class 3's rates (near 1), not 0.5 ** 6
    assert proposer.reach(1)[5] < 0.05  # shorter classes learn nothing from longer ones
    for _ in range(30):
        proposer.stats.record(GLOBAL_BUCKET - 1, 8, 8)
    assert proposer.reach(GLOBAL_BUCKET)[5] < 0.05
