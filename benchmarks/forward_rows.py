"""What a forward of n new tokens costs against one token (T(n) / T(1)): the price of verifying n guessed tokens.

Runs the default model after a cached context, n = 1, 2, 4, 8, 16, and splits each forward into the blocks (the
per-layer matmuls, attention, norms, RoPE; one native call per layer) and the output layer (norm + lm_head on n
rows), with the four per-layer matmuls also timed alone. With --before DIR (another checkout of specdecode, e.g.
`git archive <rev> | tar -x -C DIR`) it compares two versions of the code: rounds alternate between the two in
fresh processes (the order flips every round), so a loaded machine hits both alike; medians and spreads over rounds.

    python benchmarks/forward_rows.py --quantization auto,none --before /tmp/before --out <dir>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

SIZES = (1, 2, 4, 8, 16)


def worker(quantization: str, context: int, reps: int) -> dict:
    """One process, one version of the code: the median of `reps` timings of each part, per size, in ms."""
    import torch

    import specdecode
    from specdecode import kernels

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    q = None if quantization == "none" else quantization
    model = specdecode.load("smollm2-135m-instruct", quantization=q).model
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(context + 32)
    model.forward(torch.randint(0, cfg.vocab_size, (1, context), generator=g), cache, logits_at=None)
    layers = [(m, torch.randn(16, m.in_features if hasattr(m, "in_features") else m.weight.shape[1], generator=g))
              for block in model.layers for m in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2)]

    def once(part: str, n: int) -> float:
        tokens = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
        start = time.perf_counter()
        with torch.inference_mode():
            if part == "forward":
                model.forward(tokens, cache)
            elif part == "blocks":
                model.forward(tokens, cache, logits_at=None)
            elif part == "head":
                model.lm_head(model.norm(hidden[:, :n]))
            else:
                for m, x in layers:
                    m(x[:n])
        seconds = time.perf_counter() - start
        cache.rollback(context)
        return seconds * 1e3

    hidden = torch.randn(1, 16, cfg.hidden_size, generator=g)
    names = ("forward", "blocks", "head", "matmuls")
    parts: dict[str, dict[int, list[float]]] = {p: {n: [] for n in SIZES} for p in names}
    for _ in range(reps + 1):  # the first round warms up
        for n in SIZES:
            for part in names:
                parts[part][n].append(once(part, n))
    return {"weights": model.weights_kind(), "simd": kernels.simd(),
            "parts": {p: {n: statistics.median(v[1:]) for n, v in by.items()} for p, by in parts.items()}}


def run_side(code: Path, quantization: str, context: int, reps: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, "--worker", "--quantization", quantization, "--context",
                          str(context), "--reps", str(reps)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="auto,none", help="comma-separated: auto (the GGUF as stored), none, ...")
    ap.add_argument("--before", type=Path, help="another checkout to compare with (its code, this process's model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="timings per part and size in each round (median taken)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OpenMP/torch threads of the workers")
    ap.add_argument("--out", type=Path, help="directory for report.md and raw.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.quantization, args.context, args.reps)))
        return
    here = Path(__file__).resolve().parents[1]
    sides = {"after": here} | ({"before": args.before.resolve()} if args.before else {})
    raw: dict[str, dict[str, list[dict]]] = {q: {s: [] for s in sides} for q in args.quantization.split(",")}
    for r in range(args.rounds):
        for q in raw:
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                print(f"round {r + 1}/{args.rounds}: {q}, {side}...", file=sys.stderr, flush=True)
                raw[q][side].append(run_side(sides[side], q, args.context, args.reps, args.threads))
    command = (f"python benchmarks/forward_rows.py --quantization {args.quantization} --threads {args.threads} "
               f"--rounds {args.rounds} --reps {args.reps}")
    if args.before:
        command += " --before <checkout of the previous kernels>"
    lines = [f"# Forward cost of n new tokens vs one: SmolLM2-135M, {args.context} cached tokens", "",
             f"Date {date.today()}, {platform.machine()}, {args.threads} of {os.cpu_count()} CPUs (shared with other "
             f"work: medians over {args.rounds} rounds, each the median of {args.reps} timings; spread = min-max over "
             f"rounds). Command: `{command}`", ""]
    for q, by_side in raw.items():
        for side, runs in by_side.items():
            lines += [f"## quantization={q}, {side}: {runs[0]['weights']}", "",
                      "| n | forward ms | T(n)/T(1) | blocks ms | blocks T(n)/T(1) | head ms | 120 matmuls ms |",
                      "|---:|---:|---:|---:|---:|---:|---:|"]
            for n in SIZES:
                col = {part: [run["parts"][part][str(n)] for run in runs] for part in ("forward", "blocks", "head",
                                                                                        "matmuls")}
                ratio = [run["parts"]["forward"][str(n)] / run["parts"]["forward"]["1"] for run in runs]
                bratio = [run["parts"]["blocks"][str(n)] / run["parts"]["blocks"]["1"] for run in runs]
                lines.append(f"| {n} | {spread(col['forward'])} | {spread(ratio)} | {spread(col['blocks'])} | "
                             f"{spread(bratio)} | {spread(col['head'])} | {spread(col['matmuls'])} |")
            lines.append("")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(report)
        (args.out / "raw.json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
