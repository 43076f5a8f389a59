"""The engine's side of a paged KV cache (models/paged.py): admission by free blocks, preemption by recomputation,
prefix sharing at block granularity.

Rules:
- A request is admitted when the pool can hold its prompt (less the blocks it shares with kept text) with a block
  to spare for every running row; else it waits, in turn (`admits`). Preempted requests come back before any new one.
- A request that could never fit (its prompt and max_new_tokens need more blocks than the whole pool) is refused
  with a clear error at once (`check`), never left waiting.
- Before each forward every row's blocks are grown to hold the positions it writes, a shared block among them copied
  first (copy on write). When the pool runs out, the youngest row (the last admitted) is preempted: its blocks go
  back, it waits, and it is prefilled anew (its prompt and the tokens it has committed) when blocks free up; its output
  does not change, since a token's keys and values depend only on the tokens before it.
- Rejected guesses' blocks go back to the pool when the accepted path is kept (PagedKVCache.keep).
"""

from __future__ import annotations

import os

import torch

from ..models.paged import BlockPool, OutOfBlocks, PagedKVCache
from ..proposers.base import StepOutput
from .request import MAX_DRAFT_NODES, Request

# prompt tokens per forward when a preempted request is prefilled anew (as the engine's PREFILL_CHUNK)
RESUME_CHUNK = 256


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory(model, max_batch: int, block_size: int) -> int:
    """The server's KV budget when none is given: what `max_batch` full contexts need, at most half the memory the
    machine has free, but at least one full context (so a lone request never outgrows it)."""
    cfg = model.config
    per_block = BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, model.kv_dtype)
    context = -(-(cfg.max_position_embeddings + MAX_DRAFT_NODES) // block_size) * per_block
    return max(context, min(max_batch * context, available_memory() // 2))


def pool_for(model, memory: int, block_size: int) -> BlockPool:
    """A pool of as many blocks as `memory` bytes hold for `model`'s keys and values."""
    cfg = model.config
    per_block = BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, model.kv_dtype)
    blocks = memory // per_block
    if blocks < 1:
        raise ValueError(f"a KV cache memory budget of {memory} bytes holds no block of {block_size} tokens "
                         f"({per_block} bytes for this model): raise --kv-cache-memory")
    return BlockPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block_size, num_blocks=blocks,
                     dtype=model.kv_dtype, device=model.device)


class Paging:
    """Admission, preemption and resumption for an engine whose cache is a `PagedKVCache`."""

    def __init__(self, engine, cache: PagedKVCache, share: bool) -> None:
        self.engine, self.cache, self.share = engine, cache, share
        self.pool = cache.pool
        self.preempted: list[Request] = []  # waiting to be prefilled anew, oldest admission first
        self.order: dict[int, int] = {}  # id(request) -> admission number (the youngest is preempted first)
        self.admissions = self.preemptions = 0

    @property
    def bytes(self) -> int:
        """Bytes of kept blocks (shared or waiting to be): the server's prefix cache gauge."""
        cfg = self.engine.model.config
        return len(self.pool.kept) * BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                               self.pool.block_size, self.pool.kv.dtype)

    @property
    def texts(self) -> int:
        """Kept blocks (the gauge's count: each stands for the text up to its end)."""
        return len(self.pool.kept)

    # ------------------------------------------------------------------ admission
    def reusable(self, request: Request) -> int:
        """Positions of its tokens that may come from shared blocks: all cached ones (every token but the last), less
        those whose hidden states its proposer reads (they are prefilled)."""
        reusable, needs = len(request.tokens) - 1, request.needs
        if needs.hidden_layers:
            reusable = 0 if needs.hidden_context is None else reusable - needs.hidden_context
        return max(reusable, 0) if self.share else 0

    def check(self, request: Request) -> None:
        """A request whose prompt the whole pool could not hold is refused (ValueError) instead of waiting forever.
        (One that outgrows the pool alone while it decodes fails then: the server's default budget holds a whole
        context.)"""
        need = self.cache.blocks_for(len(request.tokens) + 1)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"the KV cache budget holds {self.pool.num_blocks * self.pool.block_size} tokens "
                f"({self.pool.num_blocks} blocks of {self.pool.block_size}); this request's prompt "
                f"({len(request.tokens)} tokens) and its first new token need {need} blocks: raise "
                "--kv-cache-memory or shorten the prompt")

    def blocks_to_start(self, request: Request) -> int:
        """Blocks a request takes to start: its tokens' positions, less the kept blocks it shares."""
        shared = self.cache.shared_blocks(request.tokens, self.reusable(request)) if self.share else 0
        return self.cache.blocks_for(len(request.tokens)) - shared

    def admits(self, request: Request) -> bool:
        """Whether `request` may start now: no preempted request waits before it and the pool holds its prompt with a
        block to spare per running row. A request that can never fit is admitted, to be refused by `check`."""
        try:
            self.check(request)
        except ValueError:
            return True
        if self.preempted:
            return False
        return self.blocks_to_start(request) + len(self.engine.rows) <= self.pool.available

    def place(self, request: Request, row: int) -> None:
        """Row `row` (empty) holds the request's prompt: shared kept blocks, then fresh ones for the rest (OutOfBlocks
        if the pool cannot: nothing is taken)."""
        self.cache.free_row(row)
        cached = self.cache.share_prefix(row, request.tokens, self.reusable(request)) if self.share else 0
        try:
            self.cache.grow(row, len(request.tokens))
        except OutOfBlocks:
            self.cache.free_row(row)
            raise
        self.order[id(request)] = self.admissions
        self.admissions += 1
        request.stats.cached_tokens = max(request.stats.cached_tokens, cached)
        if self.engine.prefix_cache is not None:  # the server's metrics read its counters
            counters = self.engine.prefix_cache
            counters.lookups += 1
            if cached:
                counters.hits += 1
                counters.hit_tokens += cached

    def joined(self, row: int, request: Request) -> None:
        """Its prompt is cached: its full blocks are kept, for the requests that begin the same way."""
        if self.share:
            self.cache.keep_text(row, request.tokens)

    def leave(self, row: int, request: Request, failed: bool) -> None:
        """The request leaves row `row`: its committed text's full blocks are kept (unless a step failed it), the
        rest go back to the pool."""
        if self.share and not failed:
            self.cache.keep_text(row, request.tokens)
        self.cache.free_row(row)
        self.order.pop(id(request), None)

    def forget(self, request: Request) -> bool:
        """A preempted request leaves for good (cancelled); whether it was one."""
        if request in self.preempted:
            self.preempted.remove(request)
            self.order.pop(id(request), None)
            return True
        return False

    # ------------------------------------------------------------------ before a forward
    def make_room(self, proposals: list) -> list:
        """Every row's blocks hold the positions its proposal writes (copy on write where shared); the youngest rows
        are preempted while the pool cannot. Returns the proposals of the rows left (a lone row that still cannot fit
        raises OutOfBlocks)."""
        rows, cache = self.engine.rows, self.cache
        while True:
            writes = [(cache.lengths[i], cache.lengths[i] + nodes(p)) for i, p in enumerate(proposals)]
            need = sum(cache.needed(i, end) + self._copies(i, start, end) for i, (start, end) in enumerate(writes))
            if need <= self.pool.available:
                for i, (start, end) in enumerate(writes):
                    cache.grow(i, end)
                    cache.writable(i, start, end)
                return proposals
            if len(rows) == 1:
                raise OutOfBlocks(f"the KV cache budget ({self.pool.num_blocks} blocks) cannot hold this request's "
                                  f"next step: raise --kv-cache-memory")
            youngest = max(range(len(rows)), key=lambda i: self.order.get(id(rows[i]), -1))
            self._preempt(youngest)
            proposals[youngest] = proposals[-1]
            proposals.pop()

    def _copies(self, row: int, start: int, end: int) -> int:
        table, size = self.cache.tables[row], self.cache.block_size
        return sum(self.pool.refs[b] > 1 for b in table[start // size : self.cache.blocks_for(end)])

    def _preempt(self, i: int) -> None:
        """Row i gives its blocks back and waits to be prefilled anew; the last row takes its place (and a pending
        prompt's row follows the batch)."""
        engine, cache = self.engine, self.cache
        request, last = engine.rows[i], len(engine.rows) - 1
        if self.share:
            cache.keep_text(i, request.tokens)  # found again on its return if no one needed the blocks meanwhile
        cache.free_row(i)
        cache.move(last, i)
        engine.rows[i] = engine.rows[last]
        engine.rows.pop()
        if engine.pending is not None:
            cache.move(last + 1, last)
        request.proposal = None
        self.preempted.append(request)
        self.preempted.sort(key=lambda r: self.order.get(id(r), 0))
        self.preemptions += 1

    # ------------------------------------------------------------------ after blocks free up
    @torch.inference_mode()
    def resume(self) -> None:
        """Preempted requests, oldest first, prefilled anew (their prompt and committed tokens) while the pool holds
        them with a block to spare per running row; each joins the batch after the others."""
        engine, cache = self.engine, self.cache
        while self.preempted:
            request = self.preempted[0]
            if request.finished:  # cancelled while it waited
                self.preempted.pop(0)
                continue
            if self.blocks_to_start(request) + len(engine.rows) > self.pool.available:
                return
            row = len(engine.rows)
            if engine.pending is not None:  # the pending prompt's row moves one down
                cache.move(row, row + 1)
            order = self.order[id(request)]
            self.place(request, row)
            self.order[id(request)] = order  # it keeps its age
            self.preempted.pop(0)
            self._prefill(request, row)
            engine.rows.append(request)

    def _prefill(self, request: Request, row: int) -> None:
        engine, tokens = self.engine, request.tokens
        layers = request.needs.hidden_layers
        while (done := self.cache.lengths[row]) < len(tokens) - 1:
            end = min(len(tokens) - 1, done + RESUME_CHUNK)
            out = engine.model.forward(torch.tensor([tokens[done:end]], device=engine.model.device),
                                       self.cache.row(row), logits_at=None, hidden_layers=layers)
            if layers:
                request.proposer.observe(None, None, StepOutput(tokens, done, [h[0] for h in out.hidden]))
        self.joined(row, request)


def nodes(proposal) -> int:
    """Positions a proposal's forward writes: its tree's nodes and any extra tokens."""
    return len(proposal) + (len(proposal.extra.tokens) if proposal.extra is not None else 0)
