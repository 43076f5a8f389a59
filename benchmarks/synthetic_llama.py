"""Synthetic Llama GGUF files of real shapes for speed benchmarks: SmolLM2's tokenizer (copied from the shipped
SmolLM2-135M file, so every file here shares one vocabulary and llama.cpp loads them as it loads the real ones) and
random weights, written as valid quantized blocks whose weights have a standard deviation near 1 / sqrt(fan-in)
(speed does not depend on the values).

Layouts: "Q4_1" as the shipped SmolLM2 file (Q4_1 blocks, the embedding Q8_0 and tied to the output layer);
"Q4_K_M" as llama-quantize's mix (benchmarks/kquant_decode.py: Q4_K, attn_v and ffn_down in Q6_K on the more-bits
layers, output Q6_K, embedding Q4_K; rows must be multiples of 256). Files are made at run time, never committed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kquant_decode import more_bits, random_blocks  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    rope_theta: float = 100_000.0
    vocab: int = 49152


# SmolLM2's 135M and 360M, SmolLM2-1.7B's with 8 kv heads (as the issue's runs), Llama 3.2 3B's and Llama 3.1 8B's
SHAPES = {
    "135m": Shape(576, 30, 1536, 9, 3),
    "360m": Shape(960, 32, 2560, 15, 5),
    "1.7b": Shape(2048, 24, 8192, 32, 8, 130_000.0),
    "3b": Shape(3072, 28, 8192, 24, 8, 500_000.0),
    "8b": Shape(4096, 32, 14336, 32, 8, 500_000.0),
}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def q4_1_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_1 blocks [rows, cols / 32 * 20]: w = d * q + m, q uniform 0..15 (~4.6 rms), m = -8 d."""
    raw = rng.integers(0, 256, (rows, cols // 32, 20), dtype=np.uint8)
    d = 1 / (cols**0.5 * 4.6)
    raw[..., 0:2] = np.full((rows, cols // 32, 1), d, np.float16).view(np.uint8)
    raw[..., 2:4] = np.full((rows, cols // 32, 1), -8 * d, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def q8_0_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Random Q8_0 blocks [rows, cols / 32 * 34] of weights with standard deviation `std` (int8 uniform: ~74 rms)."""
    raw = rng.integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    raw[..., 0:2] = np.full((rows, cols // 32, 1), std / 74, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write(path: Path, shape: Shape, layout: str, tokenizer_file: Path, seed: int = 0) -> Path:
    """A Llama GGUF file of `shape` in `layout` ("Q4_1" or "Q4_K_M") with `tokenizer_file`'s tokenizer."""
    import gguf

    if layout not in ("Q4_1", "Q4_K_M"):
        raise ValueError(f"layout must be Q4_1 or Q4_K_M, got {layout!r}")
    if layout == "Q4_K_M" and (shape.hidden % 256 or shape.ffn % 256):
        raise ValueError(f"Q4_K_M needs rows that are multiples of 256 (hidden {shape.hidden}, ffn {shape.ffn})")
    rng = np.random.default_rng(seed)
    source = gguf.GGUFReader(str(tokenizer_file))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic-{path.stem}")
    for add, value in ((w.add_context_length, 8192), (w.add_embedding_length, shape.hidden),
                       (w.add_block_count, shape.layers), (w.add_feed_forward_length, shape.ffn),
                       (w.add_head_count, shape.heads), (w.add_head_count_kv, shape.kv_heads),
                       (w.add_rope_dimension_count, shape.hidden // shape.heads), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_freq_base, shape.rope_theta), (w.add_vocab_size, shape.vocab)):
        add(value)
    for key in TOKENIZER_KEYS:
        field = source.fields.get(key)
        if field is None:
            continue
        types = field.types
        sub = types[1] if types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), types[0], sub_type=sub)

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        if kind == "Q4_1":
            data = q4_1_blocks(rng, rows, cols)
        elif kind == "Q8_0":
            data = q8_0_blocks(rng, rows, cols, 1.0)
        else:
            data = random_blocks(rng, kind, rows, cols)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    kq = layout == "Q4_K_M"
    matrix("token_embd.weight", shape.vocab, shape.hidden, "Q4_K" if kq else "Q8_0")
    head_dim = shape.hidden // shape.heads
    for i in range(shape.layers):
        big = "Q6_K" if kq and more_bits(i, shape.layers) else ("Q4_K" if kq else "Q4_1")
        small = "Q4_K" if kq else "Q4_1"
        kv = shape.kv_heads * head_dim
        for name, rows, cols, kind in (("attn_q", shape.heads * head_dim, shape.hidden, small),
                                       ("attn_k", kv, shape.hidden, small), ("attn_v", kv, shape.hidden, big),
                                       ("attn_output", shape.hidden, shape.heads * head_dim, small),
                                       ("ffn_gate", shape.ffn, shape.hidden, small),
                                       ("ffn_up", shape.ffn, shape.hidden, small),
                                       ("ffn_down", shape.hidden, shape.ffn, big)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, kind)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(shape.hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    if kq:  # Q4_1 files are tied (the embedding serves as the output layer), as SmolLM2's
        matrix("output.weight", shape.vocab, shape.hidden, "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
