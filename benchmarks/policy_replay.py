"""Replay Spec-Bench's greedy outputs through prompt lookup and a policy, priced by the measured cost table.

Greedy speculative decoding commits exactly the target's greedy text, so once that text is known a policy's
choices can be replayed without the model: each step the real proposer guesses from the text so far, the
policy cuts the guesses, the step accepts the longest branch that matches the known continuation, and it
costs what the cost table says a forward of its size costs at its context. No timing noise: a change to the
policy or the table is judged on 39 prompts in seconds, before a bench confirms it on the machine.

It leaves out what a real run adds to every method alike (proposing, the prefill, the machine's drift), so
its speedups are higher than a bench's; the ratios between policies are what it is for. `oracle` knows how
far each proposal will match and verifies exactly the depth that pays most: the ceiling for a depth policy.

    python benchmarks/policy_replay.py --out benchmarks/results/policy-replay-smollm2-cpu.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import specdecode
from specdecode.acceptance import AcceptanceStats
from specdecode.bench.data import load_questions
from specdecode.cost import CostModel
from specdecode.paths import default_cache_dir
from specdecode.policy import AdaptiveK, FixedK, Policy, StepRecord
from specdecode.proposers import PromptLookupProposer
from specdecode.tree import DraftTree

PROPOSE_SECONDS = 3e-4  # what proposing costs a step (measured: 0.2-0.35 ms); under 1% of a step, so always asked


def greedy_outputs(llm: specdecode.LLM, questions, max_new_tokens: int, path: Path) -> dict[str, dict]:
    """The target's greedy continuation of each prompt (cached: a few minutes to make)."""
    if path.exists():
        return json.loads(path.read_text())
    out = {}
    for q in questions:
        ids = llm.encode(q.prompt, chat=True)
        gen = llm.start(ids, method="prompt-lookup", k=4, max_new_tokens=max_new_tokens)  # lossless: = plain
        for _ in gen:
            pass
        out[str(q.question_id)] = {"category": q.category, "prompt": ids, "output": gen.new_tokens}
    path.write_text(json.dumps(out))
    return out


def matched(tree: DraftTree, truth: list[int]) -> int:
    """How many guesses of the tree's best branch match the known continuation."""
    node, m = 0, 0
    while m < len(truth):
        nxt = [c for c in tree.children(node) if tree.tokens[c] == truth[m]]
        if not nxt:
            break
        node, m = nxt[0], m + 1
    return m


def replay(policy: Policy | None, proposer, cost: CostModel, prompt: list[int], output: list[int]) -> float:
    """Seconds (table-priced) to commit `output`; policy None: the oracle."""
    tokens, pos, seconds = list(prompt), 0, 0.0
    while pos < len(output):
        context, remaining, truth = len(tokens) - 1, len(output) - pos, output[pos:]
        k = min(16, remaining - 1) if policy is None else policy.depth_to_propose(context, remaining - 1)
        proposal = proposer.propose(tokens, k, None, None) if k > 0 else DraftTree.root_only(tokens[-1])
        if policy is None:
            m, sizes = matched(proposal, truth), proposal.forward_sizes()
            tree = proposal.cut(max(range(len(sizes)),
                                    key=lambda d: (1 + min(m, d)) / cost.forward_seconds(sizes[d], context)))
        else:
            tree = policy.choose(proposal, context)
        new = truth[: matched(tree, truth) + 1]
        price = cost.forward_seconds(len(tree.tokens), context)
        seconds += price
        start, tokens, pos = len(tokens), tokens + new, pos + len(new)
        if policy is not None:
            policy.observe(StepRecord(proposal, tree, start, tokens, context, PROPOSE_SECONDS))
    if policy is not None:
        policy.finish(tokens)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="each prompt this many times in a row (as the bench does); "
                    "the last counts")
    ap.add_argument("--ks", default="2,3,4,5,8", help="fixed k to compare")
    ap.add_argument("--branches", default="1,3", help="prompt-lookup branches to compare")
    ap.add_argument("--outputs", help="cache of the greedy outputs (default: in the specdecode cache dir)")
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = specdecode.load(args.model)
    questions = load_questions(per_category=args.prompts_per_category)
    outputs = Path(args.outputs or default_cache_dir() / "replay" / f"{args.model}-{args.max_new_tokens}.json")
    outputs.parent.mkdir(parents=True, exist_ok=True)
    data = greedy_outputs(llm, questions, args.max_new_tokens, outputs)
    cost = llm.cost_model()  # prices every step; observing those prices leaves its load at 1

    configs: dict[str, tuple[str | int | None, int]] = {}
    for b in (int(x) for x in args.branches.split(",")):
        configs[f"oracle b={b}"] = (None, b)
        configs[f"auto b={b}"] = ("auto", b)
        configs.update({f"k={k} b={b}": (int(k), b) for k in args.ks.split(",")})
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, (k, branches) in configs.items():
        proposer, shared = PromptLookupProposer(branches=branches), AcceptanceStats()
        for d in data.values():
            for r in range(args.rounds):
                policy = None if k is None else AdaptiveK(cost, shared, cheap=True) if k == "auto" else FixedK(k)
                took = replay(policy, proposer, cost, d["prompt"], d["output"])
                if r == args.rounds - 1:
                    seconds[d["category"]][name] += took
        print(name, flush=True)
    for d in data.values():
        seconds[d["category"]]["plain"] += sum(cost.forward_seconds(1, len(d["prompt"]) - 1 + i)
                                               for i in range(len(d["output"])))

    names = list(configs)
    flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items() if value is not None)
    lines = [f"# Policy replay: prompt lookup on {args.model}, {len(data)} Spec-Bench prompts", "",
             f"Command: `python benchmarks/policy_replay.py {flags}`",
             f"Cost table: {cost.machine} (version {cost.version}).", "",
             "Speedup over plain decoding, both priced by the cost table (b = branches).", "",
             "| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    totals = defaultdict(float)
    for category, row in seconds.items():
        lines.append(f"| {category} | " + " | ".join(f"{row['plain'] / row[n]:.3f}" for n in names) + " |")
        for n, v in row.items():
            totals[n] += v
    lines.append("| **all** | " + " | ".join(f"**{totals['plain'] / totals[n]:.3f}**" for n in names) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
