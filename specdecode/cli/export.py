"""`specdecode export-head DIR --out OUT`: a draft head written in its published layout, for other engines."""

from __future__ import annotations

import argparse

HELP = "write a draft head in its published layout (Medusa's; EAGLE-3's for a head trained with --arch eagle3)"
DTYPES = ("float32", "bfloat16", "float16")


def add_export_parser(sub) -> None:
    e = sub.add_parser("export-head", help=HELP, description=(
        "Our Medusa heads go to Medusa's layout (medusa_lm_head.safetensors + config.json, as FasterDecoding/Medusa "
        "writes it); an EAGLE head trained with `train eagle --arch eagle3` to EAGLE-3's; a published EAGLE-3 or "
        "Medusa head (e.g. a pickled .bin) is written back as safetensors (the shipped SmolLM2 head is EAGLE-3's). "
        "A head of specdecode's first EAGLE architecture (the shipped Gemma head) cannot be written as EAGLE-3: the "
        "command says why (docs/GUIDE.md)."))
    e.add_argument("head", help="the head's folder")
    e.add_argument("--out", required=True, help="folder to write")
    e.add_argument("--target", default=None,
                   help="the target model (registry name, HF dir or .gguf): needed to read a published head")
    e.add_argument("--dtype", choices=DTYPES, default=None, help="store the weights in this dtype (default: as read)")


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from ..models.published_heads import export_head
    from ..models.published_io import LAYOUT_NAMES

    target = None
    if args.target is not None:
        from ..api import LLM

        target = LLM.load(args.target).model
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    layout = export_head(args.head, args.out, target, dtype)
    print(f"wrote {LAYOUT_NAMES[layout].removeprefix('an ').removeprefix('published ')} to {args.out}")
    return 0
