"""Forward cost of verifying n tokens after a cached context: specdecode's runtime vs transformers.

Both run the same checkpoint in the same process; measurements are interleaved (ours, theirs, ours, ...)
so machine drift hits both equally. Reports the median and min/max in milliseconds per forward.

    python benchmarks/forward_cost.py --out benchmarks/results/forward_cost.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specdecode.models import load_transformer, resolve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--sizes", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    path = resolve(args.model)
    ours = load_transformer(path, dtype=dtype)
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, ours.config.vocab_size, (1, args.context), generator=g)
    cache = ours.new_cache(args.context + 64)
    ours.forward(context, cache, logits_at=None)
    with torch.inference_mode():
        hf_cache = DynamicCache(config=theirs.config)
        theirs(context, past_key_values=hf_cache, use_cache=True)

    def run_ours(tokens: torch.Tensor) -> None:
        ours.forward(tokens, cache)
        cache.rollback(args.context)

    def run_theirs(tokens: torch.Tensor) -> None:
        with torch.inference_mode():
            theirs(tokens, past_key_values=hf_cache, use_cache=True)
        hf_cache.crop(-tokens.shape[1])  # drop what this forward added

    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[tuple[str, int], list[float]] = {(who, n): [] for who in ("ours", "transformers") for n in sizes}
    for rep in range(args.repeats + 2):  # two warm-up rounds
        for n in sizes:
            tokens = torch.randint(0, ours.config.vocab_size, (1, n), generator=g)
            for who, fn in (("ours", run_ours), ("transformers", run_theirs)):
                t = time.perf_counter()
                fn(tokens)
                if rep >= 2:
                    times[(who, n)].append((time.perf_counter() - t) * 1e3)

    lines = [
        f"# Forward cost: {args.model}, {args.dtype}, {args.context} cached tokens",
        "",
        f"Date {date.today()}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}. Command: `python benchmarks/forward_cost.py "
        f"--context {args.context} --repeats {args.repeats} --dtype {args.dtype}`",
        "",
        "| tokens | ours ms (median, min-max) | transformers ms (median, min-max) | ours vs 1 token "
        "| theirs vs 1 token | transformers / ours |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    base = {who: statistics.median(times[(who, sizes[0])]) for who in ("ours", "transformers")}
    for n in sizes:
        o, t = times[("ours", n)], times[("transformers", n)]
        mo, mt = statistics.median(o), statistics.median(t)
        lines.append(
            f"| {n} | {mo:.1f} ({min(o):.1f}-{max(o):.1f}) | {mt:.1f} ({min(t):.1f}-{max(t):.1f}) | "
            f"{mo / base['ours']:.2f}x | {mt / base['transformers']:.2f}x | {mt / mo:.2f}x |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
