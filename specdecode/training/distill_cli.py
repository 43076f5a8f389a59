"""`specdecode train draft`: a small Llama draft LM distilled from the target's own answers."""

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
    if args.layers < 1 or args.hidden < 1 or (args.heads is not None and args.heads < 1):
        raise ValueError("--layers, --hidden and --heads must be >= 1")
    if not 0 <= args.kd_weight <= 1:
        raise ValueError(f"--kd-weight must be in [0, 1], got {args.kd_weight}")
    if args.steps < 1 or args.batch_size < 1 or args.samples < 2 or args.eval_k < 1:
        raise ValueError("--steps, --batch-size and --eval-k must be >= 1, --samples >= 2 (some are held out)")
    answered = args.samples_file or (Path(args.out) / "work" / "samples.jsonl").exists()  # no prompts needed
    if not Path(args.data).is_dir() and not answered:
        raise FileNotFoundError(f"training data folder {args.data} not found: {TRAIN_SOURCE}")


def run(args: argparse.Namespace) -> int:
    from ..models import load_transformer, resolve
    from ..proposers import DraftModelProposer
    from .distill import draft_config, train_draft

    check_args(args)
    out = Path(args.out)
    target_hf = json.loads((resolve(args.target) / "config.json").read_text())
    config = draft_config(target_hf, args.layers, args.hidden, args.heads, args.intermediate)
    check_samples_file(args.samples_file, config["vocab_size"])
    claim(out, {"kind": "draft", "target": args.target, "draft_config": config, "kd_weight": args.kd_weight,
                "init_embed": args.init_embed})
    llm, store, heldout = prepare(args, [])  # the teacher's distributions only: no hidden states needed
    train_draft(store, heldout, out, train_config(args), config, llm.tokenizer, batch_size=args.batch_size,
                max_len=args.max_len, kd_weight=args.kd_weight, device=args.device,
                save_dtype=SAVE_DTYPES[args.save_dtype], log=err.print,
                target_embed=llm.model.embed.weight if args.init_embed == "target" else None)
    trained_on = samples_trained_on(store)  # every worker's shard
    if not world().main:
        return 0
    report = write_report(out, args, "draft", trained_on, len(heldout))
    with report.open("a") as f:
        f.write("\nFor the draft LM, acc is its top-1 agreement with the target at held-out answer positions "
                "(greedy acceptance of one guess), chain4_tau the tokens per forward of 4-guess chains if each "
                "guess were accepted at that rate.\n")
    if args.eval_prompts > 0:
        target = llm.model
        draft = load_transformer(out, dtype=target.dtype, device=str(target.device))  # as `--method draft` loads it
        stats = append_decoding_report(
            report, target, lambda: DraftModelProposer(draft, target.config.vocab_size), heldout, args.eval_prompts,
            k=args.eval_k, max_new_tokens=min(args.max_new_tokens, 128))
        err.print(f"held-out greedy decoding: tau {stats['tau']:.2f}, acceptance {stats['acceptance_rate']:.2f}")
    err.print(f"draft saved in {out}: use it with --method draft --draft {out}")
    return 0
