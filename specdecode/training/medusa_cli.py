"""`specdecode train medusa`: heads on the target's last hidden state, trained on its own answers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..data import TRAIN_SOURCE
from .common import err, prepare, train_config, write_report
from .distributed import samples_trained_on, world
from .guards import check_samples_file, claim
from .heldout import append_decoding_report
from .parsers import SAVE_DTYPE_NAMES

SAVE_DTYPES = {name: getattr(torch, name) for name in SAVE_DTYPE_NAMES}


def check_args(args: argparse.Namespace) -> None:
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {args.draft_vocab}")
    if not 0 <= args.kd_weight <= 1:
        raise ValueError(f"--kd-weight must be in [0, 1], got {args.kd_weight}")
    if args.steps < 1 or args.batch_size < 1 or args.samples < 2:
        raise ValueError("--steps and --batch-size must be >= 1, --samples >= 2 (some are held out)")
    answered = args.samples_file or (Path(args.out) / "work" / "samples.jsonl").exists()  # no prompts needed
    if not Path(args.data).is_dir() and not answered:
        raise FileNotFoundError(f"training data folder {args.data} not found: {TRAIN_SOURCE}")


def target_vocab(target: str) -> int:
    from ..models import resolve

    return int(json.loads((resolve(target) / "config.json").read_text())["vocab_size"])


def run(args: argparse.Namespace) -> int:
    from ..proposers.medusa import MedusaProposer
    from .medusa import train_medusa

    check_args(args)
    out = Path(args.out)
    check_samples_file(args.samples_file, target_vocab(args.target))
    claim(out, {"kind": "medusa", "target": args.target, "heads": args.heads, "draft_vocab": args.draft_vocab,
                "kd_weight": args.kd_weight})
    llm, store, heldout = prepare(args, [-1])
    heads = train_medusa(llm.model, store, heldout, out, train_config(args), heads=args.heads,
                         draft_vocab=args.draft_vocab, batch_size=args.batch_size, max_len=args.max_len,
                         kd_weight=args.kd_weight, stop_token_ids=sorted(llm.stop_token_ids), name=args.target,
                         save_dtype=SAVE_DTYPES[args.save_dtype], log=err.print)
    trained_on = samples_trained_on(store)  # every worker's shard
    if not world().main:
        return 0
    report = write_report(out, args, "medusa", trained_on, len(heldout))
    with report.open("a") as f:
        f.write("\nFor Medusa, accJ is head J's top-1 accuracy alone (the token J + 1 after the next one), and "
                "tree16_tau the expected tokens per target forward of a 16-node tree built from those accuracies.\n")
    accuracy = ", ".join(f"head {j + 1}: {row[0]:.2f}" for j, row in enumerate(heads.config.accuracy))
    err.print(f"held-out top-1 accuracy {accuracy}")
    if args.eval_prompts > 0:
        heads = heads.to(device=llm.model.device, dtype=llm.model.dtype)
        stats = append_decoding_report(
            report, llm.model, lambda: MedusaProposer(heads, llm.model.config.vocab_size, max_nodes=16),
            heldout, args.eval_prompts, k=args.heads, max_new_tokens=min(args.max_new_tokens, 128))
        err.print(f"held-out greedy decoding: tau {stats['tau']:.2f}, acceptance {stats['acceptance_rate']:.2f}")
    err.print(f"Medusa heads saved in {out}: use them with --method medusa --draft {out}")
    return 0
