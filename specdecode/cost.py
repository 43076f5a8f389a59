"""What a target forward costs: seconds per forward as a function of its tokens and the cached context.

`CostModel` is one sequence's table, measured once per model, precision and machine (cached on disk) and
scaled online by the load the machine is under; `batch_cost.BatchCost` holds one table per batch size.
Both answer `ForwardCost`, the one interface policies and self-sizing proposers price steps with.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .models import Transformer
from .paths import default_cache_dir

# every size up to 8: small forwards are not monotone in size (oneDNN picks its kernels by row count), so an
# interpolated size would be priced wrong
COST_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
# tables saved by another version of `measure` are measured again (version 1 timed 5 rounds in a fixed order:
# one burst of load could flatten the small sizes, which then looked free to verify; version 2 took unpaired
# medians, up to 10% optimistic for small sizes at long context; version 3 forced the table non-decreasing,
# pricing 2 tokens 14% under and 3-6 tokens 5% over what they cost)
TABLE_VERSION = 4


class ForwardCost(Protocol):
    """What a policy or a self-sizing proposer asks of a target's forward cost: `CostModel` for one sequence,
    `batch_cost.RowCost` for a row of a running batch. Both must answer all three (a method missing from one of
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

    @classmethod
    def flat(cls) -> CostModel:
        """Every forward the same price: for runs whose guesses are not priced (a fixed k, plain decoding)."""
        return cls([1, 2], [0, 1], [[1.0, 1.0], [1.0, 1.0]], machine="flat")

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

