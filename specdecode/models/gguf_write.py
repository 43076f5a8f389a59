"""Writing GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them, from an HF config and state dict:
the tensor names, metadata keys and layouts of each architecture, at a chosen storage type per tensor.

For tests and benchmarks that need files of every architecture x type without downloading any: the layouts are the
converter's (llama's q/k rows permuted to interleaved RoPE pairs, Gemma's norms stored as 1 + w, Llama 3's RoPE scaling
as the `rope_freqs` factor tensor, Phi-3's q|k|v and gate|up kept fused), the vocabulary a small byte-level BPE with
the special tokens and chat template of Llama 3 (or one given). One-dimensional tensors (norms, biases) stay float32,
as llama.cpp keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .gguf_file import ARCH_BLOCK_NAMES, BLOCK_NAMES, ROPE_FREQS, TOP_NAMES, llama3_factors

# HF model_type -> GGUF architecture (llama.cpp converts Mistral as llama: its window is not kept)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma3_text": "gemma3"}
FLOAT_TYPES = ("F32", "F16", "BF16")

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# text whose byte pairs the made-up vocabulary merges first (so ordinary words take few tokens)
MERGE_TEXT = ("the quick brown fox jumps over the lazy dog. speculative decoding drafts tokens that the target "
              "model verifies in one forward pass; the output equals plain decoding token for token.")


@dataclass
class Vocab:
    """A GGUF tokenizer: llama.cpp's `tokenizer.ggml.*` fields."""

    tokens: list[str]
    token_types: list[int]  # 1 normal, 3 control (special), as llama.cpp numbers them
    merges: list[str] = field(default_factory=list)
    model: str = "gpt2"  # byte-level BPE
    pre: str = "llama-bpe"  # the pre-tokenizer's split (Llama 3's)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None
    add_bos_token: bool = True


def byte_level_vocab(size: int, specials: tuple[str, ...] = LLAMA3_SPECIALS, pre: str = "llama-bpe",
                     chat_template: str | None = LLAMA3_CHAT_TEMPLATE, add_bos_token: bool = True) -> Vocab:
    """A byte-level BPE of `size` tokens in GPT-2's spelling: the 256 bytes, merges (MERGE_TEXT's most frequent pairs
    first, then pairs of letters), and `specials` last (control tokens; the first is BOS, the last EOS). Llama 3's
    by default; Qwen's: QWEN_SPECIALS, pre "qwen2", CHATML_TEMPLATE, no BOS added."""
    byte_tokens = list(_bytes_to_unicode().values())
    n_merges = size - len(byte_tokens) - len(specials)
    if n_merges < 0:
        raise ValueError(f"a byte-level vocabulary needs {len(byte_tokens) + len(specials)} tokens or more, got {size}")
    tokens, merges = list(byte_tokens), list[str]()
    known = set(tokens)
    spell = _bytes_to_unicode()
    words = [[spell[b] for b in (" " + w if i else w).encode()] for i, w in enumerate(MERGE_TEXT.split(" "))]
    while len(merges) < n_merges:
        counts: dict[tuple[str, str], int] = {}
        for word in words:
            for pair in zip(word, word[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(best[0] + best[1])
        known.add(best[0] + best[1])
        words = [_merge(word, best) for word in words]
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = ((a, b) for a in letters for b in letters)
    while len(merges) < n_merges:
        a, b = next(pairs)
        if a + b not in known:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            known.add(a + b)
    first_special = len(tokens)
    tokens += list(specials)
    types = [1] * first_special + [3] * len(specials)
    return Vocab(tokens, types, merges, pre=pre, bos_token_id=first_special if specials else None,
                 eos_token_id=len(tokens) - 1 if specials else None, chat_template=chat_template,
                 add_bos_token=add_bos_token)


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (byte-level BPE vocabularies are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes), strict=True))


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture: each head's rotate-half halves interleaved in pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Types = str | Callable[[str], str]


def tensor_type(gguf_name: str, shape: tuple[int, ...], types: Types) -> str:
    """The storage type of a tensor: one-dimensional ones float32, the rest `types` (one name, or a function of the
    GGUF tensor name)."""
    if len(shape) < 2:
        return "F32"
    return types if isinstance(types, str) else types(gguf_name)


def stored(data: np.ndarray, kind: str):
    """(array to write, raw type or None) of float32 `data` stored as `kind`: F32, F16, BF16, a type the gguf
    package quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or a K-quant models/kquantize.py writes (Q4_K, Q5_K, Q6_K)."""
    import gguf

    if kind == "F32":
        return data.astype(np.float32), None
    if kind == "F16":
        return data.astype(np.float16), None
    from .kquantize import K_TYPES, quantize_k

    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        raise ValueError(f"{kind} stores rows in blocks of {block}; a row of {data.shape[-1]} does not divide")
    data = np.ascontiguousarray(data, dtype=np.float32)
    if kind in K_TYPES:  # the gguf package writes the 32-blocks only
        return quantize_k(data.reshape(-1, data.shape[-1]), kind).reshape(*data.shape[:-1], -1), qtype
    return gguf.quants.quantize(data, qtype), qtype


def round_trip(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` as a file stores it in `kind`, read back by the gguf package (the reference a quantized file's logits are
    compared with)."""
    import gguf

    data, qtype = stored(w.detach().float().numpy(), kind)
    if qtype is None:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())


def gguf_tensors(config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """An HF state dict as the converter's GGUF tensors (float32, the file's layout), rope_freqs included."""
    cfg = ModelConfig.from_hf(dict(config))
    arch = GGUF_ARCHITECTURES[cfg.model_type]
    block_names = {hf: g for g, hf in ARCH_BLOCK_NAMES.get(arch, BLOCK_NAMES).items()}
    top_names = {hf.removeprefix("model."): g for g, hf in TOP_NAMES.items()}
    out: dict[str, np.ndarray] = {}
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "llama3":
        if arch != "llama":
            raise ValueError(f"Llama 3 RoPE scaling in a {cfg.model_type} model has no GGUF layout here")
        out[ROPE_FREQS] = llama3_factors(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim)
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        data = tensor.detach().to(torch.float32).numpy()
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            module, _, suffix = rest.rpartition(".")
            if module not in block_names:
                raise ValueError(f"{name}: no {arch} GGUF tensor holds it")
            gguf_name = f"blk.{layer}.{block_names[module]}.{suffix}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                data = permute_rows(data, cfg.num_heads if module == "self_attn.q_proj" else cfg.num_kv_heads)
        elif name in top_names:
            gguf_name = top_names[name]
            if gguf_name == "output.weight" and cfg.tie_word_embeddings:
                continue  # tied: the file has none, the embedding serves
        else:
            raise ValueError(f"{name}: no {arch} GGUF tensor holds it")
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's norm scale 1 + w
        out[gguf_name] = data
    return out


def write_gguf(path: str | Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor], types: Types = "F32",
               vocab: Vocab | None = None, name: str = "synthetic", with_tokenizer: bool = True) -> Path:
    """Write `state` (an HF checkpoint's tensors, `config` its config dict) as a GGUF file of the converter's layout,
    matrices stored as `types` (see `tensor_type`); vocab: the tokenizer (default `byte_level_vocab` of the config's
    vocabulary size); without `with_tokenizer`, none (a file of weights for a reader that needs no tokenizer, e.g.
    transformers' weight loading). Returns the path."""
    import gguf

    cfg = ModelConfig.from_hf(dict(config))
    arch = GGUF_ARCHITECTURES[cfg.model_type]
    if with_tokenizer:
        vocab = vocab or byte_level_vocab(cfg.vocab_size)
        if len(vocab.tokens) != cfg.vocab_size:
            raise ValueError(f"the vocabulary has {len(vocab.tokens)} tokens, the model {cfg.vocab_size}")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    if arch in ("gemma3", "phi3"):  # the window llama.cpp applies (Phi-3: 0 for none)
        w.add_sliding_window(cfg.sliding_window or 0)
    if vocab is not None:
        _add_vocab(w, vocab)
    for gguf_name, data in gguf_tensors(config, state).items():
        array, raw = stored(data, tensor_type(gguf_name, data.shape, types))
        if raw is None:
            w.add_tensor(gguf_name, array)
        else:
            w.add_tensor(gguf_name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_vocab(w, vocab: Vocab) -> None:
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.bos_token_id is not None:
        w.add_bos_token_id(vocab.bos_token_id)
    if vocab.eos_token_id is not None:
        w.add_eos_token_id(vocab.eos_token_id)
    w.add_add_bos_token(vocab.add_bos_token)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)
