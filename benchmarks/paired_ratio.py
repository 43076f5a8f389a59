"""Two methods of a `specdecode bench` run compared prompt by prompt: per category, the time of A over the time of
B on the same prompts (> 1: B is faster), with a 95% bootstrap interval over the prompts. The plain decoding
control (`none@k=0` over `none`) shows what the run's noise alone gives. Several runs of the same code pool: a
prompt's times add up over the runs (each its fastest of `--repeats`), and the bootstrap resamples prompts.

    python benchmarks/paired_ratio.py benchmarks/results/RUN/results.json prompt-lookup@k=auto suffix@k=auto
    python benchmarks/paired_ratio.py RUN1/results.json RUN2/results.json suffix@k=auto hybrid@k=auto
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path


def paired(records: list[dict], a: str, b: str, resamples: int = 2000, seed: int = 0) -> list[tuple]:
    """[(category, ratio, low, high)], the categories in the run's order, then 'overall'."""
    seconds: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        seconds[(r["category"], r["question_id"], r.get("temperature", 0.0))][r["method"]].append(r["seconds"])
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (category, *_), by in seconds.items():
        if a in by and b in by:
            if len(by[a]) != len(by[b]):
                raise SystemExit(f"{category}: a prompt ran {len(by[a])} times with {a!r}, {len(by[b])} with {b!r}")
            rows[category].append((sum(by[a]), sum(by[b])))
    if not rows:
        methods = sorted({r["method"] for r in records})
        raise SystemExit(f"no prompt has both {a!r} and {b!r}: the methods of this run are {methods}")
    rng = random.Random(seed)
    out = []
    for category, pairs in [*rows.items(), ("overall", [p for ps in rows.values() for p in ps])]:
        def ratio(sample):
            return sum(x for x, _ in sample) / sum(y for _, y in sample)

        boots = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(resamples))
        out.append((category, ratio(pairs), boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="a bench run's results.json, or several runs' (pooled)")
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args()
    records = [r for path in args.results for r in json.loads(Path(path).read_text())["records"]]
    control = {c: (r, lo, hi) for c, r, lo, hi in paired(records, "none", "none@k=0")} \
        if {"none", "none@k=0"} <= {r["method"] for r in records} else {}
    runs = f", {len(args.results)} runs pooled" if len(args.results) > 1 else ""
    print(f"time of {args.a} / time of {args.b}, same prompts (> 1: {args.b} faster){runs}; 95% bootstrap over "
          "prompts\n")
    print(f"| category | {args.a} / {args.b} | control: none / none@k=0 |\n|---|---:|---:|")
    for category, ratio, low, high in paired(records, args.a, args.b):
        c = control.get(category)
        noise = f"{c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}]" if c else "-"
        print(f"| {category} | {ratio:.3f} [{low:.3f}, {high:.3f}] | {noise} |")


if __name__ == "__main__":
    main()
