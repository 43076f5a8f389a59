"""An F16 / BF16 matrix at its 16 bits (HalfLinear, kernels/f16matmul.c) vs the float32 copy GGUF loads made of it
before (Linear, the native float32 kernel): time of x @ W^T for the few rows of decoding and verification.

One random matrix of --out-features x --in-features (default 16384 x 2048: a 1.7B Llama's fused gate|up), the same
values in both layouts (the 16-bit words widened exactly). Calls alternate (16-bit, float32, 16-bit, ...) in
--rounds rounds of --calls calls each; the report gives per-call medians, the ratio float32 / 16-bit (median and
min-max over rounds), the bytes each layout reads a call, and the machine's load average.

    python benchmarks/f16_matmul.py --out benchmarks/results/f16_matmul.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from specdecode import kernels
from specdecode.models.halflinear import HalfLinear
from specdecode.models.linear import Linear


def timed(layer: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-features", type=int, default=16384)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if kernels.native() is None:
        raise SystemExit("the native kernels are unavailable here: nothing to compare")
    n, k = args.out_features, args.in_features
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) / k**0.5).astype(np.float32)
    lines = [f"# F16 / BF16 matrices at 16 bits vs float32 ({date.today()})", "",
             f"Command: `python benchmarks/f16_matmul.py {' '.join(sys.argv[1:])}`", "",
             f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, kernels "
             f"{kernels.simd()}, torch threads {torch.get_num_threads()}, load average before "
             f"{os.getloadavg()[0]:.1f}. Matrix {n} x {k}: {n * k * 2 / 2**20:.0f} MiB at 16 bits, "
             f"{n * k * 4 / 2**20:.0f} MiB in float32.", "",
             "| type | rows | 16-bit ms | float32 ms | float32 / 16-bit (median, min-max) |",
             "|---|---:|---:|---:|---|"]
    for name in ("F16", "BF16"):
        if name == "F16":
            bits = torch.from_numpy(w.astype(np.float16).view(np.int16).copy())
        else:
            bits = torch.from_numpy((w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16).copy())
        half = HalfLinear(bits, name == "BF16")
        dense = Linear(k, n, bias=False)
        dense.weight = torch.nn.Parameter(half.dequantize(), requires_grad=False)
        for m in args.rows:
            x = torch.randn(m, k)
            with torch.inference_mode():
                torch.testing.assert_close(half(x), dense(x), rtol=1e-4, atol=1e-4)
                timed(half, x, 2), timed(dense, x, 2)  # warm
                ours, theirs = [], []
                for _ in range(args.rounds):
                    ours.append(timed(half, x, args.calls))
                    theirs.append(timed(dense, x, args.calls))
            ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
            lines.append(f"| {name} | {m} | {statistics.median(ours) * 1e3:.2f} | {statistics.median(theirs) * 1e3:.2f}"
                         f" | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
            print(lines[-1], flush=True)
    lines += ["", f"Load average after: {os.getloadavg()[0]:.1f}."]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
