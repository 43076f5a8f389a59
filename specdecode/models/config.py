"""Model configuration: the few numbers a Llama-family transformer needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF `model_type`s that share the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU MLP).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral: a token sees only the last `sliding_window` positions
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; specdecode runs Llama-family models "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        num_heads = hf["num_attention_heads"]
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true (per-layer windows) is not supported")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        rope_theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        return cls(
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
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
            model_type=model_type,
        )
