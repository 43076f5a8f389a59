"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state guess the tokens
+2..+K+1 after it (the target's own head gives +1: the next step's root), all from one hidden state.

Head j is one residual block on the final-normed hidden state, y = x + SiLU(W_j x + b_j), and its own
output layer over a reduced draft vocabulary (the most frequent answer tokens, with a map back to target
ids). Why not share the target's lm_head: on a CPU a forward streams every weight once, and for
SmolLM2-135M the 49k x 576 lm_head is a fifth of all weights, so K heads through it cost ~K/5 of a
target forward per step (4 heads: 0.8x), or 1/5 when batched. Own layers over 4k tokens cost K x 2.7M
weights (4 heads: 8% of a forward) and give up only the rarer tokens: the 4,096 most frequent cover ~82% of
ShareGPT answer tokens (8,192: ~89%, for twice the cost), more of a small model's own, plainer answers.
They start as the target's lm_head rows for those tokens (and the residual blocks at zero), as in Medusa.

Saved as a folder: model.safetensors + config.json (model_type "medusa", per-head rank accuracy
measured on held-out data, which the proposer's tree is built from).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import Transformer
from ..models.medusa import MedusaHeads
from .distributed import local_batch, summed, world
from .features import FeatureStore
from .loop import TrainConfig, train

HEAD_DECAY = 0.8  # loss weight of head j is HEAD_DECAY**j: later heads are harder and matter less (Medusa)


def frequent_tokens(tokens: torch.Tensor, size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids in `tokens` (ties: lower id), `always` included; size >= vocab: all."""
    if size >= vocab_size or size <= 0:
        return torch.arange(vocab_size)
    counts = summed(torch.bincount(tokens.flatten().long().cpu(), minlength=vocab_size).double())  # every shard's
    counts[list(always)] = float("inf")
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


# -------------------------------------------------------------------------------------- training
def head_targets(batch: dict[str, torch.Tensor], head: int, layer: int = 0) -> tuple[torch.Tensor, ...]:
    """What head j learns at position t: the token t + 2 + j (label), the target's distribution over it
    (teacher at t + 1 + j), where that token is an answer token. Returns hidden, labels, teacher ids,
    teacher probs, mask, all cut to the positions that have such a token."""
    s, width = head + 1, batch["tokens"].shape[1]
    n = width - s - 1
    if n <= 0:
        return (batch["hidden"][:, :0, layer],) + tuple(t[:, :0] for t in (batch["tokens"], batch["teacher_ids"],
                                                                            batch["teacher_probs"], batch["mask"]))
    return (batch["hidden"][:, :n, layer], batch["tokens"][:, s + 1 :], batch["teacher_ids"][:, s : s + n],
            batch["teacher_probs"][:, s : s + n], batch["mask"][:, s : s + n])


def medusa_loss(heads: MedusaHeads, batch: dict[str, torch.Tensor], kd_weight: float = 0.8, layer: int = 0,
                to_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per head: kd_weight x cross-entropy to the teacher's top-k (renormalised over the draft vocabulary)
    + (1 - kd_weight) x cross-entropy to the token; heads weighted HEAD_DECAY**j. `layer`: which of the
    batch's hidden layers is the target's last."""
    to_draft = heads.to_draft() if to_draft is None else to_draft
    hidden = batch["hidden"][:, :, layer]
    logits = heads(hidden.to(heads.out_weight.dtype))  # [B, T, K, Vd], one pass for all heads
    total, weights, metrics = hidden.new_zeros(()), 0.0, {}
    for j in range(heads.config.heads):
        _, labels, t_ids, t_probs, mask = head_targets(batch, j, layer)
        n = labels.shape[1]
        if n == 0 or not mask.any():
            continue
        logp = logits[:, :n, j].float().log_softmax(-1)[mask]  # [M, Vd]
        label = to_draft[labels[mask]]
        ce = -logp.gather(-1, label.clamp_min(0)[:, None])[:, 0] * (label >= 0)
        ids = to_draft[t_ids[mask]]
        soft = t_probs[mask].float() * (ids >= 0)
        soft = soft / soft.sum(-1, keepdim=True).clamp_min(1e-9)
        kd = -(soft * logp.gather(-1, ids.clamp_min(0))).sum(-1)
        loss = kd_weight * kd.mean() + (1 - kd_weight) * ce.mean()
        total = total + HEAD_DECAY**j * loss
        weights += HEAD_DECAY**j
        top1 = heads.vocab_ids[logp.argmax(-1)]
        metrics[f"acc{j + 1}"] = float((top1 == t_ids[mask][:, 0]).float().mean())
    if not weights:  # answers too short for any head (possible in a small batch): a step that changes nothing
        return logits.sum() * 0.0, metrics
    return total / weights, metrics


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, batches: list[dict[str, torch.Tensor]], ranks: int = 10, layer: int = 0
                  ) -> list[list[float]]:
    """[head][r]: how often the head's r-th best guess is the target's greedy token (the teacher's top-1),
    over the answer positions of `batches`: what greedy acceptance of a tree node depends on."""
    k = heads.config.heads
    ranks = min(ranks, heads.config.draft_vocab_size)
    hits, counts = torch.zeros(k, ranks), torch.zeros(k)
    for batch in batches:
        logits = heads(batch["hidden"][:, :, layer].to(heads.out_weight.dtype))
        for j in range(k):
            _, _, t_ids, _, mask = head_targets(batch, j, layer)
            n = t_ids.shape[1]
            if n == 0 or not mask.any():
                continue
            guesses = heads.vocab_ids[logits[:, :n, j][mask].topk(ranks, dim=-1).indices]  # [M, ranks]
            hits[j] += (guesses == t_ids[mask][:, :1]).float().sum(0).cpu()
            counts[j] += int(mask.sum())
    return (hits / counts.clamp_min(1)[:, None]).tolist()


def answer_tokens(store: FeatureStore) -> torch.Tensor:
    """Every answer token of the store's samples (what the heads will be asked to guess)."""
    offsets, prompt_lens = store.offsets.tolist(), store.prompt_lens.tolist()
    parts = [store.tokens[a + p : b] for a, b, p in zip(offsets[:-1], offsets[1:], prompt_lens, strict=True)]
    return torch.cat(parts) if parts else store.tokens[:0]


def train_medusa(
    target: Transformer,
    store: FeatureStore,
    heldout: FeatureStore,
    out_dir: Path | str,
    cfg: TrainConfig,
    *,
    heads: int = 4,
    draft_vocab: int = 4096,
    batch_size: int = 8,
    max_len: int = 1024,
    kd_weight: float = 0.8,
    stop_token_ids: list[int] = (),
    name: str = "",
    save_dtype: torch.dtype | None = None,
    log=print,
) -> MedusaHeads:
    """Train heads on cached features (the target's last layer), measure their rank accuracy on held-out
    data and save them in `out_dir`; an interrupted run resumes from its checkpoint there."""
    if heads < 1:
        raise ValueError(f"--heads must be >= 1, got {heads}")
    layer = store.layer_index(target.config.num_layers - 1)
    vocab_ids = frequent_tokens(answer_tokens(store), draft_vocab, target.config.vocab_size, always=stop_token_ids)
    module = MedusaHeads.from_target(target, heads, vocab_ids, name).float()
    to_draft = module.to_draft()
    evaluation = [heldout.batch(list(range(i, min(i + batch_size, len(heldout)))), max_len)
                  for i in range(0, len(heldout), batch_size)]

    def loss_fn(m: MedusaHeads, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return medusa_loss(m, batch, kd_weight, layer, to_draft)

    def evaluate(m: MedusaHeads) -> dict[str, float]:
        accuracy = rank_accuracy(m, evaluation, layer=layer)
        scores = {f"acc{j + 1}": row[0] for j, row in enumerate(accuracy)}
        with torch.no_grad():
            scores["loss"] = sum(float(loss_fn(m, b)[0]) for b in evaluation) / max(len(evaluation), 1)
        from ..proposers.medusa import medusa_tree  # the proposer's own tree: its expected tokens per forward

        scores["tree16_tau"] = 1 + sum(medusa_tree(accuracy, 16).estimates)
        return scores

    train(module, loss_fn, lambda start: store.batches(local_batch(batch_size), max_len, cfg.seed, start), out_dir,
          cfg, evaluate, log)
    module.config.accuracy = rank_accuracy(module, evaluation, layer=layer)
    if world().main:
        module.save(out_dir, save_dtype)
    return module
