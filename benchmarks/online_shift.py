"""Online learning under a domain shift: the EAGLE head served on traffic unlike its training data, with and
without `online_draft`, tau per window of requests.

The two arms take the same requests in turn (request i: one arm then the other, in a random order), so the
learner's thread, which runs throughout, slows both alike; the heads never rest (tau measures the head, not the
policy's choice to stop drafting on a CPU where the head's steps do not pay), except with --rest, which measures
what learning costs as users run it. Greedy: outputs are the target's.

    python benchmarks/online_shift.py --workload repetitive --categories tool-loop --requests 200 --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import specdecode.proposers.eagle as eagle
from specdecode.api import LLM
from specdecode.bench import load_questions
from specdecode.bench.workloads import load_workload
from specdecode.proposers.online_learning import OnlineConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft", help="the head's folder (default: the shipped one)")
    p.add_argument("--workload", default="repetitive", help="spec-bench or a repetitive workload")
    p.add_argument("--categories", default="tool-loop")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--window", type=int, default=50, help="requests per tau point")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=OnlineConfig.lr)
    p.add_argument("--reward", type=float, default=OnlineConfig.reward,
                   help="weight of pushing down the guesses the target rejected (DVI's reward; 0: distillation alone)")
    p.add_argument("--chunk", type=int, default=OnlineConfig.chunk, help="positions per recorded chunk")
    p.add_argument("--teacher", choices=("soft", "token"), default="soft",
                   help="the learner's teacher: the target's top-8 distribution, or the committed token alone")
    p.add_argument("--vocab-swaps", type=int, default=OnlineConfig.vocab_swaps,
                   help="draft vocabulary rows a new head may give to tokens of the traffic (0: the vocabulary stays)")
    p.add_argument("--vocab-half-life", type=int, default=OnlineConfig.vocab_half_life,
                   help="chunks recorded over which the traffic's counted token mass halves (0: it never fades)")
    p.add_argument("--rest", action="store_true",
                   help="the policy as users get it (the head rests where it does not pay): what learning costs")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not args.rest:
        eagle.MAX_REST = 0  # never rest: judge the head
    llm = LLM.load(args.model)
    cats = args.categories.split(",")
    per_category = -(-args.requests // len(cats))
    questions = (load_questions(None, cats, per_category) if args.workload == "spec-bench"
                 else load_workload(args.workload, cats, per_category))
    rng = random.Random(0)
    rng.shuffle(questions)
    questions = questions[: args.requests]
    online = llm.assets.online_head(args.draft, OnlineConfig(
        lr=args.lr, reward=args.reward, soft=args.teacher == "soft", chunk=args.chunk, vocab_swaps=args.vocab_swaps,
        vocab_half_life=args.vocab_half_life))
    arms = {"static": {}, "online": {"online_draft": True}}
    rows = {arm: [] for arm in arms}
    started = time.perf_counter()
    for i, q in enumerate(questions):
        for arm in rng.sample(sorted(arms), len(arms)):
            t = time.perf_counter()
            out = llm.generate(q.prompt, chat=True, method="eagle", draft=args.draft,
                               max_new_tokens=args.max_new_tokens, **arms[arm])
            rows[arm].append({"tokens": out.stats.new_tokens - 1, "forwards": out.stats.target_forwards - 1,
                              "seconds": time.perf_counter() - t, "version": online.version})
        if (i + 1) % args.window == 0:
            print(f"{i + 1} requests ({time.perf_counter() - started:.0f} s): "
                  + " ".join(f"{arm} tau {window_tau(rows[arm][-args.window:]):.2f}" for arm in arms)
                  + f"; learner {online.steps} steps, {online.version} heads, {online.reverts} reverted, "
                  f"{online.swapped} vocabulary rows swapped", flush=True)
    online.close()
    windows = [(w, {arm: window_tau(rows[arm][w : w + args.window]) for arm in arms})
               for w in range(0, len(questions), args.window)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows, "learner": {
        "steps": online.steps, "heads": online.version, "reverts": online.reverts,
        "chunks": online.recorded, "vocab_rows_swapped": online.swapped}}, indent=1))
    plot(windows, args.window, out_dir / "tau_per_window.png")
    speed = {arm: sum(r["tokens"] for r in rows[arm]) / sum(r["seconds"] for r in rows[arm]) for arm in arms}
    lines = ["# Online learning under a domain shift", "",
             f"- command: `python benchmarks/online_shift.py --workload {args.workload} --categories "
             f"{args.categories} --requests {args.requests} --window {args.window} --max-new-tokens "
             f"{args.max_new_tokens} --lr {args.lr} --reward {args.reward} --teacher {args.teacher} "
             f"--chunk {args.chunk} --vocab-swaps {args.vocab_swaps} --vocab-half-life {args.vocab_half_life}"
             f"{' --rest' if args.rest else ''} "
             f"--out {args.out}`",
             f"- learner: {online.steps} steps, {online.version} heads published or brought back, "
             f"{online.reverts} reverted, {online.recorded} chunks recorded, {online.swapped} draft vocabulary rows "
             "given to tokens of the traffic", "",
             "| requests | static tau | online tau | online / static |", "|---|---:|---:|---:|"]
    for w, taus in windows:
        lines.append(f"| {w + 1}-{w + args.window} | {taus['static']:.2f} | {taus['online']:.2f} | "
                     f"{taus['online'] / taus['static']:.2f}x |")
    lines += ["", f"tokens/s over all requests (the learner's thread running beside both): static "
              f"{speed['static']:.1f}, online {speed['online']:.1f}", "", "![tau](tau_per_window.png)"]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def window_tau(rows: list[dict]) -> float:
    return sum(r["tokens"] for r in rows) / max(sum(r["forwards"] for r in rows), 1)


def plot(windows, size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm in ("static", "online"):
        ax.plot([w + size for w, _ in windows], [t[arm] for _, t in windows], marker="o", label=arm)
    ax.set_xlabel("requests served")
    ax.set_ylabel(f"tau over {size} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
