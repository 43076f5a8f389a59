"""What a target forward costs: seconds per forward as a function of its tokens and the cached context.

`CostModel` is one sequence's table: calibrated in seconds on first use (a few paired timings per size),
refined online from the steps the engine runs anyway, and saved per model, precision and machine;
`batch_cost.BatchCost` holds one table per batch size. Both answer `ForwardCost`, the one interface
policies and self-sizing proposers price steps with.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..models import Transformer
from . import threads
from .timing import (
    CALIBRATION_ROUNDS,
    CALIBRATION_SIZES,
    COST_SIZES,
    ONE_THREAD_ROUNDS,
    SPREAD,
    THOROUGH_ROUNDS,
    machine_key,
    table_path,
    time_forwards,
    time_one_thread_shape,
)

WEIGHT_CAP = 64  # a size's price is the mean of at most this many paired timings: it follows slow changes
PAIR_WITHIN = 4  # a step is paired with the plain steps at most this many steps before it
REGIME = 1.5  # the median of the last REGIME_WINDOW steps this far off the load: the machine changed speed
REGIME_WINDOW = 5
REGIME_STEPS = REGIME_WINDOW // 2 + 1  # steps in a new regime before the load re-anchors
# the learned prices moved this much (relative) since they were last interpolated: interpolate again (a refresh is
# dear beside a step; a price 1% off is well inside MARGIN)
REPRICE = 0.01
DOUBTED = 8.0  # after a change of regime each size counts for at most this many paired timings
# tables saved by another version of `measure` are measured again (version 1 timed 5 rounds in a fixed order:
# one burst of load could flatten the small sizes, which then looked free to verify; version 2 took unpaired
# medians, up to 10% optimistic for small sizes at long context; version 3 forced the table non-decreasing,
# pricing 2 tokens 14% under and 3-6 tokens 5% over what they cost); version 5 adds each size's weight
# (version 4 tables are thorough ones, read as they are); version 6 adds the one-thread shape (version 5 tables are
# timed again, in seconds); version 7 adds a long context (2,048 tokens, 4,096 thorough) where two contexts were
# extrapolated past 512 (1,024), pricing deep verifications far too cheap (version 4 and 6 tables are timed again)
TABLE_VERSION = 7
READABLE_VERSIONS = (7,)


class ForwardCost(Protocol):
    """What a policy or a self-sizing proposer asks of a target's forward cost: `CostModel` for one sequence,
    `batch_cost.RowCost` for a row of a running batch. Both must answer all three (a method missing from one of
    them failed every eagle and medusa request in the server while the library path worked)."""

    def forward_seconds(self, tokens: int, context: int) -> float: ...

    def forward_seconds_many(self, tokens: np.ndarray, context: int) -> np.ndarray: ...

    def forward_seconds_upto(self, most: int, context: int) -> list[float]: ...

    def observe(self, tokens: int, context: int, seconds: float) -> None: ...


@dataclass
class CostModel:
    """Seconds per target forward as a function of tokens in the forward and cached context.

    Two things are learned online from the steps the engine times (`observe`):

    - the `load`: what steps cost now over the table's price, common to every size (the machine running
      slower or faster than when the table was made), smoothed over about five steps. A step REGIME times
      off the load is a burst and does not move it; the median of the last REGIME_WINDOW that far off is a
      change of regime (the machine got 2x slower or faster) and re-anchors it within REGIME_STEPS steps; the
      shape is then doubted (below).
    - the table's shape: a step of n tokens is paired with the plain steps timed just before it (within
      PAIR_WITHIN steps), and its price relative to theirs moves towards what the pair shows, as a running
      mean of up to WEIGHT_CAP pairs per size (one pair strays by up to 2x; one burst must not reprice a size).

    `weight`: how many paired timings of SPREAD's precision each size's price is worth (None: a table given
    as exact). Where a size is known from few of them (a calibration of a few rounds, or of noisy ones), guessing
    is priced higher by its standard error beyond the thorough table's (`forward_seconds`, up to 14%): a quick
    calibration must not make guesses look cheap.
    """

    sizes: list[int]
    contexts: list[int]
    seconds: list[list[float]]  # [context][size], medians
    machine: str = ""
    version: int = 1
    weight: list[float] | None = None  # per size
    # per size, how much steeper its price is on one thread than on the `threads` the table was timed on (None:
    # not timed; see cost_timing.time_one_thread_shape): the engine's forwards run on fewer beside a busy core
    one_thread: list[float] | None = None
    threads: int = 0
    load: float = field(default=1.0, compare=False, repr=False)
    learned: int = field(default=0, compare=False, repr=False)  # shape updates since made or read from disk

    def __post_init__(self) -> None:
        if self.weight is not None and len(self.weight) != len(self.sizes):
            raise ValueError(f"a cost table needs one weight per size: {len(self.weight)} for {len(self.sizes)}")
        if self.one_thread is not None and len(self.one_thread) != len(self.sizes):
            raise ValueError(f"a cost table needs one thread factor per size: {len(self.one_thread)} for "
                             f"{len(self.sizes)}")
        self._threads_now = self.threads  # what the next forwards run on
        self.seconds = [list(row) for row in self.seconds]  # learned in place: rows must not be shared
        self._plain: float | None = None  # recent plain steps' seconds over the table's price
        self._since_plain = PAIR_WITHIN + 1  # steps since the last plain one
        self._recent: list[float] = []  # the last steps' seconds over the table's price (a change of regime?)
        self._refresh()

    def _refresh(self) -> None:
        """Interpolate once per change (priced several times a step): seconds at 0..sizes[-1] tokens for each
        context on the threads the forwards run on now, as measured (`_rows`: what steps are compared with) and with
        the uncertainty margin (`_upper_rows`); past the last size, linear."""
        self._unpriced = 0.0  # how far the prices moved since (relative)
        factor = self.thread_factors()
        upper = [f * (1 + self.margin(i)) for i, f in enumerate(factor)]
        self._rows = [self._interpolate([t * f for t, f in zip(row, factor, strict=True)]) for row in self.seconds]
        self._upper_rows = [self._interpolate([t * f for t, f in zip(row, upper, strict=True)]) for row in self.seconds]

    def _interpolate(self, knots: list[float]) -> tuple[list[float], float]:
        """One context's prices at 0..sizes[-1] tokens from its sizes' (np.interp's arithmetic: a size's own price
        exactly, between sizes the slope times the offset), and the slope past the last size. Plain Python: numpy's
        few-element operations are dearer right after a forward."""
        s = self.sizes
        dense = [knots[0]] * s[0]
        for i in range(len(s) - 1):
            lo, t0 = s[i], knots[i]
            slope = (knots[i + 1] - t0) / (s[i + 1] - lo)
            dense.extend([slope * (n - lo) + t0 for n in range(lo, s[i + 1])])
        dense.append(knots[-1])
        return dense, (knots[-1] - knots[-2]) / (s[-1] - s[-2])

    def use_threads(self, threads: int) -> None:
        """The next forwards run on this many threads (the engine's governor): sizes are priced for it."""
        if threads != self._threads_now:
            self._threads_now = threads
            self._refresh()

    def thread_factors(self) -> list[float]:
        """Per size, its price on the threads now over the table's: 1 on the table's threads (or more), the
        one-thread shape on one, in between as the share of the work the missing threads did (Amdahl: at t of T
        threads a size's extra cost scales with T / t - 1 over T - 1)."""
        ref, now = self.threads, self._threads_now
        if self.one_thread is None or ref <= 1 or not 0 < now < ref:
            return [1.0] * len(self.sizes)
        share = (ref / now - 1) / (ref - 1)
        return [1 + (x - 1) * share for x in self.one_thread]

    def margin(self, i: int) -> float:
        """How much dearer size i is priced for guessing: the standard error of its price beyond the thorough
        table's (0 for a plain step: the anchor every other size is timed against)."""
        if self.weight is None or self.sizes[i] == 1:
            return 0.0
        return SPREAD * max(0.0, 1 / math.sqrt(max(self.weight[i], 1.0)) - 1 / math.sqrt(THOROUGH_ROUNDS))

    @classmethod
    def flat(cls) -> CostModel:
        """Every forward the same price: for runs whose guesses are not priced (a fixed k, plain decoding)."""
        return cls([1, 2], [0, 1], [[1.0, 1.0], [1.0, 1.0]], machine="flat")

    def forward_seconds(self, tokens: int, context: int) -> float:
        """What a forward is priced at for a decision: now (the load), and dearer where its size is uncertain."""
        return self._price(self._upper_rows, tokens, context) * self.load

    def forward_seconds_many(self, tokens: np.ndarray, context: int) -> np.ndarray:
        """forward_seconds for an array of sizes at once: policies price every depth each step."""
        return self._table_many(tokens, context) * self.load

    def forward_seconds_upto(self, most: int, context: int) -> list[float]:
        """forward_seconds of 1..most tokens, in one pass of plain Python (a self-sizing proposer prices every
        count of its ranked guesses each step: a call per count through the batch's layers was a fifth of suffix
        decoding's proposing time). `_price`'s arithmetic, inlined: a call per count cost a measurable share of a
        step (tests hold the two equal float for float)."""
        i, f = self._segment(context)
        (r0, b0), (r1, b1) = self._upper_rows[i], self._upper_rows[i + 1]
        floor_row, floor_beyond = self._upper_rows[0]
        last, load, out = self.sizes[-1], self.load, []
        for tokens in range(1, most + 1):
            inside = min(tokens, last)
            t0, t1 = r0[inside] + b0 * (tokens - inside), r1[inside] + b1 * (tokens - inside)
            floor = 0.2 * (floor_row[inside] + floor_beyond * (tokens - inside))
            out.append(max(t0 + (t1 - t0) * f, floor) * load)
        return out

    def plain_seconds(self, context: int) -> float:
        """What a plain step costs now (the measure of what speculation saves)."""
        return self.table_seconds(1, context) * self.load

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A step of `tokens` took `seconds`: the load follows within a few steps, the shape slowly."""
        ratio = seconds / max(self.table_seconds(tokens, context), 1e-12)
        if tokens > 1:
            self._since_plain += 1
            if self._plain is not None and self._since_plain <= PAIR_WITHIN:
                self._learn_shape(tokens, ratio / self._plain)
        else:  # every plain step, bursts included: leaving out either side's bursts would bias the pairs
            fresh = self._plain is None or self._since_plain > PAIR_WITHIN
            self._plain = ratio if fresh else 0.5 * (self._plain + ratio)  # type: ignore[operator]
            self._since_plain = 0
        if self._off_load(ratio):
            return
        self.load = 0.8 * self.load + 0.2 * ratio

    def _off_load(self, ratio: float) -> bool:
        """Is this step REGIME times dearer (or cheaper) than the load? Such a step does not move the load: alone it
        is a burst. When the median of the last REGIME_WINDOW steps is that far off, the regime changed (another
        process took a core, or left; three steps in the new regime suffice): the load re-anchors at that median,
        and the plain steps timed before no longer pair with what follows. (Three steps in a row off, the first
        rule, fired a dozen times in 400 steps of +-50% noise: each re-anchoring at an extreme set up the next.)"""
        recent = self._recent
        recent.append(ratio)
        del recent[:-REGIME_WINDOW]
        ordered = sorted(recent)  # the median (statistics.median's type checks cost more than the list is long)
        middle = len(ordered) // 2
        typical = ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])
        if len(recent) == REGIME_WINDOW and not 1 / REGIME < typical / self.load < REGIME:
            self.load = typical
            self._plain, self._since_plain = None, PAIR_WITHIN + 1
            recent.clear()
            self._doubt_shape()
            return True
        return not 1 / REGIME < ratio / self.load < REGIME

    def _doubt_shape(self) -> None:
        """After a change of regime the shape is in doubt too (on cores shared with busy threads a big forward
        costs far fewer plain steps than idle): each size counts for at most DOUBTED paired timings, so the
        new regime's steps reprice it within a few dozen pairs, and guesses carry the margin until they have."""
        weight = self.weight if self.weight is not None else [float(THOROUGH_ROUNDS)] * len(self.sizes)
        self.weight = [min(w, DOUBTED) for w in weight]
        self._refresh()

    def _learn_shape(self, tokens: int, paired: float) -> None:
        """A step of `tokens` cost `paired` times what the table says relative to the plain steps just before:
        the sizes around it move towards that, as a running mean of their paired timings (each pair clipped to
        REGIME: a burst that hit one side of the pair moves a well-known size by little, a doubted one that is
        wrong by 2x is corrected within a few dozen pairs)."""
        sizes = self.sizes
        if tokens >= sizes[-1]:
            cells = [(len(sizes) - 1, 1.0)]
        else:
            i = bisect.bisect_right(sizes, tokens) - 1
            f = (tokens - sizes[i]) / (sizes[i + 1] - sizes[i])
            cells = [(i, 1 - f), (i + 1, f)]
        weight = self.weight if self.weight is not None else [float(THOROUGH_ROUNDS)] * len(sizes)
        x = math.log(min(max(paired, 1 / REGIME), REGIME))
        for i, share in cells:
            if sizes[i] == 1 or share <= 0:
                continue  # the plain step is the anchor
            step = share * x / (weight[i] + share)
            for row in self.seconds:
                row[i] *= math.exp(step)
            weight[i] = min(weight[i] + share, WEIGHT_CAP)
            self._unpriced += abs(step) + share / (weight[i] * THOROUGH_ROUNDS)  # the price's and the margin's change
        self.weight = weight
        self.learned += 1
        if self._unpriced > REPRICE:
            self._refresh()

    def table(self) -> dict:
        """The measured part, as saved: the online corrections (the fields outside comparison) are per process."""
        online = {f.name for f in fields(self) if not f.compare}
        return {k: v for k, v in asdict(self).items() if k not in online}

    def table_seconds(self, tokens: int, context: int) -> float:
        """The table's price (no load, no margin)."""
        return self._price(self._rows, tokens, context)

    def _segment(self, context: int) -> tuple[int, float]:
        """The two measured contexts a context is priced between (i, i + 1; below the first or past the last, the
        nearest two, extrapolated) and where it lies: 0 at contexts[i], 1 at contexts[i + 1]. Attention grows with
        the context, but not at one slope: a decode step's reads of the cache are bandwidth-bound, a verification's
        queries over a long cache compute-bound, and past the caches of the CPU every key comes from memory, so a
        price extrapolated far from where it was measured is wrong by the shape (two contexts, 64 and 512, made deep
        verifications look cheap at thousands of tokens: long-context-smollm2-2026-11-29 in benchmarks/results)."""
        c = self.contexts
        i = 0
        while i + 2 < len(c) and context > c[i + 1]:
            i += 1
        return i, (context - c[i]) / (c[i + 1] - c[i])

    def _price(self, rows: list[tuple[list[float], float]], tokens: int, context: int) -> float:
        """_table_many for one size, in plain Python: numpy's few-element operations are dear right after a
        forward, and every step prices its own size."""
        inside = min(tokens, self.sizes[-1])
        i, f = self._segment(context)
        t0, t1, first = (row[inside] + beyond * (tokens - inside) for row, beyond in (rows[i], rows[i + 1], rows[0]))
        return max(t0 + (t1 - t0) * f, 0.2 * first)

    def _table_many(self, tokens: np.ndarray, context: int) -> np.ndarray:
        inside = np.minimum(tokens, self.sizes[-1])  # past the largest size measured: linear
        i, f = self._segment(context)
        dense, beyond = (np.array(part) for part in zip(*self._upper_rows, strict=True))
        priced = dense[:, inside] + beyond[:, None] * (tokens - inside)
        t0, t1 = priced[i], priced[i + 1]
        return np.maximum(t0 + (t1 - t0) * f, 0.2 * priced[0])

    @classmethod
    def calibrate(cls, model: Transformer, rounds: int = CALIBRATION_ROUNDS) -> CostModel:
        """A table good enough to start, in seconds: CALIBRATION_SIZES after a short, a 512-token and a 2,048-token
        context (as far as the model's positions go), `rounds` paired timings each (the engine's steps refine it)."""
        return cls.measure(model, rounds, sizes=CALIBRATION_SIZES, long=(512, 2048), sparse_above=None, bounded=True,
                           description="timing target forwards (once per model and machine)")

    @classmethod
    def measure(cls, model: Transformer, repeats: int = THOROUGH_ROUNDS, *, sizes: tuple[int, ...] = COST_SIZES,
                long: tuple[int, ...] = (1024, 4096), sparse_above: int | None = 16, bounded: bool = False,
                description: str = "timing target forwards") -> CostModel:
        """The table of `sizes` timed on this machine after a short context and each of the `long` ones, paired
        with plain forwards (see timing.time_forwards; `specdecode tune cost` runs it with THOROUGH_ROUNDS)."""
        contexts, seconds, weight = time_forwards(model, repeats, sizes=sizes, long=long, sparse_above=sparse_above,
                                                  bounded=bounded, description=description)
        one_thread = None
        if threads.may_change(model):  # the governor may run the forwards on fewer threads than now
            one_thread = time_one_thread_shape(model, sizes, contexts[-1], ONE_THREAD_ROUNDS)
        return cls(list(sizes), contexts, seconds, machine=machine_key(model), version=TABLE_VERSION,
                   weight=[min(w, WEIGHT_CAP) for w in weight], one_thread=one_thread,
                   threads=torch.get_num_threads())

    @classmethod
    def for_model(cls, model: Transformer, cache_dir: Path | None = None) -> CostModel:
        """The model's cost table for this machine: read from disk, or calibrated (seconds) and saved."""
        cost = cls.cached(model, cache_dir)
        if cost is None:
            cost = cls.calibrate(model)
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
        return cost if cost.version in READABLE_VERSIONS else None

    @staticmethod
    def path(model: Transformer, cache_dir: Path | None = None) -> Path:
        return table_path(model, cache_dir)

    @classmethod
    def save(cls, model: Transformer, cost: CostModel, cache_dir: Path | None = None) -> None:
        """Write the table (atomically: another process may be reading it); what it learned is now on disk."""
        path = cls.path(model, cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cost.table(), indent=1))
        os.replace(tmp, path)
        cost.learned = 0
