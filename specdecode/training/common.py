"""What every `specdecode train` kind shares: common options, the cached data and feature stages, the report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .data import (
    engine_distill,
    load_answered,
    load_prompts,
    load_samples,
    sample_lines,
    save_samples,
    self_distill,
    split,
)
from .distributed import barrier, shard, unshard, world
from .features import FeatureStore, extract_features
from .loop import TrainConfig

err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def flush_denormals() -> None:
    """Floats too small for float32's normal range count as zero from here on, in this thread and in every thread
    started after it. A softmax over logits that span ~100 (a Gemma head started from its target's norm gains)
    leaves such values in the gradients, and a CPU multiplies denormal floats orders of magnitude slower: Gemma's
    training steps slowed several-fold as their share grew.
    PyTorch's worker threads take the setting from the thread that starts them, so it must come first."""
    torch.set_flush_denormal(True)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(steps=args.steps, lr=args.lr, warmup=min(args.warmup, max(1, args.steps // 10)),
                       eval_every=args.eval_every, save_every=args.eval_every, seed=args.seed, bf16=args.bf16,
                       seconds=args.train_seconds)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err, disable=not world().main)


def answers(args: argparse.Namespace):
    """(llm, the target's answers): those of --samples-file or OUT/work/samples.jsonl, else the target answers now
    (self-distillation; kept on disk batch by batch, so an interrupted run resumes where it stopped)."""
    from ..api import LLM

    work = Path(args.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    with err.status(f"loading {args.target}..."):
        llm = LLM.load(args.target, dtype=args.dtype)
    llm.model.to(args.device)
    samples_path = Path(args.samples_file) if args.samples_file else work / "samples.jsonl"
    answered = samples_path.exists()
    barrier()  # every worker has looked before any writes
    if answered and args.distill_only and not args.samples_file:  # asked again: answer the prompts left
        partial = partial_path(samples_path)
        if not partial.exists():  # (one there holds these answers already: a run like this one, interrupted)
            partial.write_bytes(samples_path.read_bytes())  # each worker keeps its own shard's answers of it
        answered = False
    if answered:
        samples = load_samples(samples_path)
        err.print(f"using {len(samples)} target answers from {samples_path}")
    else:
        samples = distill(llm, args, samples_path)
    return llm, samples


def prepare(args: argparse.Namespace, layers: list[int]):
    """(llm, train features, held-out features) for `args`, every stage cached under OUT/work. Under torchrun each
    worker answers and extracts its own shard (train features cached per worker); all hold the held-out set."""
    llm, samples = answers(args)
    work = Path(args.out) / "work"
    train_samples, heldout_samples = split(samples, args.heldout, args.seed)
    stores, w = [], world()
    in_memory = args.feature_cache == "memory"
    for name, part in (("train", shard(train_samples)), ("heldout", heldout_samples)):
        sharded = f"-{w.rank}of{w.size}" if name == "train" and w.size > 1 else ""
        path = work / f"features-{'_'.join(map(str, layers)) or 'none'}-{name}{sharded}"
        cached = (path / "features.json").exists()
        barrier()
        shared = not sharded and not in_memory and not w.main  # the main worker extracts it once, for all
        if not cached and not shared:
            if not part:
                raise ValueError(f"no {name} samples: use more --samples or fewer --heldout")
            with progress_bar() as bar:
                task = bar.add_task(f"target features ({name})", total=len(part))
                store = extract_features(llm.model, part, layers, device=args.device if in_memory else "cpu",
                                         batch_tokens=8192 if args.device.startswith("cuda") else 2048 // w.size,
                                         progress=lambda n, task=task: bar.advance(task, n))
            if not in_memory:
                store.save(path)
        if not sharded:
            barrier()  # the shared cache is written
        if cached or shared:
            store = FeatureStore.load(path)
        stores.append(store.to(args.device))
    return llm, stores[0], stores[1]


def partial_path(path: Path) -> Path:
    """Where this worker keeps its answers as they come, until `path` is written."""
    w = world()
    return path.with_name(f"{path.stem}.partial{f'.{w.rank}of{w.size}' if w.size > 1 else ''}.jsonl")


def distill(llm, args: argparse.Namespace, path: Path):
    """The target answers training prompts: through specdecode's engine (the model as loaded, on a CPU) or
    transformers' batched `generate` on the same checkpoint in float (on a GPU); see --distill-engine."""
    prompts = shard(load_prompts(llm.tokenizer, args.data, args.samples, args.seed, args.max_prompt_tokens))
    engine = args.distill_engine
    if engine == "auto":
        engine = "transformers" if str(args.device).startswith("cuda") else "specdecode"
    options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, temperature=args.temperature,
                   seed=args.seed, seconds=args.distill_seconds)
    partial = partial_path(path)
    order = {tuple(p): i for i, p in enumerate(prompts)}
    done = [s for s in load_answered(partial) if tuple(s.tokens[: s.prompt_len]) in order]
    answered = {tuple(s.tokens[: s.prompt_len]) for s in done}
    left = [p for p in prompts if tuple(p) not in answered]
    if done:
        err.print(f"resuming self-distillation: {len(done)} answers kept in {partial}, {len(left)} prompts left")
    save_samples(partial, done)  # without a line the interruption cut short

    started = time.perf_counter()
    with progress_bar() as bar, partial.open("a") as kept:
        def keep(batch: list) -> None:  # on disk as they come: an interrupted run answers only the rest
            kept.write(sample_lines(batch))
            kept.flush()

        task = bar.add_task(f"the target answers training prompts ({engine})", total=len(prompts))
        bar.advance(task, len(done))
        hooks = dict(progress=lambda n: bar.advance(task, n), on_batch=keep)
        if engine == "specdecode":
            samples = engine_distill(llm, left, **hooks, **options)
        else:
            samples = hf_distill(llm, args, left, **hooks, **options)
    samples = sorted(done + samples, key=lambda s: order[tuple(s.tokens[: s.prompt_len])])  # in prompt order
    samples = gather_samples(samples, path)
    partial.unlink()
    answer = sum(len(s.tokens) - s.prompt_len for s in samples)
    err.print(f"{len(samples)} answers, {answer} tokens in {time.perf_counter() - started:.0f} s -> {path}")
    return samples


def hf_distill(llm, args: argparse.Namespace, prompts: list[list[int]], **options) -> list:
    from transformers import AutoModelForCausalLM

    from ..models import resolve

    hf = AutoModelForCausalLM.from_pretrained(str(resolve(args.target)), dtype=DTYPES[args.dtype]).to(args.device)
    hf.eval()
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(llm.stop_token_ids)
    return self_distill(hf, prompts, stop_token_ids=sorted(llm.stop_token_ids), pad_token_id=pad, **options)


def gather_samples(mine: list, path: Path) -> list:
    """Every worker's answers, merged in prompt order (where all were answered), saved once in `path`."""
    w = world()
    if w.size == 1:
        save_samples(path, mine)
        return mine
    parts = [path.with_name(f"{path.stem}.part{r}of{w.size}.jsonl") for r in range(w.size)]
    save_samples(parts[w.rank], mine)
    barrier()
    samples = unshard([load_samples(p) for p in parts])
    barrier()
    if w.main:
        save_samples(path, samples)
        for p in parts:
            p.unlink()
    barrier()
    return samples


def target_config(target: str):
    from ..models import ModelConfig, resolve

    path = resolve(target)
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def write_report(out: Path, args: argparse.Namespace, kind: str, n_train: int, n_heldout: int) -> Path:
    """report.md: the command, the data, and the held-out scores at each evaluation."""
    log = out / "train_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    title = {"eagle": "EAGLE head", "medusa": "Medusa heads", "draft": "distilled draft LM"}.get(kind, kind)
    lines = [f"# {title} for {args.target}", "", f"- command: `specdecode {' '.join(sys.argv[1:])}`",
             f"- samples: {n_train} train, {n_heldout} held out (the target's own answers to training prompts)",
             ""]
    if rows:
        keys = [k for k in rows[-1] if k.startswith("heldout_")]
        lines += ["| step | seconds | " + " | ".join(k.removeprefix("heldout_") for k in keys) + " |",
                  "|---:|---:|" + "---:|" * len(keys)]
        lines += [f"| {r['step']} | {r['seconds']} | " + " | ".join(f"{r.get(k, float('nan')):.3f}" for k in keys)
                  + " |" for r in rows]
        lines += ["", "acc_d: held-out greedy acceptance at draft depth d given depths < d accepted; "
                  "chain_tau: the expected tokens per target forward of a chain draft."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
