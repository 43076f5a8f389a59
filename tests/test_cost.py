"""The cost model on a new machine and under changing load: a calibration of a bounded number of forwards, online
refinement from the engine's steps, regime changes, the uncertainty margin, and the policy's estimated speedup."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import specdecode.engine.loop as engine_module
from specdecode.core.acceptance import AcceptanceStats
from specdecode.engine.loop import generate_ids
from specdecode.policy.batch_cost import EXTRA_TOKENS, STEP_SIZES, BatchCost
from specdecode.policy.cost import (
    CALIBRATION_ROUNDS,
    CALIBRATION_SIZES,
    DOUBTED,
    REGIME_STEPS,
    REPRICE,
    SPREAD,
    TABLE_VERSION,
    THOROUGH_ROUNDS,
    WEIGHT_CAP,
    CostModel,
)
from specdecode.policy.speculation import AdaptiveK, FixedK

from .helpers import Oracle, tiny_model


def shaped(per_token: float, weight: float | None = None) -> CostModel:
    """T(n) = 1 + per_token * (n - 1) at every context, as a calibration would give it (weight: its rounds)."""
    sizes = list(CALIBRATION_SIZES)
    row = [1.0 + per_token * (n - 1) for n in sizes]
    return CostModel(sizes, [64, 512], [row, row], weight=None if weight is None else [weight] * len(sizes))


def relative(cost: CostModel, n: int, context: int = 100) -> float:
    return cost.table_seconds(n, context) / cost.table_seconds(1, context)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


# ------------------------------------------------------------------------------------------- first use
def test_first_use_calibrates_in_a_bounded_number_of_forwards(tmp_path, monkeypatch) -> None:
    model = tiny_model(0, vocab_size=40)
    tokens: list[int] = []
    real = model.forward

    def counted(ids, cache, **kwargs):
        tokens.append(ids.shape[1])
        return real(ids, cache, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    cost = CostModel.for_model(model, tmp_path)
    sizes = CALIBRATION_SIZES
    pairs = CALIBRATION_ROUNDS * 2 * (len(sizes) - 1)  # every size but 1, at two contexts, next to a plain forward
    assert len(tokens) == 2 + len(sizes) + 2 * pairs  # the two contexts' prefills, a warm-up per size, the pairs
    assert len(tokens) < 150 and sum(tokens) < 2000  # the thorough table (first use until now): 1334, 8936
    assert cost.sizes == list(sizes) and len(cost.seconds) == 2
    assert all(s > 0 for row in cost.seconds for s in row)
    assert cost.weight is not None and cost.weight[0] == CALIBRATION_ROUNDS and min(cost.weight) > 0
    tokens.clear()
    again = CostModel.for_model(model, tmp_path)  # saved: the next process reads it
    assert tokens == [] and again == cost


@pytest.mark.parametrize("noise", [0.02, 0.8])
def test_a_calibration_under_heavy_load_is_physical_and_doubted(monkeypatch, noise) -> None:
    """Forwards cost 1 + 0.3 (n - 1), each timing off by a log-normal factor: a quiet machine (2%) or one shared
    with a dozen busy threads (80%: seen here, 16 tokens priced at 0.4 of 6). The table never prices a forward
    below a smaller one's or above n plain ones, and its weights say how far to trust it."""
    import specdecode.policy.timing as cost_module

    model = tiny_model(0, vocab_size=40)
    clock, rng = FakeClock(), random.Random(1)

    def forward(tokens, cache, **kwargs) -> None:
        cache.length += tokens.shape[1]
        clock.now += (1.0 + 0.3 * (tokens.shape[1] - 1)) * math.exp(rng.gauss(0.0, noise))

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(cost_module, "time", clock)
    cost = CostModel.calibrate(model)
    for row in cost.seconds:
        assert row == sorted(row) and all(t <= n * row[0] * (1 + 1e-12) for t, n in zip(row, cost.sizes, strict=True))
    assert cost.weight is not None
    if noise < 0.1:
        assert [t / row[0] for row in cost.seconds for t in row] == pytest.approx(
            [1.0 + 0.3 * (n - 1) for _ in cost.seconds for n in cost.sizes], rel=0.05)
        assert min(cost.weight[1:]) >= THOROUGH_ROUNDS and cost.margin(4) == 0.0  # known as well as thoroughly
    else:
        assert max(cost.weight[1:]) < 1 and cost.margin(4) > 0.1  # doubted: the first real steps outweigh it


def test_prices_follow_the_slope_of_the_contexts_they_lie_between() -> None:
    """Three measured contexts: a price between two of them is interpolated on their segment, past the last
    extrapolated from the last segment's slope (not the first's), and every way of asking gives the same price."""
    sizes = [1, 2, 4, 8]
    per_context = {64: [1.0, 1.1, 1.3, 1.6], 512: [1.5, 1.7, 2.1, 2.9], 2048: [2.5, 3.2, 4.6, 7.5]}
    cost = CostModel(sizes, list(per_context), list(per_context.values()))
    assert cost.table_seconds(8, 288) == pytest.approx((1.6 + 2.9) / 2)  # halfway along the first segment
    assert cost.table_seconds(8, 1280) == pytest.approx((2.9 + 7.5) / 2)  # halfway along the second
    assert cost.table_seconds(8, 3584) == pytest.approx(7.5 + (7.5 - 2.9))  # one more segment's rise
    assert cost.table_seconds(1, 3584) == pytest.approx(2.5 + (2.5 - 1.5))
    assert cost.table_seconds(8, 3584) / cost.table_seconds(1, 3584) > 3.4  # the first segment's slopes: 2.4
    for context in (0, 64, 300, 512, 1000, 2048, 8000):
        many = cost.forward_seconds_many(np.arange(1, 11), context)
        upto = cost.forward_seconds_upto(10, context)
        assert list(many) == pytest.approx(upto, rel=1e-12)
        assert upto == pytest.approx([cost.forward_seconds(n, context) for n in range(1, 11)], rel=1e-12)


def test_calibration_times_a_long_context_where_the_model_reaches_it(monkeypatch) -> None:
    """Where the model's positions allow, the first-use table is timed after 64, 512 and 2,048 cached tokens."""
    import specdecode.policy.timing as timing

    contexts: list[int] = []
    real = timing.cached_context

    def recorded(model, context, room, g):
        contexts.append(context)
        return real(model, context, room, g)

    monkeypatch.setattr(timing, "cached_context", recorded)
    cost = CostModel.calibrate(tiny_model(0, vocab_size=40, max_position_embeddings=4096), rounds=1)
    assert cost.contexts == [64, 512, 2048] and len(cost.seconds) == 3
    assert contexts[:3] == [64, 512, 2048]


@pytest.mark.parametrize("version", [4, 6])
def test_a_table_of_two_contexts_from_an_earlier_version_is_timed_again(tmp_path, version) -> None:
    """Tables before version 7 extrapolated every price past 512 (1,024) cached tokens: read, they would keep
    pricing deep verifications too cheap at long contexts."""
    model = tiny_model(0, vocab_size=40)
    table = shaped(0.1)
    table.version = version
    CostModel.save(model, table, tmp_path)
    assert CostModel.cached(model, tmp_path) is None
    table.version = TABLE_VERSION
    CostModel.save(model, table, tmp_path)
    read = CostModel.cached(model, tmp_path)
    assert read is not None and read.forward_seconds(4, 100) == table.forward_seconds(4, 100)


@pytest.mark.parametrize(("budget", "long"), [(512 * 2**20, 2048), (2**20, 1016)])
def test_server_batch_tables_time_a_long_context_within_a_memory_budget(monkeypatch, budget, long) -> None:
    """Batched tables take a long context beside 64 and 512, as one sequence's do, as long as a full batch's cache
    at it fits the budget (the tiny model's rows: 2 layers x 2 (k, v) x 2 kv heads x 16 float64 = 1,024 bytes)."""
    import specdecode.policy.batch_cost as batch_cost

    monkeypatch.setattr(batch_cost, "LONG_CONTEXT_BYTES", budget)
    model = tiny_model(5, vocab_size=24, max_position_embeddings=4096)
    cost = BatchCost.measure(model, 1, ragged=True, repeats=1)
    assert all(t.contexts == [64, 512, long] for t in cost.tables)


def test_server_batch_tables_take_a_bounded_number_of_forwards(monkeypatch) -> None:
    model = tiny_model(5, vocab_size=24, max_position_embeddings=64)
    calls: list[tuple[int, int]] = []
    real = model.forward_batch

    def counted(tokens, cache, **kwargs):
        calls.append(tuple(tokens.shape))
        return real(tokens, cache, **kwargs)

    monkeypatch.setattr(model, "forward_batch", counted)
    for ragged in (False, True):  # padded batches: rows of STEP_SIZES tokens; ragged: EXTRA_TOKENS up to 7 a row
        calls.clear()
        cost = BatchCost.measure(model, 16, smallest=2, ragged=ragged)
        assert cost.batch_sizes == [2, 4, 8, 16] and cost.ragged == ragged
        grid = [[1, *(1 + e for e in EXTRA_TOKENS if e <= 7 * b)] if ragged else list(STEP_SIZES)
                for b in cost.batch_sizes]
        assert [t.sizes for t in cost.tables] == grid  # type: ignore[attr-defined]
        # warm-up; 3 repeats of every batch size x 2 contexts x size past 1, each paired with a plain step
        assert len(calls) == 1 + 3 * 2 * 2 * sum(len(sizes) - 1 for sizes in grid)
        # priced with a margin until refined: padded, each size's 3 timings; ragged, the line's (all points' timings)
        weight = min(3.0 * sum(len(sizes) for sizes in grid), WEIGHT_CAP) if ragged else 3.0
        assert all(t.weight == [weight] * len(t.sizes) for t in cost.tables)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------- the margin of doubt
def test_guesses_cost_a_margin_while_their_price_is_known_from_few_timings() -> None:
    calibrated, exact = shaped(0.1, weight=CALIBRATION_ROUNDS), shaped(0.1)
    margin = SPREAD * (1 / math.sqrt(CALIBRATION_ROUNDS) - 1 / math.sqrt(THOROUGH_ROUNDS))
    assert calibrated.forward_seconds(1, 100) == exact.forward_seconds(1, 100)  # the plain step is the anchor
    for n in (2, 4, 16, 40):
        assert calibrated.forward_seconds(n, 100) == pytest.approx(exact.forward_seconds(n, 100) * (1 + margin))
        assert calibrated.table_seconds(n, 100) == pytest.approx(exact.table_seconds(n, 100))
    many = calibrated.forward_seconds_many(__import__("numpy").arange(1, 40), 100)
    assert many.tolist() == pytest.approx([calibrated.forward_seconds(n, 100) for n in range(1, 40)])
    for _ in range(40):  # steps at the table's own prices, each after a plain one: the doubt goes, the price stays
        calibrated.observe(1, 100, calibrated.table_seconds(1, 100))
        calibrated.observe(4, 100, calibrated.table_seconds(4, 100))
    assert calibrated.forward_seconds(4, 100) == pytest.approx(exact.forward_seconds(4, 100))


# ------------------------------------------------------------------------------------- online refinement
def test_online_refinement_converges_to_the_machines_shape_on_a_synthetic_clock() -> None:
    """The calibration priced guesses 30% too cheap relative to a plain step (a burst during it, say). Steps of
    every size, interleaved with plain ones as a policy runs them, timed by a synthetic clock with +-10% noise
    and the machine's speed drifting 1.5x: each size's price relative to a plain step converges to the truth."""
    cost = shaped(0.1, weight=CALIBRATION_ROUNDS)

    def truth(n: int) -> float:
        return 1.0 if n == 1 else 1.3 * (1.0 + 0.1 * (n - 1))

    rng = random.Random(0)
    sizes = (2, 3, 4, 6, 8, 12, 16)
    assert all(relative(cost, n) < 0.8 * truth(n) for n in sizes)
    for step in range(1000):
        speed = 1.0 + 0.5 * (step // 100 % 2)  # the machine slows 1.5x every other 100 steps
        n = 1 if rng.random() < 0.4 else rng.choice(sizes)
        cost.observe(n, 100, truth(n) * speed * math.exp(rng.uniform(-0.1, 0.1)))
        if step == 200:  # about 20 pairs per size: more than half-way there
            assert all(relative(cost, n) > 0.88 * truth(n) for n in sizes)
    for n in sizes:
        assert relative(cost, n) == pytest.approx(truth(n), rel=0.03)
    assert cost.forward_seconds(8, 100) / cost.forward_seconds(1, 100) >= relative(cost, 8)  # margin: never below
    assert cost.learned > 500


def test_prices_are_np_interp_of_the_table_and_never_lag_learning_by_more_than_reprice() -> None:
    """Between sizes a price is np.interp's of the learned table, float for float (the interpolation is plain Python
    now); it is interpolated again only once the learned prices moved REPRICE, so no price lags its size's learned
    value by more than that."""
    rng = random.Random(3)
    for _ in range(100):
        sizes = sorted(rng.sample(range(1, 70), rng.randint(2, 12)))
        row = [rng.uniform(1e-3, 1e-2) for _ in sizes]
        cost = CostModel(sizes, [64, 512], [row, [2 * t for t in row]])
        assert cost._interpolate(row)[0] == np.interp(np.arange(sizes[-1] + 1), sizes, row).tolist()
    cost = shaped(0.1, weight=CALIBRATION_ROUNDS)
    for step in range(400):
        n = 1 if step % 2 else rng.choice((2, 3, 4, 6, 8, 12, 16))
        cost.observe(n, 100, (1.0 + 0.2 * (n - 1)) * math.exp(rng.uniform(-0.1, 0.1)))
        for i, size in enumerate(cost.sizes):
            learned = cost.seconds[0][i] + (cost.seconds[1][i] - cost.seconds[0][i]) * (100 - 64) / (512 - 64)
            assert cost.table_seconds(size, 100) == pytest.approx(learned, rel=REPRICE)
    assert relative(cost, 8) == pytest.approx(1.0 + 0.2 * 7, rel=0.05)  # it did learn the new shape


def test_without_plain_steps_the_shape_stands() -> None:
    """Guess steps with no plain step nearby carry no news about the shape: only the load follows them."""
    cost = shaped(0.1, weight=CALIBRATION_ROUNDS)
    before = [relative(cost, n) for n in (2, 4, 8)]
    for _ in range(50):
        cost.observe(4, 100, 3.0 * cost.table_seconds(4, 100))
    assert [relative(cost, n) for n in (2, 4, 8)] == pytest.approx(before)
    assert cost.load == pytest.approx(3.0, rel=0.01)


# ------------------------------------------------------------------------------------- changes of regime
def clocked(monkeypatch, model, seconds) -> FakeClock:
    """The engine's clock advances by seconds(n) on every forward of n tokens per row, and by nothing else."""
    clock = FakeClock()
    real = model.forward_batch

    def forward_batch(tokens, cache, **kwargs):
        clock.now += seconds(tokens.shape[1])
        return real(tokens, cache, **kwargs)

    monkeypatch.setattr(model, "forward_batch", forward_batch)
    monkeypatch.setattr(engine_module, "time", clock)
    return clock


def test_a_change_of_regime_reanchors_the_load_within_a_few_steps(monkeypatch) -> None:
    """The machine gets 2x slower mid-request (another process took a core), then 2x faster again: the price of
    a plain step follows within REGIME_STEPS steps each time, and the shape is not disturbed."""
    model = tiny_model(0, vocab_size=56)
    slow = [1.0]
    clocked(monkeypatch, model, lambda n: slow[0] * (1.0 + 0.1 * (n - 1)))
    cost = shaped(0.1)
    prices: list[float] = []

    class Watch(FixedK):
        def observe(self, step) -> None:
            prices.append(cost.forward_seconds(1, step.context))
            if len(prices) == 10:
                slow[0] = 2.0
            if len(prices) == 30:
                slow[0] = 1.0

    generate_ids(model, [1, 2, 3], k=Watch(0), max_new_tokens=50, cost=cost)
    assert prices[9] == pytest.approx(1.0, rel=0.01)
    assert prices[10 + REGIME_STEPS - 1] == pytest.approx(2.0, rel=0.02)  # re-anchored on the third slow step
    assert all(p == pytest.approx(2.0, rel=0.02) for p in prices[10 + REGIME_STEPS : 30])
    assert prices[30 + REGIME_STEPS - 1] == pytest.approx(1.0, rel=0.02)
    assert relative(cost, 4) == pytest.approx(1.3)  # the shape stands, but is in doubt until steps re-time it
    assert cost.weight == [DOUBTED] * len(cost.sizes) and cost.margin(4) > 0


def test_after_a_change_of_regime_the_new_shape_is_learned_within_a_few_pairs() -> None:
    """Many pairs taught the shape under one regime (16 tokens: 3x a plain step, as on a machine shared with a
    dozen busy threads); then the machine is idle and 16 tokens cost 8x. The weight of the old regime's pairs must
    not hold the price back for hundreds of steps."""
    cost = shaped(2 / 15)  # 16 tokens: 3x
    for _ in range(100):
        cost.observe(1, 100, 1.0)
        cost.observe(16, 100, 3.0)
    assert relative(cost, 16) == pytest.approx(3.0, rel=0.01) and cost.weight is not None
    assert cost.weight[cost.sizes.index(16)] == 64
    for _ in range(40):  # idle: every step 5x faster, and the 16-token forward relatively dearer
        cost.observe(1, 100, 0.2)
        cost.observe(16, 100, 1.6)
    assert relative(cost, 16) > 5.5  # more than half-way from 3x to 8x (in log terms) within 40 pairs
    for _ in range(160):
        cost.observe(1, 100, 0.2)
        cost.observe(16, 100, 1.6)
    assert relative(cost, 16) == pytest.approx(8.0, rel=0.05)


# --------------------------------------------------------------------------------- the policy's own metric
def test_the_estimated_speedup_is_what_plain_steps_would_have_cost_over_what_the_steps_took(monkeypatch) -> None:
    model = tiny_model(0, vocab_size=56)
    prompt = [random.Random(0).randrange(56) for _ in range(20)]
    expected = generate_ids(model, prompt, max_new_tokens=40)[0]
    clocked(monkeypatch, model, lambda n: 1.0 + 0.1 * (n - 1))
    policy = AdaptiveK(shaped(0.1), AcceptanceStats(), cheap=True)
    out, stats = generate_ids(model, prompt, proposer=Oracle(prompt + expected, True, 56), k=policy,
                              max_new_tokens=40)
    assert out == expected and stats.target_forwards < 15
    # 40 tokens at 1 s each in plain steps, over the forwards' fake seconds (drafting takes real microseconds)
    assert stats.estimated_speedup == pytest.approx(40 / stats.target_seconds, rel=0.01)
    assert stats.estimated_speedup > 2
    wrong = AdaptiveK(shaped(0.1), AcceptanceStats(), cheap=True)  # guesses that never match: about plain speed
    _, stats = generate_ids(model, prompt, proposer=Oracle(prompt + expected, False, 56), k=wrong, max_new_tokens=40)
    assert 0.85 < stats.estimated_speedup < 1.01
    _, plain = generate_ids(model, prompt, max_new_tokens=10)  # not priced: no estimate
    assert plain.estimated_speedup is None and plain.as_dict()["estimated_speedup"] is None
