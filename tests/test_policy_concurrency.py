"""Speculation in a batch (issue 56 item 3): per-row depths from each row's own acceptance and the batch's marginal
cost. Every decision here is priced by a fixed made-up table (a batched forward of T tokens costs 0.5 + T / 32 s,
16 plain rows 1 s: a machine where a guessed token costs a 32nd of a full batch's step), never by this machine."""

from __future__ import annotations

import pytest

from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.tree import DraftTree
from specdecode.policy.batch_cost import BatchCost, RowCost, shared_out
from specdecode.policy.speculation import MARGIN, AdaptiveK, FixedK, joint_cut, ragged_cut

from .helpers import FrozenCost

ROWS = 16
CONTEXTS = [0, 1000]


def seconds_of(tokens: float) -> float:
    """The made-up machine: a batched forward of `tokens` tokens in all (rows and guesses together)."""
    return 0.5 + tokens / 32


def one_row() -> FrozenCost:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    return FrozenCost(sizes, CONTEXTS, [[seconds_of(n) for n in sizes]] * 2)


def ragged_table(rows: int) -> FrozenCost:
    """What BatchCost.measure saves for native batches: size s = rows + s - 1 tokens in all."""
    sizes = [1, 2, 3, 5, 9, 17, 33, 65]
    return FrozenCost(sizes, CONTEXTS, [[seconds_of(rows + s - 1) for s in sizes]] * 2)


def padded_table(rows: int) -> FrozenCost:
    """What it saves for padded batches: size n = rows rows of n tokens each (the padding costs as a token does)."""
    sizes = [1, 2, 4, 8]
    return FrozenCost(sizes, CONTEXTS, [[seconds_of(rows * n) for n in sizes]] * 2)


def batch(ragged: bool) -> BatchCost:
    return BatchCost([1, ROWS], [one_row(), ragged_table(ROWS) if ragged else padded_table(ROWS)], ragged=ragged)


def confident(rate: float, depth: int = 16) -> AcceptanceStats:
    """Stats that have seen 200 trials at every depth with conditional acceptance `rate`."""
    stats = AcceptanceStats(max_depth=depth, decay=1.0)
    stats.hits[0], stats.trials[0] = [rate * 200] * depth, [200.0] * depth
    return stats


def lookup_row(view: RowCost, rate: float) -> AdaptiveK:
    policy = AdaptiveK(view, AcceptanceStats(), cheap=True)
    policy.stats = confident(rate)  # the request's own estimate
    return policy


def chain(depth: int, first: int = 1) -> DraftTree:
    return DraftTree.from_paths(0, [list(range(first, first + depth))]) if depth else DraftTree.root_only(0)


def cut_batch(ragged: bool, rates: list[float], depths: list[int]) -> list[int]:
    """The depths a batch of ROWS rows verifies: row i proposes a chain depths[i] deep, accepted at rates[i] (the
    rest of the rows propose nothing), priced as the engine prices it (BatchCost.seconds at the batch's size)."""
    cost = batch(ragged)
    view = RowCost(cost)
    view.rows = ROWS
    policies = [lookup_row(view, rate) for rate in rates] + [lookup_row(view, 0.5) for _ in range(ROWS - len(rates))]
    proposals = [chain(d) for d in depths] + [chain(0) for _ in range(ROWS - len(depths))]
    trees = joint_cut(policies, proposals, [100] * ROWS, lambda width, context: cost.seconds(ROWS, width, context))
    return [t.depth for t in trees]


def test_tables_price_a_batch_by_its_tokens_where_it_is_ragged_and_by_its_width_where_padded() -> None:
    ragged, padded = batch(True), batch(False)
    for cost in (ragged, padded):
        assert cost.seconds(ROWS, 1, 100) == pytest.approx(seconds_of(ROWS))  # a plain step, either kind
        assert cost.seconds(ROWS, 2, 100) == pytest.approx(seconds_of(2 * ROWS))  # two tokens a row
    assert ragged.seconds(ROWS, 1 + 3 / ROWS, 100) == pytest.approx(seconds_of(ROWS + 3))  # 3 guesses in the batch
    assert ragged.seconds(ROWS, 1 + 6 / ROWS, 100) == pytest.approx(seconds_of(ROWS + 6))  # between measured sizes
    assert shared_out(4, 6) == [3, 3, 2, 2] and sum(shared_out(16, 21)) == 16 + 21


def test_one_row_guesses_in_a_full_ragged_batch_where_its_acceptance_pays_for_its_tokens() -> None:
    """One row of 16 repeats its prompt (90% of each guess accepted), the others propose nothing. Each guess adds a
    token to a 16-token forward (1/32 s of a 1 s step) and brings 0.9^d expected tokens: the batch's rate is highest
    at 5 of its 8 guesses (17.03 tokens/s against 16 plain), so a ragged batch verifies 5. A padded batch would pay
    16 rows of padding a guessed depth, and stays plain (the old shared cap priced every batch so: at 16 rows it
    never guessed)."""
    assert cut_batch(True, [0.9], [8])[0] == 5
    assert cut_batch(False, [0.9], [8])[0] == 0


def test_each_row_gets_its_own_depth_from_its_own_acceptance() -> None:
    """Rows that guess well guess deep beside rows whose guesses fail; a row's bad guesses are dropped whatever the
    others do, and a guess must beat its marginal cost by MARGIN."""
    depths = cut_batch(True, [0.9, 0.05, 0.75, 0.95], [10, 10, 10, 10])
    assert depths[1] == 0  # 5% accepted: its tokens cost more than they bring
    assert depths[3] >= depths[0] >= depths[2] >= 1  # deeper where acceptance is higher
    assert depths[4:] == [0] * (ROWS - 4)
    # a guess whose expected gain is just under the margin's worth is not verified, just over it is
    plain = seconds_of(ROWS)
    per_token = seconds_of(ROWS + 1) - plain
    at_cost = ROWS / plain * per_token  # tokens a guessed token must bring to keep the batch's rate
    assert ragged_cut([[1, 2]], [[0.0, at_cost + 0.9 * MARGIN]], ROWS - 1, ROWS - 1, seconds_of) == [0]
    assert ragged_cut([[1, 2]], [[0.0, at_cost + 1.5 * MARGIN]], ROWS - 1, ROWS - 1, seconds_of) == [1]


def test_a_lone_row_is_cut_as_the_policy_cuts_it_alone() -> None:
    """With one row a ragged batch is the request alone: the same depth as its own policy chooses."""
    cost = BatchCost.single(one_row())
    cost.ragged = True
    view = RowCost(cost)
    for rate in (0.05, 0.3, 0.6, 0.9):
        for depth in (1, 4, 12):
            policy = lookup_row(view, rate)
            alone = AdaptiveK(one_row(), AcceptanceStats(), cheap=True)
            alone.stats = policy.stats
            (tree,) = joint_cut([policy], [chain(depth)], [100], lambda w, c: cost.seconds(1, w, c))
            assert tree.depth == alone.choose(chain(depth), 100).depth


def test_fixed_rows_tokens_count_in_the_batch_they_share() -> None:
    """A row verifying a fixed 8 guesses makes the forward 8 tokens bigger whatever the others do (1.25 s for 16
    rows, its gain counted as a plain row's): the others' guesses are priced on top of it, where a token costs less
    of the step's rate, so the 90% row keeps 7 of its 8 guesses (5 in a plain batch)."""
    cost = batch(True)
    view = RowCost(cost)
    view.rows = ROWS
    policies = [FixedK(8), lookup_row(view, 0.9)] + [lookup_row(view, 0.5) for _ in range(ROWS - 2)]
    proposals = [chain(8), chain(8, first=20)] + [chain(0) for _ in range(ROWS - 2)]
    trees = joint_cut(policies, proposals, [100] * ROWS, lambda w, c: cost.seconds(ROWS, w, c))
    assert [t.depth for t in trees[:2]] == [8, 7] and all(t.depth == 0 for t in trees[2:])


def test_a_row_prices_its_guesses_at_the_batchs_marginal_cost() -> None:
    """A row's view of the batch: its share of a plain step plus what its own tokens add. So a model draft whose
    guesses cost 50 ms each pays alone (a 0.53 s step) but not in a 16-row batch (a 62 ms share of a 1 s step),
    where the old view priced the row's forward at the whole batch's second and kept drafting."""
    cost = batch(True)
    view = RowCost(cost)
    view.rows = ROWS
    share = seconds_of(ROWS) / ROWS
    assert view.forward_seconds(1, 100) == pytest.approx(share)
    assert view.forward_seconds(5, 100) == pytest.approx(share + seconds_of(ROWS + 4) - seconds_of(ROWS))
    assert view.forward_seconds_upto(9, 100) == pytest.approx([view.forward_seconds(n, 100) for n in range(1, 10)])
    drafted = AdaptiveK(view, AcceptanceStats(), cheap=False)
    drafted.stats = confident(0.7)
    drafted.draft_per_guess = 0.05
    assert drafted.best_depth(0, 100, 8) == 0
    view.rows = 1
    assert drafted.best_depth(0, 100, 8) >= 2


def test_ragged_steps_teach_the_table_only_what_their_width_says() -> None:
    """The engine reports a step's width: a ragged step wider than one token held an unknown number of tokens, so
    only plain steps (or steps whose tokens are known) move its batch size's table."""
    learned: list[tuple[int, float]] = []

    class Recording(FrozenCost):
        def observe(self, tokens: int, context: int, seconds: float) -> None:
            learned.append((tokens, seconds))

    sizes = [1, 2, 3, 5]
    cost = BatchCost([1, ROWS], [one_row(), Recording(sizes, CONTEXTS, [[1.0, 1.1, 1.2, 1.3]] * 2)], ragged=True)
    cost.observe(ROWS, 3, 100, 2.0)
    cost.observe(ROWS, 1, 100, 1.5)
    cost.observe_tokens(ROWS, ROWS + 4, 100, 1.7)
    assert learned == [(1, 1.5), (5, 1.7)]


def test_ragged_tables_are_one_line_through_every_batch_sizes_points() -> None:
    """Measured points a + slope x tokens at every batch size, one of them hit by a burst (5x): the tables are the
    line through them all, the burst left out, and b rows of s table size cost what b + s - 1 tokens do."""
    from specdecode.policy.batch_cost import pooled
    from specdecode.policy.cost import CostModel

    sizes = [2, 4, 8]
    grid = {b: [1, 2, 3, 5, 9] for b in sizes}
    tables = [CostModel(grid[b], CONTEXTS, [[0.01 + 0.002 * (b + s - 1) * (1 + (c > 0)) for s in grid[b]]
                                            for c in CONTEXTS]) for b in sizes]
    tables[1].seconds[0][2] *= 5  # a burst of another process's load in one timing
    lines = pooled(sizes, grid, CONTEXTS, tables, None, 3)  # type: ignore[arg-type]
    for b, table in zip(sizes, lines, strict=True):
        assert table.sizes == grid[b]
        assert table.seconds[0] == pytest.approx([0.01 + 0.002 * (b + s - 1) for s in grid[b]])
        assert table.seconds[1] == pytest.approx([0.01 + 0.004 * (b + s - 1) for s in grid[b]])
