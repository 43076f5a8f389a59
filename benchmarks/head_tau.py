"""EAGLE heads side by side on Spec-Bench: tau per category with the head never resting.

`specdecode bench` measures what a user gets, and on a CPU the policy rests a head whose steps do not pay
(tau 1.00 everywhere): that hides how good the head is. Here every step drafts (k=auto sizes each tree), so
tau measures the head itself. Greedy; outputs are the target's either way.

    python benchmarks/head_tau.py --heads shipped,path/to/head --prompts-per-category 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specdecode.proposers.eagle as eagle
from specdecode.api import LLM
from specdecode.bench import load_questions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--heads", default="shipped", help="comma list: 'shipped' or a head folder")
    p.add_argument("--prompts-per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", default="auto", help="tree depth: 'auto' (sized by the cost model) or a number")
    p.add_argument("--nodes", type=int, help="the most guesses a step (default: the proposer's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    eagle.MAX_REST = 0  # never rest: judge the head, not the policy
    llm = LLM.load(args.model)
    heads = args.heads.split(",")
    k = args.k if args.k == "auto" else int(args.k)
    nodes = {} if args.nodes is None else {"nodes": args.nodes}
    questions = load_questions(None, "all", args.prompts_per_category)
    rows: dict[str, dict[str, list[int]]] = {}  # category -> head -> [tokens after the first, forwards after it]
    for cat in dict.fromkeys(q.category for q in questions):
        rows[cat] = {}
        for head in heads:
            tokens = forwards = 0
            for q in (q for q in questions if q.category == cat):
                out = llm.generate(q.prompt, chat=True, method="eagle", draft=None if head == "shipped" else head,
                                   max_new_tokens=args.max_new_tokens, k=k, **nodes)
                tokens += out.stats.new_tokens - 1  # the prefill's token costs no decode forward
                forwards += out.stats.target_forwards - 1
            rows[cat][head] = [tokens, forwards]
        print(cat, " ".join(f"{h}: tau {t / max(f, 1):.2f}" for h, (t, f) in rows[cat].items()), flush=True)
    overall = {h: [sum(rows[c][h][i] for c in rows) for i in (0, 1)] for h in heads}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows, "overall": overall}, indent=1))
    lines = ["# EAGLE heads, never resting: tau per Spec-Bench category", "",
             f"- command: `python benchmarks/head_tau.py --model {args.model} --heads {args.heads} "
             f"--prompts-per-category {args.prompts_per_category} --max-new-tokens {args.max_new_tokens} "
             f"--k {args.k}{'' if args.nodes is None else f' --nodes {args.nodes}'} --out {args.out}`", "",
             "| category | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for cat, row in [*rows.items(), ("overall", overall)]:
        lines.append(f"| {cat} | " + " | ".join(f"{t / max(f, 1):.2f}" for t, f in row.values()) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
