"""Model configuration: the few numbers a Llama-family transformer needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

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

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers can load too."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        out = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "sliding_window": self.sliding_window,
            "hidden_act": "silu",
        }
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
