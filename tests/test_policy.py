"""The adaptive speculation policy: cost model, acceptance estimates, depth choice, and the engine with it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from specdecode.core.acceptance import SCORE_AHEAD, AcceptanceStats, ProposalScorer
from specdecode.core.tree import DraftTree, ExtraNodes
from specdecode.engine.loop import generate_ids
from specdecode.policy import timing
from specdecode.policy.batch_cost import BatchCost, RowCost, nondecreasing
from specdecode.policy.cost import TABLE_VERSION, CostModel
from specdecode.policy.speculation import (
    FIRST_PROBE_WITHIN,
    IDLE_ASKS,
    IDLE_PROBE_MOST,
    MARGIN,
    AdaptiveK,
    FixedK,
    Rest,
    StepRecord,
    best_count,
)
from specdecode.proposers import DraftModelProposer, PromptLookupProposer

from .helpers import FrozenCost, Oracle, ask, tiny_model


def linear_cost(per_token: float, per_context: float = 0.0, frozen: bool = False) -> CostModel:
    """T(n, c) = 1 + per_token * (n - 1) + per_context * c, as a measured table would give it (frozen: a table that
    learns nothing from the steps it is shown, for tests of the policy's own decisions)."""
    sizes, contexts = [1, 2, 4, 8, 16, 32, 64], [0, 1000]
    seconds = [[1.0 + per_token * (n - 1) + per_context * c for n in sizes] for c in contexts]
    return (FrozenCost if frozen else CostModel)(sizes, contexts, seconds)


# ------------------------------------------------------------------------------------------- cost model
def test_cost_model_interpolates_and_extrapolates() -> None:
    cost = linear_cost(0.1, per_context=0.001)
    assert cost.forward_seconds(1, 0) == pytest.approx(1.0)
    assert cost.forward_seconds(3, 0) == pytest.approx(1.2)  # between measured sizes 2 and 4
    assert cost.forward_seconds(100, 0) == pytest.approx(1.0 + 0.1 * 99)  # past the largest size
    assert cost.forward_seconds(1, 500) == pytest.approx(1.5)  # between the two contexts
    assert cost.forward_seconds(1, 3000) == pytest.approx(4.0)  # longer than measured: linear in context


def test_one_size_is_priced_as_the_many_sizes_are() -> None:
    """forward_seconds (plain Python, asked every step), forward_seconds_upto (every count at once) and
    forward_seconds_many (numpy) are one price, alone and for a row of a batch."""
    rng = np.random.default_rng(0)
    seconds = [sorted(rng.uniform(0.03, 0.2, 12).tolist()) for _ in range(2)]
    cost = CostModel([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64], [64, 1024], seconds)
    cost.load = 1.3
    sizes = np.arange(1, 130)
    for context in (0, 64, 300, 1024, 5000):
        many = cost.forward_seconds_many(sizes, context)
        one = [cost.forward_seconds(int(n), context) for n in sizes]
        assert one == pytest.approx(many.tolist(), rel=1e-12)
        assert cost.forward_seconds_upto(len(sizes), context) == one  # the same operations: the same floats
        for batch in (BatchCost.single(cost), BatchCost([1, 4], [cost, CostModel.flat()])):
            row = RowCost(batch)
            row.rows = 3
            assert row.forward_seconds_upto(len(sizes), context) == pytest.approx(
                [row.forward_seconds(int(n), context) for n in sizes], rel=1e-12)


def test_noisy_timings_become_nondecreasing() -> None:
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([4.0, 5.0, 3.0, 6.0]) == pytest.approx([4.0, 4.0, 4.0, 6.0])
    assert nondecreasing([2.0, 1.0]) == pytest.approx([1.5, 1.5])


def test_measured_prices_follow_the_sizes_while_the_machine_speed_swings(monkeypatch) -> None:
    """The machine's speed swings 3x every three pairs of forwards: each size is timed next to a 1-token forward,
    so the table's shape (price over a plain step's) comes out exact. Medians of unpaired timings would not."""
    import specdecode.policy.timing as timing

    model = tiny_model(0, vocab_size=40)
    clock, forwards = [0.0], [0]

    def forward(tokens, cache, **kwargs) -> None:
        forwards[0] += 1
        cache.length += tokens.shape[1]
        slow = 3.0 if (forwards[0] - 1) // 6 % 2 else 1.0  # forwards 1, 2: the contexts; then pairs
        clock[0] += slow * (1.0 + 0.1 * (tokens.shape[1] - 1))

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(timing, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    cost = CostModel.measure(model, repeats=8)
    for row in cost.seconds:
        assert [t / row[0] for t in row] == pytest.approx([1.0 + 0.1 * (n - 1) for n in cost.sizes])
    with pytest.raises(ValueError, match="repeats"):
        CostModel.measure(model, repeats=0)


def test_cost_model_is_measured_once_and_cached(tmp_path, monkeypatch) -> None:
    model = tiny_model(0, vocab_size=40)
    assert CostModel.cached(model, tmp_path) is None
    first = CostModel.for_model(model, tmp_path)
    assert CostModel.cached(model, tmp_path) == first
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and first.sizes[0] == 1 and len(first.seconds) == 2
    assert all(s > 0 for row in first.seconds for s in row)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(CostModel, "measure", classmethod(no_measuring))
    assert CostModel.for_model(model, tmp_path) == first
    other = tiny_model(0, vocab_size=48)  # another shape is another entry
    monkeypatch.undo()
    CostModel.for_model(other, tmp_path)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2
    files[0].write_text("{not json")  # a damaged file is measured again, not fatal
    assert CostModel.for_model(model, tmp_path).sizes == first.sizes
    assert json.loads(files[0].read_text())["sizes"] == first.sizes
    older = json.loads(files[0].read_text())  # a table an older `measure` made is measured again
    del older["version"]
    older["seconds"] = [[1.0] * len(row) for row in older["seconds"]]
    files[0].write_text(json.dumps(older))
    again = CostModel.for_model(model, tmp_path)
    assert again.version == TABLE_VERSION and again.seconds[0][0] < 1.0
    assert json.loads(files[0].read_text())["version"] == TABLE_VERSION


def test_fewer_threads_price_each_size_by_its_one_thread_shape() -> None:
    """Beside a busy core the forwards run on fewer threads (threads.py), where a verification is dearer relative to
    a plain step than on all of them: the table prices each size by its one-thread shape there, and the online
    corrections stay in the table's own terms."""
    shape = [1.0, 1.2, 1.5, 1.4]
    cost = CostModel([1, 2, 4, 8], [0, 1000], [[1.0, 1.1, 1.3, 2.0]] * 2, one_thread=shape, threads=2)
    assert cost.forward_seconds(4, 0) == pytest.approx(1.3)
    cost.use_threads(1)
    assert cost.forward_seconds(1, 0) == pytest.approx(1.0) and cost.forward_seconds(4, 0) == pytest.approx(1.95)
    assert cost.forward_seconds_many(np.array([1, 2, 4]), 0) == pytest.approx([1.0, 1.32, 1.95])
    assert cost.table_seconds(3, 0) == pytest.approx((1.32 + 1.95) / 2)
    for _ in range(200):  # steps that cost what the one-thread prices say teach the table nothing new
        cost.observe(1, 0, 1.0)
        cost.observe(4, 0, 1.95)
    assert cost.seconds[0][2] == pytest.approx(1.3) and cost.load == pytest.approx(1.0)
    cost.use_threads(2)
    assert cost.forward_seconds(4, 0) == pytest.approx(1.3)
    cost.use_threads(3)  # more than the table's: as timed
    assert cost.forward_seconds(4, 0) == pytest.approx(1.3)
    wide = CostModel([1, 4], [0, 1000], [[1.0, 1.3]] * 2, one_thread=[1.0, 1.6], threads=4)
    wide.use_threads(2)  # two of four threads: a third of the one-thread steepening ((4 / 2 - 1) / (4 - 1))
    assert wide.forward_seconds(4, 0) == pytest.approx(1.3 * 1.2)
    unknown = CostModel([1, 4], [0, 1000], [[1.0, 1.3]] * 2, threads=2)  # an older table: priced as timed
    unknown.use_threads(1)
    assert unknown.forward_seconds(4, 0) == pytest.approx(1.3)
    with pytest.raises(ValueError, match="thread factor per size"):
        CostModel([1, 4], [0, 1000], [[1.0, 1.3]] * 2, one_thread=[1.0], threads=2)


def test_calibration_times_the_one_thread_shape_where_the_thread_count_may_change(tmp_path, monkeypatch) -> None:
    model = tiny_model(0, vocab_size=40)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # what the set_num_threads calls restore
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(type(model), "native_kernels", property(lambda self: True))
    monkeypatch.setenv("SPECDECODE_ADAPTIVE_THREADS", "1")
    timed = CostModel.calibrate(model, rounds=1)
    assert timed.threads == 2 and timed.one_thread is not None and len(timed.one_thread) == len(timed.sizes)
    assert timed.one_thread[0] == 1.0 and all(x > 0 for x in timed.one_thread)
    monkeypatch.setenv("SPECDECODE_ADAPTIVE_THREADS", "0")  # the count never changes: nothing to time
    assert CostModel.calibrate(model, rounds=1).one_thread is None


def test_the_one_thread_shape_stays_within_what_the_threads_allow(monkeypatch) -> None:
    """Timings spoiled by another busy process must not price a size on one thread at 4x (or 0.3x) its steepness on
    two: one thread is at most two times slower than two, and no faster."""
    model = tiny_model(0, vocab_size=40)
    threads = {"now": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["now"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.update(now=n))
    steep = {1: {1: 1.0, 2: 9.0, 4: 0.1}, 2: {1: 1.0, 2: 1.0, 4: 1.0}}  # [threads][tokens]: seconds
    monkeypatch.setattr(timing, "timed_forward", lambda model, cache, context, n, g: steep[threads["now"]][n])
    assert timing.time_one_thread_shape(model, (1, 2, 4), 8, 2) == [1.0, 2.0, 0.5]
    assert threads["now"] == 2  # restored


# ----------------------------------------------------------------------------------------- acceptance
def test_acceptance_rates_are_conditional_per_depth() -> None:
    stats = AcceptanceStats(max_depth=4, decay=1.0)
    assert np.allclose(stats.rates(0), 0.5)  # the Beta(1, 1) prior before any data
    for _ in range(8):
        stats.record(0, matched=2, tried=3)  # depths 1, 2 matched, depth 3 missed
    rates = stats.rates(0)  # each depth's 8 trials and two pseudo-trials at the rate of the depth above
    assert rates[0] == pytest.approx(9 / 10) and rates[1] == pytest.approx((8 + 1.8) / 10)
    assert rates[2] == pytest.approx(2 * 0.98 / 10) and rates[3] == pytest.approx(rates[2])  # never tried
    expected = stats.expected_accepted(0)
    assert expected[0] == 0 and expected[1] == pytest.approx(0.9) and expected[2] == pytest.approx(0.9 + 0.9 * 0.98)
    assert np.allclose(stats.rates(1), 0.5)  # classes are separate


def test_reach_is_the_running_product_of_the_rates_cut_where_it_falls_under_a_bound() -> None:
    """stats.reach(b, floor, until): the chance that guesses 1..d all match, computed in one pass with the floor
    class's rates (what suffix decoding asks each step): the same numbers as multiplying rates(b, rates(floor))."""
    rng = random.Random(0)
    stats = AcceptanceStats(max_depth=12, decay=0.9)
    for _ in range(200):
        bucket = rng.choice([3, 4])
        tried = rng.randint(1, 12)
        stats.record(bucket, rng.randint(0, tried), tried)
    stats.prior[3] = 0.7
    for bucket, floor in ((4, 3), (4, None), (3, 7)):
        product, full = 1.0, []
        for rate in stats.rates(bucket, floor=None if floor is None else stats.rates(floor)):
            product *= rate
            full.append(product)
        assert stats.reach(bucket, floor) == full
        cut = stats.reach(bucket, floor, until=full[4])  # stops at the first depth under the bound, included
        first_under = next(d for d, r in enumerate(full) if r < full[4])
        assert cut == full[: first_under + 1]


def test_acceptance_forgets_and_forks() -> None:
    stats = AcceptanceStats(max_depth=2, decay=0.5)
    for _ in range(20):
        stats.record(0, matched=2, tried=2)
    assert stats.rates(0)[0] > 0.7
    for _ in range(5):
        stats.record(0, matched=0, tried=1)
    assert stats.rates(0)[0] < 0.3  # recent misses dominate older hits
    long_run = AcceptanceStats(max_depth=2, decay=1.0)
    for _ in range(100):
        long_run.record(3, matched=1, tried=2)
    request = long_run.fork(weight=8.0)
    assert request.trials[3][0] == pytest.approx(8.0)
    assert request.hits[3][0] / request.trials[3][0] == pytest.approx(1.0)  # same evidence, less weight
    assert request.hits[3][1] / request.trials[3][1] == pytest.approx(0.0)
    for _ in range(50):
        request.record(3, matched=0, tried=1)
    long_run.absorb(request)
    assert long_run.rates(3)[0] < 0.2  # the request's final estimate replaced the long-run one


def test_scorer_learns_from_unverified_guesses() -> None:
    stats = AcceptanceStats(max_depth=8, decay=1.0)
    scorer = ProposalScorer(stats)
    tokens = [1, 2, 3]
    scorer.add(DraftTree.from_paths(3, [[4, 5, 9]], bucket=2), len(tokens))  # proposed, never verified
    tokens += [4]
    scorer.update(tokens)
    assert len(scorer.pending) == 1  # matched so far, depth 2 not known yet
    tokens += [5, 6]
    scorer.update(tokens)
    assert not scorer.pending
    assert stats.trials[2][:3] == [1, 1, 1] and stats.hits[2][:3] == [1, 1, 0]
    # a tree is as good as its best branch
    scorer.add(DraftTree.from_paths(6, [[7, 7], [8, 1]]), len(tokens))
    tokens += [8, 2]
    scorer.update(tokens)
    assert stats.hits[0][:2] == [1, 0] and stats.trials[0][:2] == [1, 1]
    # a request that ends mid-match records what it saw, without inventing a miss
    scorer.add(DraftTree.from_paths(2, [[3, 4, 5]], bucket=1), len(tokens))
    tokens += [3]
    scorer.update(tokens, final=True)
    assert stats.trials[1][:3] == [1, 0, 0] and stats.hits[1][0] == 1


# -------------------------------------------------------------------------------------------- choices
def confident(rate: float, bucket: int = 0, depth: int = 16) -> AcceptanceStats:
    """Stats that have seen 200 trials at every depth with conditional acceptance `rate`."""
    stats = AcceptanceStats(max_depth=depth, decay=1.0)
    stats.hits[bucket], stats.trials[bucket] = [rate * 200] * depth, [200.0] * depth
    return stats


def test_depth_follows_cost_and_acceptance() -> None:
    flat, steep = linear_cost(0.0), linear_cost(0.5)
    assert AdaptiveK(flat, confident(0.9), cheap=True).best_depth(0, 0, 16) == 16  # free to verify: guess deep
    assert AdaptiveK(steep, confident(0.1), cheap=True).best_depth(0, 0, 16) == 0  # nothing pays: plain step
    middle = AdaptiveK(linear_cost(0.1), confident(0.7), cheap=True).best_depth(0, 0, 16)
    assert 1 <= middle < 16
    assert AdaptiveK(flat, confident(0.9), cheap=True).best_depth(0, 0, 3) == 3  # never past the limit
    costly = AdaptiveK(flat, confident(0.6), cheap=False)
    costly.draft_per_guess = 0.05
    cheap_depth = AdaptiveK(flat, confident(0.6), cheap=True).best_depth(0, 0, 16)
    assert costly.best_depth(0, 0, 16) < cheap_depth  # a draft that costs time is asked for less


def test_a_guess_must_beat_a_plain_step_by_the_margin() -> None:
    """One guess on a 10% dearer step: 13% accepted wins 2.7% on paper, inside the error of the estimates
    (MARGIN), so the step stays plain; 20% accepted wins 9%."""
    cost = linear_cost(0.1)
    assert (1 + 0.13) / 1.1 - 1 < MARGIN < (1 + 0.2) / 1.1 - 1
    for rate, depth in ((0.13, 0), (0.2, 1)):
        policy = AdaptiveK(cost, AcceptanceStats(), cheap=True)
        policy.stats = confident(rate)  # the request's own estimate (a fork mixes in the prior)
        assert policy.best_depth(0, 0, 16) == depth
    assert best_count(np.array([0.13]), cost, 0)[0] == 0
    n, rate = best_count(np.array([0.2]), cost, 0)
    assert n == 1 and rate == pytest.approx(1.2 / 1.1)


def test_cheap_proposals_are_cut_after_seeing_them() -> None:
    stats = AcceptanceStats(max_depth=16, decay=1.0)
    stats.hits[3], stats.trials[3] = [190.0] * 16, [200.0] * 16  # 3-gram matches: good
    stats.hits[1], stats.trials[1] = [10.0] * 16, [200.0] * 16  # 1-gram matches: poor
    policy = AdaptiveK(linear_cost(0.05), stats, cheap=True)
    assert policy.depth_to_propose(100, 50) == 16 and policy.depth_to_propose(100, 5) == 5
    good = DraftTree.from_paths(0, [list(range(1, 11))], bucket=3)
    assert policy.choose(good, 100).depth == 10
    window = ExtraNodes([1, 2], [1, 2], np.ones((2, 2), dtype=bool))
    poor = DraftTree([0, 1, 2], [-1, 0, 1], bucket=1, extra=window)
    chosen = AdaptiveK(linear_cost(0.1), stats, cheap=True).choose(poor, 100)
    assert chosen.num_drafted == 0 and chosen.extra is None  # a plain step drops the lookahead window too


def test_a_lookahead_window_rides_along_only_where_it_is_nearly_free() -> None:
    """Lookahead's premise is a forward bound by reading the weights, where more tokens cost next to nothing: there
    the window goes with the verified guesses; where its tokens cost real time (a CPU), the guesses go alone."""
    stats = AcceptanceStats(max_depth=16, decay=1.0)
    stats.hits[1], stats.trials[1] = [150.0] * 16, [200.0] * 16
    window = ExtraNodes([7, 8, 9, 10], [1, 2, 1, 2], np.ones((4, 4), dtype=bool))
    tree = DraftTree.from_paths(0, [[1, 2, 3]], bucket=1)
    tree.extra = window
    free = AdaptiveK(linear_cost(0.002), stats, cheap=True).choose(tree, 100)
    assert free.depth == 3 and free.extra is window  # 4 more tokens: 0.8% dearer
    dear = AdaptiveK(linear_cost(0.05), stats, cheap=True).choose(tree, 100)
    assert dear.depth > 0 and dear.extra is None  # 4 more tokens: 20% dearer, for guesses that pay alone


def test_costly_drafts_probe_with_backoff() -> None:
    policy = AdaptiveK(linear_cost(0.0), confident(0.05), cheap=False)
    assert policy.depth_to_propose(10, 20) == 2  # first: a short draft to measure what it costs
    policy.draft_per_guess = 0.5  # half a target forward per guess, for ~5% acceptance: never pays
    depths = [policy.depth_to_propose(10, 20) for _ in range(8 + 1 + 16 + 1 + 32 + 1)]
    probes = [i for i, d in enumerate(depths) if d]
    assert probes == [8, 8 + 1 + 16, 8 + 1 + 16 + 1 + 32]  # intervals double while the draft keeps not paying
    policy.stats = confident(0.95)  # what the last probe found
    policy.scorer.stats = policy.stats
    policy.draft_per_guess = 0.5
    assert policy.depth_to_propose(10, 20) > 0  # good again: speculate every step
    assert policy.probe_every == 8
    # a draft as slow as the target cannot pay even if every guess were right: no probing at all
    hopeless = AdaptiveK(linear_cost(0.05), confident(0.05), cheap=False)
    hopeless.draft_per_guess = 1.0
    assert not any(hopeless.depth_to_propose(10, 20) for _ in range(3000))
    # what was learned about the draft carries over to the next request, which still probes within its first
    # FIRST_PROBE_WITHIN steps (a long interval learned on other text must not keep it from ever guessing)
    shared = AcceptanceStats()
    first = AdaptiveK(linear_cost(0.0), shared, cheap=False)
    first.draft_per_guess, first.probe_every = 0.3, 64
    first.finish([1, 2, 3])
    second = AdaptiveK(linear_cost(0.0), shared, cheap=False)
    assert second.draft_per_guess == 0.3 and second.probe_every == FIRST_PROBE_WITHIN < 64
    first.probe_every = 12
    first.finish([1, 2, 3])
    assert AdaptiveK(linear_cost(0.0), shared, cheap=False).probe_every == 12


def test_a_step_with_no_room_for_a_guess_is_no_evidence_against_guessing() -> None:
    """A request's last token leaves no room for a guess: that plain step must not start a wait for the next probe
    (a policy reused for the next request began it with probe_every - 1 plain steps)."""
    policy = AdaptiveK(linear_cost(0.0), confident(0.9), cheap=False)
    policy.draft_per_guess = 0.01
    assert policy.depth_to_propose(10, 20) > 0
    assert policy.depth_to_propose(10, 0) == 0
    assert policy.depth_to_propose(10, 20) > 0


def test_cheap_proposals_that_cost_time_are_skipped_while_they_do_not_pay() -> None:
    policy = AdaptiveK(linear_cost(0.05), confident(0.05), cheap=True)
    tree = DraftTree.chain(5, [6, 7])
    policy.depth_to_propose(10, 20)
    policy.observe(StepRecord(tree, tree, 3, [1, 2, 5, 9], 10, draft_seconds=0.004))
    assert policy.propose_seconds == pytest.approx(0.004)  # under 1% of a plain step: still asked every step
    assert all(policy.depth_to_propose(10, 20) == 16 for _ in range(50))
    policy.propose_seconds = 0.1  # heads costing a tenth of a plain step, for ~5% acceptance: never pays
    depths = [policy.depth_to_propose(10, 20) for _ in range(8 + 1 + 16 + 1 + 32 + 1)]
    assert [i for i, d in enumerate(depths) if d] == [8, 8 + 1 + 16, 8 + 1 + 16 + 1 + 32]  # probes, backing off
    policy.stats = confident(0.9)
    policy.propose_seconds = 0.1
    assert policy.depth_to_propose(10, 20) == 16 and policy.probe_every == 8  # good again: every step


def test_free_proposals_that_are_never_verified_are_made_on_probes_only() -> None:
    """Proposing and scoring cost ~1% of a step even where a proposal is under 1% (a lookahead window): after
    IDLE_ASKS steps in a row with nothing verified, the proposer is asked on probes only, backing off up to
    IDLE_PROBE_MOST steps, and every step again once a probe's proposal is verified."""
    policy = AdaptiveK(linear_cost(0.05), confident(0.05), cheap=True)
    tokens = [1, 2, 3]

    def step(verified: int) -> int:
        depth = policy.depth_to_propose(10, 20)
        proposal = DraftTree.chain(tokens[-1], [6, 7]) if depth else DraftTree.root_only(tokens[-1])
        start = len(tokens)
        tokens.append(9)  # never the guess: a miss, scored at once
        policy.observe(StepRecord(proposal, proposal.cut(verified if depth else 0), start, tokens, 10,
                                  draft_seconds=0.004 if depth else 0.0))
        return depth

    asked = [i for i in range(IDLE_ASKS + 400) if step(verified=0)]
    assert asked[:IDLE_ASKS] == list(range(IDLE_ASKS))  # free: asked every step while it may still pay
    gaps = np.diff(asked[IDLE_ASKS - 1 :]).tolist()
    assert gaps[:4] == [1 + 8, 1 + 16, 1 + 32, 1 + IDLE_PROBE_MOST] and set(gaps[4:]) == {1 + IDLE_PROBE_MOST}
    while not step(verified=1):  # the next probe's guess is verified
        pass
    assert all(step(verified=0) for _ in range(IDLE_ASKS))  # asked every step again
    assert not step(verified=0)


def test_the_decision_is_made_again_while_earlier_proposals_are_scored() -> None:
    """Between probes a plain step is not priced again, but only once every proposal made before is scored:
    a miss is scored at once, a match only when the text covers the whole guess, so a policy that stopped
    deciding at the first plain step would have seen the misses alone."""
    def after_one_plain_step(pending: bool) -> int:
        policy = AdaptiveK(linear_cost(0.05), confident(0.05), cheap=True)
        policy.propose_seconds = 0.1  # a tenth of a plain step: asked only while it pays
        assert policy.depth_to_propose(10, 20) == 0
        if pending:  # a guess made before, still uncovered
            policy.scorer.add(DraftTree.chain(9, [10, 11, 12]), 10)
        policy.stats = policy.scorer.stats = confident(0.9)  # what scoring the others has taught meanwhile
        policy.propose_seconds = 0.1
        return policy.depth_to_propose(10, 20)

    assert after_one_plain_step(pending=True) == 16  # decided again: guessing pays now
    assert after_one_plain_step(pending=False) == 0  # nothing left to score: the decision stands until a probe


def test_a_request_starts_from_what_earlier_requests_found() -> None:
    shared = AcceptanceStats()
    first = AdaptiveK(linear_cost(0.0), shared, cheap=False)
    assert first.stats.rates(0)[0] == 0.5  # nothing known yet
    for _ in range(100):  # a weak draft: every first guess missed
        first.stats.record(0, 0, 1)
    first.finish([1, 2, 3])
    second = AdaptiveK(linear_cost(0.0), shared, cheap=False)
    assert second.stats.rates(0)[0] < 0.05  # not pulled back towards 0.5 (it used to start at 0.1)
    assert second.stats.rates(0)[1] == pytest.approx(second.stats.rates(0)[0])  # never tried: the depth above's


def test_observe_learns_real_step_costs_and_draft_cost() -> None:
    """The engine teaches the cost model each step's timing; the policy learns the draft's own cost."""
    cost = linear_cost(0.0)
    policy = AdaptiveK(cost, AcceptanceStats(), cheap=False)
    tree = DraftTree.chain(5, [6, 7])
    for _ in range(60):  # 3-token steps really cost twice the table
        cost.observe(3, 10, 2.0)
        policy.observe(StepRecord(tree, tree, 3, [1, 2, 5, 6, 7, 8], 10, draft_seconds=0.2))
    assert cost.load * cost.table_seconds(3, 10) == pytest.approx(2.0, rel=0.01)
    assert cost.table_seconds(3, 10) == pytest.approx(1.0)  # no plain step to pair with: the load, not the shape
    assert cost.forward_seconds(3, 10) > 2.0  # a change of regime: the shape is in doubt, guesses carry a margin
    assert policy.draft_per_guess == pytest.approx(0.1)
    fresh = AdaptiveK(cost, AcceptanceStats(), cheap=False)  # a draft's own per-guess timing wins over the average
    fresh.observe(StepRecord(tree, tree, 3, [1, 2, 5, 6, 7, 8], 10, 1.0, seconds_per_guess=0.01))
    assert fresh.draft_per_guess == pytest.approx(0.01)
    for _ in range(30):  # then plain steps at the table's cost: the 2x was load, which every size follows
        cost.observe(1, 10, 1.0)
    assert cost.forward_seconds(1, 10) == pytest.approx(1.0, rel=0.01)
    assert cost.load * cost.table_seconds(3, 10) == pytest.approx(1.0, rel=0.01)


def test_one_stalled_draft_call_does_not_price_the_draft_out() -> None:
    """Only steps that guess time the draft again: one call 13x its usual time (a garbage collection) moves the
    estimate by a fifth at most, so a draft that pays keeps guessing; a lasting change is followed within steps."""
    policy = AdaptiveK(linear_cost(0.0), confident(0.7), cheap=False)
    tree = DraftTree.chain(5, [6, 7])

    def step(per_guess: float) -> None:
        policy.observe(StepRecord(tree, tree, 3, [1, 2, 5, 6, 7, 8], 10, 2 * per_guess, seconds_per_guess=per_guess))

    for _ in range(20):
        step(0.25)
    step(3.3)
    assert policy.draft_per_guess == pytest.approx(0.3)
    assert policy.depth_to_propose(10, 20) > 0
    for _ in range(12):
        step(1.0)
    assert policy.draft_per_guess == pytest.approx(1.0, rel=0.1)


def test_a_spike_in_one_step_leaves_no_trace() -> None:
    """Seen with Medusa on SmolLM2: its first tree met a spike (1.7x), every step after sent 4 tokens at the
    table's cost. The spike must not stay in the price of any size: a step REGIME times off the load is a burst
    and moves nothing."""
    cost = linear_cost(0.1)
    cost.observe(3, 10, 1.72 * cost.table_seconds(3, 10))
    assert cost.load == 1.0
    cost.observe(3, 10, 1.3 * cost.table_seconds(3, 10))  # within REGIME: the load follows a fifth of the way
    assert cost.load == pytest.approx(1.06)
    for _ in range(30):
        cost.observe(4, 10, cost.table_seconds(4, 10))
    assert cost.forward_seconds(1, 10) == pytest.approx(cost.table_seconds(1, 10), rel=0.01)
    assert cost.forward_seconds(4, 10) == pytest.approx(cost.table_seconds(4, 10), rel=0.01)


def test_noisy_steps_never_make_guesses_cheaper_than_the_table_says() -> None:
    """Seen with Medusa on SmolLM2 (q163): a burst on plain steps, then 3-token steps timed at the table's
    price. When each size learned its own deviation against the plain steps just before, 3-token steps came
    out at 0.85 of a plain step and Medusa guessed at 3% acceptance for 100 steps, each 13% dearer than
    a plain step. Each size now learns as a running mean of its paired timings, each pair clipped, weighted
    against the table's own timings (a measured table: 32), and is priced with a margin while in doubt, so noise
    never makes a guess's price relative to a plain step's fall far below the table's."""
    original = linear_cost(0.1)
    cost = linear_cost(0.1)
    rng = random.Random(0)
    for burst in (1.85, 1.5, 1.6):
        cost.observe(1, 10, burst * cost.table_seconds(1, 10))
    for _ in range(400):
        n = rng.choice([1, 3, 3, 12])
        cost.observe(n, 10, rng.uniform(0.7, 1.9) * cost.table_seconds(n, 10))
        for size in (3, 12):
            table = original.table_seconds(size, 10) / original.table_seconds(1, 10)
            # timings this noisy (each step 0.7x-1.9x) read as changes of regime now and then (each puts the shape in
            # doubt: a running mean of 8 pairs), so the estimate wanders (0.93x-1.2x here) and what guesses are
            # charged (with the margin of doubt, which does not yet grow with the noise seen online) dips to 0.94x
            assert 0.9 * table < cost.table_seconds(size, 10) / cost.table_seconds(1, 10) < 1.5 * table
            assert cost.forward_seconds(size, 10) / cost.forward_seconds(1, 10) >= 0.93 * table


def test_load_moves_every_size_alike() -> None:
    """Plain steps alone teach the price of sizes not run (a policy that stopped guessing during a burst must
    see guesses cheap again once it ends; seen in a Spec-Bench run: every adaptive method stuck at plain
    steps after a few seconds of load)."""
    cost = linear_cost(0.1)
    for _ in range(30):  # the burst: every step at 4x the table
        cost.observe(1, 10, 4.0 * cost.table_seconds(1, 10))
        cost.observe(5, 10, 4.0 * cost.table_seconds(5, 10))
    assert cost.forward_seconds(5, 10) > 3.5 * cost.table_seconds(5, 10)
    for _ in range(30):  # then plain steps only, at the table's cost
        cost.observe(1, 10, cost.table_seconds(1, 10))
    assert cost.load == pytest.approx(1.0, rel=0.01)
    assert cost.forward_seconds(5, 10) >= cost.table_seconds(5, 10)  # after changes of regime: with a margin
    for _ in range(30):  # plain steps twice as dear: twelve-token steps follow without being run
        cost.observe(1, 10, 2.0 * cost.table_seconds(1, 10))
    assert cost.load * cost.table_seconds(12, 10) == pytest.approx(2.0 * cost.table_seconds(12, 10), rel=0.02)


def test_fixed_k_rejects_negative() -> None:
    with pytest.raises(ValueError, match="k \\(tokens to guess per step\\) must be >= 0 or 'auto'"):
        FixedK(-1)


# ---------------------------------------------------------------------------------------- in the engine
def test_a_draft_that_never_guesses_holds_no_cache() -> None:
    target = tiny_model(0, vocab_size=56)
    draft = DraftModelProposer(target, 56)
    _, stats = generate_ids(target, [1, 2, 3], proposer=draft, k=FixedK(0), max_new_tokens=5)
    assert stats.drafted == 0 and draft.cache is None
    with pytest.raises(RuntimeError, match="begin"):
        DraftModelProposer(target, 56).propose(ask([1, 2], 2))
    generate_ids(target, [1, 2, 3], proposer=draft, k=2, max_new_tokens=5)
    assert draft.cache is not None


def test_engine_stops_guessing_when_guesses_fail_and_guesses_deep_when_they_pay() -> None:
    """Prices as the table says (a frozen table: the tiny model's real timings would otherwise reshape it online)."""
    target = tiny_model(0, vocab_size=56)
    rng = random.Random(0)
    prompt = [rng.randrange(56) for _ in range(20)]
    expected = generate_ids(target, prompt, max_new_tokens=60)[0]
    full = prompt + expected
    policy = AdaptiveK(linear_cost(0.1, frozen=True), AcceptanceStats(), cheap=True)
    out, stats = generate_ids(target, prompt, proposer=Oracle(full, False, 56), k=policy, max_new_tokens=60)
    assert out == expected
    # the first steps guess (prior 0.5), then the policy learns the guesses fail and stops sending them,
    # while still scoring every proposal for free
    assert policy.verified_depths[0] > 0 and set(policy.verified_depths[10:]) == {0}
    assert stats.target_forwards == 60
    policy = AdaptiveK(linear_cost(0.1, frozen=True), AcceptanceStats(), cheap=True)
    out, stats = generate_ids(target, prompt, proposer=Oracle(full, True, 56), k=policy, max_new_tokens=60)
    assert out == expected and stats.accepted == stats.drafted
    assert policy.verified_depths[0] == 2 and max(policy.verified_depths) >= 8  # always right: learns to go deep
    # a draft identical to the target, with a measured per-guess cost, also ends up guessing deep
    policy = AdaptiveK(linear_cost(0.0, frozen=True), AcceptanceStats(), cheap=False)
    out, stats = generate_ids(target, prompt, proposer=DraftModelProposer(target, 56), k=policy, max_new_tokens=60)
    assert out == expected and stats.accepted == stats.drafted and max(policy.verified_depths) >= 6


def test_every_step_teaches_the_engine_its_cost_whatever_the_policy():
    """Self-sizing proposers (eagle, medusa) run under FixedK: their steps must still correct the cost table.
    The engine times every forward and teaches its cost model, not the policy."""
    target = tiny_model(5, vocab_size=56)
    cost = CostModel([1, 64], [0, 1000], [[1e-9, 1.5e-9], [1e-9, 1.5e-9]])  # far cheaper than any real forward
    generate_ids(target, [1, 2, 3], proposer=PromptLookupProposer(), k=FixedK(2), max_new_tokens=20, cost=cost)
    assert cost.load > 3.0  # moved toward what steps really cost (the correction is clamped at 4x a step)


def test_rest_backs_off_while_steps_do_not_pay_and_a_paying_step_ends_it() -> None:
    """Judged in plain steps of their own time: steps that gain nothing rest the proposer 1, 2, 4 ... `most` steps
    (after `evidence` steps); a carried state starts a new request resting; steps that pay end the backoff."""
    cost = CostModel([1, 2, 8], [0, 1000], [[1.0, 1.5, 4.0], [1.0, 1.5, 4.0]])
    rest = Rest(most=4, evidence=2)
    rests = []
    for _ in range(6):  # 0 accepted of a 2-token verification: 1 token in 1.5 plain steps and more
        while rest.take():
            pass
        rest.judge(cost, 0, 0.1, 2, 10)
        rests.append(rest.left)
    assert rests == [0, 0, 1, 2, 4, 4] and rest.value < 1  # the first rest is of no step
    carried = Rest(most=4, evidence=2)
    carried.resume(rest.state())
    assert carried.take() and carried.left == 3
    for _ in range(20):  # 7 accepted of 8 guesses: 8 tokens for 4 plain steps' time
        rest.take()
        rest.judge(cost, 7, 0.0, 8, 10)
    assert rest.value > 1 + MARGIN and rest.backoff == 0 and rest.left == 0


def test_a_matching_guess_is_scored_a_few_depths_past_what_was_verified() -> None:
    """A 32-deep guess sent 2 deep is scored once the text covers 2 + SCORE_AHEAD of it (a copy learns within a
    step or two), its depths past that untouched; a proposal scored whole waits for the text to cover all of it."""
    stats = AcceptanceStats(max_depth=32)
    scorer = ProposalScorer(stats)
    guess = list(range(1, 33))
    scorer.add(DraftTree.from_paths(0, [guess]), 1, verified_depth=2)
    scorer.add(DraftTree.from_paths(0, [guess], bucket=1), 1)
    scorer.update([0, *guess[: 2 + SCORE_AHEAD]])
    assert [p.bucket for p in scorer.pending] == [1]  # the whole one still waits
    assert stats.trials[0][2 + SCORE_AHEAD - 1] == 1 and stats.trials[0][2 + SCORE_AHEAD] == 0
    assert stats.hits[0][: 2 + SCORE_AHEAD] == [1.0] * (2 + SCORE_AHEAD)
    scorer.update([0, *guess])
    assert not scorer.pending and stats.hits[1] == [1.0] * 32
