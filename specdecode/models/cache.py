"""Preallocated KV cache with a length pointer.

One tensor holds every layer's keys and values, so rollback is a pointer move and compacting an
accepted tree path is one index copy for all layers at once (not a loop over layers).
"""

from __future__ import annotations

import torch


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
        shape = (num_layers, 2, batch_size, num_kv_heads, max_len, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens [0, length) hold valid entries

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H, n, D]) at positions start.. and return the layer's keys/values up to there."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: need {end} positions, cache holds {self.max_len}")
        layer_kv = self.kv[layer]
        layer_kv[0, :, :, start:end] = k
        layer_kv[1, :, :, start:end] = v
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
