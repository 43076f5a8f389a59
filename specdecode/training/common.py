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
    DEFAULT_TRAIN_DIR,
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
    leaves such values in the gradients, and a CPU multiplies them ~100x slower: one [16384 x 512] x [512 x 640]
    product took 6 s instead of 45 ms, and Gemma training steps slowed from 2 s to 11 s as their share grew.
    PyTorch's worker threads take the setting from the thread that starts them, so it must come first."""
    torch.set_flush_denormal(True)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf")
    p.add_argument("--data", default=str(DEFAULT_TRAIN_DIR),
                   help="folder of training prompts: sharegpt/, gpteacher/, gsm8k/, flan_cot/ (README: Train a draft)")
    p.add_argument("--out", required=True, help="output folder (weights, config, report; work/ holds caches)")
    p.add_argument("--samples", type=int, default=2000, help="prompts the target answers (self-distillation)")
    p.add_argument("--samples-file", help="reuse the target's answers from this samples.jsonl")
    p.add_argument("--heldout", type=int, default=64, help="samples kept out of training for evaluation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of the target's answers")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per batched generate call")
    p.add_argument("--temperature", type=float, default=0.0, help="the target's sampling when answering (0: greedy)")
    p.add_argument("--distill-engine", choices=["auto", "specdecode", "transformers"], default="auto",
                   help="who answers: specdecode's engine (the target as loaded, quantized as it serves; ~3x "
                        "transformers' float32 generate on a CPU) or transformers (float; on a GPU); auto: "
                        "specdecode on a CPU, transformers on a GPU")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="learning-rate warm-up steps")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations (and saves)")
    p.add_argument("--distill-seconds", type=float,
                   help="time budget of self-distillation: prompts not answered by then are left out")
    p.add_argument("--distill-only", action="store_true",
                   help="answer the prompts and stop: train later, here or on another machine (a GPU), with "
                        "--samples-file OUT/work/samples.jsonl; run again, it answers the prompts still left "
                        "(after a --distill-seconds budget)")
    p.add_argument("--train-seconds", type=float,
                   help="time budget of training: the step count (at most --steps) is fitted to it")
    p.add_argument("--feature-cache", choices=["disk", "memory"], default="disk",
                   help="keep the target's features under OUT/work (a rerun skips extracting them) or in memory "
                        "only (large runs: tens of GB)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where training runs")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the target's dtype for data and features")
    p.add_argument("--bf16", action="store_true", help="train under bfloat16 autocast (GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and initialisation")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes (torchrun + PyTorch DDP: gloo on CPUs, nccl on GPUs, one GPU each); "
                        "--batch-size is the global batch, split between them")


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
