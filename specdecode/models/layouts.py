"""Checkpoint layouts other than Llama's, as the Llama names the loaders read: Phi-3's fused q|k|v and gate|up split,
and the text model of a multimodal Gemma 3 checkpoint (4B and up) taken out of it."""

from __future__ import annotations

import torch

from .config import ModelConfig


def fused_splits(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Phi-3's fused tensors (name within a layer's prefix) -> the (Llama name, rows) parts they hold, in order."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
            "mlp.gate_up_proj": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size))}


def split_fused(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A state dict (without the `model.` prefix) with every fused tensor replaced by its parts (rows, in order); the
    fused tensor's rows must add up to its parts' (a checkpoint of another shape is refused, never read shifted)."""
    splits = fused_splits(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        base, _, suffix = name.rpartition(".")
        layer_prefix, fused = _layer_split(base)
        if fused not in splits:
            out[name] = tensor
            continue
        parts = splits[fused]
        sizes = [rows for _, rows in parts]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name} has {tensor.shape[0]} rows; this config's {fused} holds {sum(sizes)} "
                             f"({' + '.join(map(str, sizes))})")
        for (part, _), piece in zip(parts, tensor.split(sizes), strict=True):
            out[f"{layer_prefix}{part}.{suffix}"] = piece
    return out


def _layer_split(base: str) -> tuple[str, str]:
    """'layers.3.self_attn.qkv_proj' -> ('layers.3.', 'self_attn.qkv_proj'); a name outside the layers -> ('', base)."""
    parts = base.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 2]) + ".", ".".join(parts[i + 2 :])
    return "", base


# a multimodal checkpoint's text model: its prefixes (transformers' saved names, then its in-memory ones) -> a text-only
# checkpoint's; the vision tower and projector are left out
TEXT_TOWER = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
              ("model.language_model.", "model."))
NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_tower(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's text model under a text-only checkpoint's names; any other state dict as it is."""
    if not any(name.startswith(prefix) for name in state for prefix, _ in TEXT_TOWER):
        return state
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(NOT_TEXT):
            continue
        for prefix, text in TEXT_TOWER:
            if name.startswith(prefix):
                name = text + name.removeprefix(prefix)
                break
        out[name] = tensor
    return out
