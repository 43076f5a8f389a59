"""Attention masks (True = attend) for one sequence's forward and for a ragged batch's: tree masks among the new
tokens, the cached prefix, sliding windows, padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_masks(masks: Sequence[torch.Tensor | None], sizes: Sequence[int], n: int) -> torch.Tensor:
    """[B, n, n] from per-row tree masks (None: a causal chain); padding rows and columns stay False."""
    out = torch.zeros(len(sizes), n, n, dtype=torch.bool)
    for i, (mask, m) in enumerate(zip(masks, sizes, strict=True)):
        out[i, :m, :m] = torch.ones(m, m, dtype=torch.bool).tril() if mask is None else mask[:m, :m]
    return out


def attention_mask(start: int, positions: torch.Tensor, tree_mask: torch.Tensor | None, window: int | None,
                   device: torch.device) -> torch.Tensor | None:
    """[n, start + n] bool (True = attend), or None when every query may see every cached key. A query at
    position p sees keys at positions > p - window: the cache holds the accepted prefix at positions
    0..start-1 and tree nodes sit at prefix_len + depth, so a node sees exactly what the target would."""
    n = positions.shape[-1]
    windowed = window is not None and int(positions.max()) >= window
    if n == 1 and not windowed:
        return None
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    prefix = torch.ones(n, start, dtype=torch.bool, device=device)
    mask = torch.cat((prefix, tree_mask.to(device)), dim=1)
    if windowed:  # keys more than `window - 1` positions behind the query are out of sight
        key_pos = torch.cat((torch.arange(start, device=device), positions.to(device)))
        mask &= (positions.to(device)[:, None] - key_pos[None, :]) < window
    return mask


def ragged_mask(starts: torch.Tensor, sizes: torch.Tensor, positions: torch.Tensor, tree_masks: torch.Tensor | None,
                visible: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[B, 1, n, visible] bool: row b's query i sees its cached keys [0, starts[b]) and, among its new
    keys, the real ones its tree mask allows; padding queries see their own key (no empty row)."""
    b, n = positions.shape
    rel = torch.arange(visible, device=device)[None, :] - starts[:, None]  # [B, L]: index in the new block
    if tree_masks is None:
        tree_masks = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(b, n, n)
    tree_masks = tree_masks.to(device)
    block = torch.gather(tree_masks, 2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, visible))  # [B, n, L]
    real_key = (rel >= 0) & (rel < sizes[:, None])
    mask = (rel < 0)[:, None, :] | (block & real_key[:, None, :])
    padding_query = torch.arange(n, device=device)[None, :] >= sizes[:, None]  # [B, n]
    mask |= padding_query[:, :, None] & (rel[:, None, :] == torch.arange(n, device=device)[None, :, None])
    if window is not None and int(positions.max()) >= window:
        key_pos = torch.where(rel < 0, torch.arange(visible, device=device)[None, :],
                              torch.gather(positions, 1, rel.clamp(0, n - 1)))  # [B, L]
        mask &= (positions[:, :, None] - key_pos[:, None, :]) < window
    return mask[:, None]
