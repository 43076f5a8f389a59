"""One resumable training loop for every draft: AdamW, warmup + cosine decay, a progress bar,
periodic held-out evaluation and checkpoints from which an interrupted run carries on."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from .distributed import data_parallel, from_main, world

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 250
    save_every: int = 250
    seed: int = 0
    bf16: bool = False  # autocast to bfloat16 (GPU training)
    seconds: float | None = None  # a time budget: training ends (evaluated, saved) within it, the schedule fitted
    # to the steps it allows (measured over the first FIT_STEPS steps, fitted again at each evaluation on the
    # average so far, evaluations included); `steps` stays the upper bound


FIT_STEPS = 20  # steps timed (after one warm-up step) to fit a time budget's step count


def lr_at(step: int, cfg: TrainConfig, total: int | None = None) -> float:
    """Linear warm-up, then cosine decay to lr / 10 at `total` (default cfg.steps)."""
    total = cfg.steps if total is None else total
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))  # down to lr / 10


def train(
    module: nn.Module,
    loss_fn: Callable[[nn.Module, dict], tuple[torch.Tensor, dict[str, float]]],
    batches: Callable[[int], Iterator[dict]],
    out_dir: Path | str,
    cfg: TrainConfig,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train `module` for cfg.steps; `batches(start_step)` yields training batches from that step on.

    Under torchrun, the module trains in DDP: every worker runs this with its own batches, the main worker
    alone evaluates, logs and saves, and every worker stops when it does.
    A checkpoint in `out_dir` (module, optimizer, step, history) is resumed from. Every eval_every steps and
    at the end, `evaluate(module)` scores held-out data; history lines go to train_log.jsonl. Returns history.
    With cfg.seconds, the run's step count is fitted to that budget (the checkpoint keeps it: resumed with a
    budget again, a run that had finished stays finished; without one, it trains on to cfg.steps).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    main = world().main
    if not main:
        log, evaluate = (lambda *_: None), None
    torch.manual_seed(cfg.seed)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, history, total = 0, [], cfg.steps
    ckpt = out / CHECKPOINT
    if ckpt.exists():
        state = torch.load(ckpt, map_location=params[0].device, weights_only=False)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        if cfg.seconds is not None and state.get("fitted"):  # a budgeted run ends where its budget had it end
            total = state["fitted"]
        log(f"resuming from step {step} ({ckpt})")
    if step >= total:
        return history
    first_step = step
    device_type = params[0].device.type
    step_loss = data_parallel(module, loss_fn)  # (DDP broadcasts the main worker's weights: all start equal)

    def record(entry: dict) -> None:
        history.append(entry)
        with (out / LOG).open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def save() -> None:
        if not main:
            return
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"module": module.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "history": history, "config": asdict(cfg), "fitted": total if deadline is not None else None},
                   tmp)
        tmp.replace(ckpt)  # never a half-written checkpoint

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    running: dict[str, float] = {}
    started = time.perf_counter()
    deadline = None if cfg.seconds is None else started + cfg.seconds
    timed_from = started
    with Progress(*columns, transient=False, disable=not main) as bar:
        task = bar.add_task("train", total=total, completed=step)
        for batch in batches(step):
            module.train()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg, total)
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, metrics = step_loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            metrics = {"loss": loss.item(), **metrics}  # .item() waits for the device: the clock below is true
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(
                    f"training loss is {metrics['loss']} at step {step}: the weights are spoiled, so nothing more is "
                    f"saved (the checkpoint in {ckpt.parent} is the last good one); look for inf in the features "
                    "(delete OUT/work/features-* to extract them again) or lower --lr")
            if deadline is not None and step - first_step == 1:
                timed_from = time.perf_counter()
            elif deadline is not None and step - first_step == 1 + FIT_STEPS:
                total = from_main(fit_steps(step, cfg, (time.perf_counter() - timed_from) / FIT_STEPS, deadline, log))
                bar.update(task, total=total)
            for name, value in metrics.items():
                running[name] = value if name not in running else 0.95 * running[name] + 0.05 * value
            bar.update(task, advance=1, description="train " + " ".join(f"{k}={v:.3f}" for k, v in running.items()))
            last = bool(from_main(step >= total or (deadline is not None and time.perf_counter() >= deadline)))
            if evaluate is not None and (step % cfg.eval_every == 0 or last):
                module.eval()
                scores = evaluate(module)
                entry = {"step": step, "seconds": round(time.perf_counter() - started, 1),
                         **{f"train_{k}": round(v, 4) for k, v in running.items()},
                         **{f"heldout_{k}": round(v, 4) for k, v in scores.items()}}
                record(entry)
                bar.console.log(" ".join(f"{k}={v}" for k, v in entry.items()))
            if step % cfg.save_every == 0 or last:
                save()
            if last:
                break
            if deadline is not None and step % cfg.eval_every == 0 and step - first_step > 1 + FIT_STEPS:
                average = (time.perf_counter() - timed_from) / (step - first_step - 1)  # evaluations included
                total = from_main(fit_steps(step, cfg, average, deadline, None, share=0.97))
                bar.update(task, total=total)
    module.eval()
    return history


def fit_steps(step: int, cfg: TrainConfig, per_step: float, deadline: float, log: Callable[[str], None] | None,
              share: float = 0.9) -> int:
    """The step count a time budget allows from here at `per_step` seconds a step, using `share` of the time left
    (the first fit keeps a tenth for the evaluations; later ones measure them in `per_step`)."""
    left = max(0.0, deadline - time.perf_counter())
    total = min(cfg.steps, step + int(share * left / max(per_step, 1e-9)))
    if log is not None:
        log(f"time budget {cfg.seconds:.0f} s: {total} steps at {per_step * 1000:.0f} ms a step")
    return max(total, step)
