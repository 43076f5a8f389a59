"""Preallocated KV cache with a length pointer.

One tensor holds every layer's keys and values, so rollback is a pointer move and compacting an
accepted tree path is one index copy for all layers at once (not a loop over layers).

The cache's element type (`kv_dtype`): a float32 model keeps its keys and values in float16 by default (half the
memory and half the bytes an attention reads, as llama.cpp does), in int8 (`kv_cache_dtype="int8"`: a quarter, plus
a float32 scale a row), or in float32 (`kv_cache_dtype="float32"`). A key or value is rounded (quantized) once, when
it is written; every reader reads what is stored, so a token's numbers never depend on how many tokens share its
forward, and greedy speculation stays equal to plain decoding with the same cache type. Models in another dtype keep
their own: float64 (the tiny test models) and the half-precision ones.

An int8 row (one token's key or value for one kv head) holds its head_dim values, padded to a multiple of 4, then its
float32 scale in the last 4 bytes (`row_width`): value e = q_e * scale, scale = max |x| / 127 (symmetric, per row, as
llama.cpp's Q8_0 per block of 32). A row's numbers stay together in the one tensor, so copies, rollbacks, tree
compaction, paging and the prefix cache move int8 rows as they move float ones. Queries meet int8 keys quantized the
same way (each head's, as llama.cpp quantizes the queries it multiplies with a Q8_0 cache): the kernels' scores are
exact integer dot products times the two scales.
"""

from __future__ import annotations

import torch

from ..common.names import KV_CACHE_DTYPES

_DTYPES = {"float16": torch.float16, "int8": torch.int8}
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # the kernels' kv_kind (kernels/attention.h)


def kv_dtype(model_dtype: torch.dtype, kv_cache_dtype: str = "float16") -> torch.dtype:
    """The element type of a cache for a model in `model_dtype`: float16 halves a float32 model's cache, int8
    quarters it; other model dtypes (float64, float16, bfloat16) are kept whatever the option."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _DTYPES.get(kv_cache_dtype, model_dtype) if model_dtype == torch.float32 else model_dtype


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements a cache row holds: head_dim, or for int8 the values padded to a multiple of 4 and a float32 scale."""
    return (head_dim + 3) // 4 * 4 + 4 if dtype == torch.int8 else head_dim


def store_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., head_dim] as the cache stores them: int8 quantized (see the module's docstring; the same bits as
    kernels/block.c's store_kv), other dtypes as they are (the assignment into the cache rounds them)."""
    if dtype != torch.int8:
        return x
    x = x.float()
    head_dim = x.shape[-1]
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(x / scale), 0.0).clamp(-127, 127)
    out = torch.zeros(*x.shape[:-1], row_width(head_dim, dtype), dtype=torch.int8, device=x.device)
    out[..., :head_dim] = q.to(torch.int8)
    out[..., -4:] = scale.view(torch.int8)
    return out


def read_rows(stored: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows as numbers of `dtype` [..., head_dim] (int8: q * scale; widening a float16 row is exact)."""
    if stored.dtype != torch.int8:
        return stored.to(dtype)
    return stored[..., :head_dim].to(dtype) * stored[..., -4:].view(torch.float32).to(dtype)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, 2, batch_size, num_kv_heads, max_len, row_width(head_dim, dtype))
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens [0, length) hold valid entries

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H, n, D]) at positions start.. and return the layer's keys/values up to there (as stored:
        `read_rows` gives their numbers)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: need {end} positions, cache holds {self.max_len}")
        layer_kv = self.kv[layer]
        layer_kv[0, :, :, start:end] = store_rows(k, layer_kv.dtype)
        layer_kv[1, :, :, start:end] = store_rows(v, layer_kv.dtype)
        return layer_kv[0, :, :, :end], layer_kv[1, :, :, :end]

    def rollback(self, length: int) -> None:
        """Forget everything from `length` on; later writes overwrite it."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        self.length = length

    def keep(self, start: int, indices: torch.Tensor | list[int]) -> None:
        """Keep only the entries at start + indices (an accepted tree path), packed from `start` on."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.kv.device)
        n = idx.numel()
        if n and (int(idx.min()) < 0 or start + int(idx.max()) >= self.length):
            raise IndexError(f"keep indices {idx.tolist()} out of range for {self.length - start} new entries")
        is_prefix = bool(torch.equal(idx, torch.arange(n, device=idx.device)))
        if not is_prefix:  # a chain path is already in place; a tree path needs one gather
            self.kv[:, :, :, :, start : start + n] = self.kv[:, :, :, :, start + idx]
        self.length = start + n


class BatchKVCache:
    """KV cache for a ragged batch: row b holds its own sequence, valid at [0, lengths[b]).

    One tensor [layers, k|v, rows, kv_heads, capacity, head_dim]. The rows of a running batch are rows
    0..B-1 (the scheduler keeps them packed with `move`), so a step reads a view, not a gather. Both the
    row count and the capacity grow on demand (`reserve`), so memory follows the longest live request.
    A batched forward writes row b's n new entries at lengths[b].. in one index_put per layer.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        limit: int | None = None,
    ) -> None:
        """limit: the most positions a row may ever need (growth stops there)."""
        width = row_width(head_dim, dtype)
        self.kv = torch.zeros((num_layers, 2, batch_size, num_kv_heads, max_len, width), dtype=dtype, device=device)
        self.lengths = [0] * batch_size
        self.limit = limit
        self.initial = (batch_size, max_len)  # what `release` shrinks back to
        self._write: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (rows, positions, keys visible)

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    @property
    def batch_size(self) -> int:
        return self.kv.shape[2]

    def reserve(self, rows: int, max_len: int) -> None:
        """Make room for `rows` rows of `max_len` positions (grows geometrically, keeps the contents)."""
        if rows <= self.batch_size and max_len <= self.max_len:
            return
        new_rows = max(rows, self.batch_size)
        new_len = self.max_len
        if max_len > self.max_len:
            new_len = max(max_len, min(2 * self.max_len, self.limit or 2 * self.max_len))
        shape = list(self.kv.shape)
        shape[2], shape[4] = new_rows, new_len
        with torch.inference_mode(False):  # may run inside a forward: the cache must stay a normal tensor
            kv = torch.zeros(shape, dtype=self.kv.dtype, device=self.kv.device)
            kv[:, :, : self.batch_size, :, : self.max_len] = self.kv
        self.kv = kv
        self.lengths += [0] * (new_rows - len(self.lengths))

    def release(self) -> None:
        """Shrink back to the size it started with once no row holds anything (a burst of long requests must not
        keep its memory: the freed tensor goes back to the system)."""
        if any(self.lengths) or (self.batch_size, self.max_len) == self.initial:
            return
        shape = list(self.kv.shape)
        shape[2], shape[4] = self.initial
        with torch.inference_mode(False):
            self.kv = torch.zeros(shape, dtype=self.kv.dtype, device=self.kv.device)
        self.lengths = [0] * self.initial[0]

    def begin_step(self, starts: torch.Tensor, n: int) -> int:
        """A batched forward of n tokens per row starts: row b writes at starts[b]..; returns the keys seen."""
        rows = starts.shape[0]
        visible = int(starts.max()) + n
        self.reserve(rows, visible)
        positions = starts[:, None] + torch.arange(n, device=starts.device)
        self._write = (torch.arange(rows, device=self.kv.device)[:, None], positions.to(self.kv.device), visible)
        return visible

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H, n, D]) at each row's positions (set by begin_step); return rows 0..B-1's keys and
        values up to the longest row (the attention mask hides what a row must not see)."""
        if self._write is None:
            raise RuntimeError("BatchKVCache.write outside a batched forward (call begin_step first)")
        rows, positions, visible = self._write
        layer_kv = self.kv[layer]
        layer_kv[0][rows, :, positions] = store_rows(k.transpose(1, 2), layer_kv.dtype)
        layer_kv[1][rows, :, positions] = store_rows(v.transpose(1, 2), layer_kv.dtype)
        b = k.shape[0]
        return layer_kv[0, :b, :, :visible], layer_kv[1, :b, :, :visible]

    def end_step(self) -> None:
        self._write = None

    def keep(self, row: int, start: int, indices: torch.Tensor | list[int]) -> None:
        """Row `row` keeps only its entries at start + indices (an accepted tree path), packed from `start` on."""
        if isinstance(indices, list) and indices == list(range(len(indices))):  # a chain's prefix: nothing moves
            if start + len(indices) > self.lengths[row]:
                raise IndexError(f"keep indices {indices} out of range for {self.lengths[row] - start} new entries")
            self.lengths[row] = start + len(indices)
            return
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.kv.device)
        n = idx.numel()
        if n and (int(idx.min()) < 0 or start + int(idx.max()) >= self.lengths[row]):
            raise IndexError(f"keep indices {idx.tolist()} out of range for {self.lengths[row] - start} new entries")
        if not bool(torch.equal(idx, torch.arange(n, device=idx.device))):
            self.kv[:, :, row, :, start : start + n] = self.kv[:, :, row, :, start + idx]
        self.lengths[row] = start + n

    def load(self, row: int, cache: KVCache) -> None:
        """Copy a single-sequence cache (a prefill) into row `row`."""
        n = cache.length
        self.reserve(row + 1, n)
        self.kv[:, :, row, :, :n] = cache.kv[:, :, 0, :, :n]
        self.lengths[row] = n

    def row(self, row: int) -> RowCache:
        """Row `row` as a single-sequence cache (a view: what it writes lands in this batch's tensor)."""
        self.reserve(row + 1, 1)
        return RowCache(self, row)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Row `dst` holds row `src`'s first n entries (a shared prompt's prefill), `src` unchanged."""
        self.reserve(dst + 1, n)
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
        self.lengths[dst] = n

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s entries become row `dst`'s (packs the batch when a row leaves)."""
        if src != dst:
            self.copy(src, dst, self.lengths[src])
            self.lengths[src] = 0


class RowCache(KVCache):
    """One row of a `BatchKVCache` seen as a `KVCache`: the single-sequence forward (and its native kernels) runs
    on it in place; its length is the batch's length for the row. Valid until the batch's tensor is regrown."""

    def __init__(self, batch: BatchKVCache, row: int) -> None:  # noqa: D107 - no KVCache.__init__: a view
        self.batch, self.row = batch, row
        self.kv = batch.kv[:, :, row : row + 1]
        self.max_len = self.kv.shape[4]

    @property
    def length(self) -> int:
        return self.batch.lengths[self.row]

    @length.setter
    def length(self, value: int) -> None:
        self.batch.lengths[self.row] = value
