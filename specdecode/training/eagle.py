"""Train an EAGLE-3-style head on cached target features, with "training-time test" (the unroll and its loss:
models/eagle_ttt.py, shared with online learning)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models import Transformer
from ..models.eagle import ARCH_EAGLE3, ARCH_OURS, CONFIG, EagleConfig, EagleHead
from ..models.eagle3 import Eagle3Head, from_specdecode_head
from ..models.eagle_ttt import ttt_loss
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
    arch: str | None = None,
) -> EagleHead:
    """Train a head for `target` on cached features (which must hold the head's layers); save it in out_dir.
    init: a trained head to fine-tune instead (its layers and vocabulary size; up to `vocab_swaps` of its draft
    vocabulary's rows go to tokens these answers use that it lacks, `EagleHead.swap_vocab`). arch: "specdecode"
    (EagleHead) or "eagle3" (EAGLE-3's architecture, Eagle3Head; a specdecode `init` is converted as a warm
    start, `from_specdecode_head`); default: init's, else "specdecode"."""
    device = store.hidden.device
    if init is None:
        eagle_cfg = EagleConfig.for_target(target.config, draft_vocab, arch=arch or ARCH_OURS)
        head = (Eagle3Head(eagle_cfg) if eagle_cfg.arch == ARCH_EAGLE3 else EagleHead(eagle_cfg)).to(device)
        vocab = choose_draft_vocab(store, eagle_cfg.draft_vocab_size, target.config.vocab_size).to(device)
        head.init_from_target(target, vocab)  # float32 copies of its weights (dequantized where quantized)
    else:
        init.check_target(target)
        if arch not in (None, init.config.arch):
            if arch != ARCH_EAGLE3:
                raise ValueError(f"an {init.config.arch} head cannot be fine-tuned into a {arch} one")
            init = from_specdecode_head(init)
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

    if world().main:  # the config first: a run stopped early leaves a checkpoint that, with it, makes the head
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / CONFIG).write_text(head.config.to_json())
    train(head, loss_fn, batches, out_dir, cfg, evaluate=evaluate, log=log)
    head.requires_grad_(False)
    if world().main:
        head.float().save(out_dir)
    return head

