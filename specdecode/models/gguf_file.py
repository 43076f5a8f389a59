"""Reading GGUF files (llama.cpp's format): their config as an HF config dict, their tensors under HF names.

Architectures: llama (Llama 1-3.x, Mistral, SmolLM2), qwen2, qwen3, phi3 (the Llama block) and gemma3. Tensors keep
the file's layout but for the fixes that make them the HF checkpoint's: llama.cpp permutes llama's q/k rows
(interleaved RoPE pairs), stores Gemma's norm weights as 1 + w (HF: w, scaled by 1 + w at run time), so `dense`
subtracts the 1 again, as transformers' GGUF reader does, and keeps Phi-3's q|k|v and gate|up fused (read as row
ranges of the one tensor). Llama 3.1+'s RoPE scaling is a tensor, `rope_freqs.weight` (each frequency divided by its
factor): `config` reads it back into the HF "llama3" rope_scaling it was made from.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .layouts import fused_splits

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3_text"}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# the chat template of Google's Gemma 3 tokenizers (text only), for Gemma 3 GGUF files that carry none
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BLOCK_NAMES = {  # GGUF block tensor -> HF name within model.layers.{i}.
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GEMMA3_BLOCK_NAMES = {  # Gemma's HF names: post_attention_layernorm is the norm on the attention's output
    **BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
QWEN3_BLOCK_NAMES = {**BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
PHI3_BLOCK_NAMES = {**BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
ARCH_BLOCK_NAMES = {"gemma3": GEMMA3_BLOCK_NAMES, "qwen3": QWEN3_BLOCK_NAMES, "phi3": PHI3_BLOCK_NAMES}
ROPE_FREQS = "rope_freqs.weight"
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def reader(path: Path):
    """(reader, architecture) of a GGUF file this runtime can run."""
    import gguf

    from .gguf_header import Header, NotFast

    try:  # the header alone, quickly (see gguf_header); else the package's reader
        r: Any = Header(path)
    except NotFast:
        r = gguf.GGUFReader(str(path))
    arch = field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    return r, arch


def field(r, key: str, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def tensors(path: Path):
    """(HF name, gguf tensor, row order or None, norm shift) for every tensor of the file. The row order undoes
    llama.cpp's q/k row permutation, or picks one part of a fused tensor; the shift is what `dense` subtracts (Gemma's
    norms: 1). rope_freqs is config, not a weight (`config` reads it)."""
    r, arch = reader(path)
    n_heads = field(r, f"{arch}.attention.head_count")
    n_kv = field(r, f"{arch}.attention.head_count_kv", n_heads)
    names = ARCH_BLOCK_NAMES.get(arch, BLOCK_NAMES)
    splits = fused_splits(ModelConfig.from_hf(_shape(r, arch))) if arch == "phi3" else {}
    # the metadata read (the config reads it apart): a 128k-token vocabulary's fields are ~250 MB of small arrays,
    # freed now rather than held through the whole load
    r.fields.clear()
    for t in r.tensors:
        name, rows = t.name, None
        if name == ROPE_FREQS:
            continue
        if name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in names:
                raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported (not a {arch} block tensor)")
            if arch == "llama" and kind in ("attn_q", "attn_k"):  # llama.cpp permutes only llama's q/k
                rows = _unpermute(torch.arange(int(t.shape[-1])), n_heads if kind == "attn_q" else n_kv)
            hf = names[kind]
            if hf in splits:  # Phi-3's fused tensor: each part a range of its rows
                first = 0
                for part, size in splits[hf]:
                    yield f"model.layers.{layer}.{part}.{suffix}", t, torch.arange(first, first + size), 0.0
                    first += size
                continue
            name = f"model.layers.{layer}.{hf}.{suffix}"
        elif name in TOP_NAMES:
            name = TOP_NAMES[name]
        else:
            raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported (not a {arch} tensor); use the HF "
                             "checkpoint instead")
        shift = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        yield name, t, rows, shift


def release(t) -> None:
    """Drop a GGUF tensor's (or an array of its bytes') pages from this process's memory map of the file (madvise
    DONTNEED; the page cache keeps them, a later read maps them back): a load converts the tensors one by one into
    the kernels' layout, and without this every page it has read stays counted in the process's resident memory
    until the reader is gone, the file's size on top of the converted weights at the end of a load. Nothing where
    the data is not a memory map (or the platform has no madvise)."""
    data = t if isinstance(t, np.ndarray) else t.data
    mapped = getattr(data, "_mmap", None)  # numpy memmaps and their views hold the file's mmap
    if not isinstance(mapped, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or not data.nbytes:
        return
    start = data.__array_interface__["data"][0] - np.frombuffer(mapped, np.uint8).__array_interface__["data"][0]
    page = mmap.PAGESIZE
    first, end = start // page * page, start + data.nbytes  # whole pages: a neighbour's only maps back in
    with contextlib.suppress(OSError, ValueError):
        mapped.madvise(mmap.MADV_DONTNEED, first, end - first)


def dense(t, rows: torch.Tensor | None = None, shift: float = 0.0) -> torch.Tensor:
    """A GGUF tensor dequantized to float32, in HF's layout (see `tensors`)."""
    import gguf

    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    w = (w if rows is None else w[rows]).contiguous()
    return w - shift if shift else w


def read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """GGUF -> (HF config dict, HF-named float32 state dict)."""
    return config(path), {name: dense(t, rows, shift) for name, t, rows, shift in tensors(path)}


def config(path: Path) -> dict:
    """The HF config of a GGUF file, from its metadata (and Llama 3's RoPE factors, from rope_freqs)."""
    r, arch = reader(path)
    try:
        return _shape(r, arch)
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from e


def _shape(r, arch: str) -> dict:
    """The HF config dict of an open GGUF file (`config`)."""

    def get(key: str, default=None):
        return field(r, f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or hidden // n_heads
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"RoPE on {rope_dims} of each head's {head_dim} dimensions (partial rotary) is not supported")
    names = {t.name for t in r.tensors}
    cfg = {
        "architectures": [HF_CLASSES[arch]],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": get("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 4096),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "gemma3":  # what llama.cpp fixes for Gemma 3: every 6th layer global, local RoPE base 10k
        cfg.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   sliding_window=get("attention.sliding_window"), sliding_window_pattern=6,
                   rope_local_base_freq=10000.0,  # llama.cpp: the 27B (62 layers) scales queries by hidden / heads
                   query_pre_attn_scalar=hidden // n_heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"],
                   pad_token_id=field(r, "tokenizer.ggml.padding_token_id"))
    if arch == "phi3":  # the window on every layer, as transformers runs Phi-3 (0: none, Phi-4); llama.cpp has
        # disabled Phi-3's window (its PR 13676): past the window its logits are not the model's, nor ours
        cfg["sliding_window"] = get("attention.sliding_window") or None
        if {"rope_factors_long.weight", "rope_factors_short.weight"} & names:
            raise ValueError("Phi-3's long-context RoPE (rope_factors_long / rope_factors_short, longrope) is not "
                             "supported")
    if arch == "qwen3":  # no q/k/v biases: say so, as transformers' default for Qwen3 does
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 1.0):
        if kind != "linear":
            raise ValueError(f"RoPE scaling {kind!r} (rope.scaling.type) is not supported (linear, llama3)")
        cfg["rope_scaling"] = {"rope_type": kind, "factor": float(factor)}
    if ROPE_FREQS in names:
        if arch != "llama":
            raise ValueError(f"{ROPE_FREQS} in a {arch} file is not supported (Llama 3's RoPE scaling only)")
        t = next(t for t in r.tensors if t.name == ROPE_FREQS)
        import gguf

        factors = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        original = get("rope.scaling.original_context_length")
        cfg["rope_scaling"] = llama3_scaling(factors, cfg["rope_theta"], head_dim, original)
    return cfg


def llama3_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter writes them to rope_freqs
    (from float32 frequencies): inv_freq / factor is the scaled frequency."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, original: int | None = None) -> dict:
    """The "llama3" rope_scaling that gives these rope_freqs factors: the factor is the largest one; the function
    depends on the two wavelength thresholds only (original / low and original / high), so the original context
    (the file's, else Llama 3's 8192) fixes low and high. Llama 3's own low 1, high 4 are tried first; otherwise
    they are solved from the blended frequencies (two or more needed). Whatever is found is checked to rebuild the
    file's factors, else the file is refused: scaling it cannot describe is never run approximately."""
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"{ROPE_FREQS} holds {factors.size} factors, expected head_dim / 2 = {head_dim // 2}")
    factor = float(factors.max())
    old = float(original or 8192)
    candidates = [{"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": int(old)}]
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))).astype(np.float64)
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1 and blended.sum() >= 2:  # 1 / f_i = (1 - s_i) / factor + s_i, s_i = a / wavelen_i - b
        smooth = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
        x = inv_freq[blended] / (2 * math.pi)  # 1 / wavelength
        a, b = np.polyfit(x, smooth, 1)  # s = a x + b': a = old / (high - low), b' = -low / (high - low)
        low = -b * old / a
        high = low + old / a
        candidates.append({"factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high),
                           "original_max_position_embeddings": int(old)})
    for scaling in candidates:
        if np.allclose(llama3_factors(scaling, theta, head_dim), factors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", **scaling}
    raise ValueError(f"{ROPE_FREQS} is not a Llama 3 RoPE scaling this runtime can read back "
                     f"(factors {np.round(factors, 4).tolist()}); not supported")


def trim_added_tokens(tokenizer_dir: Path, vocab_size: int) -> list[str]:
    """Drop the tokens transformers' GGUF conversion adds past the file's vocabulary (its byte-level tokenizer's
    default `<|endoftext|>`, which Llama 3's vocabulary lacks): a text spelling one would encode to an id the model has
    no embedding for. Rewrites the saved tokenizer.json (and tokenizer_config.json); returns the tokens dropped."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    dropped = [t["content"] for t in data.get("added_tokens", []) if t["id"] >= vocab_size]
    if not dropped:
        return []
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config_path = tokenizer_dir / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        decoder = config.get("added_tokens_decoder") or {}
        config["added_tokens_decoder"] = {k: v for k, v in decoder.items() if int(k) < vocab_size} or decoder
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if config.get(key) in dropped:
                config[key] = None
        config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    return dropped
