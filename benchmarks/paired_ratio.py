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


def paired(runs: list[list[dict]], a: str, b: str, same_work: bool = False, resamples: int = 2000,
           seed: int = 0) -> list[tuple]:
    """[(category, ratio, low, high, prompts)], the categories in the first run's order, then 'overall'. runs: each
    run's records; a prompt's A and B times of a run pair up, and add up over the runs. same_work: only the runs of a
    prompt where A and B did the same work (the same forwards and guesses): what the bench's noise alone gives."""
    rows: dict[str, dict[tuple, list[float]]] = defaultdict(dict)
    for records in runs:
        by: dict[tuple, dict[str, dict]] = defaultdict(dict)
        for r in records:
            by[(r["category"], r["question_id"], r.get("temperature", 0.0))][r["method"]] = r
        for (category, *prompt), methods in by.items():
            ra, rb = methods.get(a), methods.get(b)
            if ra is None or rb is None or same_work and (
                    (ra["target_forwards"], ra["drafted"]) != (rb["target_forwards"], rb["drafted"])):
                continue
            pair = rows[category].setdefault(tuple(prompt), [0.0, 0.0])
            pair[0] += ra["seconds"]
            pair[1] += rb["seconds"]
    if not rows and not same_work:
        methods = sorted({r["method"] for records in runs for r in records})
        raise SystemExit(f"no prompt has both {a!r} and {b!r}: the methods of these runs are {methods}")
    rng = random.Random(seed)
    out = []
    every = [pair for category in rows.values() for pair in category.values()]
    for category, pairs in [*((c, list(ps.values())) for c, ps in rows.items()), ("overall", every)]:
        def ratio(sample):
            return sum(x for x, _ in sample) / sum(y for _, y in sample)

        boots = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(resamples))
        out.append((category, ratio(pairs), boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1],
                    len(pairs)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="a bench run's results.json, or several runs' (pooled)")
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args()
    runs = [json.loads(Path(path).read_text())["records"] for path in args.results]
    methods = {r["method"] for records in runs for r in records}
    control = {c: row for c, *row in paired(runs, "none", "none@k=0")} if {"none", "none@k=0"} <= methods else {}
    same = {c: row for c, *row in paired(runs, args.a, args.b, same_work=True)}
    pooled = f", {len(runs)} runs pooled" if len(runs) > 1 else ""
    print(f"time of {args.a} / time of {args.b}, same prompts (> 1: {args.b} faster){pooled}; 95% bootstrap over "
          "prompts; same work: the prompts where both made the same forwards and guesses (noise alone)\n")
    print(f"| category | {args.a} / {args.b} | same work (prompts) | control: none / none@k=0 |\n|---|---:|---:|---:|")

    def cell(row) -> str:
        return f"{row[0]:.3f} [{row[1]:.3f}, {row[2]:.3f}]" if row else "-"

    for category, ratio, low, high, _ in paired(runs, args.a, args.b):
        noise = same.get(category)
        same_cell = f"{cell(noise)} ({noise[3]})" if noise else "-"
        print(f"| {category} | {cell((ratio, low, high))} | {same_cell} | {cell(control.get(category))} |")


if __name__ == "__main__":
    main()
