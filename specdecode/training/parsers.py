"""The arguments of `specdecode train eagle|medusa|draft`, apart from the code that trains: this module imports no
torch, so `specdecode train ... --help` and a mistyped option answer at once (the commands themselves, in cli.py,
medusa_cli.py and distill_cli.py, import it when they run)."""

from __future__ import annotations

import argparse

from ..common.names import DTYPE_NAMES
from ..data import train_dir

SAVE_DTYPE_NAMES = ("float32", "bfloat16")  # medusa_cli / distill_cli.SAVE_DTYPES: torch's dtypes of these names


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a draft on the target's own answers: eagle, medusa or draft")
    kinds = t.add_subparsers(dest="kind", required=True)
    e = kinds.add_parser("eagle", help="an EAGLE-3-style head (fused low/mid/high features, training-time test)")
    add_common(e)
    e.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head predicts (most frequent)")
    e.add_argument("--ttt-steps", type=int, default=4, help="draft depths unrolled in training")
    e.add_argument("--init", help="fine-tune this trained head (its folder, or 'shipped': the one shipped for the "
                                  "target) on the answers to --data's prompts, your traffic's; its layers and draft "
                                  "vocabulary size stay (--draft-vocab is not used)")
    e.add_argument("--arch", choices=["specdecode", "eagle3"],
                   help="the head's architecture: specdecode's first (the default) or EAGLE-3's own, which other "
                        "engines load (`specdecode export-head`); with --init specdecode's, a warm start from it")
    e.add_argument("--vocab-swaps", type=int, default=512,
                   help="with --init: draft vocabulary rows the head may give to tokens of these answers it lacks")
    add_medusa_parser(kinds, "medusa")
    add_draft_parser(kinds, "draft")


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf")
    p.add_argument("--data", default=str(train_dir()),
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
    p.add_argument("--device", help="where training runs (default: cuda where torch sees a GPU, else cpu: decided "
                                    "when the command runs, so --help needs no torch)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES),
                   help="the target's dtype for data and features")
    p.add_argument("--bf16", action="store_true", help="train under bfloat16 autocast (GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and initialisation")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes (torchrun + PyTorch DDP: gloo on CPUs, nccl on GPUs, one GPU each); "
                        "--batch-size is the global batch, split between them")


def add_medusa_parser(kinds, name: str) -> None:
    p = kinds.add_parser(name, help="Medusa heads: residual blocks on the last hidden state guessing +2..+K+1")
    add_common(p)
    p.add_argument("--max-samples", dest="samples", type=int, default=argparse.SUPPRESS, help="same as --samples")
    p.add_argument("--heads", type=int, default=4, help="tokens guessed per step (one head per tree depth)")
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="tokens the heads predict (most frequent answer tokens; 0 = the whole vocabulary)")
    p.add_argument("--kd-weight", type=float, default=0.8,
                   help="share of the loss on the teacher's top-k (the rest: the token itself)")
    p.add_argument("--save-dtype", choices=list(SAVE_DTYPE_NAMES), default="float32",
                   help="dtype of the saved weights (bfloat16: half the size; cast to the target's on load)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts decoded with the heads at the end")


def add_draft_parser(kinds, name: str) -> None:
    p = kinds.add_parser(name, help="a small draft LM with the target's tokenizer, distilled from the target (KD)")
    add_common(p)
    p.add_argument("--max-samples", dest="samples", type=int, default=argparse.SUPPRESS, help="same as --samples")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the draft")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the draft")
    p.add_argument("--heads", type=int, help="attention heads (default: hidden / 64)")
    p.add_argument("--intermediate", type=int, help="MLP size (default: 8/3 x hidden, rounded up to 64)")
    p.add_argument("--kd-weight", type=float, default=0.8,
                   help="share of the loss on the teacher's top-k (the rest: the token itself)")
    p.add_argument("--init-embed", choices=["target", "random"], default="target",
                   help="the draft's embedding starts as the target's projected to --hidden dims, or random")
    p.add_argument("--save-dtype", choices=list(SAVE_DTYPE_NAMES), default="float32",
                   help="dtype of the saved weights (bfloat16: half the size; cast to the target's on load)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts decoded with the draft at the end")
    p.add_argument("--eval-k", type=int, default=4, help="draft depth for that final held-out decoding")
