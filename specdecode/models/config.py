"""Model configuration: the few numbers a Llama-family transformer needs, and Gemma 3's differences as options.

Llama 3.x, Mistral, Qwen2/2.5, Qwen3 and Phi-3 are the Llama block as it is: Qwen2 adds biases on q/k/v, Qwen3 an
RMSNorm on each head's queries and keys (`qk_norm`), Mistral and Phi-3 a sliding window on every layer where their
config sets one, Llama 3.1+ its RoPE scaling ("llama3"); Phi-3's fused q|k|v and gate|up checkpoint tensors are split
as they load (models/fused.py).

Gemma 3 is the Llama block with a handful of switches (all off for the others): sliding-window
attention on most layers with full attention between (`layer_types`), its own RoPE base on the sliding layers,
RMSNorm on each head's queries and keys, norms on the attention and MLP outputs too ("sandwich"), a tanh-GELU
gate, embeddings scaled by sqrt(hidden size), a query scale of its own, and norm weights stored as w for a
scale of (1 + w) (`norm_offset`, applied once when weights load).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# HF `model_type`s that share the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU MLP), and Gemma 3's text model.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
# RoPE scalings the runtime computes (rope_inv_freq): each one's required keys
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
ACTIVATIONS = ("silu", "gelu_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # with layer_types: the full-attention layers' only
    attention_bias: bool = False  # biases on q/k/v (Qwen2's default)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # a token sees only the last `sliding_window` positions (see layer_types)
    model_type: str = "llama"
    # ---- Gemma 3 (defaults: the Llama block)
    layer_types: list[str] | None = None  # per layer SLIDING or FULL; None: the window (if any) on every layer
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys, before RoPE
    sandwich_norm: bool = False  # RMSNorm on the attention and MLP outputs before each residual add
    hidden_act: str = "silu"  # the MLP gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size), rounded to the dtype)
    query_scale: float | None = None  # attention scores' scale (None: head_dim ** -0.5)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    norm_offset: float = 0.0  # checkpoints store norm weights as w - norm_offset (Gemma: 1)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {self.num_layers} "
                                 f"layers, got {self.layer_types}")

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    def plain(self) -> ModelConfig:
        """This shape with every Gemma option off (e.g. an EAGLE head's Llama block for a Gemma target)."""
        return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(self)
                                            if f.name in GEMMA_OPTIONS})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):  # Gemma 3 4B+: its text model
            hf = gemma3_text_config(hf)
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = " (a Gemma 3 multimodal config without its text_config: give the text model's, model_type " \
                "gemma3_text)" if model_type == "gemma3" else ""
            raise ValueError(
                f"model_type {model_type!r} is not supported{hint}; specdecode runs Llama-family models and Gemma 3 "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        num_heads = hf["num_attention_heads"]
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ValueError(f"{model_type} with use_sliding_window=true (windows on some layers only, "
                             "max_window_layers) is not supported; set use_sliding_window to false")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        partial = hf.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0
        if float(partial) != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} (RoPE on part of each head, e.g. Phi-4-mini) is not "
                             "supported: specdecode rotates whole heads")
        rope_theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        if model_type != "gemma3_text":
            check_rope_scaling(rope)
        # Qwen2 always has q/k/v biases (transformers' Qwen2 ignores attention_bias); the others say so
        bias = model_type == "qwen2" or bool(hf.get("attention_bias"))
        base = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            attention_bias=bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # a window on every layer where the config sets one (Qwen's sliding_window applies only with
            # use_sliding_window, refused above)
            sliding_window=(hf.get("sliding_window") or None) if model_type in ("mistral", "phi3") else None,
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )
        if model_type == "gemma3_text":
            base.update(_gemma3(hf))
        return cls(**base)


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config's text model, transformers' defaults filled in (the published 4B-27B configs give
    only what differs from them)."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**hf["text_config"]).to_dict()
    if "tie_word_embeddings" in hf and "tie_word_embeddings" not in hf["text_config"]:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return {**text, "model_type": "gemma3_text"}


def check_rope_scaling(rope: dict[str, Any] | None) -> None:
    """Refuse a RoPE scaling the runtime does not compute (e.g. yarn, longrope, dynamic) or one missing its keys."""
    if rope is None:
        return
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)}, or none)")
    missing = [key for key in ROPE_SCALINGS[kind] if key not in rope]
    if missing:
        raise ValueError(f"RoPE scaling {kind!r} needs {', '.join(missing)} in rope_scaling; got {rope}")


GEMMA_OPTIONS = ("layer_types", "rope_local_theta", "qk_norm", "sandwich_norm", "hidden_act", "embed_scale",
                 "query_scale", "final_logit_softcap", "norm_offset")


def _gemma3(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's options from its HF config, old style (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) or new (rope_parameters per layer type, layer_types)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit softcapping (attn_logit_softcapping) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an embedding model) is not supported")
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    layer_types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    if FULL in params:  # transformers >= 5: one RoPE per layer type
        full, local = dict(params[FULL]), dict(params.get(SLIDING) or {})
    else:
        full = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **(hf.get("rope_scaling") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling on Gemma's sliding layers ({local}) is not supported")
    theta = float(full.pop("rope_theta", 1_000_000.0))
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    check_rope_scaling(scaling)
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 with hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    head_dim = hf.get("head_dim") or 256
    return dict(
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=list(layer_types),
        qk_norm=True,
        sandwich_norm=True,
        hidden_act="gelu_tanh",
        embed_scale=hf["hidden_size"] ** 0.5,
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=hf.get("final_logit_softcapping"),
        norm_offset=1.0,
    )
