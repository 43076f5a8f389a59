"""Train an EAGLE-3-style head on cached target features, with "training-time test".

At inference the head drafts several tokens deep on its own outputs: depth 1 reads the target's fused
features, depth d > 1 reads the head's own output at the previous position. Training unrolls the same
way (EAGLE-3's training-time test): step j feeds each position the head's step j-1 output from the
position before, and attends exactly as a draft started j positions earlier would -- to target-feature
entries up to that root, and to its own entries on the diagonal since. The loss at every step is the
cross-entropy against the target's next-token distribution (top-k teacher), restricted to the draft
vocabulary; the accuracy at step j is the greedy acceptance rate at depth j + 1 given the ones before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..models import Transformer
from ..models.eagle import EagleConfig, EagleHead
from ..models.llama import rotate_half
from .distributed import local_batch, summed, world
from .features import FeatureStore
from .loop import LOG, TrainConfig, train


def choose_draft_vocab(store: FeatureStore, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target tokens the target most often predicts (its top-1 on every position), ties by id; over
    every worker's shard (all must agree on it)."""
    counts = torch.bincount(store.teacher_ids[:, 0].long().cpu(), minlength=vocab_size).double()
    counts += 1e-3 * torch.bincount(store.tokens.cpu(), minlength=vocab_size)  # then the most frequent in text
    counts = summed(counts)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def _shift(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """x moved `by` places later along `dim`, zeros in front."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat((pad, x.narrow(dim, 0, x.shape[dim] - by)), dim=dim)


def ttt_logits(head: EagleHead, embed: torch.nn.Embedding, batch: dict, steps: int) -> list[torch.Tensor]:
    """Draft-vocab logits [B, T-1, Vd] for each unrolled step; entry t predicts token t + 2."""
    return [head.lm_head(state) for state in ttt_states(head, embed, batch, steps)]


def ttt_states(head: EagleHead, embed: torch.nn.Embedding, batch: dict, steps: int) -> list[torch.Tensor]:
    """The head's normed output [B, T-1, H] for each unrolled step, its output layer not yet applied (the loss
    applies it to the positions it scores only: the output layer is most of a step's work)."""
    hidden = batch["hidden"]
    features = head.fuse_features(hidden[:, :-1])  # [B, T-1, H]: target features at t
    embeds = embed(batch["tokens"][:, 1:])  # token t + 1
    b, n, _ = features.shape
    attn = head.block.attn
    nh, nkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    cos, sin = head.rope(torch.arange(n, device=features.device))
    causal0 = [torch.ones(n, n, dtype=torch.bool, device=features.device).tril(-j) for j in range(steps)]
    keys, values, outputs = [], [], []
    feat = features
    for j in range(steps):
        x = head.embed_input(feat, embeds)
        q, k, v = attn.wqkv(head.block.attn_norm(x)).split(attn.split, dim=-1)
        q = q.view(b, n, nh, d).transpose(1, 2)
        k = k.view(b, n, nkv, d).transpose(1, 2)
        v = v.view(b, n, nkv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        keys.append(k)
        values.append(v)
        scale = 1.0 / math.sqrt(d)
        parts = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal0[j], float("-inf"))]
        for i in range(1, j + 1):  # the draft's own entries: step i at position t - (j - i)
            parts.append((q * _shift(keys[i], j - i, dim=2)).sum(-1, keepdim=True) * scale)
        scores = torch.cat(parts, dim=-1)
        weights = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        out = weights[..., :n] @ values[0]
        for i in range(1, j + 1):
            out = out + weights[..., n + i - 1 : n + i] * _shift(values[i], j - i, dim=2)
        x = x + attn.wo(out.transpose(1, 2).reshape(b, n, nh * d))
        x = x + head.block.mlp(head.block.mlp_norm(x))
        outputs.append(head.norm(x))
        feat = _shift(x, 1, dim=1)  # next step reads the head's own output one position back (same draft root)
    return outputs


def ttt_loss(head: EagleHead, embed: torch.nn.Embedding, t2d: torch.Tensor, batch: dict, steps: int,
             decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted sum over steps (decay^j) of the soft cross-entropy to the teacher; per-step accuracies. A negative
    teacher weight marks a token to push down (a guess the target rejected, online learning): its term is the
    unlikelihood -w log(1 - q), which stops pulling once q is small (a replay buffer repeats old rejections)."""
    states = ttt_states(head, embed, batch, steps)
    ids, probs = batch["teacher_ids"][:, 1:], batch["teacher_probs"][:, 1:]  # teacher for token t + 2
    draft_ids = t2d[ids]  # -1: outside the draft vocabulary (weight dropped)
    weight = probs * (draft_ids >= 0)
    gather_ids = draft_ids.clamp_min(0)
    base = batch["mask"][:, 1:]
    positions = torch.arange(base.shape[1], device=base.device)
    total, metrics = 0.0, {}
    for j, state in enumerate(states):
        valid = base & (positions >= j)
        count = valid.sum().clamp_min(1)
        logits = head.lm_head(state[valid])  # [valid positions, Vd]
        w = weight[valid]
        logp = logits.float().log_softmax(-1).gather(-1, gather_ids[valid])
        terms = w.clamp_min(0) * logp
        if bool((w < 0).any()):
            terms = terms - w.clamp_max(0) * torch.log1p(-logp.exp().clamp_max(1 - 1e-6))
        loss = -terms.sum() / count
        hit = head.d2t[logits.argmax(-1)] == ids[valid][..., 0]
        total = total + decay**j * loss
        metrics[f"acc{j + 1}"] = float(hit.sum() / count)
    return total / sum(decay**j for j in range(steps)), metrics


@torch.no_grad()
def evaluate_head(head: EagleHead, embed: torch.nn.Embedding, t2d: torch.Tensor, store: FeatureStore, steps: int,
                  batch_size: int, max_len: int) -> dict[str, float]:
    """Held-out greedy acceptance per depth (step accuracies, pooled) and the chain's expected tau."""
    hits = torch.zeros(steps, dtype=torch.float64)
    count = 0
    for b in range(0, len(store), batch_size):
        batch = store.batch(list(range(b, min(b + batch_size, len(store)))), max_len)
        _, metrics = ttt_loss(head, embed, t2d, batch, steps)
        n = int(batch["mask"][:, 1:].sum())
        hits += torch.tensor([metrics[f"acc{j + 1}"] for j in range(steps)]) * n
        count += n
    acc = (hits / max(count, 1)).tolist()
    out = {f"acc{j + 1}": a for j, a in enumerate(acc)}
    # depth-d accuracy is measured given depths < d were right, so tau = 1 + sum of cumulative products
    out["chain_tau"] = 1.0 + float(torch.tensor(acc).cumprod(0).sum())
    return out


def train_eagle(
    target: Transformer,
    store: FeatureStore,
    heldout: FeatureStore,
    out_dir: Path | str,
    cfg: TrainConfig,
    *,
    draft_vocab: int = 8192,
    ttt_steps: int = 4,
    batch_size: int = 16,
    max_len: int = 1024,
    log=print,
    init: EagleHead | None = None,
    vocab_swaps: int = 0,
) -> EagleHead:
    """Train a head for `target` on cached features (which must hold the head's layers); save it in out_dir.
    init: a trained head to fine-tune instead (its layers and vocabulary size; up to `vocab_swaps` of its draft
    vocabulary's rows go to tokens these answers use that it lacks, `EagleHead.swap_vocab`)."""
    device = store.hidden.device
    if init is None:
        eagle_cfg = EagleConfig.for_target(target.config, draft_vocab)
        head = EagleHead(eagle_cfg).to(device)
        vocab = choose_draft_vocab(store, eagle_cfg.draft_vocab_size, target.config.vocab_size).to(device)
        head.init_from_target(target, vocab)  # float32 copies of its weights (dequantized where quantized)
    else:
        init.check_target(target)
        head, eagle_cfg = init.float_copy().to(device), init.config
    layer_idx = [store.layer_index(i) for i in eagle_cfg.target_layers]
    embed = torch.nn.Embedding.from_pretrained(target.embed.weight.detach().float().clone()).to(device)

    def pick(batch: dict) -> dict:
        return {**batch, "hidden": batch["hidden"][:, :, layer_idx]}

    def batches(start: int):
        for batch in store.batches(local_batch(batch_size), max_len, cfg.seed, start_step=start):
            yield pick(batch)

    picked = FeatureStore(heldout.layers, heldout.tokens, heldout.offsets, heldout.prompt_lens,
                          heldout.hidden[:, layer_idx], heldout.teacher_ids, heldout.teacher_probs)

    def evaluate(module):
        return evaluate_head(module, embed, module.draft_ids(), picked, ttt_steps, batch_size, max_len)

    if init is not None:
        first = Path(out_dir) / LOG
        if world().main and not first.exists():  # where fine-tuning starts, the head as it was: step 0 of the log
            first.parent.mkdir(parents=True, exist_ok=True)
            scores = evaluate(head.eval())
            first.write_text(json.dumps({"step": 0, "seconds": 0.0, **{f"heldout_{k}": round(v, 4)
                                                                         for k, v in scores.items()}}) + "\n")
            log(f"the head before fine-tuning: held-out chain_tau {scores['chain_tau']:.3f}")
        counts = torch.bincount(store.teacher_ids[:, 0].long().cpu(), minlength=target.config.vocab_size)
        swapped = head.swap_vocab(summed(counts.double()), target.lm_head.weight.detach(), vocab_swaps, 2.0)
        log(f"{len(swapped)} of its {len(head.d2t)} draft vocabulary rows given to tokens of these answers it lacked")
    head.requires_grad_(True)
    head.d2t.requires_grad_(False)
    t2d = head.draft_ids()

    def loss_fn(module, batch):
        return ttt_loss(module, embed, t2d, batch, ttt_steps)

    train(head, loss_fn, batches, out_dir, cfg, evaluate=evaluate, log=log)
    head.requires_grad_(False)
    if world().main:
        head.float().save(out_dir)
    return head

