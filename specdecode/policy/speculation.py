"""How much to guess: a measured cost model times an online acceptance estimate.

Each step the policy picks the draft depth d that maximises expected committed tokens per second,

    (1 + E[accepted | d]) / (T_target(nodes(d), context) + T_draft(d)),

and d = 0 (a plain step) when no depth beats 1 / T_target(1) by MARGIN. T_target comes from forward timings
measured once per model and machine (cached on disk) and scaled online by the load the machine is under
(what steps actually cost over the table's price); E[accepted] from per-depth conditional acceptance
rates, tracked per proposal class.

Acceptance is learned from every proposal, not only the verified part: once the committed text covers
a guess we know how far it would have matched. So a policy that stops speculating still learns when
guesses become good again, for free when proposing is free (prompt lookup). Proposers that cost a
model forward per guess cannot be scored without running them; for those a plain-step streak is
broken by a probe whose interval doubles each time it finds nothing worth guessing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.acceptance import AcceptanceStats, ProposalScorer
from ..core.tree import DraftTree
from .cost import ForwardCost

# a guess must beat a plain step's rate by this fraction: a small size's price is known to +-3% and acceptance
# is estimated from a few dozen guesses, and guessing is chosen when those estimates look best, so a step
# estimated within a few percent of a plain one loses about as often as it wins (Medusa in summarization did,
# benchmarks/results/comment-timings.md)
MARGIN = 0.04
FIRST_PROBE_WITHIN = 16  # plain steps at most before a request's first probe, whatever earlier requests found
# a free proposer asked this many steps in a row with nothing worth verifying is asked on probes only (every 8, 16,
# ... IDLE_PROBE_MOST steps): proposing and scoring a lookahead window is ~1% of a step, steps that never pay it back
IDLE_ASKS = 32
IDLE_PROBE_MOST = 64


def rate_to_beat(cost: ForwardCost, context: int) -> float:
    """What guessing must beat: a plain step's tokens per second, raised by MARGIN."""
    return (1 + MARGIN) / cost.forward_seconds(1, context)


def best_count(chances: Sequence[float], cost: ForwardCost, context: int, overhead: np.ndarray | float = 0.0
               ) -> tuple[int, float]:
    """For guesses ranked best first (each prefix a tree) with these chances of acceptance: the count n
    maximising (1 + chances of the first n) / (forward of n + 1 tokens + overhead[n]), and that rate.
    n = 0 is a plain step, chosen unless guessing beats it by MARGIN; overhead: what proposing costs (an array:
    per count), 0 once it is spent. Plain Python: two dozen sizes a step, where numpy's small operations right
    after a forward cost several times more (a third of suffix decoding's proposing time)."""
    prices = cost.forward_seconds_upto(len(chances) + 1, context)
    if isinstance(overhead, np.ndarray):
        prices = [p + o for p, o in zip(prices, overhead.tolist(), strict=False)]
    elif overhead:
        prices = [p + float(overhead) for p in prices]
    plain = 1.0 / prices[0]
    expected, best, best_rate = 1.0, 0, plain * (1 + MARGIN)
    for n, chance in enumerate(map(float, chances), start=1):
        expected += chance
        rate = expected / prices[n]
        if rate > best_rate:  # the first of equal rates: the fewest guesses
            best, best_rate = n, rate
    return best, best_rate if best else plain


class Rest:
    """Whether a proposer that costs time to run rests. Its steps' realized rate, tokens committed over the seconds
    they took (proposing included, each step counted in plain steps of its own time, as the load moves; decayed
    sums, since one step gains 0 or several tokens and a short run of misses must not send a proposer that pays on
    average to rest), is compared with a plain step's: under 1 + MARGIN once `evidence` steps are judged, it rests
    for 1, 2, 4 ... up to `most` steps, then probes again; a step that pays ends the backoff."""

    def __init__(self, most: int, evidence: int = 4) -> None:
        self.most, self.evidence = most, evidence
        self.left = self.backoff = 0  # steps left to rest; the next rest (0: one step)
        self.value: float | None = None  # realized rate over a plain step's
        self.tally = (0.0, 0.0, 0)  # decayed tokens and plain steps' seconds of the judged steps, steps judged

    def take(self) -> bool:
        """A step: True while resting (the proposer is not run)."""
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def judge(self, cost: ForwardCost, accepted: int, seconds: float, nodes: int, context: int) -> None:
        """A step that ran the proposer: it proposed for `seconds`, the target verified `nodes` tokens (the root
        included) after `context` cached ones and accepted `accepted` guesses."""
        plain_steps = (seconds + cost.forward_seconds(nodes, context)) / cost.forward_seconds(1, context)
        total, spent, steps = self.tally
        total, spent = 0.9 * total + 1 + accepted, 0.9 * spent + plain_steps
        self.tally, self.value = (total, spent, steps + 1), total / spent
        if self.value < 1 + MARGIN and steps + 1 >= self.evidence:
            self.left, self.backoff = self.backoff, min(2 * self.backoff or 1, self.most)
        else:
            self.backoff = 0

    def state(self) -> tuple[float | None, int, tuple[float, float, int]]:
        return self.value, self.backoff, self.tally

    def resume(self, state: tuple[float | None, int, tuple[float, float, int]]) -> None:
        """Start from what an earlier request found: resting then, this one starts resting too."""
        self.value, self.backoff, self.tally = state
        self.left = self.backoff if self.value is not None and self.value < 1 + MARGIN else 0


# ------------------------------------------------------------------------------ what a policy reads
@dataclass(frozen=True)
class Guessing:
    """How a proposer's guesses are paid for: the one thing k="auto" reads of a proposer (`policy_for`)."""

    plain: bool = False  # it never guesses (plain decoding): no policy needed
    # proposing costs next to nothing (no model forward): the policy asks for a deep tree and cuts it afterwards;
    # else each guess costs a draft forward, and the depth is chosen before drafting from its measured cost
    cheap: bool = False
    # it sizes each step's guesses itself from the cost it is given (RequestInfo.cost); k="auto" caps the depth
    sizes_itself: bool = False
    max_depth: int = 0  # that cap
    # False where a measurement found that drafting cannot beat plain steps on this model and machine (layer
    # skipping whose search found no set that pays): k="auto" then runs plain steps without probing
    pays: bool = True


@dataclass(frozen=True)
class Pricing:
    """What k="auto" prices a request's guesses with: its engine's forward cost (a `batch_cost.RowCost`), and the
    long-run acceptance statistics it starts from and hands back to, by part ("" for the proposer itself)."""

    cost: ForwardCost
    acceptance: Callable[[str], AcceptanceStats]


def policy_for(k: int | str, guessing: Guessing, pricing: Pricing) -> Policy:
    """The policy of a request: k = "auto", the cost model decides each step; an int, always guess k tokens."""
    if k != "auto":
        if isinstance(k, str) and not k.isdigit():
            raise ValueError(f"k must be 'auto' or an integer >= 0 (tokens guessed per step), got {k!r}")
        return FixedK(int(k))
    if guessing.plain or not guessing.pays:
        return FixedK(0)
    if guessing.sizes_itself:  # sizes each step from the cost model (which every step keeps correcting)
        return FixedK(guessing.max_depth)
    return AdaptiveK(pricing.cost, pricing.acceptance(""), cheap=guessing.cheap)


# -------------------------------------------------------------------------------------- policies
class Policy(ABC):
    """Decides each step's speculation: how deep to ask the proposer, and how much of its tree to verify."""

    @abstractmethod
    def depth_to_propose(self, context: int, limit: int) -> int: ...

    def choose(self, tree: DraftTree, context: int) -> DraftTree:
        return tree

    def observe(self, step: StepRecord) -> None:  # noqa: B027 - optional hook
        """After each step."""

    def finish(self, tokens: list[int]) -> None:  # noqa: B027 - optional hook
        """The request ended; `tokens` is everything committed."""

    def remember(self) -> None:  # noqa: B027 - optional hook
        """Hand what was learned so far to the long-run estimate (policies that learn across requests)."""


@dataclass
class StepRecord:
    proposal: DraftTree  # everything the proposer offered
    verified: DraftTree  # what the target saw
    start: int  # tokens committed before the step (= index of the first guessed position)
    tokens: list[int]  # all tokens committed after the step
    context: int  # cached tokens before the step's forward
    draft_seconds: float
    seconds_per_guess: float | None = None  # the proposer's own measure (ProposalContext.seconds_per_guess)


class FixedK(Policy):
    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k (tokens to guess per step) must be >= 0 or 'auto', got {k}")
        self.k = k

    def depth_to_propose(self, context: int, limit: int) -> int:
        return min(self.k, limit)


def learned(name: str) -> property:
    """A policy attribute kept in its AcceptanceStats, so it carries over between requests with them."""
    return property(lambda self: getattr(self.stats, name), lambda self, value: setattr(self.stats, name, value))


def smoothed(old: float | None, new: float) -> float:
    """Exponential smoothing of a timing: the first sample as is, then 80% old and 20% new, the new one counted at
    no more than twice the old (nor under half): only steps that guess time a draft again, so one stalled call (a
    garbage collection, a page fault) that tripled the estimate priced a 360M draft as dear as its target and it was
    never asked again; a real change is followed within a few steps."""
    return new if old is None else 0.8 * old + 0.2 * min(max(new, 0.5 * old), 2.0 * old)


class AdaptiveK(Policy):
    """Cost-model-driven depth; see the module docstring.

    `cheap` proposers (n-gram lookups) cost nothing to ask for a deep tree: the policy cuts the tree after
    seeing it, using the acceptance of the tree's class. Model drafts cost a forward per guess: the depth
    is chosen before drafting, from the draft's measured time per guess.
    """

    def __init__(self, cost: ForwardCost, shared: AcceptanceStats, *, cheap: bool, max_k: int = 16) -> None:
        self.cost, self.shared, self.cheap, self.max_k = cost, shared, cheap, max_k
        self.stats = shared.fork()
        # the probe interval carries over, but a new request probes within its first steps: a run of requests
        # where guessing did not pay had doubled it past any request's length, so text that copies its prompt
        # (Spec-Bench extraction after writing: tau 3 alone, 1.00 after) was never guessed at again
        self.probe_every = min(self.probe_every, FIRST_PROBE_WITHIN)
        self.scorer = ProposalScorer(self.stats)
        self.plain_streak = 0
        self.asked = 0  # the depth asked of a cheap proposer this step (0: it was not asked)
        self.idle_asks = 0  # steps in a row a cheap proposer was asked and nothing was verified
        self.verified_depths: list[int] = []  # per step, for stats and tests

    # what is learned about the proposer's cost and the probe interval lives with the learned stats
    draft_per_guess = learned("draft_per_guess")
    propose_seconds = learned("propose_seconds")
    probe_every = learned("probe_every")

    def _target(self, tokens: int, context: int) -> float:
        return self.cost.forward_seconds(tokens, context)

    def _rates(self, expected: list[float], sizes: list[int], context: int, overhead: float) -> list[float]:
        """Tokens per second of depths 1..len(sizes): expected[d] accepted, target forward of sizes[d - 1].
        In plain Python: a dozen depths, priced every step right after a forward, when numpy's small operations
        are slowest."""
        per_guess = 0.0 if self.cheap else self.draft_per_guess or 0.0
        return [(1.0 + expected[d]) / (self.cost.forward_seconds(n, context) + overhead + d * per_guess)
                for d, n in enumerate(sizes, start=1)]

    def _sizes(self, top: int) -> list[int]:
        return [d + 1 for d in range(1, top + 1)]  # a chain: the root and d guesses

    def best_depth(self, bucket: int, context: int, limit: int, nodes: list[int] | None = None,
                   overhead: float = 0.0) -> int:
        """argmax_d (1 + E[accepted | d]) / seconds(d), d = 0 included; nodes[d] = forward tokens at depth d;
        overhead: seconds a proposal costs whatever its depth (only while it is still to be paid for)."""
        expected = self.stats.expected_accepted(bucket)
        top = min(limit, len(expected) - 1, self.max_k if nodes is None else len(nodes) - 1)
        if top < 1:
            return 0
        rates = self._rates(expected, self._sizes(top) if nodes is None else nodes[1 : top + 1], context, overhead)
        best = max(range(top), key=rates.__getitem__)  # the first of equal rates: the fewest guesses
        return best + 1 if rates[best] > rate_to_beat(self.cost, context) else 0

    def depth_to_propose(self, context: int, limit: int) -> int:
        if self.cheap:
            self.asked = self._cheap_depth(context, min(self.max_k, limit))
            return self.asked
        if limit < 1:  # no room for a guess (a request's last token): no evidence either way, the probes stand
            return 0
        if self.draft_per_guess is None:  # nothing measured yet: a short draft to learn its cost
            return min(2, limit)
        if self._between_probes():
            return 0
        depth = self.best_depth(0, context, limit)
        if depth:
            return self._guessing(depth)
        if not self._probe_due():
            return 0
        return min(2, limit) if self.could_pay(context, limit) else 0

    def _cheap_depth(self, context: int, depth: int) -> int:
        """Ask for the whole depth (the tree is cut after it is seen) unless proposing itself costs more
        than it can win: Medusa's heads are a few matmuls, not nothing. A proposal costing under 1% of a
        plain step is made while its proposals get verified: scoring it teaches the policy for free. After
        IDLE_ASKS steps in a row with nothing verified, it is made on probes only (proposing and scoring are not
        quite free), until a probe's proposal is verified."""
        overhead = self.propose_seconds or 0.0
        if depth < 1:
            return depth
        if overhead < 0.01 * self._target(1, context):
            if self.idle_asks < IDLE_ASKS:
                return depth
            if self._between_probes() or not self._probe_due(IDLE_PROBE_MOST):
                return 0
            return depth
        if self._between_probes():
            return 0
        if any(self.best_depth(b, context, depth, overhead=overhead) for b in self.stats.hits or [0]):
            return self._guessing(depth)
        if not self._probe_due():
            return 0
        return depth if self.could_pay(context, depth, overhead) else 0

    def _between_probes(self) -> bool:
        """A proposer that costs to run is not run on plain steps, so once its last proposals are scored they
        teach the policy nothing new: the decision stands (costing nothing to make) until a probe is due.
        Not before: a guess that matched is scored only once the text covers all of it, a miss at once, so
        deciding before then would see the misses alone."""
        if 0 < self.plain_streak < self.probe_every and not self.scorer.pending:
            self.plain_streak += 1
            return True
        return False

    def _guessing(self, depth: int) -> int:
        self.plain_streak, self.probe_every = 0, 8
        return depth

    def _probe_due(self, most: int = 4096) -> bool:
        """Nothing is worth guessing: a plain step, or after `probe_every` of them a probe (True), the interval
        doubling (up to `most`) while probes find nothing worth guessing. Only then is it worth asking whether
        guesses could pay."""
        self.plain_streak += 1
        if self.plain_streak <= min(self.probe_every, most):
            return False
        self.plain_streak, self.probe_every = 0, min(2 * self.probe_every, most)
        return True

    def could_pay(self, context: int, limit: int, overhead: float = 0.0) -> bool:
        """Would even all-accepted guesses beat plain steps?"""
        top = min(limit, self.max_k)
        if top < 1:
            return False
        rates = self._rates(list(range(top + 1)), self._sizes(top), context, overhead)
        return max(rates) > rate_to_beat(self.cost, context)

    def choose(self, tree: DraftTree, context: int) -> DraftTree:
        """The request alone: joint_cut with one row (what the engine runs for a batch of one)."""
        return joint_cut([self], [tree], [context], self.cost.forward_seconds)[0]

    def observe(self, step: StepRecord) -> None:
        self.scorer.add(step.proposal, step.start, step.verified.depth)
        self.scorer.update(step.tokens)
        depth = step.verified.depth
        self.verified_depths.append(depth)
        if self.cheap and self.asked:
            self.propose_seconds = smoothed(self.propose_seconds, step.draft_seconds)
            if depth and self.idle_asks >= IDLE_ASKS:  # a probe found guesses worth verifying: asked every step again
                self._guessing(depth)
            self.idle_asks = 0 if depth else self.idle_asks + 1
        if not self.cheap and depth:
            self.draft_per_guess = smoothed(self.draft_per_guess, step.seconds_per_guess or step.draft_seconds / depth)

    def finish(self, tokens: list[int]) -> None:
        self.scorer.update(tokens, final=True)
        self.remember()

    def remember(self) -> None:
        """Hand what this request learned to the long-run estimate (also done when the request ends)."""
        self.shared.absorb(self.stats)


def nearly_free(seconds: Callable[[int, int], float], tokens: int, extra: int, context: int) -> bool:
    """Do `extra` nodes beside a forward of `tokens` cost under MARGIN of it? A lookahead window rides along only
    then: its guesses are worth what it costs where a forward is bound by reading the weights, so that more tokens
    are nearly free (a GPU); on a CPU a forward is compute-bound past a few tokens, and the window's guesses win
    about one token a step."""
    return seconds(tokens + extra, context) <= (1 + MARGIN) * seconds(tokens, context)


def ragged_pricing(policies: Sequence[Policy]) -> bool:
    """Do these rows' forwards run ragged (each row's real tokens, no padding: the native blocks)? Read from the
    batch's cost the adaptive policies price with (`batch_cost.RowCost.ragged`); a lone request's own table: no."""
    return any(isinstance(p, AdaptiveK) and getattr(p.cost, "ragged", False) for p in policies)


def joint_cut(policies: Sequence[Policy], proposals: Sequence[DraftTree], contexts: Sequence[int],
              seconds: Callable[..., float], ragged: bool | None = None) -> list[DraftTree]:
    """How much of each row's proposal a batch verifies; seconds(width, context): the batch's forward with every row
    `width` tokens wide (ragged: fractional, rows x width tokens in all, however they are shared out).

    Cheap proposals under an adaptive policy are cut for the batch as a whole, to maximise expected committed tokens
    of the whole batch per second of the batched forward; guessing must beat plain steps by MARGIN for each row that
    guesses (a lone row: its own MARGIN, as alone). Ragged batches (`ragged_pricing`; the native blocks) cost by
    their tokens: each row gets its own depth, its guesses taken best first while their expected gain pays for their
    marginal cost (`ragged_cut`). Padded batches cost by the widest row (padding costs as much as a token): one
    depth cap D shared by the rows, each row then also filling the padding it pays for anyway. A lookahead window
    rides along only where it is nearly free (`nearly_free`). Other rows (fixed k, or a model draft already paid
    for) are verified as their policy says.
    With one row this is the adaptive policy's own choice of depth for its tree."""
    if ragged is None:
        ragged = ragged_pricing(policies)
    context, rows = max(contexts), len(proposals)
    trees: list[DraftTree | None] = [None] * rows
    proposals = list(proposals)
    # a row's n tokens beside plain rows (ragged) or a batch n tokens wide (padded)
    def wide(total: int) -> float:  # a ragged batch of `total` tokens as a width (an int where it is one)
        return total // rows if total % rows == 0 else total / rows

    width_seconds = (lambda n, c: seconds(wide(rows - 1 + n), c)) if ragged else seconds
    floor, fixed_gain, fixed_tokens, free = 1, 0.0, 0, []
    for i, (policy, tree) in enumerate(zip(policies, proposals, strict=True)):
        if isinstance(policy, AdaptiveK) and policy.cheap:
            if tree.num_drafted:
                if tree.extra is not None and not nearly_free(width_seconds, len(tree), len(tree.extra.tokens),
                                                              context):
                    proposals[i] = tree.without_extra()
                free.append(i)
                continue
            tree = DraftTree.root_only(tree.tokens[0])  # nothing to verify: a lookahead window alone only costs
        chosen = trees[i] = tree if isinstance(policy, AdaptiveK) else policy.choose(tree, contexts[i])
        tokens = len(chosen) + (len(chosen.extra.tokens) if chosen.extra else 0)
        floor, fixed_tokens = max(floor, tokens), fixed_tokens + tokens
        fixed_gain += 1.0
    if free and ragged:
        depths = ragged_cut([proposals[i].forward_sizes() for i in free],
                            [policies[i].stats.expected_accepted(proposals[i].bucket)  # type: ignore[attr-defined]
                             for i in free], fixed_gain, fixed_tokens, lambda total: seconds(wide(total), context))
        for i, depth in zip(free, depths, strict=True):
            trees[i] = proposals[i].cut(depth)
    elif free:
        nodes = {i: proposals[i].forward_sizes() for i in free}
        expected = {i: policies[i].stats.expected_accepted(proposals[i].bucket) for i in free}  # type: ignore[attr-defined]
        top = max(len(n) - 1 for n in nodes.values())
        best, best_width = 0, floor
        best_rate = (fixed_gain + len(free)) / seconds(floor, context) * (1 + MARGIN)  # no guesses: D = 0
        for depth in range(1, top + 1):
            width, gain = floor, fixed_gain
            for i in free:
                d = min(depth, len(nodes[i]) - 1, len(expected[i]) - 1)
                width = max(width, nodes[i][d])
                gain += 1.0 + float(expected[i][d])
            rate = gain / seconds(width, context)
            if rate > best_rate:
                best, best_rate, best_width = depth, rate, width
        for i in free:  # the deepest cut that still fits the batch's width
            fits = [d for d, n in enumerate(nodes[i]) if n <= best_width]
            trees[i] = proposals[i].cut(max(min(best, len(nodes[i]) - 1), fits[-1]))
    return trees  # type: ignore[return-value]


def ragged_cut(nodes: Sequence[Sequence[int]], expected: Sequence[Sequence[float]], fixed_gain: float,
               fixed_tokens: int, seconds: Callable[[int], float]) -> list[int]:
    """Depths for the free rows of a ragged batch: nodes[r][d], row r's forward tokens at depth d (nodes[r][0] = 1,
    the root); expected[r][d], its expected accepted guesses there; the other rows hold `fixed_tokens` tokens and
    count `fixed_gain` tokens a step; seconds(total): the batch's forward at that many tokens.

    The rows' next depths are taken in turn, best expected gain per added token first (a row's depths in order),
    and the batch keeps the prefix of that order whose rate, tokens committed per second, minus MARGIN of a plain
    step's rate for each row that guesses, is highest (the plain step included: no row guesses). So one row's good
    guesses pay in a full batch where they beat the marginal cost of their tokens, and a row that guesses badly
    guesses nothing, whatever the others do."""
    import heapq

    rows = len(nodes)
    depth = [0] * rows
    gain, total = fixed_gain + rows, fixed_tokens + rows
    prices: dict[int, float] = {}

    def price(tokens: int) -> float:
        if tokens not in prices:
            prices[tokens] = seconds(tokens)
        return prices[tokens]

    plain = price(total)
    tops = [min(len(n), len(e)) - 1 for n, e in zip(nodes, expected, strict=True)]

    def step(r: int) -> tuple[float, int, float]:
        d = depth[r] + 1
        added = nodes[r][d] - nodes[r][d - 1]
        gained = float(expected[r][d]) - float(expected[r][d - 1])
        return gained, added, gained / max(added, 1)

    heap = [(-step(r)[2], r) for r in range(rows) if tops[r] >= 1]
    heapq.heapify(heap)
    best_score, best = gain / plain, list(depth)
    guessing = 0
    while heap and heap[0][0] < 0:  # a guess that adds nothing expected cannot pay for its tokens
        _, r = heapq.heappop(heap)
        gained, added, _ = step(r)
        guessing += depth[r] == 0
        depth[r] += 1
        gain, total = gain + gained, total + added
        score = gain / price(total) - MARGIN * guessing / plain
        if score > best_score:
            best_score, best = score, list(depth)
        if depth[r] < tops[r]:
            heapq.heappush(heap, (-step(r)[2], r))
    return best
