"""Continuous batching: many requests share each verification forward.

A `Row` is one request (a `Generation` whose forwards someone else runs); `BatchDecoder` holds the running
rows, packed in rows 0..B-1 of one `BatchKVCache`, and steps them all at once:

    every row proposes (its own proposer and policy)   ->  one batch-level choice of how much to verify
    one ragged forward (each row: own length, positions, tree mask)  ->  per row: verify, keep, commit

Rows join (prefilled alone, then copied into the batch cache) and leave between steps. How much to guess
comes from `BatchCost`, target forward seconds measured per batch size (B rows x n tokens each, padding
included): a guess that is nearly free for one request costs real time in a full batch, so speculation
backs off as the batch grows and returns when it shrinks.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .engine import MAX_DRAFT_NODES, Generation
from .models import BatchKVCache, Transformer
from .policy import AdaptiveK, CostModel, default_cache_dir, machine_key
from .tree import DraftTree
from .verify import Verdict, verify

STEP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per row in a measured batched forward


# ------------------------------------------------------------------------------------------ cost
@dataclass
class BatchCost:
    """Seconds of one batched forward as a function of rows, tokens per row and cached context.

    One `CostModel` table per measured batch size (so its interpolation, extrapolation and online correction
    apply per batch size); rows in between are interpolated linearly.
    """

    batch_sizes: list[int]
    tables: list[CostModel]

    def seconds(self, rows: int, tokens: int, context: int) -> float:
        return float(self._across_rows(rows, [t.forward_seconds(tokens, context) for t in self.tables]))

    def seconds_many(self, rows: int, tokens: np.ndarray, context: int) -> np.ndarray:
        """`seconds` for an array of token counts at once."""
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

    def observe(self, rows: int, tokens: int, context: int, seconds: float) -> None:
        """A real step: the table of that batch size (if measured) learns how far it strays."""
        if rows in self.batch_sizes:
            self.tables[self.batch_sizes.index(rows)].observe(tokens, context, seconds)

    @staticmethod
    def sizes_up_to(max_batch: int) -> list[int]:
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch]
        return [*sizes, max_batch]

    @classmethod
    def measure(cls, model: Transformer, max_batch: int, repeats: int = 3,
                sizes: tuple[int, ...] = STEP_SIZES) -> BatchCost:
        """Time batched forwards (every row n tokens after the same context), interleaved; the fastest of the
        repeats (the cost without another process in the way: bursts of load are what the online correction
        is for, and a burst during the one-off measurement would otherwise stay in the table)."""
        limit = model.config.max_position_embeddings
        contexts = [min(64, limit // 8), min(512, limit - sizes[-1])]
        batch_sizes = cls.sizes_up_to(max_batch)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        times = {(b, c, n): [] for b in batch_sizes for c in contexts for n in sizes}
        cfg = model.config
        cache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, contexts[-1] + sizes[-1],
                             batch_size=batch_sizes[-1], dtype=model.dtype, device=model.device)
        for rep in range(repeats + 1):  # the first round warms up
            for (b, c, n), got in times.items():
                cache.lengths = [c] * cache.batch_size
                tokens = torch.randint(0, vocab, (b, n), generator=g)
                positions = (c + torch.arange(n)).expand(b, n)
                started = time.perf_counter()
                model.forward_batch(tokens, cache, positions=positions, sizes=[n] * b)
                if rep:
                    got.append(time.perf_counter() - started)
        tables = [
            CostModel(list(sizes), contexts,
                      [nondecreasing([min(times[b, c, n]) for n in sizes]) for c in contexts],
                      machine=machine_key(model))
            for b in batch_sizes
        ]
        return cls(batch_sizes, tables)

    @classmethod
    def for_model(cls, model: Transformer, max_batch: int, cache_dir: Path | None = None) -> BatchCost:
        """Read from the cache dir, or measure once and save (per model shape, machine and max batch)."""
        path = cls.path(model, max_batch, cache_dir)
        if path.exists():
            try:
                data = json.loads(path.read_text())
                return cls(data["batch_sizes"], [CostModel(**t) for t in data["tables"]])
            except (ValueError, TypeError, KeyError):
                pass  # damaged or older: measure again
        cost = cls.measure(model, max_batch)
        cost.save(path)
        return cost

    @staticmethod
    def path(model: Transformer, max_batch: int, cache_dir: Path | None = None) -> Path:
        digest = hashlib.sha1(machine_key(model).encode()).hexdigest()[:16]
        return (cache_dir or default_cache_dir()) / "costs" / f"{digest}-batch{max_batch}.json"

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tables = [t.table() for t in self.tables]
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

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """Rows do not time their share of a batched forward; the decoder corrects the table per step."""


# ------------------------------------------------------------------------------------------- rows
class Row(Generation):
    """One request in a batch: Generation's checks, sampling state, policy and stats. The decoder runs the
    forwards, so a step is split: `plan` (ask the proposer) and, after the batched forward, `commit`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps.close()  # Generation's own loop never runs
        self.proposal: DraftTree | None = None
        self.draft_seconds = 0.0
        self.started = time.perf_counter()
        self._finished = False

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(getattr(self.proposer, "hidden_layers", ()))

    def plan(self, context: int) -> DraftTree:
        remaining = self.max_new_tokens - self.stats.new_tokens
        k = self.policy.depth_to_propose(context, remaining - 1)  # the target adds one token of its own
        t0 = time.perf_counter()
        root = DraftTree.root_only(self.tokens[-1])
        self.proposal = self.proposer.propose(self.tokens, k, self.params, self.generator) if k > 0 else root
        self.draft_seconds = time.perf_counter() - t0
        return self.proposal

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        return verify(tree, logits[: len(tree)], self.params, self.generator)

    def commit(self, tree: DraftTree, verdict: Verdict, logits: torch.Tensor, context: int,
               step_seconds: float) -> list[int]:
        """Record a verified step; returns the newly committed tokens (cut at a stop token / max_new_tokens)."""
        self.proposer.observe(tree, verdict, logits[len(tree) :])
        self.stats.target_seconds += step_seconds  # the batch's forward: not this row's cost, so not for its policy
        new = self._commit(self.proposal, tree, verdict, context, self.draft_seconds, None)
        self.stats.new_tokens += len(new)
        self.stats.seconds = time.perf_counter() - self.started
        return new

    def finish(self) -> None:
        """The request left the batch (done, stopped by a stop string, cancelled or failed)."""
        if not self._finished:
            self._finished = True
            self.stats.seconds = time.perf_counter() - self.started
            self.policy.finish(self.tokens)
            self.proposer.finish(self.tokens)


# ---------------------------------------------------------------------------------------- decoder
class BatchDecoder:
    def __init__(self, model: Transformer, cost: BatchCost) -> None:
        cfg = model.config
        self.model, self.cost = model, cost
        self.view = RowCost(cost)  # shared by every row's AdaptiveK
        self.cache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, dtype=model.dtype,
                                  device=model.device, limit=cfg.max_position_embeddings + MAX_DRAFT_NODES)
        self.rows: list[Row] = []
        self.last_depths: list[int] = []  # per row, the depth verified in the last step (tests, metrics)

    def add(self, row: Row) -> None:
        """Prefill the row's prompt (alone, by the single-sequence forward) and let it join the batch."""
        started = time.perf_counter()
        prompt, model = row.tokens, self.model
        row.proposer.begin(list(prompt), len(prompt) + row.max_new_tokens + MAX_DRAFT_NODES)
        single = model.new_cache(max(len(prompt) - 1, 1))
        if len(prompt) > 1:  # the cache holds every committed token but the last (the next root)
            out = model.forward(torch.tensor([prompt[:-1]], device=model.device), single, logits_at=None,
                                hidden_layers=row.hidden_layers)
            if row.hidden_layers:
                row.proposer.observe_hidden(0, [h[0] for h in out.hidden])
        self.cache.load(len(self.rows), single)
        self.rows.append(row)
        row.stats.prefill_seconds = time.perf_counter() - started

    def remove(self, row: Row) -> None:
        """Drop a row (its cache row is freed now); the last row moves into its place."""
        i, last = self.rows.index(row), len(self.rows) - 1
        self.cache.move(last, i)
        self.cache.lengths[last] = 0
        self.rows[i] = self.rows[last]
        self.rows.pop()
        row.finish()

    def choose(self, proposals: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        """How much of each proposal to verify, for the batch as a whole.

        Free proposals under an adaptive policy share one depth cap D, picked to maximise expected committed
        tokens of the whole batch per second of the batched forward, whose size is the largest row (padding
        costs as much as a token); a row then also fills the padding it would pay for anyway. Other rows
        (fixed k, or a model draft already paid for) are verified as their policy says."""
        rows, context = len(proposals), max(contexts)
        trees: list[DraftTree | None] = [None] * rows
        floor, fixed_gain, free = 1, 0.0, []
        for i, (row, tree) in enumerate(zip(self.rows, proposals, strict=True)):
            policy = row.policy
            if isinstance(policy, AdaptiveK) and policy.cheap:
                free.append(i)
                continue
            trees[i] = policy.choose(tree, contexts[i])
            floor = max(floor, len(trees[i]) + (len(trees[i].extra.tokens) if trees[i].extra else 0))
            fixed_gain += 1.0
        if free:
            nodes = {i: proposals[i].forward_sizes() for i in free}
            expected = {i: self.rows[i].policy.stats.expected_accepted(proposals[i].bucket) for i in free}
            top = max(len(n) - 1 for n in nodes.values())
            best, best_rate, best_width = 0, -1.0, floor
            for depth in range(top + 1):
                width, gain = floor, fixed_gain
                for i in free:
                    d = min(depth, len(nodes[i]) - 1, len(expected[i]) - 1)
                    width = max(width, nodes[i][d])
                    gain += 1.0 + float(expected[i][d])
                rate = gain / self.cost.seconds(rows, width, context)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate, best_width = depth, rate, width
            for i in free:  # the deepest cut that still fits the batch's width
                fits = [d for d, n in enumerate(nodes[i]) if n <= best_width]
                trees[i] = proposals[i].cut(max(min(best, len(nodes[i]) - 1), fits[-1]))
        return trees  # type: ignore[return-value]

    def step(self) -> list[tuple[Row, list[int] | Exception]]:
        """One step of every row: newly committed tokens per row, or the exception that failed it."""
        results: list[tuple[Row, list[int] | Exception]] = []
        self.view.rows = len(self.rows)
        planned: dict[int, DraftTree] = {}
        for i, row in enumerate(self.rows):
            try:
                planned[id(row)] = row.plan(self.cache.lengths[i])
                self._check_size(row, planned[id(row)])
            except Exception as e:  # noqa: BLE001 - one bad request must not take the batch down
                results.append((row, e))
        for row, _ in results:
            self.remove(row)
        if not self.rows:
            return results
        contexts = self.cache.lengths[: len(self.rows)]
        proposals = [planned[id(row)] for row in self.rows]
        self.view.rows = len(self.rows)  # the batch that runs now
        trees = self.choose(proposals, contexts)
        self.last_depths = [t.depth for t in trees]
        inputs = [t.forward_inputs(c) for t, c in zip(trees, contexts, strict=True)]
        sizes = [len(tokens) for tokens, _, _ in inputs]
        b, n = len(inputs), max(sizes)
        tokens = torch.zeros(b, n, dtype=torch.long)
        positions = torch.zeros(b, n, dtype=torch.long)
        masks = torch.zeros(b, n, n, dtype=torch.bool)
        for i, (toks, pos, mask) in enumerate(inputs):
            m = sizes[i]
            tokens[i, :m] = torch.tensor(toks)
            positions[i, :m] = pos
            positions[i, m:] = contexts[i] + torch.arange(m, n)
            masks[i, :m, :m] = torch.ones(m, m, dtype=torch.bool).tril() if mask is None else mask
        layers = list(dict.fromkeys(layer for row in self.rows for layer in row.hidden_layers))
        started = time.perf_counter()
        try:
            out = self.model.forward_batch(tokens, self.cache, positions=positions, sizes=sizes, tree_masks=masks,
                                           hidden_layers=layers)
        except Exception as e:  # noqa: BLE001 - the step is lost for its rows; the server goes on
            for row in list(self.rows):
                self.remove(row)
                results.append((row, e))
            return results
        seconds = time.perf_counter() - started
        self.cost.observe(b, n, max(contexts), seconds)
        for i, (row, tree) in enumerate(zip(list(self.rows), trees, strict=True)):
            try:
                logits = out.logits[i]
                verdict = row.verify(tree, logits)
                self.cache.keep(i, contexts[i], verdict.path)
                if row.hidden_layers:
                    path = torch.tensor(verdict.path, device=logits.device)
                    row.proposer.observe_hidden(contexts[i], [out.hidden[i][layers.index(layer)][path]
                                                              for layer in row.hidden_layers])
                results.append((row, row.commit(tree, verdict, logits, contexts[i], seconds)))
            except Exception as e:  # noqa: BLE001
                results.append((row, e))
        for row, result in results:  # failed rows leave now (their cache rows may be half-updated)
            if isinstance(result, Exception) and row in self.rows:
                self.remove(row)
        return results

    @staticmethod
    def _check_size(row: Row, tree: DraftTree) -> None:
        nodes = tree.num_drafted + (len(tree.extra.tokens) if tree.extra is not None else 0)
        if nodes > MAX_DRAFT_NODES:
            raise ValueError(f"{row.proposer.name} sent {nodes} tokens besides the root; at most {MAX_DRAFT_NODES}")


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): the batch table takes the fastest of a few
    unpaired runs, so its dips are mostly noise, averaged away with their neighbours (the single-request table is
    paired and kept as measured: there, some sizes really are cheaper than smaller ones)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]
