"""Draft heads in the layouts people publish, run as those layouts' own code computes them.

EAGLE-3 (SafeAILab/EAGLE eagle/model/cnets.py `Model`; SpecForge's LlamaForCausalLMEagle3): `fc` fuses the target's
hidden states at three layers into f; one decoder layer `midlayer` attends over cat(input_layernorm(embedding),
hidden_norm(f)) (q/k/v take 2 * hidden inputs) with f itself as the residual, then a Llama MLP; `norm` and a
draft-vocabulary `lm_head` give the logits, and the layer's output is the next depth's f (no fc again). `d2t` holds
offsets (target id = draft id + d2t[draft id]), `t2d` which target tokens the draft vocabulary has. SpecForge's
options: `fc_norm` (an RMSNorm per fused hidden state before fc) and `norm_output` (false: no norm before lm_head).

EAGLE-1/2 (cnets1.py `Model`): fc over cat(embedding, feature) (2h -> h, with a bias unless config says
"bias": false), then Llama decoder layers of which the first has no input norm; the feature is the target's last
hidden state after its final norm, and the logits come from the target's own lm_head, without a norm.

Medusa (FasterDecoding/Medusa medusa_model.py): head i is `medusa_num_layers` ResBlocks (x + silu(W x + b), keys
`{i}.{j}.linear.*`) then a linear layer to the whole vocabulary (`{i}.{layers}.weight`), over the target's last
hidden state after its final norm.

Which target layers an EAGLE-3 head reads: EAGLE, vLLM and SGLang capture the residual stream *entering* layers
2, n // 2 and n - 3 by default (outputs of layers 1, n // 2 - 1, n - 4, as specdecode counts them: a layer's output);
SpecForge's `eagle_config.eagle_aux_hidden_state_layer_ids` name layer outputs (SGLang adds one to capture them), a
top-level `eagle_aux_hidden_state_layer_ids` (vLLM's speculators configs) names layers entered. Every engine
captures them in layer order, once each, and so does this reader.

Our first EAGLE head (eagle.EagleHead) cannot be written in the EAGLE-3 layout (see docs/GUIDE.md, "Use a published
head"): its residual stream starts at a linear map of both normed inputs and its attention reads that stream
through a norm, where EAGLE-3's residual is the fused feature itself and its q/k/v read the two normed inputs
directly; no choice of EAGLE-3 weights computes the same function. Heads trained with `--arch eagle3`
(eagle3.Eagle3Head, EAGLE-3's own architecture) are written and read back exactly. Medusa heads can
(`save_medusa`), when their draft vocabulary is the whole vocabulary (a published head's linear layer has no way
to rule a token out).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .cache import KVCache
from .config import ModelConfig
from .eagle import EagleConfig, EagleHead
from .eagle3 import Eagle3Head, Fuse, wide_attention  # noqa: F401 - where callers found them before they moved
from .head_files import load_head
from .linear import Linear
from .llama import MLP, Attention, Transformer
from .medusa import MedusaConfig, MedusaHeads
from .published_io import (
    EAGLE1,
    EAGLE3,
    LAYOUT_NAMES,
    MEDUSA,
    OURS_EAGLE,
    OURS_MEDUSA,
    detect_layout,
    read_config,
    read_weights,
)

IGNORED = ("rotary_emb.",)  # buffers some checkpoints carry that the runtime computes itself


class Mismatch(ValueError):
    """A head that does not fit its target: every problem found, said at once, before any forward."""


def refuse(path: Path, layout: str, target: Transformer, problems: list[str], advice: str) -> None:
    if problems:
        t = target.config
        raise Mismatch(f"{path} holds {LAYOUT_NAMES[layout]} that does not fit this target (hidden size "
                       f"{t.hidden_size}, vocabulary {t.vocab_size}, {t.num_layers} layers): " + "; ".join(problems)
                       + f". {advice}")


def head_block(config: dict[str, Any], target: Transformer, layers: int) -> ModelConfig:
    """The head's decoder-layer shape from its config.json (a Llama config), with the target's vocabulary."""
    hf = {"model_type": "llama", "num_hidden_layers": layers, "vocab_size": target.config.vocab_size, **config}
    hf["model_type"] = "llama"  # the head's layer is a Llama layer whatever the target's family
    hf["num_hidden_layers"] = layers
    try:
        block = ModelConfig.from_hf(hf)
    except KeyError as err:
        raise ValueError(f"the head's config.json lacks {err.args[0]!r}, which its decoder layer needs") from None
    return dataclasses.replace(block, vocab_size=target.config.vocab_size, num_layers=layers, sliding_window=None,
                               tie_word_embeddings=False)


def check_embedding(state: dict[str, torch.Tensor], target: Transformer, problems: list[str]) -> None:
    """A head that ships an embedding was made with its target's, frozen (EAGLE and SpecForge copy it from the
    target): the target's is used, and one that differs beyond a bfloat16 copy's rounding says the head was made
    for another model (or another vocabulary order)."""
    own = state.get("embed_tokens.weight")
    if own is None:
        return
    t = target.config
    if tuple(own.shape) != (t.vocab_size, t.hidden_size):
        problems.append(f"its embedding is {list(own.shape)}, the target's [{t.vocab_size}, {t.hidden_size}]")
        return
    rows = torch.linspace(0, t.vocab_size - 1, min(t.vocab_size, 512)).long()
    with torch.no_grad():
        theirs = target.embed(rows.to(target.device)).double().cpu()
    ours = own[rows].double()
    if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * float(theirs.abs().max())):
        problems.append("its embedding differs from the target's (it was trained beside another model)")


# ---------------------------------------------------------------------------------------------- EAGLE-3


def eagle3_layers(config: dict[str, Any], target: Transformer) -> tuple[list[int], str]:
    """(target layers as specdecode counts them: layer outputs, how the config named them) -- module docstring."""
    n = target.config.num_layers
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is not None:
        return sorted(set(nested)), f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (layer outputs)"
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:
        return sorted({i - 1 for i in top}), f"eagle_aux_hidden_state_layer_ids {list(top)} (layers entered)"
    entered = sorted({2, n // 2, n - 3})
    return [i - 1 for i in entered], f"the default: the layers entered {entered} of {n}"


def load_eagle3(path: Path, target: Transformer) -> Eagle3Head:
    config, state = read_config(path), read_weights(path)
    t = target.config
    problems: list[str] = []
    hidden = config.get("hidden_size")
    if hidden != t.hidden_size:
        problems.append(f"hidden size {hidden}, the target's {t.hidden_size}")
    target_hidden = config.get("target_hidden_size") or hidden
    if target_hidden != hidden and hidden == t.hidden_size:
        problems.append(f"it reads target states of {target_hidden} values into its {hidden} (target_hidden_size): "
                        "specdecode runs heads as wide as their target")
    vocab = config.get("vocab_size", t.vocab_size)
    if vocab != t.vocab_size:
        problems.append(f"vocabulary {vocab}, the target's {t.vocab_size}")
    layers, named = eagle3_layers(config, target)
    bad = [i for i in layers if not 0 <= i < t.num_layers]
    if bad:
        embedding = ": layer id 0 is the embedding, which specdecode does not hand to heads" if -1 in bad else ""
        problems.append(f"it reads target layers {layers} ({named}), the target's layer outputs are "
                        f"0..{t.num_layers - 1}{embedding}")
    fc = state.get("fc.weight")
    if fc is None:
        problems.append("it has no fc.weight")
    elif hidden and fc.shape[1] != len(layers) * hidden:
        problems.append(f"its fc reads {fc.shape[1]} values, {len(layers)} layers ({layers}, {named}) of {hidden} "
                        f"make {len(layers) * hidden}: set the layers it was trained on in config.json "
                        "(eagle_config.eagle_aux_hidden_state_layer_ids)")
    draft_vocab = config.get("draft_vocab_size", vocab)
    check_embedding(state, target, problems)
    refuse(path, EAGLE3, target, problems, "Use an EAGLE-3 head published for this target model")
    block = head_block(config, target, 1)
    head = Eagle3Head(EagleConfig(layers, draft_vocab, block), config, fc_norm=bool(config.get("fc_norm", False)),
                      norm_output=bool(config.get("norm_output", True)))
    ours = split_published(state, head)
    d2t = state.get("d2t")
    ids = torch.arange(draft_vocab) if d2t is None else torch.arange(len(d2t)) + d2t.long()
    if d2t is None and draft_vocab != t.vocab_size:
        problems.append(f"draft vocabulary {draft_vocab} without the d2t map to the target's")
    elif len(ids) != draft_vocab:
        problems.append(f"d2t maps {len(ids)} draft tokens, draft_vocab_size is {draft_vocab}")
    elif len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= t.vocab_size):
        problems.append(f"d2t maps draft tokens to target ids {int(ids.min())}..{int(ids.max())}, outside the "
                        f"target's vocabulary 0..{t.vocab_size - 1}")
    elif len(set(ids.tolist())) != len(ids):
        problems.append("d2t maps two draft tokens to one target token")
    t2d = state.get("t2d")
    if t2d is not None and not problems and (len(t2d) != t.vocab_size or int(t2d.sum()) != len(ids)
                                             or not bool(t2d.bool()[ids].all())):
        problems.append("t2d (the target tokens the draft vocabulary has) disagrees with d2t")
    problems += shape_problems(ours, head)
    refuse(path, EAGLE3, target, problems, "Use an EAGLE-3 head published for this target model")
    head.load_state_dict({**ours, "d2t": ids}, strict=True)
    head.published = True
    return head


def split_published(state: dict[str, torch.Tensor], head: Eagle3Head) -> dict[str, torch.Tensor]:
    """EAGLE-3's names -> Eagle3Head's (q/k/v and gate/up fused as the runtime runs them)."""
    p = "midlayer."
    names = {"fc.weight": "fuse.fc.weight", p + "input_layernorm.weight": "embed_norm.weight",
             p + "hidden_norm.weight": "feature_norm.weight", p + "self_attn.o_proj.weight": "attn.wo.weight",
             p + "post_attention_layernorm.weight": "mlp_norm.weight", p + "mlp.down_proj.weight": "mlp.w2.weight",
             "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    names.update({f"fc_norm.{i}.weight": f"fuse.norms.{i}.weight" for i in range(3)})
    fused = {"attn.wqkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
             "attn.wqkv.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
             "mlp.w13.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]}
    return rename(state, names, fused, {"d2t", "t2d", "embed_tokens.weight"}, head)


def rename(state: dict[str, torch.Tensor], names: dict[str, str], fused: dict[str, list[str]], extra: set[str],
           head: nn.Module) -> dict[str, torch.Tensor]:
    """`state` under the module's names; a key neither mapped nor known is refused (another architecture)."""
    out = {names[k]: v.float() for k, v in state.items() if k in names}
    for name, parts in fused.items():
        if all(p in state for p in parts):
            out[name] = torch.cat([state[p].float() for p in parts], dim=0)
    known = set(names) | {p for parts in fused.values() for p in parts} | extra
    unknown = sorted(k for k in state if k not in known and not any(k.startswith(i) or f".{i}" in k for i in IGNORED))
    if unknown:
        raise ValueError(f"the head's weights hold {', '.join(unknown[:6])}, which its layout does not have: "
                         "it is another architecture, which specdecode cannot run exactly")
    return out


def shape_problems(state: dict[str, torch.Tensor], head: nn.Module) -> list[str]:
    expected = {k: v.shape for k, v in head.state_dict().items() if k != "d2t"}
    problems = [f"it lacks {k}" for k in expected if k not in state]
    problems += [f"{k} is {list(state[k].shape)}, its config makes it {list(shape)}"
                 for k, shape in expected.items() if k in state and state[k].shape != shape]
    return problems


def save_eagle3(head: EagleHead, out_dir: Path | str, dtype: torch.dtype | None = None) -> Path:
    """Write a head in the EAGLE-3 layout (model.safetensors + config.json), as EAGLE, SpecForge, vLLM and SGLang
    read it. Only heads that are EAGLE-3 heads can be (see the module docstring for why ours cannot)."""
    if not isinstance(head, Eagle3Head):
        raise ValueError(
            "specdecode's first EAGLE head (train with --arch eagle3 for one that can) cannot be written in the "
            "EAGLE-3 layout: its residual stream starts at a "
            "linear map of the normed embedding and feature, and its attention reads that stream through a norm, "
            "where EAGLE-3's residual is the fused feature and its q/k/v read the normed inputs directly, so no "
            "EAGLE-3 weights compute what it computes (docs/GUIDE.md, 'Use a published head')")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in head.state_published().items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head.source, indent=1))
    return out


# -------------------------------------------------------------------------------------------- EAGLE-1/2


class Eagle1Layer(nn.Module):
    """A Llama decoder layer; EAGLE-1/2's first has no input norm (the fc's output goes to attention as it is)."""

    def __init__(self, block: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(block.hidden_size, eps=block.rms_norm_eps) if index else None
        self.attn = Attention(block)
        self.mlp_norm = nn.RMSNorm(block.hidden_size, eps=block.rms_norm_eps)
        self.mlp = MLP(block)

    def forward(self, x, cos, sin, cache, layer, start, mask) -> torch.Tensor:
        x = x + self.attn(x if self.attn_norm is None else self.attn_norm(x), cos, sin, cache, layer, start, mask)
        return x + self.mlp(self.mlp_norm(x))


class Eagle1Head(EagleHead):
    """A published EAGLE-1/2 head (module docstring): its feature is the target's normed last hidden state (`fuse`
    here: a copy of the target's final norm), its logits the target's own output layer over its whole vocabulary
    (held outside the module tree: never saved, moved or quantized with the head)."""

    def __init__(self, cfg: EagleConfig, target: Transformer, fc_bias: bool) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        b = cfg.block
        self.fuse = nn.RMSNorm(b.hidden_size, eps=target.norm.eps)
        self.input = Linear(2 * b.hidden_size, b.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(Eagle1Layer(b, i) for i in range(b.num_layers))
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)
        self._output = (target.lm_head,)
        self._rope = None

    @property
    def device(self) -> torch.device:
        return self.fuse.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    def new_cache(self, max_len: int) -> KVCache:
        b = self.config.block
        return KVCache(b.num_layers, b.num_kv_heads, b.head_dim, max_len, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, features, token_embeds, cache: KVCache, positions, mask=None, logits_at=slice(None)):
        start, n = cache.length, features.shape[1]
        cos, sin, mask = self.step_inputs(start, n, positions, mask)
        x = self.input(torch.cat((token_embeds.to(self.dtype), features.to(self.dtype)), dim=-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start, mask)
        cache.length = start + n
        return self._output[0](x[:, logits_at]), x

    def check_target(self, target: Transformer) -> None:
        super().check_target(target)
        if target.lm_head is not self._output[0]:
            raise ValueError("this EAGLE-1/2 head drafts through the output layer of the target it was loaded "
                             "beside: load it for this target (draft=its folder)")

    def float_copy(self) -> EagleHead:
        raise ValueError("online learning (online_draft) trains heads in specdecode's own layout; a published "
                         "EAGLE-1/2 head drafts as published: drop online_draft")

    def save(self, out_dir: Path | str, dtype: torch.dtype | None = None, int8: bool = False) -> None:
        raise ValueError("an EAGLE-1/2 head is read as published; it is not written back")


def load_eagle1(path: Path, target: Transformer) -> Eagle1Head:
    config, state = read_config(path), read_weights(path)
    t = target.config
    problems: list[str] = []
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size", t.vocab_size)
    if hidden != t.hidden_size:
        problems.append(f"hidden size {hidden}, the target's {t.hidden_size}")
    if vocab != t.vocab_size:
        problems.append(f"vocabulary {vocab}, the target's {t.vocab_size}")
    check_embedding(state, target, problems)
    refuse(path, EAGLE1, target, problems, "Use an EAGLE head published for this target model")
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    if config.get("num_hidden_layers", layers) != layers:
        problems.append(f"config.json says {config['num_hidden_layers']} layers, its weights hold {layers}")
    block = head_block(config, target, layers)
    block = dataclasses.replace(block, attention_bias="layers.0.self_attn.q_proj.bias" in state)
    head = Eagle1Head(EagleConfig([t.num_layers - 1], t.vocab_size, block), target, "fc.bias" in state)
    names = {"fc.weight": "input.weight", "fc.bias": "input.bias"}
    fused: dict[str, list[str]] = {}
    for i in range(layers):
        p = f"layers.{i}."
        names.update({p + "input_layernorm.weight": p + "attn_norm.weight", p + "self_attn.o_proj.weight":
                      p + "attn.wo.weight", p + "post_attention_layernorm.weight": p + "mlp_norm.weight",
                      p + "mlp.down_proj.weight": p + "mlp.w2.weight"})
        fused[p + "attn.wqkv.weight"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        fused[p + "attn.wqkv.bias"] = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        fused[p + "mlp.w13.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    ours = rename(state, names, fused, {"embed_tokens.weight"}, head)
    with torch.no_grad():
        ours["fuse.weight"] = target.norm.weight.detach().float().cpu()
    problems += shape_problems(ours, head)
    refuse(path, EAGLE1, target, problems, "Use an EAGLE head published for this target model")
    head.load_state_dict({**ours, "d2t": torch.arange(t.vocab_size)}, strict=True)
    return head


# ----------------------------------------------------------------------------------------------- Medusa


class DeepMedusa(MedusaHeads):
    """Medusa heads of several ResBlocks each (medusa_num_layers > 1): res_weight [K, layers, H, H]."""

    def __init__(self, cfg: MedusaConfig, layers: int) -> None:
        super().__init__(cfg)
        k, h = cfg.heads, cfg.hidden_size
        self.res_weight = nn.Parameter(torch.zeros(k, layers, h, h))
        self.res_bias = nn.Parameter(torch.zeros(k, layers, h))

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        k = heads or self.config.heads
        x = self.norm(hidden).unsqueeze(-2).expand(*hidden.shape[:-1], k, hidden.shape[-1])
        for j in range(self.res_weight.shape[1]):
            x = x + F.silu(torch.einsum("...kh,kgh->...kg", x, self.res_weight[:k, j]) + self.res_bias[:k, j])
        return torch.einsum("...kh,kvh->...kv", x, self.out_weight[:k])


def load_medusa(path: Path, target: Transformer) -> MedusaHeads:
    config, state = read_config(path), read_weights(path)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    t = target.config
    heads = sorted({int(k.split(".")[0]) for k in state if k.split(".")[0].isdigit()})
    if not heads or heads != list(range(len(heads))):
        raise ValueError(f"{path}: Medusa weights name heads {heads}, expected 0..K-1 ({{i}}.{{j}}.linear.weight)")
    layers = len({k.split(".")[1] for k in state if k.startswith("0.") and k.endswith(".linear.weight")})
    problems: list[str] = []
    if config.get("medusa_num_layers", layers) != layers:
        problems.append(f"config.json says medusa_num_layers {config['medusa_num_layers']}, its weights hold {layers}")
    hidden = state["0.0.linear.weight"].shape[1] if "0.0.linear.weight" in state else None
    out = state.get(f"0.{layers}.weight")
    if hidden != t.hidden_size:
        problems.append(f"hidden size {hidden}, the target's {t.hidden_size}")
    if out is None:
        problems.append(f"it lacks the heads' output layer (0.{layers}.weight)")
    elif out.shape[0] != t.vocab_size:
        problems.append(f"vocabulary {out.shape[0]}, the target's {t.vocab_size}")
    for key, value in (("hidden_size", t.hidden_size), ("vocab_size", t.vocab_size)):
        if key in config and config[key] != value and not any(key.split("_")[0] in p for p in problems):
            problems.append(f"config.json's {key} {config[key]}, the target's {value}")
    refuse(path, MEDUSA, target, problems, "Use Medusa heads published for this target model")
    accuracy = config.get("specdecode_accuracy")
    cfg = MedusaConfig(len(heads), t.hidden_size, t.vocab_size, t.vocab_size, target.norm.eps or t.rms_norm_eps,
                       accuracy=accuracy, target=str(config.get("base_model_name_or_path", "")))
    medusa = MedusaHeads(cfg) if layers == 1 else DeepMedusa(cfg, layers)
    k = len(heads)
    try:
        weight = torch.stack([torch.stack([state[f"{i}.{j}.linear.weight"] for j in range(layers)]) for i in range(k)])
        bias = torch.stack([torch.stack([state[f"{i}.{j}.linear.bias"] for j in range(layers)]) for i in range(k)])
        output = torch.stack([state[f"{i}.{layers}.weight"] for i in range(k)])
    except KeyError as err:
        raise ValueError(f"{path}: Medusa head weights lack {err.args[0]}") from None
    except RuntimeError as err:
        raise ValueError(f"{path}: Medusa heads of different shapes ({err})") from None
    with torch.no_grad():
        medusa.norm.weight.copy_(target.norm.weight.detach().float().cpu())
        medusa.res_weight.copy_(weight[:, 0] if layers == 1 else weight)
        medusa.res_bias.copy_(bias[:, 0] if layers == 1 else bias)
        medusa.out_weight.copy_(output)
    return medusa


def save_medusa(heads: MedusaHeads, out_dir: Path | str, dtype: torch.dtype | None = None) -> Path:
    """Write Medusa heads in Medusa's own layout (medusa_lm_head.safetensors + config.json); the measured rank
    accuracies go in config.json's `specdecode_accuracy` (other readers ignore it). The heads' norm is not written:
    Medusa reads the target's normed state, and ours keep the target's final norm, frozen."""
    cfg = heads.config
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        raise ValueError(f"these Medusa heads guess among {cfg.draft_vocab_size} of the {cfg.target_vocab_size} "
                         "tokens; Medusa's layout has a linear layer over the whole vocabulary, which cannot rule the "
                         "others out: train heads with the whole vocabulary to publish them")
    layers = heads.res_weight.shape[1] if isinstance(heads, DeepMedusa) else 1
    state: dict[str, torch.Tensor] = {}
    for i in range(cfg.heads):
        for j in range(layers):
            w = heads.res_weight[i, j] if layers > 1 else heads.res_weight[i]
            b = heads.res_bias[i, j] if layers > 1 else heads.res_bias[i]
            state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = w, b
        state[f"{i}.{layers}.weight"] = heads.out_weight[i]
    state = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in state.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": cfg.heads, "medusa_num_layers": layers, "base_model_name_or_path": cfg.target,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.target_vocab_size, "specdecode_accuracy": cfg.accuracy}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


# ------------------------------------------------------------------------------------------ dispatching


def load_eagle_head(path: Path | str, target: Transformer, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> EagleHead:
    """The EAGLE head in `path`, whichever layout (ours, EAGLE-3, EAGLE-1/2), checked against `target` (a
    Mismatch naming every difference) and in the target's dtype and device unless given."""
    path = Path(path).expanduser()
    layout = detect_layout(path)
    dtype, device = dtype or target.dtype, device or target.device
    if layout == OURS_EAGLE:
        head = load_head(path, dtype=dtype, device=device)
    elif layout == EAGLE3:
        head = load_eagle3(path, target).to(device=device, dtype=dtype).eval().requires_grad_(False)
    elif layout == EAGLE1:
        head = load_eagle1(path, target).to(device=device, dtype=dtype).eval().requires_grad_(False)
    else:
        raise ValueError(f"{path} holds {LAYOUT_NAMES[layout]}: use it with method 'medusa' (--method medusa)")
    head.check_target(target)
    return head


def load_medusa_heads(path: Path | str, target: Transformer, dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None) -> MedusaHeads:
    """The Medusa heads in `path` (ours or Medusa's layout), checked against `target`."""
    path = Path(path).expanduser()
    layout = detect_layout(path)
    dtype, device = dtype or target.dtype, device or target.device
    if layout == OURS_MEDUSA:
        heads = MedusaHeads.load(path, dtype=dtype, device=device)
    elif layout == MEDUSA:
        heads = load_medusa(path, target).to(device=device, dtype=dtype).eval().requires_grad_(False)
    else:
        raise ValueError(f"{path} holds {LAYOUT_NAMES[layout]}: use it with method 'eagle' (--method eagle)")
    heads.check_target(target)
    return heads


def export_head(path: Path | str, out_dir: Path | str, target: Transformer | None = None,
                dtype: torch.dtype | None = None) -> str:
    """Write the head in `path` in its published layout: our Medusa heads in Medusa's, an EAGLE-3 head (e.g. one
    shipped as a pickle) as EAGLE-3 safetensors. Returns the layout written. Our EAGLE head: a ValueError with the
    reason it cannot be (save_eagle3)."""
    layout = detect_layout(path)
    if layout == OURS_MEDUSA:
        save_medusa(MedusaHeads.load(path), out_dir, dtype)
        return MEDUSA
    if layout == OURS_EAGLE:
        save_eagle3(load_head(path), out_dir, dtype)
        return EAGLE3
    if target is None:
        raise ValueError(f"{path} holds {LAYOUT_NAMES[layout]}: reading it needs its target model (--target)")
    if layout == EAGLE3:
        save_eagle3(load_eagle3(Path(path), target), out_dir, dtype)
        return EAGLE3
    if layout == MEDUSA:
        save_medusa(load_medusa(Path(path), target), out_dir, dtype)
        return MEDUSA
    raise ValueError(f"{path} holds {LAYOUT_NAMES[layout]}, which is read as published and not written back")
