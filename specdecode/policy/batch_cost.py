"""Forward cost of a ragged batch: one `CostModel` table per measured batch size, and a row's view of it.

A guess that is nearly free for one request costs real time in a full batch, so policies price a row's
steps at the batch's current size (`RowCost`: the row's share of a plain batched step plus what its own guesses add
to the batch's forward) and speculation backs off as the batch grows, as far as the batch's marginal cost says.

Two kinds of batched forward, two meanings of a table's sizes:
- ragged (the native blocks on the CPU): every row's real tokens side by side, no padding, so a forward costs by
  the tokens in it. Size s of batch size b's table: b rows holding b + s - 1 tokens in all (s = 1: a plain step;
  one row guessing n - 1 tokens beside plain rows: s = n).
- padded (the PyTorch blocks): every row padded to the widest, so a forward costs by its width. Size s: b rows of s
  tokens each.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..common.progress import progress_bar
from ..models import BatchKVCache, Transformer
from ..models.paged import BlockPool
from .cost import WEIGHT_CAP, CostModel, ForwardCost
from .timing import machine_key, nondecreasing, table_path

# tokens per row in a measured padded batched forward: few, so that a server starts in seconds (a full batch backs off
# to shallow guesses anyway; deeper ones are extrapolated and every batched step refines its batch size's table)
STEP_SIZES = (1, 2, 4, 8)
# a ragged batch's guessed tokens beyond its plain step's one a row, measured up to 8 tokens a row: the decisions a
# full batch makes are about its first few dozen guessed tokens, which a per-row grid (16, 32, 64 tokens for 16 rows)
# priced only by interpolation; past the last, linear
EXTRA_TOKENS = (1, 2, 4, 8, 16, 32)
# 1: padded only, fastest of 2 unpaired timings; 2: ragged, per size; 3: few weights; 5: a third, long context
BATCH_TABLE_VERSION = 5
# the long context's cache (a full batch of rows at it) may take at most this much memory while the tables are timed
LONG_CONTEXT_BYTES = 512 * 2**20


@dataclass
class BatchCost:
    """Seconds of one batched forward as a function of rows, tokens per row and cached context.

    One `CostModel` table per measured batch size (so its interpolation, extrapolation and online correction
    apply per batch size); rows in between are interpolated linearly.
    """

    batch_sizes: list[int]
    tables: list[ForwardCost]  # measured ones are CostModels; a lone request's may be any cost
    ragged: bool = False  # the sizes' meaning (module docstring): True where the native blocks run the batches

    @property
    def priced(self) -> bool:
        """Do these tables price forwards (False: `CostModel.flat`, for runs whose guesses are not priced)?"""
        return any(not isinstance(t, CostModel) or t.machine != "flat" for t in self.tables)

    @classmethod
    def single(cls, cost: ForwardCost) -> BatchCost:
        """A batch of one, priced by one sequence's table (a request run alone)."""
        return cls([1], [cost])

    def seconds(self, rows: int, tokens: float, context: int) -> float:
        """A forward of `rows` rows of `tokens` tokens each; in a ragged batch `tokens` may be fractional: rows x
        tokens in all, however they are shared out (joint_cut prices a ragged batch's cut so)."""
        if rows == 1 and self.batch_sizes[0] == 1 and float(tokens).is_integer():  # a lone request: exactly its own
            return self.tables[0].forward_seconds(int(tokens), context)
        return self.size_seconds(rows, self.size_of(rows, tokens), context)

    def size_of(self, rows: int, tokens: float) -> float:
        """The table size of a forward of `rows` rows of `tokens` tokens each."""
        return 1 + rows * (tokens - 1) if self.ragged else tokens

    def size_seconds(self, rows: int, size: float, context: int) -> float:
        """Seconds at a table size (fractional: linear between the integers around it) at `rows` rows."""
        low = int(size)
        price = self._at_rows(rows, low, context)
        if size > low:
            price += (size - low) * (self._at_rows(rows, low + 1, context) - price)
        return price

    def _at_rows(self, rows: int, size: int, context: int) -> float:
        """`_across_rows` for one size, in plain Python and asking only the tables it reads (a ragged cut prices a
        few dozen totals a step)."""
        sizes, tables = self.batch_sizes, self.tables
        if len(sizes) == 1:
            return tables[0].forward_seconds(size, context) * rows / sizes[0]
        if rows >= sizes[-1]:
            below, last = tables[-2].forward_seconds(size, context), tables[-1].forward_seconds(size, context)
            return last + (last - below) / (sizes[-1] - sizes[-2]) * (rows - sizes[-1])
        upper = next(i for i, b in enumerate(sizes) if b >= rows)
        if sizes[upper] == rows or upper == 0:
            return tables[upper].forward_seconds(size, context)
        w = (rows - sizes[upper - 1]) / (sizes[upper] - sizes[upper - 1])
        return (1 - w) * tables[upper - 1].forward_seconds(size, context) + w * tables[upper].forward_seconds(size,
                                                                                                            context)

    def seconds_upto(self, rows: int, most: int, context: int) -> list[float]:
        """`size_seconds` of table sizes 1..most (a lone row's tokens), in one pass per table."""
        if rows == 1 and self.batch_sizes[0] == 1:
            return self.tables[0].forward_seconds_upto(most, context)
        return [float(x) for x in self._across_rows(rows, [t.forward_seconds_upto(most, context) for t in self.tables])]

    def seconds_many(self, rows: int, tokens: np.ndarray, context: int) -> np.ndarray:
        """`size_seconds` for an array of table sizes at once."""
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
        """A real step of `rows` rows, the widest `tokens` tokens: the table of that batch size (if measured) learns
        how far it strays. A ragged step's width does not say how many tokens it held: only its plain steps (width
        1: one token a row) are learned from there (the load; `observe_tokens` for the rest)."""
        if self.ragged and tokens != 1 and rows > 1:
            return
        if rows in self.batch_sizes:
            self.tables[self.batch_sizes.index(rows)].observe(tokens, context, seconds)

    def observe_tokens(self, rows: int, total: int, context: int, seconds: float) -> None:
        """A real ragged step of `rows` rows holding `total` tokens in all (the engine knows it; `observe` has only
        the width)."""
        size = 1 + total - rows if self.ragged else total  # padded: a lone row's tokens are its width
        if rows in self.batch_sizes and (self.ragged or rows == 1):
            self.tables[self.batch_sizes.index(rows)].observe(size, context, seconds)

    @staticmethod
    def sizes_up_to(max_batch: int) -> list[int]:
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch]
        return [*sizes, max_batch]

    @classmethod
    def measure(cls, model: Transformer, max_batch: int, repeats: int = 3,
                sizes: tuple[int, ...] = STEP_SIZES, smallest: int = 1, ragged: bool | None = None) -> BatchCost:
        """Time batched forwards after the same context, each size right after a plain batched step (one token a
        row) and priced as the fastest plain step times the median of its paired ratios (the machine's speed drifts
        within seconds; the fastest plain step is the cost without another process in the way, and a burst during
        the one-off measurement would otherwise stay in the table). ragged (default: where the native blocks run
        the batches): size s is b + s - 1 tokens shared out over the rows (EXTRA_TOKENS up to 8 a row); else b
        rows of `sizes` tokens each. One forward of the largest shape warms up. Each table's weight is `repeats`:
        guesses are priced with a margin until the batched steps the server runs have timed them
        (CostModel.margin)."""
        if ragged is None:
            ragged = bool(model.native_kernels)
        room = 8 if ragged else sizes[-1]  # tokens a row at most
        limit = model.config.max_position_embeddings
        batch_sizes = [b for b in cls.sizes_up_to(max_batch) if b >= smallest]
        cfg = model.config
        row_bytes = BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, model.kv_dtype)
        # as one sequence's table (CostModel.calibrate): a long context beside 512, where the slope of attention with
        # the context is no longer the short one's, as far as the positions and the batch cache's memory allow
        long = min(2048, limit - room, LONG_CONTEXT_BYTES // (row_bytes * batch_sizes[-1]) - room)
        contexts = sorted({min(64, limit // 8), min(512, limit - room), max(long, min(512, limit - room))})
        grid = {b: [1, *(1 + e for e in EXTRA_TOKENS if e <= (room - 1) * b)] if ragged else list(sizes)
                for b in batch_sizes}
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        cache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, contexts[-1] + room,
                             batch_size=batch_sizes[-1], dtype=model.kv_dtype, device=model.device)

        def timed(b: int, c: int, size: int) -> float:
            per_row = shared_out(b, size - 1) if ragged else [size] * b
            n = max(per_row)
            cache.lengths = [c] * cache.batch_size
            tokens = torch.randint(0, vocab, (b, n), generator=g)
            positions = (c + torch.arange(n)).expand(b, n)
            started = time.perf_counter()
            model.forward_batch(tokens, cache, positions=positions, sizes=per_row)
            return time.perf_counter() - started

        plain: dict[tuple[int, int], list[float]] = {(b, c): [] for b in batch_sizes for c in contexts}
        ratios: dict[tuple[int, int, int], list[float]] = {
            (b, c, s): [] for b in batch_sizes for c in contexts for s in grid[b][1:]}
        with progress_bar(f"timing batched forwards (once per model, machine and max batch {max_batch})",
                          1 + repeats * len(ratios)) as advance:
            timed(batch_sizes[-1], contexts[-1], grid[batch_sizes[-1]][-1])
            advance()
            for _ in range(repeats):
                for (b, c, s), got in ratios.items():
                    base = timed(b, c, 1)
                    plain[b, c].append(base)
                    got.append(timed(b, c, s) / base)
                    advance()
        tables = []
        for b in batch_sizes:
            seconds = []
            for c in contexts:
                fastest = min(plain[b, c]) if plain[b, c] else timed(b, c, 1)
                seconds.append(nondecreasing([fastest, *(fastest * statistics.median(ratios[b, c, s])
                                                         for s in grid[b][1:])]))
            tables.append(CostModel(grid[b], contexts, seconds, machine=machine_key(model),
                                    weight=[float(repeats)] * len(grid[b])))
        if ragged:  # a ragged forward costs by its tokens, whatever the rows: one line through every batch size's
            tables = pooled(batch_sizes, grid, contexts, tables, model, repeats)  # points (module docstring)
        return cls(batch_sizes, list(tables), ragged=ragged)

    @classmethod
    def for_model(cls, model: Transformer, max_batch: int, single: CostModel,
                  cache_dir: Path | None = None) -> BatchCost:
        """single: one sequence's table, which prices a batch of one (so a lone request in the server is priced
        exactly as by the library); the larger batch sizes are read from the cache dir, or measured once and saved
        (per model shape, machine and max batch)."""
        path = cls.path(model, max_batch, cache_dir)
        ragged = bool(model.native_kernels)
        cost = None
        if path.exists():
            try:
                data = json.loads(path.read_text())
                cost = cls(data["batch_sizes"], [CostModel(**t) for t in data["tables"]], ragged=ragged)
                # a table measured for the other kind of batch (or by an older `measure`) is measured again; padded
                # tables without a version are read as they are (the tests' and older servers' files)
                if data.get("ragged", False) != ragged or (ragged and data.get("version") != BATCH_TABLE_VERSION):
                    cost = None
            except (ValueError, TypeError, KeyError):
                pass  # damaged or older: measure again
        if cost is None:
            cost = cls.measure(model, max_batch, smallest=2, ragged=ragged) if max_batch > 1 else \
                cls([], [], ragged=ragged)
            cost.save(path)
        larger = [(b, t) for b, t in zip(cost.batch_sizes, cost.tables, strict=True) if b > 1]
        return cls([1, *(b for b, _ in larger)], [single, *(t for _, t in larger)], ragged=ragged)

    @staticmethod
    def path(model: Transformer, max_batch: int, cache_dir: Path | None = None) -> Path:
        return table_path(model, cache_dir, f"-batch{max_batch}")

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tables = [t.table() for t in self.tables if isinstance(t, CostModel)]
        path.write_text(json.dumps({"batch_sizes": self.batch_sizes, "tables": tables, "ragged": self.ragged,
                                    "version": BATCH_TABLE_VERSION}, indent=1))


def pooled(batch_sizes: list[int], grid: dict[int, list[int]], contexts: list[int], tables: list[CostModel],
           model: Transformer, repeats: int) -> list[CostModel]:
    """Ragged tables from one line per context through all of them: the native blocks run a batch's tokens side by
    side, so b rows holding T tokens cost about what any rows holding T tokens cost, a + slope x T. The slope is the
    median of the pairwise slopes between the measured points (Theil-Sen: a third of the points may be bursts of
    another process's load without moving it), the intercept the median of what is left. Per batch size and pair
    of sizes, a few timings on a busy machine priced one guessed token in a batch of 8 above a whole row's share;
    the line through every batch size's points prices it as the rows' own tokens cost. Its weight is the paired
    timings behind the line (every point's `repeats`): a size's margin of doubt (CostModel.margin, a share of the
    whole forward's price) is for a price known from a few timings; in a batch of 16 a 7% margin on the forward was a
    whole row's step, more than a guessed token costs."""
    out = []
    for b, table in zip(batch_sizes, tables, strict=True):
        seconds = []
        for ci in range(len(contexts)):
            points = [(bb + s - 1, t.seconds[ci][i]) for bb, t in zip(batch_sizes, tables, strict=True)
                      for i, s in enumerate(t.sizes)]
            slopes = [(y2 - y1) / (x2 - x1) for k, (x1, y1) in enumerate(points) for x2, y2 in points[k + 1:]
                      if x2 != x1]
            slope = max(statistics.median(slopes), 0.0)
            base = statistics.median(y - slope * x for x, y in points)
            seconds.append([max(base + slope * (b + s - 1), 1e-6) for s in grid[b]])
        behind = float(min(repeats * sum(len(t.sizes) for t in tables), WEIGHT_CAP))
        out.append(CostModel(grid[b], contexts, seconds, machine=table.machine, weight=[behind] * len(grid[b])))
    return out


def shared_out(rows: int, extra: int) -> list[int]:
    """Tokens a row when `extra` guessed tokens are shared out evenly over `rows` plain rows."""
    return [1 + extra // rows + (1 if i < extra % rows else 0) for i in range(rows)]


class RowCost:
    """A `ForwardCost` for one row's policy or self-sizing proposer at the batch's current size (the decoder sets
    `rows`): a forward of n tokens is priced at the row's share of a plain batched step plus what n - 1 guessed
    tokens of this row add to the batch's forward (the other rows plain),

        price(n) = S(n) - (1 - 1 / rows) S(1),   S(n): the batch's table at size n (see the module docstring).

    Then a row's guesses pay, (1 + E[accepted]) / (price(n) + drafting) over 1 / price(1), exactly where they raise
    the whole batch's tokens per second: their accepted tokens must pay for slowing every row's step, drafting
    included (a row drafts while the batch waits). With one row it is the row's own forward."""

    def __init__(self, cost: BatchCost) -> None:
        self.cost, self.rows = cost, 1

    @property
    def ragged(self) -> bool:
        return self.cost.ragged

    def _others(self, context: int) -> float:
        """What the rest of a plain batched step costs beyond this row's share."""
        if self.rows <= 1:
            return 0.0
        return (1 - 1 / self.rows) * self.cost.seconds(self.rows, 1, context)

    def forward_seconds(self, tokens: int, context: int) -> float:
        return self.cost.seconds(self.rows, tokens, context) if self.rows <= 1 else \
            self.cost.size_seconds(self.rows, tokens, context) - self._others(context)

    def forward_seconds_many(self, tokens: np.ndarray, context: int) -> np.ndarray:
        return self.cost.seconds_many(self.rows, tokens, context) - self._others(context)

    def forward_seconds_upto(self, most: int, context: int) -> list[float]:
        others = self._others(context)
        return [t - others for t in self.cost.seconds_upto(self.rows, most, context)]

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """Rows do not time their share of a batched forward; the decoder corrects the table per step."""
