"""Synthetic GGUF files of real Llama-3 layouts for benchmarks/llamacpp_bench.py: random weights, llama.cpp's
tensor names and metadata, and the quantization MIX llama-quantize gives each tensor.

The mix (which tensor gets which type: Q4_K_M keeps attn_v / ffn_down of some layers and the output layer in Q6_K,
...) is read from llama-quantize itself: a small proxy file of the same architecture, layer count, head counts and
vocabulary (float16, random) is quantized by the llama.cpp build under test, and the big file takes each tensor's
type from the proxy's tensor of the same name. The big file's weights are then random valid blocks of those types
(scales that keep activations O(1); decode speed does not depend on the values), written tensor by tensor so an
8B file never sits in memory. The vocabulary is a byte-level BPE (models/gguf_write.py's) padded with unreachable
filler tokens to the shape's size, so llama.cpp loads the file.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdecode.models.gguf_file import config as gguf_config
from specdecode.models.gguf_file import llama3_factors
from specdecode.models.gguf_write import Vocab, _add_vocab, byte_level_vocab


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# SmolLM2-1.7B's blocks with Llama 3's vocabulary and RoPE (the issue's "1.7B shape"); Llama-3.1-8B's
LLAMA3_1_7B = Shape("llama3-1.7b", 2048, 24, 8192, 32, 8, 128256)
LLAMA3_8B = Shape("llama3-8b", 4096, 32, 14336, 32, 8, 128256)
ROPE_THETA = 500_000.0
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
# bytes of a block and weights in it, for the types a Llama mix uses
BLOCKS = {"Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256), "Q8_0": (34, 32), "Q5_0": (22, 32),
          "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_1": (24, 32), "Q3_K": (110, 256)}
# the typical magnitude of a block's quantized value (uniform random bits), to pick a scale giving weights of
# standard deviation ~1 / sqrt(cols)
VALUE_RMS = {"Q4_K": 36 * 4.6, "Q5_K": 36 * 9.2, "Q6_K": 74 * 18, "Q8_0": 74, "Q5_0": 9.2, "Q4_0": 4.6,
             "Q4_1": 4.6, "Q5_1": 9.2, "Q3_K": 18 * 2.3}


def vocab_of(size: int) -> Vocab:
    """A byte-level BPE of `size` tokens: models/gguf_write.py's small one, padded with filler tokens no merge
    reaches (before the special tokens, which stay last)."""
    small = byte_level_vocab(1024)
    first_special = small.token_types.index(3)
    fillers = [f"<filler{i}>" for i in range(size - len(small.tokens))]
    tokens = small.tokens[:first_special] + fillers + small.tokens[first_special:]
    types = [1] * (first_special + len(fillers)) + small.token_types[first_special:]
    shift = len(fillers)
    return Vocab(tokens, types, small.merges, pre=small.pre, bos_token_id=(small.bos_token_id or 0) + shift,
                 eos_token_id=(small.eos_token_id or 0) + shift, chat_template=small.chat_template)


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, (rows, cols) or (n,)) of every tensor, in llama.cpp's converter's order."""
    kv = shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, int] | tuple[int]]] = [("rope_freqs.weight", (shape.head_dim // 2,)),
                                                           ("token_embd.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (shape.hidden,)), (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn)),
                (f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)),
                (f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)), (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
                (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
                (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
                (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
                (f"blk.{i}.attn_v.weight", (kv, shape.hidden))]
    out.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, shape.hidden)))
    return out


def random_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Valid random `kind` blocks [rows, bytes]: random bits, float16 scales set so the weights have a standard
    deviation near 1 / sqrt(cols) (Q4_1 / Q5_1 / Q4_K / Q5_K: their min too)."""
    size, per = BLOCKS[kind]
    raw = np.frombuffer(rng.bytes(rows * (cols // per) * size), np.uint8).reshape(rows, cols // per, size).copy()
    d = np.float16(1 / (cols**0.5 * VALUE_RMS[kind]))
    at = {"Q6_K": 208, "Q3_K": 108}.get(kind, 0)
    raw[..., at:at + 2] = np.full((rows, cols // per, 1), d, np.float16).view(np.uint8)
    if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # the min: -8 d (Q4_1), or dmin = d (K: a 6-bit min times it)
        m = np.float16(-8 * float(d)) if kind in ("Q4_1", "Q5_1") else d
        raw[..., 2:4] = np.full((rows, cols // per, 1), m, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _writer(path: Path, shape: Shape, file_type: int):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(shape.name)
    for add, value in ((w.add_context_length, 131072), (w.add_embedding_length, shape.hidden),
                       (w.add_block_count, shape.layers), (w.add_feed_forward_length, shape.ffn),
                       (w.add_head_count, shape.heads), (w.add_head_count_kv, shape.kv_heads),
                       (w.add_key_length, shape.head_dim), (w.add_value_length, shape.head_dim),
                       (w.add_rope_dimension_count, shape.head_dim), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_freq_base, ROPE_THETA), (w.add_vocab_size, shape.vocab),
                       (w.add_file_type, file_type)):
        add(value)
    _add_vocab(w, vocab_of(shape.vocab))
    return w


def write_proxy(path: Path, shape: Shape) -> Path:
    """A small float16 file with `shape`'s architecture, layers, heads and vocabulary (hidden 256, ffn 512): what
    llama-quantize is run on to learn its mix."""
    small = Shape(shape.name + "-proxy", 256, shape.layers, 512, shape.heads, shape.kv_heads, shape.vocab, shape.tied)
    rng = np.random.default_rng(0)
    w = _writer(path, small, 1)
    for name, dims in tensor_shapes(small):
        if name == "rope_freqs.weight":
            w.add_tensor(name, llama3_factors(LLAMA31_SCALING, ROPE_THETA, shape.head_dim).astype(np.float32))
        elif len(dims) == 1:
            w.add_tensor(name, np.ones(dims, np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(dims) * 0.02).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v / ffn_down a Q4_K_M or Q5_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def rule_mix(shape: Shape, mix: str) -> dict[str, str]:
    """The mix as read from llama-quantize's source (llama-quant.cpp, llama.cpp of llama-cpp-python 0.3.36) for a
    dense Llama without an importance matrix: to write files before a build exists; `llama_quantize_mix` (the
    binary's own answer) is what the benchmark checks them against."""
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}[mix]
    out = {}
    for name, dims in tensor_shapes(shape):
        if len(dims) < 2:
            continue
        kind = base
        if name == "output.weight" and mix != "Q8_0":
            kind = "Q6_K"
        elif name.startswith("blk.") and mix in ("Q4_K_M", "Q5_K_M") and ("attn_v" in name or "ffn_down" in name):
            kind = "Q6_K" if more_bits(int(name.split(".")[1]), shape.layers) else base
        out[name] = kind
    return out


def file_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> type of a file's matrices."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}


def llama_quantize_mix(quantize: Path, shape: Shape, mix: str, workdir: Path) -> dict[str, str]:
    """GGUF tensor name -> type, as llama-quantize (`quantize`: its binary) quantizes `shape` to `mix` (Q4_K_M,
    Q5_K_M, Q6_K, Q8_0, ...): read off a small proxy file of the same architecture that it quantizes here."""
    proxy = workdir / f"{shape.name}-proxy-f16.gguf"
    if not proxy.is_file():
        write_proxy(proxy, shape)
    out = workdir / f"{shape.name}-proxy-{mix}.gguf"
    if not out.is_file():
        subprocess.run([str(quantize), str(proxy), str(out), mix, "2"], check=True, capture_output=True)
    return {name: kind for name, kind in file_types(out).items()}


def write_synthetic(path: Path, shape: Shape, types: dict[str, str], file_type: int, seed: int = 0,
                    progress=print) -> Path:
    """The file of `shape` with each tensor in `types[name]` (1-d ones float32), random valid blocks, written
    tensor by tensor; its HF config beside it (config.json, read from the file)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = _writer(path, shape, file_type)
    listed = tensor_shapes(shape)
    for name, dims in listed:  # the header first: names, shapes, types, sizes
        kind = types[name] if len(dims) == 2 else "F32"
        if kind == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            size, per = BLOCKS[kind]
            rows, cols = dims[0], dims[-1]
            w.add_tensor_info(name, (rows, cols // per * size), np.dtype(np.uint8), rows * (cols // per) * size,
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, dims) in enumerate(listed):
        if name == "rope_freqs.weight":
            data = llama3_factors(LLAMA31_SCALING, ROPE_THETA, shape.head_dim).astype(np.float32)
        elif len(dims) == 1:
            data = np.ones(dims, np.float32)
        else:
            data = random_blocks(rng, types[name], *dims)
        w.write_tensor_data(data)
        if i % 36 == 0:
            progress(f"  writing {path.name}: tensor {i + 1} of {len(listed)}")
    w.close()
    (path.parent / "config.json").write_text(json.dumps(gguf_config(path)))
    (path.parent / "types.json").write_text(json.dumps({n: types[n] for n, d in listed if len(d) == 2}))
    return path
