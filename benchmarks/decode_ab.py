"""End-to-end decoding speed of two versions of the code: tokens/s of each method on the same Spec-Bench prompts.

Each round runs both versions in fresh processes (the order flips every round, so a machine whose speed drifts hits
both alike); a process loads the default model, warms up, then decodes every prompt greedily with each method in
turn, prefill included. Reported: per method the median tokens/s of each version with its spread over rounds, the
ratio after/before paired round by round, and the share of prompts whose tokens the two versions agree on (the
same weights; a kernel change may move a near-tie).

    git worktree add /tmp/before <rev>
    python benchmarks/decode_ab.py --before /tmp/before --methods none,prompt-lookup,suffix --out <dir>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path


def worker(methods: list[str], categories: list[str], per_category: int, max_new_tokens: int) -> dict:
    """One process, one version: {method: {"seconds", "tokens", "outputs"}}."""
    import specdecode
    from specdecode.bench import load_questions

    llm = specdecode.LLM.load()
    questions = [q for q in load_questions(None, "all", per_category) if q.category in categories]
    for method in methods:  # warm-up: kernels built, cost table timed, proposers' first calls
        llm.generate(questions[0].prompt, chat=True, method=method, max_new_tokens=16)
    out = {}
    for method in methods:
        seconds, tokens, outputs = 0.0, 0, []
        for q in questions:
            started = time.perf_counter()
            done = llm.generate(q.prompt, chat=True, method=method, max_new_tokens=max_new_tokens)
            seconds += time.perf_counter() - started
            tokens += done.stats.new_tokens
            outputs.append(done.token_ids)
        out[method] = {"seconds": seconds, "tokens": tokens, "outputs": outputs}
    return out


def run_side(code: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    command = [sys.executable, __file__, "--worker", "--methods", args.methods, "--categories", args.categories,
               "--prompts-per-category", str(args.prompts_per_category), "--max-new-tokens", str(args.max_new_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, help="another checkout of specdecode (its code, same model)")
    ap.add_argument("--methods", default="none,prompt-lookup,suffix")
    ap.add_argument("--categories", default="writing,coding,qa,math_reasoning,summarization")
    ap.add_argument("--prompts-per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, help="directory for report.md and raw.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    methods, categories = args.methods.split(","), args.categories.split(",")
    if args.worker:
        print(json.dumps(worker(methods, categories, args.prompts_per_category, args.max_new_tokens)))
        return
    if args.before is None:
        ap.error("--before: a checkout of the version to compare with")
    from specdecode.bench.hardware import machine_description

    sides = {"before": args.before.resolve(), "after": Path(__file__).resolve().parents[1]}
    raw: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            print(f"round {r + 1}/{args.rounds}: {side} ({', '.join(methods)})...", file=sys.stderr, flush=True)
            raw[side].append(run_side(sides[side], args))
    revisions = {side: subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True, check=False).stdout.strip() or "?" for side, code in sides.items()}
    command = (f"python benchmarks/decode_ab.py --before <checkout> --methods {args.methods} --categories "
               f"{args.categories} --prompts-per-category {args.prompts_per_category} --max-new-tokens "
               f"{args.max_new_tokens} --rounds {args.rounds}")
    lines = ["# Decoding speed, two versions of the code: SmolLM2-135M-Instruct (the GGUF as stored), greedy", "",
             f"Date {date.today()}, {machine_description()}. {len(categories)} Spec-Bench "
             f"categories x {args.prompts_per_category} prompts, up to {args.max_new_tokens} new tokens, prefill "
             f"included; {args.rounds} rounds, each running both versions in fresh processes (order flipped every "
             f"round). Medians over rounds, spread = min-max. Before: {revisions['before']}, after: "
             f"{revisions['after']} (and what the working tree changed). Command: `{command}`", "",
             "| method | before tok/s | after tok/s | after / before (paired) | same tokens |",
             "|---|---:|---:|---:|---:|"]
    for method in methods:
        speed = {side: [run[method]["tokens"] / run[method]["seconds"] for run in raw[side]] for side in sides}
        ratio = [a / b for a, b in zip(speed["after"], speed["before"], strict=True)]
        before, after = raw["before"][0][method]["outputs"], raw["after"][0][method]["outputs"]
        same = sum(a == b for a, b in zip(before, after, strict=True)) / len(before)
        lines.append(f"| {method} | {spread(speed['before'])} | {spread(speed['after'])} | {spread(ratio, 3)} | "
                     f"{same:.0%} |")
    plain = [raw[side][0]["none"]["outputs"] for side in sides] if "none" in methods else []
    for side, outputs in zip(sides, plain, strict=False):
        lossless = all(raw[side][0][m]["outputs"] == outputs for m in methods)
        lines.append(f"\n{side}: every method's greedy tokens equal its plain decoding's: {lossless}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(report + "\n")
        timings = {side: [{m: {k: v for k, v in run[m].items() if k != "outputs"} for m in run} for run in runs]
                   for side, runs in raw.items()}  # the tokens themselves stay out (the report says if they agree)
        (args.out / "raw.json").write_text(json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()
