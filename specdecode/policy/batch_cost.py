"""Forward cost of a ragged batch: one `CostModel` table per measured batch size, and a row's view of it.

A guess that is nearly free for one request costs real time in a full batch, so policies price a row's
steps at the batch's current size (`RowCost`) and speculation backs off as the batch grows.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..common.progress import progress_bar
from ..models import BatchKVCache, Transformer
from .cost import CostModel, ForwardCost
from .timing import machine_key, nondecreasing, table_path

# tokens per row in a measured batched forward: few, so that a server starts in seconds (a full batch backs off to
# shallow guesses anyway; deeper ones are extrapolated and every batched step refines its batch size's table)
STEP_SIZES = (1, 2, 4, 8)


@dataclass
class BatchCost:
    """Seconds of one batched forward as a function of rows, tokens per row and cached context.

    One `CostModel` table per measured batch size (so its interpolation, extrapolation and online correction
    apply per batch size); rows in between are interpolated linearly.
    """

    batch_sizes: list[int]
    tables: list[ForwardCost]  # measured ones are CostModels; a lone request's may be any cost

    @property
    def priced(self) -> bool:
        """Do these tables price forwards (False: `CostModel.flat`, for runs whose guesses are not priced)?"""
        return any(not isinstance(t, CostModel) or t.machine != "flat" for t in self.tables)

    @classmethod
    def single(cls, cost: ForwardCost) -> BatchCost:
        """A batch of one, priced by one sequence's table (a request run alone)."""
        return cls([1], [cost])

    def seconds(self, rows: int, tokens: int, context: int) -> float:
        if rows == 1 and self.batch_sizes[0] == 1:  # a lone request: its own table, exactly
            return self.tables[0].forward_seconds(tokens, context)
        return float(self._across_rows(rows, [t.forward_seconds(tokens, context) for t in self.tables]))

    def seconds_upto(self, rows: int, most: int, context: int) -> list[float]:
        """`seconds` of 1..most tokens."""
        if rows == 1 and self.batch_sizes[0] == 1:
            return self.tables[0].forward_seconds_upto(most, context)
        return [self.seconds(rows, tokens, context) for tokens in range(1, most + 1)]

    def seconds_many(self, rows: int, tokens: np.ndarray, context: int) -> np.ndarray:
        """`seconds` for an array of token counts at once."""
        if rows == 1 and self.batch_sizes[0] == 1:
            return self.tables[0].forward_seconds_many(tokens, context)
        return self._across_rows(rows, np.stack([t.forward_seconds_many(tokens, context) for t in self.tables]))

    def _across_rows(self, rows: int, times):
        """Seconds at `rows` from the seconds at each measured batch size (times[i]: at batch_sizes[i])."""
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return np.asarray(times[0]) * rows / sizes[0]
        if rows >= sizes[-1]:
            slope = (np.asarray(times[-1]) - np.asarray(times[-2])) / (sizes[-1] - sizes[-2])
            return np.asarray(times[-1]) + slope * (rows - sizes[-1])
        upper = next(i for i, b in enumerate(sizes) if b >= rows)
        lower = max(upper - 1, 0)
        if sizes[upper] == rows or upper == 0:
            return np.asarray(times[upper])
        w = (rows - sizes[lower]) / (sizes[upper] - sizes[lower])
        return (1 - w) * np.asarray(times[lower]) + w * np.asarray(times[upper])

    def use_threads(self, threads: int) -> None:
        """The next forwards run on this many threads: tables that know their one-thread shape price for it."""
        for table in self.tables:
            if isinstance(table, CostModel):
                table.use_threads(threads)

    def observe(self, rows: int, tokens: int, context: int, seconds: float) -> None:
        """A real step: the table of that batch size (if measured) learns how far it strays."""
        if rows in self.batch_sizes:
            self.tables[self.batch_sizes.index(rows)].observe(tokens, context, seconds)

    @staticmethod
    def sizes_up_to(max_batch: int) -> list[int]:
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch]
        return [*sizes, max_batch]

    @classmethod
    def measure(cls, model: Transformer, max_batch: int, repeats: int = 2,
                sizes: tuple[int, ...] = STEP_SIZES, smallest: int = 1) -> BatchCost:
        """Time batched forwards (every row n tokens after the same context), interleaved; the fastest of the
        repeats (the cost without another process in the way: bursts of load are what the online correction
        is for, and a burst during the one-off measurement would otherwise stay in the table). One forward of the
        largest shape warms up. Each table's weight is `repeats`: guesses are priced with a margin until the
        batched steps the server runs have timed them (CostModel.margin)."""
        limit = model.config.max_position_embeddings
        contexts = [min(64, limit // 8), min(512, limit - sizes[-1])]
        batch_sizes = [b for b in cls.sizes_up_to(max_batch) if b >= smallest]
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        times: dict[tuple[int, int, int], list[float]] = {
            (b, c, n): [] for b in batch_sizes for c in contexts for n in sizes}
        cfg = model.config
        cache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, contexts[-1] + sizes[-1],
                             batch_size=batch_sizes[-1], dtype=model.kv_dtype, device=model.device)

        def timed(b: int, c: int, n: int) -> float:
            cache.lengths = [c] * cache.batch_size
            tokens = torch.randint(0, vocab, (b, n), generator=g)
            positions = (c + torch.arange(n)).expand(b, n)
            started = time.perf_counter()
            model.forward_batch(tokens, cache, positions=positions, sizes=[n] * b)
            return time.perf_counter() - started

        with progress_bar(f"timing batched forwards (once per model, machine and max batch {max_batch})",
                          1 + repeats * len(times)) as advance:
            timed(batch_sizes[-1], contexts[-1], sizes[-1])
            advance()
            for _ in range(repeats):
                for (b, c, n), got in times.items():
                    got.append(timed(b, c, n))
                    advance()
        tables = [
            CostModel(list(sizes), contexts,
                      [nondecreasing([min(times[b, c, n]) for n in sizes]) for c in contexts],
                      machine=machine_key(model), weight=[float(repeats)] * len(sizes))
            for b in batch_sizes
        ]
        return cls(batch_sizes, list(tables))

    @classmethod
    def for_model(cls, model: Transformer, max_batch: int, single: CostModel,
                  cache_dir: Path | None = None) -> BatchCost:
        """single: one sequence's table, which prices a batch of one (so a lone request in the server is priced
        exactly as by the library); the larger batch sizes are read from the cache dir, or measured once and saved
        (per model shape, machine and max batch)."""
        path = cls.path(model, max_batch, cache_dir)
        cost = None
        if path.exists():
            try:
                data = json.loads(path.read_text())
                cost = cls(data["batch_sizes"], [CostModel(**t) for t in data["tables"]])
            except (ValueError, TypeError, KeyError):
                pass  # damaged or older: measure again
        if cost is None:
            cost = cls.measure(model, max_batch, smallest=2) if max_batch > 1 else cls([], [])
            cost.save(path)
        larger = [(b, t) for b, t in zip(cost.batch_sizes, cost.tables, strict=True) if b > 1]
        return cls([1, *(b for b, _ in larger)], [single, *(t for _, t in larger)])

    @staticmethod
    def path(model: Transformer, max_batch: int, cache_dir: Path | None = None) -> Path:
        return table_path(model, cache_dir, f"-batch{max_batch}")

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tables = [t.table() for t in self.tables if isinstance(t, CostModel)]
        path.write_text(json.dumps({"batch_sizes": self.batch_sizes, "tables": tables}, indent=1))


class RowCost:
    """A `ForwardCost` for one row's policy or self-sizing proposer: forward seconds at the batch's current size
    (the decoder sets `rows`)."""

    def __init__(self, cost: BatchCost) -> None:
        self.cost, self.rows = cost, 1

    def forward_seconds(self, tokens: int, context: int) -> float:
        return self.cost.seconds(self.rows, tokens, context)

    def forward_seconds_many(self, tokens: np.ndarray, context: int) -> np.ndarray:
        return self.cost.seconds_many(self.rows, tokens, context)

    def forward_seconds_upto(self, most: int, context: int) -> list[float]:
        return self.cost.seconds_upto(self.rows, most, context)

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """Rows do not time their share of a batched forward; the decoder corrects the table per step."""
