"""How far online learning can take the head on shifted traffic, given all the learner steps it wants.

The online-shift benchmark gives the learner the CPU time that 200 requests leave it (about one step a request).
This asks what more steps would buy: the shipped head serves `--record` requests of the shifted traffic while its
learner is stopped (recording only: the serving head stays the shipped one), then the learner trains on that fixed
buffer, and the head is published and measured (greedy tau, the head never resting) on `--held-out` other requests
of the same traffic after each of `--checkpoints` learner steps (what those requests record is dropped: the learner
never sees them). A plateau below the online bar says the head and
the recorded text are the limit, not the learner's share of the cores.

    python benchmarks/online_ceiling.py --out benchmarks/results/online-ceiling-tool-loop
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from specdecode import LLM
from specdecode.bench.workloads import load_workload
from specdecode.proposers import eagle
from specdecode.proposers.online_learning import OnlineConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--category", default="tool-loop", help="a repetitive workload's category (bench --workload)")
    p.add_argument("--record", type=int, default=200, help="requests served to fill the replay buffer")
    p.add_argument("--held-out", type=int, default=50, help="other requests on which tau is measured")
    p.add_argument("--checkpoints", default="200,600,1200", help="learner steps after which tau is measured")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=OnlineConfig.lr)
    p.add_argument("--vocab-swaps", type=int, default=OnlineConfig.vocab_swaps,
                   help="draft vocabulary rows a new head may give to tokens of the traffic (0: the vocabulary stays)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    eagle.MAX_REST = 0  # the head never rests: it is what is measured
    llm = LLM.load(args.model)
    questions = load_workload("repetitive", [args.category], args.record + args.held_out)
    random.Random(0).shuffle(questions)
    recorded, held_out = questions[: args.record], questions[args.record :]
    online = llm.assets.online_head(None, OnlineConfig(lr=args.lr, publish_every=10**9,
                                                     vocab_swaps=args.vocab_swaps))
    online.close()  # recording only: the learner runs below, on the buffer as recorded

    def tau(prompts, **options) -> float:
        tokens = forwards = 0
        for q in prompts:
            out = llm.generate(q.prompt, chat=True, method="eagle", max_new_tokens=args.max_new_tokens, **options)
            tokens, forwards = tokens + out.stats.new_tokens - 1, forwards + out.stats.target_forwards - 1
        return tokens / forwards

    def held_out_tau() -> float:
        """tau of the published head on the held-out requests, which must not join what it learns from"""
        kept, count, mass = list(online.buffer), online.recorded, online.mass.clone()
        try:
            return tau(held_out, online_draft=True)
        finally:
            online.buffer.clear()
            online.buffer.extend(kept)
            online.recorded, online.mass = count, mass

    started = time.perf_counter()
    rows = [{"steps": 0, "tau": tau(held_out)}]
    print(f"shipped head: held-out tau {rows[0]['tau']:.3f}", flush=True)
    tau(recorded, online_draft=True)
    print(f"recorded {online.recorded} chunks from {len(recorded)} requests "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    for step in range(1, checkpoints[-1] + 1):
        online.step()
        if step in checkpoints:
            online.publish()
            online.previous = None  # no guard here: every checkpoint's head is measured
            rows.append({"steps": step, "tau": held_out_tau()})
            print(f"after {step} learner steps ({time.perf_counter() - started:.0f} s): held-out tau "
                  f"{rows[-1]['tau']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                  "chunks": online.recorded,
                                                  "vocab_rows_swapped": online.swapped}, indent=1))
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    lines = [f"# Online learning's ceiling on {args.category}", "",
             f"- command: `python benchmarks/online_ceiling.py {flags}`",
             f"- replay buffer: {online.recorded} chunks recorded from {len(recorded)} requests (the buffer keeps "
             f"the last {online.cfg.buffer_chunks}); {online.swapped} draft vocabulary rows given to tokens of the "
             f"traffic; tau on {len(held_out)} other requests, greedy, the head never "
             "resting", "", "| learner steps | held-out tau | over the shipped head |", "|---:|---:|---:|"]
    lines += [f"| {r['steps']} | {r['tau']:.3f} | {r['tau'] / rows[0]['tau']:.2f}x |" for r in rows]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
