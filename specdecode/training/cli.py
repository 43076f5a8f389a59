"""`specdecode train eagle|medusa|draft`: self-distilled data -> cached target features -> a trained draft.

Every stage is cached under OUT/work, so an interrupted run picks up where it stopped: the target's
answers (samples.jsonl; while they are being written, samples.partial.jsonl batch by batch), the features
(work/features-*), and training checkpoints. --distill-only stops after the answers (train elsewhere).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import distill_cli, medusa_cli
from .common import answers, err, flush_denormals, prepare, target_config, train_config, write_report
from .distributed import finish, init, launch, launched, samples_trained_on, world
from .parsers import add_train_parser  # noqa: F401 - where callers found it before it moved


def cmd_train(args: argparse.Namespace) -> int:
    flush_denormals()
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.batch_size % args.nproc:
        raise ValueError(f"--batch-size {args.batch_size} does not split between {args.nproc} processes: use a "
                         "multiple of --nproc (it is the global batch)")
    if args.nproc > 1 and not launched():
        err.print(f"training in {args.nproc} processes (torchrun, PyTorch DDP)")
        return launch(args.nproc, args.argv)
    if args.device is None:  # the parser leaves it open: deciding it imports torch, which --help does not need
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    world, args.device = init(args.device)
    err.quiet = not world.main  # one voice: the main worker's
    try:
        if args.distill_only:
            return answer_only(args)
        run = {"eagle": train_eagle_cmd, "medusa": medusa_cli.run, "draft": distill_cli.run}[args.kind]
        return run(args)
    finally:
        finish()


def answer_only(args: argparse.Namespace) -> int:
    """--distill-only: the target's answers, and where to take them."""
    _, samples = answers(args)
    path = Path(args.samples_file) if args.samples_file else Path(args.out) / "work" / "samples.jsonl"
    if world().main:
        err.print(f"{len(samples)} answers in {path}: train with `specdecode train {args.kind} --samples-file "
                  f"{path} ...` here or on another machine, or run this command again without --distill-only")
    return 0


def load_init(where: str, target: str):
    """--init: a trained head's folder, or 'shipped' (the head shipped for a registry name)."""
    from ..engine.assets import SHIPPED_EAGLE
    from ..models.head_files import load_head

    path = SHIPPED_EAGLE.get(target.lower()) if where == "shipped" else Path(where)
    if path is None:
        raise ValueError(f"no EAGLE head ships for {target!r} (heads ship for {', '.join(SHIPPED_EAGLE)}): "
                         "pass --init DIR, a head you trained")
    return load_head(path)


def train_eagle_cmd(args: argparse.Namespace) -> int:
    from ..models.eagle import EagleConfig
    from .eagle import train_eagle

    if args.draft_vocab < 1 or args.ttt_steps < 1:
        raise ValueError("--draft-vocab and --ttt-steps must be >= 1")
    out = Path(args.out)
    from ..api import LLM  # noqa: F401 - fail early if the package is broken

    init = None if args.init is None else load_init(args.init, args.target)
    config = init.config if init else EagleConfig.for_target(target_config(args.target), args.draft_vocab,
                                                             arch=getattr(args, "arch", None) or "specdecode")
    layers = config.target_layers
    llm, store, heldout = prepare(args, layers)
    train_eagle(llm.model, store, heldout, out, train_config(args), draft_vocab=args.draft_vocab,
                ttt_steps=args.ttt_steps, batch_size=args.batch_size, max_len=args.max_len, log=err.print,
                init=init, vocab_swaps=args.vocab_swaps, arch=getattr(args, "arch", None))
    trained_on = samples_trained_on(store)  # every worker's shard
    if not world().main:
        return 0
    write_report(out, args, "eagle", trained_on, len(heldout))
    err.print(f"EAGLE head saved in {out}: use it with --method eagle --draft {out}")
    return 0
