"""A small draft LM distilled from the target: the target's tokenizer and vocabulary, a few narrow Llama
layers, trained on the target's own answers to match its next-token distributions (top-k teacher, KD)
plus the token itself (CE). Saved as a Hugging Face checkpoint (config.json + model.safetensors + the
target's tokenizer), which the `draft` proposer (`--method draft --draft DIR`) and transformers load.

It trains as transformers' LlamaForCausalLM: our Transformer is built for inference (an inference-mode
forward that writes a KV cache), while transformers' module is a tested differentiable reference of the
same architecture and `save_pretrained` writes exactly the layout our loader reads.
The output layer is tied to the embedding: with a 49k vocabulary it is most of a narrow draft's weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import local_batch, world
from .features import FeatureStore
from .loop import TrainConfig, train


def draft_config(target_hf: dict[str, Any], layers: int, hidden: int, heads: int | None = None,
                 intermediate: int | None = None) -> dict[str, Any]:
    """An HF Llama config for the draft: the target's vocabulary, special tokens, positions and RoPE;
    `layers` x `hidden` (heads of 64 dims unless given; MLP 8/3 x hidden rounded up to 64)."""
    if layers < 1 or hidden < 1:
        raise ValueError(f"--layers and --hidden must be >= 1, got {layers} and {hidden}")
    heads = heads or max(1, hidden // 64)
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} is not divisible by {heads} attention heads")
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"attention heads of {head_dim} dims: RoPE needs an even head size")
    keep = ("vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "bos_token_id",
            "eos_token_id", "pad_token_id")
    config = {k: target_hf[k] for k in keep if target_hf.get(k) is not None}
    config.update(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        intermediate_size=intermediate or math.ceil(hidden * 8 / 3 / 64) * 64, hidden_act="silu",
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    )
    return config


def new_draft(config: dict[str, Any], seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # transformers' own initialisation, made repeatable
    return LlamaForCausalLM(LlamaConfig(**config))


@torch.no_grad()
def init_embeddings(model: nn.Module, target_embed: torch.Tensor) -> None:
    """Start the draft's (tied) embedding as the target's, projected on its top principal directions: token
    similarities the target learnt come for free instead of from a few million distilled tokens."""
    e = target_embed.detach().float().cpu()
    weight = model.get_input_embeddings().weight
    if e.shape[0] != weight.shape[0]:
        raise ValueError(f"target embedding has {e.shape[0]} rows, the draft's vocabulary {weight.shape[0]}")
    _, _, vh = torch.linalg.svd(e - e.mean(0), full_matrices=False)
    k = min(weight.shape[1], vh.shape[0])
    projected = e @ vh[:k].T
    # at the scale of a fresh embedding: at the target's, the tied output layer would start out with huge,
    # confidently wrong logits (a first loss of ~30 nats instead of ~ln V); directions and distances stay
    projected *= float(weight.std()) / float(projected.std())
    weight[:, :k] = projected.to(weight.dtype)  # any further columns keep their random start


def distill_loss(model: nn.Module, batch: dict[str, torch.Tensor], kd_weight: float = 0.8
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """kd_weight x cross-entropy to the teacher's top-k (renormalised) + (1 - kd_weight) x CE to the token,
    at answer positions only (logits are computed only there: the 49k-wide output is the costly part)."""
    tokens, mask = batch["tokens"], batch["mask"]
    hidden = model.model(input_ids=tokens).last_hidden_state  # right padding sits after every real token
    if not mask.any():  # prompts cut by --max-len before any answer: a step that changes nothing
        return hidden.sum() * 0.0, {}
    logp = model.lm_head(hidden[mask]).float().log_softmax(-1)  # [M, V]
    labels = F.pad(tokens[:, 1:], (0, 1))[mask]
    ce = -logp.gather(-1, labels[:, None])[:, 0]
    soft = batch["teacher_probs"][mask].float()
    soft = soft / soft.sum(-1, keepdim=True).clamp_min(1e-9)
    teacher = batch["teacher_ids"][mask]
    kd = -(soft * logp.gather(-1, teacher)).sum(-1)
    loss = kd_weight * kd.mean() + (1 - kd_weight) * ce.mean()
    agree = float((logp.argmax(-1) == teacher[:, 0]).float().mean())
    return loss, {"acc": agree}


def train_draft(
    store: FeatureStore,
    heldout: FeatureStore,
    out_dir: Path | str,
    cfg: TrainConfig,
    config: dict[str, Any],
    tokenizer,
    *,
    batch_size: int = 16,
    max_len: int = 1024,
    kd_weight: float = 0.8,
    target_embed: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    save_dtype: torch.dtype = torch.float32,
    log=print,
) -> Path:
    """Train the draft on cached teacher distributions, save it in `out_dir` as an HF checkpoint with the
    target's tokenizer; an interrupted run resumes from its checkpoint there. `target_embed`: start the
    embedding from the target's (see init_embeddings); `save_dtype`: of the saved weights."""
    out = Path(out_dir)
    model = new_draft(config, cfg.seed)
    if target_embed is not None:
        init_embeddings(model, target_embed)
    model.to(device)
    evaluation = [heldout.batch(list(range(i, min(i + batch_size, len(heldout)))), max_len)
                  for i in range(0, len(heldout), batch_size)]

    def loss_fn(m: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return distill_loss(m, batch, kd_weight)

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        scored = [(distill_loss(m, b, kd_weight), int(b["mask"].sum())) for b in evaluation if b["mask"].any()]
        total = max(sum(w for _, w in scored), 1)  # averages over answer tokens, not batches
        acc = sum(metrics["acc"] * w for (_, metrics), w in scored) / total
        loss = sum(float(value) * w for (value, _), w in scored) / total
        # a chain of 4 guesses, each right with the teacher-forced agreement: expected tokens per forward
        return {"loss": loss, "acc": acc, "chain4_tau": sum(acc**d for d in range(5))}

    train(model, loss_fn, lambda start: store.batches(local_batch(batch_size), max_len, cfg.seed, start), out, cfg,
          evaluate, log)
    if world().main:
        model.eval().to(save_dtype).save_pretrained(str(out))  # config.json + model.safetensors
        tokenizer.save_pretrained(str(out))
    return out
