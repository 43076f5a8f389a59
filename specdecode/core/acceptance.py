"""What the policy knows of a proposer's guesses: conditional acceptance per depth, learned from every
proposal (verified or not) once the committed text shows how far it matched."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat

from .tree import DraftTree


@dataclass
class AcceptanceStats:
    """Conditional acceptance per proposal class and depth: P(guess d matches | guesses 1..d-1 matched).

    Counts decay geometrically so the estimate follows the text as it changes. Each depth's counts are
    pulled, with the weight of two observations, toward the estimate one depth up: a deep guess is resolved
    only after the ones above it matched, so it has few observations of its own, and the depth above is
    the best guess for it (a per-depth prior carried over from a request that copied its prompt kept
    summarization guessing 13 deep at half the acceptance it expected). The first depth is pulled toward
    what the requests before found (0.5 before any ended): a weak draft (3% accepted) starts a request
    near 3%, not halfway to 50%, so it does not spend the request's first steps finding out again.
    """

    max_depth: int = 16
    decay: float = 0.97
    # decayed counts per bucket and depth, in plain lists: a step touches a dozen floats, and numpy's small
    # operations right after a forward cost more than the Python loops (benchmarks/results/comment-timings.md)
    hits: dict[int, list[float]] = field(default_factory=dict)
    trials: dict[int, list[float]] = field(default_factory=dict)
    prior: dict[int, float] = field(default_factory=dict)  # per bucket, the first depth's; 0.5 where missing
    # what else a policy learns about a proposer, kept across requests: a model draft's seconds per guess,
    # a cheap proposer's seconds per proposal, and how many plain steps pass before the next probe
    # (doubling while probes find guessing does not pay)
    draft_per_guess: float | None = None
    propose_seconds: float | None = None
    probe_every: int = 8

    def _rows(self, bucket: int) -> tuple[list[float], list[float]]:
        if bucket not in self.hits:
            self.hits[bucket] = [0.0] * self.max_depth
            self.trials[bucket] = [0.0] * self.max_depth
        return self.hits[bucket], self.trials[bucket]

    def record(self, bucket: int, matched: int, tried: int) -> None:
        """A proposal matched its first `matched` guesses; guesses 1..`tried` were resolved (tried >= matched)."""
        hits, trials = self._rows(bucket)
        tried = min(tried, self.max_depth)
        matched = min(matched, tried)
        decay = self.decay
        hits[:matched] = [h * decay + 1.0 for h in hits[:matched]]
        hits[matched:] = [h * decay for h in hits[matched:]]
        trials[:tried] = [t * decay + 1.0 for t in trials[:tried]]
        trials[tried:] = [t * decay for t in trials[tried:]]

    def rates(self, bucket: int, floor: list[float] | None = None) -> list[float]:
        """floor: per depth, what this bucket is known to do at least as well as (suffix decoding: the class of
        the next shorter matches); each depth is pulled toward it where it is above the estimate carried down."""
        return list(self._conditional(bucket, floor))

    def _conditional(self, bucket: int, floor: Iterable[float] | None = None) -> Iterator[float]:
        """`rates`, one depth at a time (a caller that stops early computes no deeper one)."""
        hits, trials = self._rows(bucket)
        below = None if floor is None else iter(floor)
        above = self.prior.get(bucket, 0.5)
        for h, t in zip(hits, trials, strict=True):
            toward = above
            if below is not None:
                under = next(below)
                if under >= above:
                    toward = under
            above = (h + 2.0 * toward) / (t + 2.0)
            yield above

    def reach(self, bucket: int, floor: int | None = None, until: float = 0.0) -> list[float]:
        """[d - 1]: the chance that guesses 1..d all match (the running product of `rates(bucket, rates(floor))`),
        up to the first depth under `until` (included): what a proposer that sends nothing less likely asks each
        step, at a fraction of the deep rows' work. One plain loop over both classes' counts (suffix decoding asks
        it every step), cheaper than `_conditional`'s two nested generators."""
        hits, trials = self._rows(bucket)
        floor_hits: Iterable[float]
        floor_trials: Iterable[float]
        if floor is None:  # a floor that never rises above the estimate
            floor_hits = floor_trials = repeat(0.0)
            under = -math.inf
        else:
            (floor_hits, floor_trials), under = self._rows(floor), self.prior.get(floor, 0.5)
        above, reach, out = self.prior.get(bucket, 0.5), 1.0, []
        for h, t, fh, ft in zip(hits, trials, floor_hits, floor_trials, strict=False):
            under = (fh + 2.0 * under) / (ft + 2.0)  # the floor's own rate (no floor of its own)
            above = (h + 2.0 * (under if under >= above else above)) / (t + 2.0)
            reach *= above
            out.append(reach)
            if reach < until:
                break
        return out

    def expected_accepted(self, bucket: int) -> list[float]:
        """[d] = expected accepted guesses for a chain of depth d (index 0: depth 0)."""
        out = [0.0]
        for reach in self.reach(bucket):
            out.append(out[-1] + reach)
        return out

    def fork(self, weight: float = 8.0) -> AcceptanceStats:
        """A per-request copy that starts from this long-run estimate, worth at most `weight` observations."""
        out = AcceptanceStats(self.max_depth, self.decay)
        out.draft_per_guess, out.propose_seconds = self.draft_per_guess, self.propose_seconds
        out.probe_every = self.probe_every
        out.prior = dict(self.prior)
        for b in self.hits:
            scale = min(1.0, weight / max(float(self.trials[b][0]), 1e-9))
            out.hits[b], out.trials[b] = [h * scale for h in self.hits[b]], [t * scale for t in self.trials[b]]
        return out

    def absorb(self, request: AcceptanceStats) -> None:
        """A request ended: its final estimate (which started from this one) becomes the long-run one."""
        for b in request.hits:
            self.hits[b], self.trials[b] = list(request.hits[b]), list(request.trials[b])
            self.prior[b] = request.rates(b)[0]  # what the next request expects before it has seen anything
        self.draft_per_guess, self.propose_seconds = request.draft_per_guess, request.propose_seconds
        self.probe_every = request.probe_every


@dataclass
class Proposal:
    """A proposal waiting for the committed text to show how far it matched."""

    start: int  # index in the token list of the first guessed position
    paths: list[list[int]]
    bucket: int


SCORE_AHEAD = 4  # depths scored past the deepest guess verified: see ProposalScorer


class ProposalScorer:
    """Scores every proposal against the tokens committed after it, whatever part of it was verified, up to
    SCORE_AHEAD depths past the deepest guess the step verified. A path that keeps matching is scored only once the
    text covers all of it, so a 32-deep guess sent 2 deep in a copy taught nothing for the ten steps the text took
    to cover it, and every one of those steps sent 2 guesses again; cut a few depths past what was verified it is
    scored a step or two later (a cut chosen before the outcome biases no depth before it; deeper ones follow the
    depth above, see AcceptanceStats)."""

    def __init__(self, stats: AcceptanceStats) -> None:
        self.stats = stats
        self.pending: list[Proposal] = []

    def add(self, tree: DraftTree, tokens_so_far: int, verified_depth: int | None = None) -> None:
        """tree: all the proposer offered; verified_depth: the deepest guess the target saw (None: all)."""
        paths = tree.paths()
        if verified_depth is not None:
            cut = {tuple(p[: verified_depth + SCORE_AHEAD]): None for p in paths}
            paths = [list(p) for p in cut]
        if paths:
            self.pending.append(Proposal(tokens_so_far, paths, tree.bucket))

    def cut(self, count: int, verified_depth: int) -> None:
        """The last `count` proposals added (to `pending` by the proposer itself) are cut as `add` cuts them."""
        for prop in self.pending[len(self.pending) - count :]:
            prop.paths = [p[: verified_depth + SCORE_AHEAD] for p in prop.paths]

    def update(self, tokens: list[int], final: bool = False) -> None:
        still = []
        for prop in self.pending:
            actual = tokens[prop.start :]
            matched, longest_matching = 0, 0
            for path in prop.paths:
                m = 0
                while m < len(path) and m < len(actual) and path[m] == actual[m]:
                    m += 1
                if m > matched or (m == matched and len(path) > longest_matching):
                    matched, longest_matching = m, len(path)
            if matched < min(longest_matching, len(actual)):  # a miss was seen at depth matched + 1
                self.stats.record(prop.bucket, matched, matched + 1)
            elif matched == longest_matching or final:  # fully matched, or the request ended first
                self.stats.record(prop.bucket, matched, matched)
            else:
                still.append(prop)
        self.pending = still

