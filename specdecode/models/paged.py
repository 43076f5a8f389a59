"""Paged KV cache: a pool of fixed-size blocks and a block table per sequence (as vLLM's block manager and
llama.cpp's unified cache keep them).

The pool is one tensor [layers, k|v, blocks, kv_heads, block_size, row] (cache.row_width) sized by a memory budget; a
sequence's position p lives in block table[p // block_size] at offset p % block_size. Memory follows the tokens
actually held (not the longest row times the row count), rollback frees whole blocks, and sequences that begin with
the same tokens share the blocks of that beginning: reference counted, a block written while shared is copied first
(copy on write).

Block 0 is scratch: never handed out, it pads the tables a batched PyTorch forward gathers through and takes the
writes of a ragged batch's padding tokens (seen by no real token).

Full blocks of committed text are kept by a hash of every token up to their end (SHA-256, chained): a later sequence
whose prompt begins with the same tokens takes them instead of recomputing them. A kept block no sequence uses stays
cached until the pool needs it (least recently used first), so a conversation's next turn finds its history.
Lossless: a token's keys and values depend only on the tokens before it, and the native kernels compute them bit for
bit the same in any company, so a shared block holds what a prefill would write.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .cache import row_width, store_rows

SCRATCH = 0  # the block that pads tables and takes padding writes


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (the engine preempts a request, or the request waits)."""


class BlockPool:
    """`num_blocks` blocks of `block_size` positions for every layer's keys and values, with reference counts and
    the table of kept (hashed) full blocks."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int, num_blocks: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if block_size < 8 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 8 (the attention reads keys 8 at a time), "
                             f"got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        # not zeroed here (that would make the whole budget resident at once): a block is zeroed when first handed
        # out, so memory becomes resident as blocks are used, and padding read by a batched PyTorch forward (masked,
        # but multiplied by a zero weight) is never a stale NaN
        shape = (num_layers, 2, num_blocks + 1, num_kv_heads, block_size, row_width(head_dim, dtype))
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.kv[:, :, SCRATCH] = 0
        self.zeroed = bytearray(num_blocks + 1)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.refs = [0] * (num_blocks + 1)
        self.free: list[int] = list(range(num_blocks, 0, -1))  # popped from the end: low ids first
        self.kept: dict[bytes, int] = {}  # hash of the tokens up to a full block's end -> the block
        self.key_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # kept blocks no sequence uses, least recently used first
        self.lookups = self.hits = self.hit_tokens = 0

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * num_kv_heads * block_size * row_width(head_dim, dtype) * element

    @property
    def available(self) -> int:
        """Blocks a sequence can take now: free ones and kept ones no sequence uses (evicted on demand)."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def allocate(self) -> int:
        if self.free:
            block = self.free.pop()
        elif self.idle:  # the least recently used kept block leaves the table
            block, _ = self.idle.popitem(last=False)
            del self.kept[self.key_of.pop(block)]
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        if not self.zeroed[block]:
            self.kv[:, :, block] = 0
            self.zeroed[block] = 1
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.idle.pop(block, None)
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise RuntimeError(f"KV block {block} freed more often than taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.idle[block] = None
            else:
                self.free.append(block)

    def keep(self, block: int, key: bytes) -> None:
        """Block `block` holds the full block of text hashed `key`: later sequences may share it."""
        if key in self.kept or block in self.key_of:
            return  # the same text's block is kept already (another copy of it stays private)
        self.kept[key] = block
        self.key_of[block] = key

    def forget(self, block: int) -> None:
        """Its contents are about to change: it no longer stands for its text."""
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.kept[key]

    def find(self, key: bytes) -> int | None:
        return self.kept.get(key)


def block_keys(tokens: Sequence[int], block_size: int, count: int) -> list[bytes]:
    """The chained hashes of the first `count` full blocks of `tokens`: block i's covers every token up to its end
    (two texts share a block's key only if they agree on everything before it too)."""
    keys, digest = [], b""
    for i in range(count):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        digest = hashlib.sha256(digest + b"|" + ",".join(map(str, chunk)).encode()).digest()
        keys.append(digest)
    return keys


class PagedKVCache:
    """Sequences (the engine's rows) over a `BlockPool`: row r's block table and length. Growing, sharing and
    freeing blocks is the engine's job (`grow`, `share`, `truncate`, `free_row`); a forward reads and writes
    through the tables (`write` and `begin_step` for the PyTorch blocks; `block_table` for the native ones)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []
        self._tensors: dict[int, torch.Tensor] = {}  # row -> its table as int32 (the native kernel reads it)
        self._write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    # ------------------------------------------------------------------ the tables
    @property
    def kv(self) -> torch.Tensor:
        return self.pool.kv

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    def _rows(self, rows: int) -> None:
        while len(self.tables) < rows:
            self.tables.append([])
            self.lengths.append(0)

    def capacity(self, row: int) -> int:
        self._rows(row + 1)
        return len(self.tables[row]) * self.block_size

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def needed(self, row: int, positions: int) -> int:
        """New blocks row `row` needs to hold `positions` positions."""
        return max(0, self.blocks_for(positions) - len(self.tables[row]) if row < len(self.tables)
                   else self.blocks_for(positions))

    def grow(self, row: int, positions: int) -> None:
        """Row `row` holds at least `positions` positions (OutOfBlocks, taking nothing, if the pool cannot)."""
        self._rows(row + 1)
        need = self.needed(row, positions)
        if need > self.pool.available:
            raise OutOfBlocks(f"row {row} needs {need} more KV blocks, {self.pool.available} are free")
        for _ in range(need):
            self.tables[row].append(self.pool.allocate())
        if need:
            self._tensors.pop(row, None)

    def writable(self, row: int, start: int, end: int) -> None:
        """Positions start..end of row `row` may be written: a shared block among them is copied first (copy on
        write), a kept one is forgotten (its text changes). OutOfBlocks if a copy finds no block."""
        table, size = self.tables[row], self.block_size
        for i in range(start // size, min(self.blocks_for(end), len(table))):
            block = table[i]
            if self.pool.refs[block] > 1:
                copy = self.pool.allocate()
                self.pool.kv[:, :, copy] = self.pool.kv[:, :, block]
                self.pool.decref(block)
                table[i] = copy
                self._tensors.pop(row, None)
            else:
                self.pool.forget(block)

    def truncate(self, row: int, length: int) -> None:
        """Row `row` holds `length` positions; blocks past them go back to the pool (rejected guesses)."""
        self.lengths[row] = length
        table, keep = self.tables[row], self.blocks_for(length)
        if len(table) > keep:
            for block in table[keep:]:
                self.pool.decref(block)
            del table[keep:]
            self._tensors.pop(row, None)

    def free_row(self, row: int) -> None:
        if row < len(self.tables):
            self.truncate(row, 0)

    def share(self, src: int, dst: int, n: int) -> None:
        """Row `dst` (empty) holds row `src`'s first n positions in the same blocks (a partly filled last one is
        copied when either writes into it)."""
        self._rows(max(src, dst) + 1)
        self.free_row(dst)
        blocks = self.tables[src][: self.blocks_for(n)]
        for block in blocks:
            self.pool.incref(block)
        self.tables[dst] = list(blocks)
        self.lengths[dst] = n
        self._tensors.pop(dst, None)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s table becomes row `dst`'s (dst's blocks must have been freed); src is left empty."""
        if src == dst:
            return
        self._rows(max(src, dst) + 1)
        if self.tables[dst]:
            raise RuntimeError(f"row {dst} still holds blocks: free it before moving row {src} there")
        self.tables[dst], self.tables[src] = self.tables[src], []
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0
        self._tensors.pop(src, None)
        self._tensors.pop(dst, None)

    def swap(self, a: int, b: int) -> None:
        self._rows(max(a, b) + 1)
        self.tables[a], self.tables[b] = self.tables[b], self.tables[a]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]
        self._tensors.pop(a, None)
        self._tensors.pop(b, None)

    def share_prefix(self, row: int, tokens: Sequence[int], limit: int) -> int:
        """Row `row` (empty) takes the kept blocks of the longest run of full blocks of `tokens` (within the first
        `limit` positions) that earlier text hashed; returns the positions it holds."""
        self._rows(row + 1)
        count = min(limit, len(tokens)) // self.block_size
        self.pool.lookups += 1
        taken = 0
        for key in block_keys(tokens, self.block_size, count):
            block = self.pool.find(key)
            if block is None:
                break
            self.pool.incref(block)
            self.tables[row].append(block)
            taken += 1
        n = taken * self.block_size
        if n:
            self.pool.hits += 1
            self.pool.hit_tokens += n
            self._tensors.pop(row, None)
        self.lengths[row] = n
        return n

    def shared_blocks(self, tokens: Sequence[int], limit: int) -> int:
        """How many full blocks of `tokens` (within `limit` positions) `share_prefix` would find kept now."""
        found = 0
        for key in block_keys(tokens, self.block_size, min(limit, len(tokens)) // self.block_size):
            if self.pool.find(key) is None:
                break
            found += 1
        return found

    def keep_text(self, row: int, tokens: Sequence[int]) -> None:
        """Row `row`'s full blocks of committed text (positions below its length, tokens[p] at p) are kept by hash."""
        count = min(self.lengths[row], len(tokens)) // self.block_size
        for key, block in zip(block_keys(tokens, self.block_size, count), self.tables[row], strict=False):
            self.pool.keep(block, key)

    def block_table(self, row: int) -> torch.Tensor:
        """Row `row`'s table as a contiguous int32 tensor (what the native kernel reads)."""
        table = self._tensors.get(row)
        if table is None:
            table = self._tensors[row] = torch.tensor(self.tables[row] or [SCRATCH], dtype=torch.int32)
        return table

    # ------------------------------------------------------------------ BatchKVCache's interface
    @property
    def max_len(self) -> int:
        return max((self.capacity(r) for r in range(len(self.tables))), default=0)

    def reserve(self, rows: int, max_len: int) -> None:
        """Rows exist; their blocks are the engine's to grow beforehand (a forward never takes blocks)."""
        self._rows(rows)

    def release(self) -> None:
        """Nothing to shrink: the pool's size is its budget."""

    def row(self, row: int) -> PagedRow:
        self._rows(row + 1)
        return PagedRow(self, row)

    def copy(self, src: int, dst: int, n: int) -> None:
        self.share(src, dst, n)

    def keep(self, row: int, start: int, indices: torch.Tensor | list[int]) -> None:
        """Row `row` keeps only its entries at start + indices (an accepted tree path), packed from `start` on; the
        blocks past them are freed."""
        if isinstance(indices, list) and indices == list(range(len(indices))):  # a chain's prefix: nothing moves
            if start + len(indices) > self.lengths[row]:
                raise IndexError(f"keep indices {indices} out of range for {self.lengths[row] - start} new entries")
            self.truncate(row, start + len(indices))
            return
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = idx.numel()
        if n and (int(idx.min()) < 0 or start + int(idx.max()) >= self.lengths[row]):
            raise IndexError(f"keep indices {idx.tolist()} out of range for {self.lengths[row] - start} new entries")
        if not bool(torch.equal(idx, torch.arange(n))):
            src, dst = self._locate(row, start + idx), self._locate(row, start + torch.arange(n))
            kv = self.pool.kv
            kv[:, :, dst[0], :, dst[1]] = kv[:, :, src[0], :, src[1]]
        self.truncate(row, start + n)

    def _locate(self, row: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(self.tables[row], dtype=torch.long)
        return table[positions // self.block_size], positions % self.block_size

    def _padded_tables(self, rows: int, blocks: int) -> torch.Tensor:
        out = torch.full((rows, blocks), SCRATCH, dtype=torch.long)
        for r in range(rows):
            table = self.tables[r][:blocks]
            out[r, : len(table)] = torch.tensor(table, dtype=torch.long)
        return out

    def begin_step(self, starts: torch.Tensor, n: int) -> int:
        """A batched PyTorch forward of n tokens per row: row b writes at starts[b].. (positions past its blocks,
        padding, land in the scratch block); returns the keys seen."""
        rows = starts.shape[0]
        visible = int(starts.max()) + n
        nb = self.blocks_for(visible)
        tables = self._padded_tables(rows, nb)
        positions = starts[:, None].cpu() + torch.arange(n)
        blocks = tables.gather(1, (positions // self.block_size).clamp(max=nb - 1))
        blocks[positions >= torch.tensor([self.capacity(r) for r in range(rows)])[:, None]] = SCRATCH
        device = self.pool.kv.device
        self._write = (tables.to(device), blocks.to(device), (positions % self.block_size).to(device), visible)
        return visible

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H, n, D]) at each row's positions (set by begin_step); return rows 0..B-1's keys and values
        up to the longest row, gathered through the tables ([B, H, visible, D])."""
        if self._write is None:
            raise RuntimeError("PagedKVCache.write outside a batched forward (call begin_step first)")
        tables, blocks, offsets, visible = self._write
        layer_kv = self.pool.kv[layer]
        layer_kv[0][blocks, :, offsets] = store_rows(k.transpose(1, 2), layer_kv.dtype).to(layer_kv.dtype)
        layer_kv[1][blocks, :, offsets] = store_rows(v.transpose(1, 2), layer_kv.dtype).to(layer_kv.dtype)
        return gather(layer_kv[0], tables, visible), gather(layer_kv[1], tables, visible)

    def end_step(self) -> None:
        self._write = None


def gather(blocks: torch.Tensor, tables: torch.Tensor, visible: int) -> torch.Tensor:
    """[blocks, H, N, D] read through tables [B, nb] -> [B, H, visible, D] (each row's positions in order)."""
    b, nb = tables.shape
    _, h, n, d = blocks.shape
    return blocks[tables].permute(0, 2, 1, 3, 4).reshape(b, h, nb * n, d)[:, :, :visible]


class PagedRow:
    """One row of a `PagedKVCache` as a single-sequence cache (the prefill's and a lone row's forward): writes go
    through its table; the row's blocks must already hold the positions written."""

    def __init__(self, cache: PagedKVCache, row: int) -> None:
        self.cache, self.row = cache, row
        self.kv = cache.pool.kv

    @property
    def length(self) -> int:
        return self.cache.lengths[self.row]

    @length.setter
    def length(self, value: int) -> None:
        self.cache.lengths[self.row] = value

    @property
    def max_len(self) -> int:
        return self.cache.capacity(self.row)

    def block_table(self, row: int = 0) -> torch.Tensor:
        return self.cache.block_table(self.row)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([1, H, n, D]) at positions start..; return the row's keys and values up to there."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: need {end} positions, the row's blocks hold {self.max_len}")
        cache = self.cache
        positions = torch.arange(start, end)
        blocks, offsets = cache._locate(self.row, positions)
        layer_kv = cache.pool.kv[layer]
        layer_kv[0][blocks, :, offsets] = store_rows(k[0].transpose(0, 1), layer_kv.dtype).to(layer_kv.dtype)
        layer_kv[1][blocks, :, offsets] = store_rows(v[0].transpose(0, 1), layer_kv.dtype).to(layer_kv.dtype)
        table = torch.tensor(cache.tables[self.row][: cache.blocks_for(end)], dtype=torch.long)[None]
        return gather(layer_kv[0], table, end), gather(layer_kv[1], table, end)
