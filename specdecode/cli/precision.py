"""The precision options every command shares (generate, tune, bench, serve): --dtype, --quantization and
--kv-cache-dtype."""

from __future__ import annotations

import argparse

from ..common.names import DTYPE_NAMES, KV_CACHE_DTYPES, QUANTIZATIONS

QUANTIZATION_CHOICES = ["auto", "none", *QUANTIZATIONS]


def add_precision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES),
                   help="activations and unquantized weights (default: %(default)s)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weights: auto = a GGUF file's Q4_0/Q4_1/Q8_0 as stored, int8 activations as llama.cpp, "
                   "others in --dtype; none = all in --dtype; int4/int8 = weight-only, float32 activations; "
                   "int4-a8/int8-a8 = int8 activations too (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="float16", choices=list(KV_CACHE_DTYPES),
                   help="keys and values of a float32 model: float16 = half the memory, as llama.cpp; float32 = as "
                   "computed (default: %(default)s)")


def quantization(args: argparse.Namespace) -> str | None:
    """--quantization as `specdecode.load` takes it ("none" -> None)."""
    return None if args.quantization == "none" else args.quantization
