"""Float weights to GGUF K-quant bytes (Q4_K, Q5_K, Q6_K), laid out as ggml-common.h's block_q4_K, block_q5_K and
block_q6_K: what the `gguf` package cannot write (its quantize covers the 32-blocks only), for tests and benchmarks
that need K-quant files made at run time. The rounding is plain (each block's range, scales rounded to their bits),
not llama.cpp's error-minimizing search: the bytes are valid blocks of the format, not the ones llama-quantize picks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def quantize_k(data: np.ndarray, ggml_type: str) -> np.ndarray:
    """`data` [rows, k] (k a multiple of 256) as `ggml_type` blocks: uint8 [rows, k / 256 * block bytes]."""
    if ggml_type not in K_TYPES:
        raise ValueError(f"quantize_k writes {', '.join(K_TYPES)}, not {ggml_type}")
    w = np.ascontiguousarray(data, dtype=np.float32)
    rows, k = w.shape
    if k % QK_K:
        raise ValueError(f"a {ggml_type} row holds super-blocks of {QK_K} weights; {k} is not a multiple of it")
    w = w.reshape(rows, k // QK_K, QK_K)
    if ggml_type == "Q6_K":
        return _q6_k(w).reshape(rows, -1)
    return _q45_k(w, 15 if ggml_type == "Q4_K" else 31).reshape(rows, -1)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _q45_k(w: np.ndarray, top: int) -> np.ndarray:
    """w = d * sc * q - dmin * m per block of 32, q in 0..top, sc and m 6-bit, d and dmin float16."""
    blocks = w.reshape(*w.shape[:2], 8, 32)
    low = np.maximum(-blocks.min(-1), 0.0)  # the block's min, as a non-negative offset
    scale = (blocks.max(-1) + low) / top
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (low.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(_ratio(scale, d.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(low, dmin.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.rint(_ratio(blocks + offset[..., None], np.broadcast_to(step[..., None], blocks.shape))), 0, top)
    q = q.astype(np.uint8)  # [rows, supers, 8 blocks, 32]
    packed = np.concatenate((
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
        (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)), axis=-1)  # get_scale_min_k4's inverse
    pairs = q.reshape(*q.shape[:2], 4, 2, 32)  # 32 bytes a pair of blocks: the first's low nibbles, the second's high
    nibbles = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).reshape(*q.shape[:2], 128)
    head = np.concatenate((d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed), axis=-1)
    if top == 15:
        return np.concatenate((head, nibbles), axis=-1)
    fifth = ((q >> 4) & 1).reshape(*q.shape[:2], 8, 32)  # block j's weight l: bit j of byte l
    qh = (fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    return np.concatenate((head, qh, nibbles), axis=-1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """w = d * sc * (q - 32) per 16 weights, q in 0..63, sc int8, d float16."""
    groups = w.reshape(*w.shape[:2], 16, 16)
    biggest = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)[..., 0]
    scale = -biggest / 32  # the largest magnitude maps to -32 (the wider side), as llama.cpp's make_qx_quants
    d = (np.abs(scale).max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(_ratio(scale, d.astype(np.float32)[..., None])), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(_ratio(groups, np.broadcast_to(step[..., None], groups.shape))), -32, 31) + 32
    u = q.astype(np.uint8).reshape(*w.shape[:2], 2, 4, 32)  # [half of 128][quarter][32]
    ql = np.concatenate(((u[..., 0, :] & 15) | ((u[..., 2, :] & 15) << 4),
                         (u[..., 1, :] & 15) | ((u[..., 3, :] & 15) << 4)), axis=-1)  # [.., half, 64]
    qh = ((u >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)  # [.., half, 32]
    return np.concatenate((ql.reshape(*w.shape[:2], 128), qh.reshape(*w.shape[:2], 64), sc.view(np.uint8),
                           d[..., None].view(np.uint8)), axis=-1)
