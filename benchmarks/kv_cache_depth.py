"""Decode cost by context depth and KV cache dtype (float32, float16, int8): ms per one-token forward after 100, 500,
1000 and 2000 cached tokens (issue 56: long contexts are bound by reading the cache's keys and values).

One process, one model (the default, SmolLM2-135M-Instruct as the registry gives it): per depth and cache dtype a
cache is prefilled once with random tokens; a round times `--steps` one-token forwards at each depth with each dtype,
rolling the cache back to the depth before each, the dtype order rotating every round (a machine whose speed drifts
hits all alike). Reported: per depth and dtype the median ms per token over rounds with its spread, each dtype's time
over the first dtype's paired round by round, and each dtype's speed at a depth relative to its speed at the smallest.

    python benchmarks/kv_cache_depth.py --dtypes float16,int8,float32 --threads 2 --rounds 7 \
        --out benchmarks/results/kv-cache-depth-int8.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--depths", default="100,500,1000,2000")
    ap.add_argument("--steps", type=int, default=16, help="one-token forwards timed per depth, dtype and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,float16", help="cache dtypes, the first the ratios' reference")
    ap.add_argument("--out", type=Path, help="the report (markdown); printed when not given")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import specdecode
    from specdecode import kernels
    from specdecode.bench.hardware import machine_description

    model = specdecode.LLM.load(args.model).model
    depths = [int(d) for d in args.depths.split(",")]
    dtypes = args.dtypes.split(",")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    caches = {}
    with torch.inference_mode():
        for name in dtypes:
            model.kv_cache_dtype = name
            for d in depths:
                cache = model.new_cache(d + args.steps + 1)
                model.forward(torch.randint(0, vocab, (1, d), generator=g), cache, logits_at=None)
                caches[name, d] = cache
        tokens = torch.randint(0, vocab, (args.steps,), generator=g).tolist()

        def timed(name: str, d: int) -> float:
            cache = caches[name, d]
            cache.rollback(d)
            started = time.perf_counter()
            for t in tokens:
                model.forward(torch.tensor([[t]]), cache, logits_at=slice(-1, None))
            return (time.perf_counter() - started) / len(tokens) * 1e3

        for name in dtypes:  # warm-up: kernels built, caches touched
            for d in depths:
                timed(name, d)
        ms: dict[tuple[str, int], list[float]] = {key: [] for key in caches}
        for r in range(args.rounds):
            for d in depths:
                for name in dtypes[r % len(dtypes):] + dtypes[: r % len(dtypes)]:
                    ms[name, d].append(timed(name, d))

    cfg = model.config
    per_token_kb = {name: caches[name, depths[0]].kv[:, :, :, :, :1].numel()
                    * caches[name, depths[0]].kv.element_size() / 1024 for name in dtypes}
    first, others = dtypes[0], dtypes[1:]
    lines = [f"# KV cache dtype by context depth ({date.today().isoformat()})", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Model: {args.model} ({model.quantization} weights, {cfg.num_layers} layers, {cfg.num_kv_heads} kv heads "
             f"of {cfg.head_dim}); kernels: {kernels.simd()}; {args.threads} thread(s); {args.rounds} interleaved "
             f"rounds of {args.steps} one-token forwards per depth and dtype.", "",
             f"Machine: {machine_description()}", "",
             "| depth | " + " | ".join(f"{name} ms/token" for name in dtypes) + " | "
             + " | ".join(f"{name} / {first} (paired)" for name in others) + f" | KV MB read ({' / '.join(dtypes)}) |",
             "|---:|" + "---:|" * (2 * len(dtypes))]
    for d in depths:
        ratios = [spread([a / b for a, b in zip(ms[name, d], ms[first, d], strict=True)]) for name in others]
        mb = " / ".join(f"{per_token_kb[name] * d / 1024:.1f}" for name in dtypes)
        lines.append(f"| {d} | " + " | ".join(spread(ms[name, d]) for name in dtypes) + " | " + " | ".join(ratios)
                     + f" | {mb} |")
    lines += ["", "Speed at a depth relative to the same dtype's at the smallest depth (median ms ratio):", "",
              "| depth | " + " | ".join(dtypes) + " |", "|---:|" + "---:|" * len(dtypes)]
    for d in depths:
        rel = [statistics.median(ms[name, depths[0]]) / statistics.median(ms[name, d]) for name in dtypes]
        lines.append(f"| {d} | " + " | ".join(f"{x:.2f}x" for x in rel) + " |")
    report = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
