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

import hashlib
import json
import os
import platform
import random
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .models import Transformer
from .tree import DraftTree

# every size up to 8: small forwards are not monotone in size (oneDNN picks its kernels by row count), so an
# interpolated size would be priced wrong
COST_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
# tables saved by another version of `measure` are measured again (version 1 timed 5 rounds in a fixed order:
# one burst of load could flatten the small sizes, which then looked free to verify; version 2 took unpaired
# medians, up to 10% optimistic for small sizes at long context; version 3 forced the table non-decreasing,
# pricing 2 tokens 14% under and 3-6 tokens 5% over what they cost)
TABLE_VERSION = 4
# a guess must beat a plain step's rate by this fraction: a small size's price is known to +-3% and acceptance
# is estimated from a few dozen guesses, and guessing is chosen when those estimates look best, so a step
# estimated within a few percent of a plain one loses about as often as it wins (Medusa in summarization:
# guesses at 8% acceptance, each step 4% dearer than the table said, 0.96x of plain decoding)
MARGIN = 0.04
FIRST_PROBE_WITHIN = 16  # plain steps at most before a request's first probe, whatever earlier requests found


# ------------------------------------------------------------------------------------------ cost
class ForwardCost(Protocol):
    """What a policy or a self-sizing proposer asks of a target's forward cost: `CostModel` for one request,
    `batch.RowCost` for a row of a running batch. Both must answer all three (a method missing from one of
    them failed every eagle and medusa request in the server while the library path worked)."""

    def forward_seconds(self, tokens: int, context: int) -> float: ...

    def forward_seconds_many(self, tokens: np.ndarray, context: int) -> np.ndarray: ...

    def observe(self, tokens: int, context: int, seconds: float) -> None: ...


@dataclass
class CostModel:
    """Seconds per target forward as a function of tokens in the forward and cached context.

    The measured table is scaled online by the `load`: what steps really cost over the table's price, the
    machine running slower or faster than when the table was measured. It is common to every size, so
    every step teaches it and a burst moves every size alike and leaves with the burst. The table's
    shape (how the price grows with tokens) stands: on Spec-Bench prompts the median real step of each size
    (prompt lookup, Medusa and lookahead, 2 to 17 tokens) cost 0.85-1.05 of the table's price relative to
    plain steps, while one step's timing strays by up to 2x.
    """

    sizes: list[int]
    contexts: list[int]
    seconds: list[list[float]]  # [context][size], medians
    machine: str = ""
    version: int = 1
    load: float = field(default=1.0, compare=False, repr=False)

    def __post_init__(self) -> None:
        # priced several times a step, so interpolated once: seconds at 0..sizes[-1] tokens for each context
        self._dense = np.array([np.interp(np.arange(self.sizes[-1] + 1), self.sizes, row) for row in self.seconds])
        self._beyond = np.array([(row[-1] - row[-2]) / (self.sizes[-1] - self.sizes[-2]) for row in self.seconds])
        self._rows = list(zip(self._dense.tolist(), self._beyond.tolist(), strict=True))  # one size, in Python

    def forward_seconds(self, tokens: int, context: int) -> float:
        return self.table_seconds(tokens, context) * self.load

    def forward_seconds_many(self, tokens: np.ndarray, context: int) -> np.ndarray:
        """forward_seconds for an array of sizes at once: policies price every depth each step."""
        return self._table_many(tokens, context) * self.load

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A step of `tokens` took `seconds`: the load follows within a few steps.

        Only the load is learned. Each size's own deviation from the table (a `shape`) was learned against
        the plain steps timed just before, and on Spec-Bench that contrast was noise: one burst on plain
        steps priced 3-token steps at 0.85 of a plain one, and Medusa then guessed at 3% acceptance for
        100 steps, each 13% dearer than a plain step (the table's price)."""
        ratio = seconds / max(self.table_seconds(tokens, context), 1e-9)
        self.load = 0.8 * self.load + 0.2 * min(max(ratio, 0.25), 4.0)

    def table(self) -> dict:
        """The measured part, as saved: the online corrections (the fields outside comparison) are per process."""
        online = {f.name for f in fields(self) if not f.compare}
        return {k: v for k, v in asdict(self).items() if k not in online}

    def table_seconds(self, tokens: int, context: int) -> float:
        """_table_many for one size, in plain Python: numpy's few-element operations cost 120 us here right after a
        forward (every step prices its own size: 0.35% of a step, what draft@auto lost to plain decoding)."""
        inside = min(tokens, self.sizes[-1])
        t0, t1 = (row[inside] + beyond * (tokens - inside) for row, beyond in self._rows)
        c0, c1 = self.contexts
        return max(t0 + (t1 - t0) / (c1 - c0) * (context - c0), 0.2 * t0)

    def _table_many(self, tokens: np.ndarray, context: int) -> np.ndarray:
        inside = np.minimum(tokens, self.sizes[-1])  # past the largest size measured: linear
        t0, t1 = self._dense[:, inside] + self._beyond[:, None] * (tokens - inside)
        c0, c1 = self.contexts
        slope = (t1 - t0) / (c1 - c0)  # attention grows with the context; extrapolate linearly
        return np.maximum(t0 + slope * (context - c0), 0.2 * t0)

    @classmethod
    def measure(cls, model: Transformer, repeats: int = 32) -> CostModel:
        """Time forwards of each size after a short and a long cached context, each next to a 1-token forward.

        A size's price is the 1-token median times the median of its paired ratios: the machine's speed drifts
        within seconds, and unpaired medians of 10 rounds were off by up to 10% for 3-4 tokens at long context
        (pricing Medusa's small trees as paying when they cost more than they saved). Sizes past 16 tokens are
        timed every fourth round: they cost as much as all the small ones and are far from any decision's margin.
        Still, one forward's time strays by +-15% on a 2-core machine, so a small size's price is known to +-3%.
        The medians are kept as measured, not forced non-decreasing: on a 2-core EPYC with oneDNN, 2 tokens cost
        1.15x of one and 3-6 tokens 0.95x at a short context (the same in a direct paired timing), so a guess of
        one token is dear and guesses two to five deep are cheaper than a plain step.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        sizes = COST_SIZES
        limit = model.config.max_position_embeddings
        long = min(1024, limit - sizes[-1])
        if long < 8:
            raise ValueError(f"context of {limit} tokens is too short to measure forward costs")
        contexts = [min(64, long // 4), long]
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        caches = []
        for c in contexts:
            cache = model.new_cache(c + sizes[-1])
            model.forward(torch.randint(0, vocab, (1, c), generator=g), cache, logits_at=None)
            caches.append(cache)

        def timed(ci: int, n: int) -> float:
            tokens = torch.randint(0, vocab, (1, n), generator=g).to(model.device)
            started = time.perf_counter()
            model.forward(tokens, caches[ci])  # logits for every token, as a verification does
            elapsed = time.perf_counter() - started
            caches[ci].rollback(contexts[ci])
            return elapsed

        order = random.Random(0)
        single: list[list[float]] = [[] for _ in contexts]
        ratios: list[list[list[float]]] = [[[] for _ in sizes] for _ in contexts]
        for rep in range(repeats + 1):  # the first round warms up
            large = rep % 4 == 1 or rep == 0
            cells = [(ci, si) for ci in range(len(contexts)) for si, n in enumerate(sizes)
                     if n > 1 and (n <= 16 or large)]
            for ci, si in order.sample(cells, len(cells)):
                n = sizes[si]
                took = {m: timed(ci, m) for m in order.sample([1, n], 2)}  # either may run first
                if rep:
                    single[ci].append(took[1])
                    ratios[ci][si].append(took[n] / took[1])
        seconds = []
        for ci in range(len(contexts)):
            plain = statistics.median(single[ci])
            seconds.append([plain] + [plain * statistics.median(r) for r in ratios[ci][1:]])
        return cls(list(sizes), contexts, seconds, machine=machine_key(model), version=TABLE_VERSION)

    @classmethod
    def for_model(cls, model: Transformer, cache_dir: Path | None = None) -> CostModel:
        """The model's cost table for this machine: read from disk, or measured once (about a minute for
        SmolLM2-135M on 2 CPU cores) and saved."""
        cost = cls.cached(model, cache_dir)
        if cost is None:
            cost = cls.measure(model)
            cls.save(model, cost, cache_dir)
        return cost

    @classmethod
    def cached(cls, model: Transformer, cache_dir: Path | None = None) -> CostModel | None:
        """The table saved for this model and machine by this version of `measure`, if any."""
        path = cls.path(model, cache_dir)
        try:
            cost = cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # none yet, or a damaged file: measure again
        return cost if cost.version == TABLE_VERSION else None

    @staticmethod
    def path(model: Transformer, cache_dir: Path | None = None) -> Path:
        digest = hashlib.sha1(machine_key(model).encode()).hexdigest()[:16]
        return (cache_dir or default_cache_dir()) / "costs" / f"{digest}.json"

    @classmethod
    def save(cls, model: Transformer, cost: CostModel, cache_dir: Path | None = None) -> None:
        path = cls.path(model, cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cost.table(), indent=1))


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


def machine_key(model: Transformer) -> str:
    """What forward costs depend on: the model's shape, dtype, device, CPU, threads and torch build."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if model.device.type == "cuda":
        cpu = torch.cuda.get_device_name(model.device)
    cfg = model.config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    threads = torch.get_num_threads()
    return (f"{shape}|{model.dtype}|{model.weights_kind()}|{model.device.type}|{cpu}|{threads} threads"
            f"|torch {torch.__version__}")


def rate_to_beat(cost: ForwardCost, context: int) -> float:
    """What guessing must beat: a plain step's tokens per second, raised by MARGIN."""
    return (1 + MARGIN) / cost.forward_seconds(1, context)


def best_count(chances: np.ndarray, cost: ForwardCost, context: int, overhead: np.ndarray | float = 0.0
               ) -> tuple[int, float]:
    """For guesses ranked best first (each prefix a tree) with these chances of acceptance: the count n
    maximising (1 + chances of the first n) / (forward of n + 1 tokens + overhead[n]), and that rate.
    n = 0 is a plain step, chosen unless guessing beats it by MARGIN; overhead: what proposing costs (an array:
    per count), 0 once it is spent."""
    expected = 1.0 + np.concatenate(([0.0], np.cumsum(chances)))
    rates = expected / (cost.forward_seconds_many(np.arange(1, len(expected) + 1), context) + overhead)
    n = int(np.argmax(np.append(rates[0] * (1 + MARGIN), rates[1:])))  # the first of equal rates: the fewest guesses
    return n, float(rates[n])


# ------------------------------------------------------------------------------------ acceptance
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
    # operations right after a forward cost more than the Python loops (choose + observe: 0.2 ms a step)
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
        for d in range(self.max_depth):
            hits[d] = hits[d] * decay + (d < matched)
            trials[d] = trials[d] * decay + (d < tried)

    def rates(self, bucket: int) -> list[float]:
        hits, trials = self._rows(bucket)
        out, above = [], self.prior.get(bucket, 0.5)
        for h, t in zip(hits, trials, strict=True):
            above = (h + 2.0 * above) / (t + 2.0)
            out.append(above)
        return out

    def expected_accepted(self, bucket: int) -> list[float]:
        """[d] = expected accepted guesses for a chain of depth d (index 0: depth 0)."""
        out, reach = [0.0], 1.0
        for rate in self.rates(bucket):
            reach *= rate  # the chance that guesses 1..d all match
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


class ProposalScorer:
    """Scores every proposal against the tokens committed after it, whatever part of it was verified."""

    def __init__(self, stats: AcceptanceStats) -> None:
        self.stats = stats
        self.pending: list[Proposal] = []

    def add(self, tree: DraftTree, tokens_so_far: int) -> None:
        paths = tree.paths()
        if paths:
            self.pending.append(Proposal(tokens_so_far, paths, tree.bucket))

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
    target_seconds: float | None  # None: not measured (the step's forward is someone else's)
    seconds_per_guess: float | None = None  # the proposer's own measure (see Proposer.seconds_per_guess)

    @property
    def forward_tokens(self) -> int:
        """Tokens in the step's target forward: the verified tree and any extra nodes (lookahead)."""
        extra = self.verified.extra
        return len(self.verified.tokens) + (len(extra.tokens) if extra is not None else 0)


class FixedK(Policy):
    def __init__(self, k: int, cost: ForwardCost | None = None) -> None:
        """cost: a cost model to teach what steps really cost (for a proposer that sizes its own trees by it)."""
        if k < 0:
            raise ValueError(f"k (tokens to guess per step) must be >= 0 or 'auto', got {k}")
        self.k, self.cost = k, cost

    def depth_to_propose(self, context: int, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, step: StepRecord) -> None:
        if self.cost is not None and step.target_seconds is not None:
            self.cost.observe(step.forward_tokens, step.context, step.target_seconds)


def learned(name: str) -> property:
    """A policy attribute kept in its AcceptanceStats, so it carries over between requests with them."""
    return property(lambda self: getattr(self.stats, name), lambda self, value: setattr(self.stats, name, value))


def smoothed(old: float | None, new: float) -> float:
    """Exponential smoothing of a timing: the first sample as is, then 80% old and 20% new."""
    return new if old is None else 0.8 * old + 0.2 * new


class AdaptiveK(Policy):
    """Cost-model-driven depth; see the module docstring.

    `cheap` proposers (n-gram lookups) cost nothing to ask for a deep tree: the policy cuts the tree after
    seeing it, using the acceptance of the tree's class. Model drafts cost a forward per guess: the depth
    is chosen before drafting, from the draft's measured time per guess.
    """

    def __init__(self, cost: ForwardCost, shared: AcceptanceStats, *, cheap: bool, max_k: int = 16,
                 tree_size: Callable[[int], int] | None = None) -> None:
        """tree_size(d): tokens a depth-d proposal sends to the target, root included (default d + 1: a chain)."""
        self.cost, self.shared, self.cheap, self.max_k = cost, shared, cheap, max_k
        self.tree_size = tree_size or (lambda d: d + 1)
        self.stats = shared.fork()
        # the probe interval carries over, but a new request probes within its first steps: a run of requests
        # where guessing did not pay had doubled it past any request's length, so text that copies its prompt
        # (Spec-Bench extraction after writing: tau 3 alone, 1.00 after) was never guessed at again
        self.probe_every = min(self.probe_every, FIRST_PROBE_WITHIN)
        self.scorer = ProposalScorer(self.stats)
        self.plain_streak = 0
        self.asked = 0  # the depth asked of a cheap proposer this step (0: it was not asked)
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
        return [self.tree_size(d) for d in range(1, top + 1)]

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
        plain step is always made: scoring it teaches the policy for free."""
        overhead = self.propose_seconds or 0.0
        if depth < 1 or overhead < 0.01 * self._target(1, context):
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

    def _probe_due(self) -> bool:
        """Nothing is worth guessing: a plain step, or after `probe_every` of them a probe (True), the interval
        doubling while probes find nothing worth guessing. Only then is it worth asking whether guesses could pay."""
        self.plain_streak += 1
        if self.plain_streak <= self.probe_every:
            return False
        self.plain_streak, self.probe_every = 0, min(2 * self.probe_every, 4096)
        return True

    def could_pay(self, context: int, limit: int, overhead: float = 0.0) -> bool:
        """Would even all-accepted guesses beat plain steps?"""
        top = min(limit, self.max_k)
        if top < 1:
            return False
        rates = self._rates(list(range(top + 1)), self._sizes(top), context, overhead)
        return max(rates) > rate_to_beat(self.cost, context)

    def choose(self, tree: DraftTree, context: int) -> DraftTree:
        if not self.cheap:  # a model draft was paid for: verify all of it
            return tree
        if tree.num_drafted == 0:  # nothing to verify: a lookahead window alone would only slow the step
            return DraftTree.root_only(tree.tokens[0])
        nodes = tree.forward_sizes()
        return tree.cut(self.best_depth(tree.bucket, context, len(nodes) - 1, nodes))

    def observe(self, step: StepRecord) -> None:
        self.scorer.add(step.proposal, step.start)
        self.scorer.update(step.tokens)
        depth = step.verified.depth
        self.verified_depths.append(depth)
        if step.target_seconds is not None:  # the cost table learns what steps of this size really cost
            self.cost.observe(step.forward_tokens, step.context, step.target_seconds)
        if self.cheap and self.asked:
            self.propose_seconds = smoothed(self.propose_seconds, step.draft_seconds)
        if not self.cheap and depth:
            self.draft_per_guess = smoothed(self.draft_per_guess, step.seconds_per_guess or step.draft_seconds / depth)

    def finish(self, tokens: list[int]) -> None:
        self.scorer.update(tokens, final=True)
        self.remember()

    def remember(self) -> None:
        """Hand what this request learned to the long-run estimate (also done when the request ends)."""
        self.shared.absorb(self.stats)
