"""Fine-tuning the shipped EAGLE head on a traffic's own answers (`specdecode train eagle --init shipped`), measured
in real decoding on requests it never saw.

    # 1. the served model answers N requests of a repetitive workload's category: a user's traffic logs
    python benchmarks/finetune_traffic.py answer --category tool-loop --requests 250 --out SAMPLES.jsonl
    # 2. fine-tune on them (CPU)
    specdecode train eagle --init shipped --samples-file SAMPLES.jsonl --heldout 50 --steps 200 --batch-size 8 \\
        --lr 3e-4 --out HEAD
    # 3. tau of the shipped head and the fine-tuned one, side by side, on requests not among the samples
    python benchmarks/finetune_traffic.py compare --category tool-loop --samples SAMPLES.jsonl --draft HEAD
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import specdecode.proposers.eagle as eagle
from specdecode.api import LLM
from specdecode.bench.workloads import load_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=("answer", "compare"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--category", default="tool-loop", help="a repetitive workload's category")
    p.add_argument("--requests", type=int, default=250, help="answer: requests answered; compare: requests measured")
    p.add_argument("--samples", help="compare: the samples.jsonl fine-tuned on (its prompts are left out)")
    p.add_argument("--draft", help="compare: the fine-tuned head's folder")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", help="answer: the samples.jsonl to write")
    args = p.parse_args()
    llm = LLM.load(args.model)
    if args.step == "answer":
        questions = load_workload("repetitive", [args.category], args.requests)
        random.Random(0).shuffle(questions)
        with Path(args.out).open("w") as f:
            for q in questions:
                prompt = llm.encode(q.prompt, chat=True)
                out = llm.generate(prompt, method="none", max_new_tokens=args.max_new_tokens)
                f.write(json.dumps({"tokens": prompt + list(out.token_ids), "prompt_len": len(prompt)}) + "\n")
        return
    eagle.MAX_REST = 0  # the heads never rest: tau measures them
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines()]
    seen = {tuple(s["tokens"][: s["prompt_len"]]) for s in samples}
    questions = load_workload("repetitive", [args.category], len(seen) + 2 * args.requests)
    random.Random(1).shuffle(questions)
    fresh = [q for q in questions if tuple(llm.encode(q.prompt, chat=True)) not in seen][: args.requests]
    rows = {"shipped": [0, 0], "fine-tuned": [0, 0]}
    rng = random.Random(2)
    for q in fresh:
        for arm in rng.sample(sorted(rows), 2):  # side by side, in a random order
            out = llm.generate(q.prompt, chat=True, method="eagle", max_new_tokens=args.max_new_tokens,
                               draft=args.draft if arm == "fine-tuned" else None)
            rows[arm][0] += out.stats.new_tokens - 1
            rows[arm][1] += out.stats.target_forwards - 1
    tau = {arm: tokens / forwards for arm, (tokens, forwards) in rows.items()}
    print(f"{len(fresh)} {args.category} requests not among the {len(seen)} samples, greedy, heads never resting: "
          f"tau shipped {tau['shipped']:.3f}, fine-tuned {tau['fine-tuned']:.3f} "
          f"({tau['fine-tuned'] / tau['shipped']:.2f}x)")


if __name__ == "__main__":
    main()
