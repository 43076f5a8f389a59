"""Replay Spec-Bench's greedy outputs through prompt lookup and a policy, priced by the measured cost table.

Greedy speculative decoding commits exactly the target's greedy text, so once that text is known a policy's
choices can be replayed without the model: each step the real proposer guesses from the text so far, the
policy cuts the guesses, the step accepts the longest branch that matches the known continuation, and it
costs what the cost table says a forward of its size costs at its context. No timing noise: a change to the
policy or the table is judged on 39 prompts in seconds, before a bench confirms it on the machine.

It leaves out what a real run adds to every method alike (the prefill, the machine's drift), so its speedups
are higher than a bench's; the ratios between policies are what it is for. `oracle` knows how far each proposal
will match and verifies exactly the depth that pays most: the ceiling for a depth policy.

With --methods (e.g. prompt-lookup,suffix) it compares proposers instead, each under its own k='auto' sizing, and
adds each step's proposing time as measured (the one cost that differs between cheap proposers): tau, speedup
and proposing time per category, on as many prompts as wanted, with no machine noise in the forwards.

    python benchmarks/policy_replay.py --out benchmarks/results/policy-replay-smollm2-cpu.md
    python benchmarks/policy_replay.py --methods prompt-lookup,suffix --prompts-per-category 10
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import specdecode
from specdecode.bench.data import load_questions
from specdecode.bench.workloads import load_workload
from specdecode.common.paths import default_cache_dir
from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.tree import DraftTree
from specdecode.core.verify import Verdict
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import AdaptiveK, FixedK, Policy, StepRecord
from specdecode.proposers import PromptLookupProposer, SuffixCache, SuffixProposer
from specdecode.proposers.base import ProposalContext, RequestInfo, StepOutput
from specdecode.proposers.suffix import MAX_DEPTH

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
    return len(accepted_path(tree, truth)) - 1


def accepted_path(tree: DraftTree, truth: list[int]) -> list[int]:
    """The nodes of the tree's branch that matches the known continuation, root first (a greedy verdict's path)."""
    path = [0]
    while len(path) <= len(truth):
        nxt = [c for c in tree.children(path[-1]) if tree.tokens[c] == truth[len(path) - 1]]
        if not nxt:
            break
        path.append(nxt[0])
    return path


def replay(policy: Policy | None, proposer, cost: CostModel, prompt: list[int], output: list[int],
           propose_seconds: float | None = PROPOSE_SECONDS) -> dict[str, float]:
    """Commit `output`: table-priced forward seconds, measured proposing seconds, steps and tokens; policy None: the
    oracle. The policy learns that proposing costs `propose_seconds` a step (None: as measured)."""
    tokens, pos, row = list(prompt), 0, defaultdict(float)
    proposer.begin(RequestInfo(tokens, len(tokens) + len(output) + 64))
    while pos < len(output):
        context, remaining, truth = len(tokens) - 1, len(output) - pos, output[pos:]
        started = time.perf_counter()
        k = min(16, remaining - 1) if policy is None else policy.depth_to_propose(context, remaining - 1)
        asked = ProposalContext(tokens, k, None, None)  # type: ignore[arg-type]  # n-gram proposers read no params
        proposal = proposer.propose(asked) if k > 0 else DraftTree.root_only(tokens[-1])
        if policy is None:
            m, sizes = matched(proposal, truth), proposal.forward_sizes()
            tree = proposal.cut(max(range(len(sizes)),
                                    key=lambda d: (1 + min(m, d)) / cost.forward_seconds(sizes[d], context)))
        else:
            tree = policy.choose(proposal, context)
        proposing = time.perf_counter() - started
        path = accepted_path(tree, truth)
        new = truth[: len(path)]
        row["forward"] += cost.forward_seconds(len(tree.tokens), context)
        row["propose"] += proposing
        row["steps"] += 1
        row["tokens"] += len(new)
        start, tokens, pos = len(tokens), tokens + new, pos + len(new)
        proposer.observe(tree, Verdict(path, new[-1]), StepOutput(tokens, context))
        if policy is not None:
            policy.observe(StepRecord(proposal, tree, start, tokens, context,
                                      proposing if propose_seconds is None else propose_seconds))
    if policy is not None:
        policy.finish(tokens)
    proposer.finish()
    return row


def replay_method(method: str, cost: CostModel, data: dict[str, dict], rounds: int) -> dict[str, dict[str, float]]:
    """Per category: table-priced forward seconds plus measured proposing seconds, steps and tokens of one proposer
    under its k='auto' sizing (prompt lookup: the adaptive policy; suffix: its own sizing by the cost table, with a
    global cache of the earlier prompts' outputs, as the bench and the server keep one)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    shared, cache = AcceptanceStats(), SuffixCache()
    for d in data.values():
        with cache.holding():  # a prompt's rounds never find each other's answers (as in the bench)
            for r in range(rounds):
                replay_round(method, cost, shared, cache, d, totals if r == rounds - 1 else None)
    return totals


def replay_round(method: str, cost: CostModel, shared: AcceptanceStats, cache: SuffixCache, d: dict,
                 totals: dict[str, dict[str, float]] | None) -> None:
    """One run of a prompt under one method, added to `totals` (None: not counted)."""
    if method == "prompt-lookup":
        proposer, policy = PromptLookupProposer(), AdaptiveK(cost, shared, cheap=True)
    elif method in ("suffix", "suffix-local"):  # suffix-local: the request's own text only, no global cache
        proposer, policy = SuffixProposer(cache if method == "suffix" else None, cost=cost), FixedK(MAX_DEPTH)
    else:
        raise ValueError(f"replay compares prompt-lookup, suffix and suffix-local, not {method!r}")
    row = replay(policy, proposer, cost, d["prompt"], d["output"], propose_seconds=None)
    if totals is not None:
        for key, value in row.items():
            totals[d["category"]][key] += value


def compare_methods(methods: list[str], cost: CostModel, data: dict[str, dict], rounds: int, command: str,
                    model: str) -> str:
    plain: dict[str, float] = defaultdict(float)
    for d in data.values():
        plain[d["category"]] += sum(cost.forward_seconds(1, len(d["prompt"]) - 1 + i) for i in range(len(d["output"])))
    results = {m: replay_method(m, cost, data, rounds) for m in methods}
    categories = [*plain, "all"]
    plain["all"] = sum(plain.values())
    for per in results.values():  # the "all" row: every category's sums
        per["all"] = defaultdict(float)
        for c in categories[:-1]:
            for key, value in per[c].items():
                per["all"][key] += value
    head = " | ".join(f"{m} speedup | {m} forwards only | {m} tau | {m} ms/step" for m in methods)
    lines = [f"# Proposer replay on {model}: {', '.join(methods)}, {len(data)} prompts", "",
             f"Command: `{command}`", f"Cost table: {cost.machine} (version {cost.version}).", "",
             "Speedup over plain decoding: forwards priced by the cost table, plus each step's proposing time as "
             "measured here (forwards only: without it); tau = tokens per step; ms/step = proposing time.", "",
             f"| category | {head} |", "|---|" + "---:|" * (4 * len(methods))]
    for c in categories:
        cells = []
        for m in methods:
            row = results[m][c]
            cells += [f"{plain[c] / (row['forward'] + row['propose']):.3f}", f"{plain[c] / row['forward']:.3f}",
                      f"{row['tokens'] / row['steps']:.2f}",
                      f"{1e3 * row['propose'] / row['steps']:.3f}"]
        name = f"**{c}**" if c == "all" else c
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="each prompt this many times in a row (as the bench does); "
                    "the last counts")
    ap.add_argument("--ks", default="2,3,4,5,8", help="fixed k to compare")
    ap.add_argument("--branches", default="1,3", help="prompt-lookup branches to compare")
    ap.add_argument("--workload", default="spec-bench", help="spec-bench, or a repetitive workload (bench --workload)")
    ap.add_argument("--methods", help="compare these proposers (prompt-lookup, suffix) instead of k and branches")
    ap.add_argument("--outputs", help="cache of the greedy outputs (default: in the specdecode cache dir)")
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = specdecode.load(args.model)
    questions = (load_questions(per_category=args.prompts_per_category) if args.workload == "spec-bench"
                 else load_workload(args.workload, per_category=args.prompts_per_category))
    outputs = Path(args.outputs or default_cache_dir() / "replay" /
                   f"{args.model}-{args.workload}-{args.prompts_per_category}x{args.max_new_tokens}.json")
    outputs.parent.mkdir(parents=True, exist_ok=True)
    data = greedy_outputs(llm, questions, args.max_new_tokens, outputs)
    cost = llm.assets.cost_model()  # prices every step; observing those prices leaves its load at 1
    flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items() if value is not None)
    if args.methods:
        report = compare_methods(args.methods.split(","), cost, data, args.rounds,
                                 f"python benchmarks/policy_replay.py {flags}", args.model)
        print(report)
        if args.out:
            Path(args.out).write_text(report)
        return

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
                took = replay(policy, proposer, cost, d["prompt"], d["output"])["forward"]
                if r == args.rounds - 1:
                    seconds[d["category"]][name] += took
        print(name, flush=True)
    for d in data.values():
        seconds[d["category"]]["plain"] += sum(cost.forward_seconds(1, len(d["prompt"]) - 1 + i)
                                               for i in range(len(d["output"])))

    names = list(configs)
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
