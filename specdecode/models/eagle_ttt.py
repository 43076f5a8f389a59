"""EAGLE-3's training-time test: the head unrolled as it drafts, and the loss that offline training
(training/eagle.py) and online learning (proposers/online_learning.py) both minimise.

At inference the head drafts several tokens deep on its own outputs: depth 1 reads the target's fused
features, depth d > 1 reads the head's own output at the previous position. The unroll does the same: step j
feeds each position the head's step j-1 output from the position before, and attends exactly as a draft started
j positions earlier would -- to target-feature entries up to that root, and to its own entries on the diagonal
since. The loss at every step is the cross-entropy against the target's next-token distribution (top-k teacher),
restricted to the draft vocabulary; the accuracy at step j is the greedy acceptance rate at depth j + 1 given the
ones before.
"""

from __future__ import annotations

import math

import torch

from .eagle import EagleHead
from .llama import rotate_half


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
    attn = head.attention()  # the head's parts (EagleHead's or Eagle3Head's architecture)
    nh, nkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    cos, sin = head.rope(torch.arange(n, device=features.device))
    causal0 = [torch.ones(n, n, dtype=torch.bool, device=features.device).tril(-j) for j in range(steps)]
    keys, values, outputs = [], [], []
    feat = features
    for j in range(steps):
        inputs, x = head.attn_input(feat, embeds)  # what q/k/v read, the residual stream
        q, k, v = attn.wqkv(inputs).split(attn.split, dim=-1)
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
        x = head.mlp_step(x)
        outputs.append(head.final(x))
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
