"""Plain decoding while another process keeps a core busy: ours with the thread governor (threads.py), ours on a
fixed thread count, and llama.cpp on the same GGUF file and prompts, each idle and beside a busy-looping process.

    python benchmarks/busy_core.py --out benchmarks/results/busy-core-smollm2

A user's laptop or a shared server is such a machine. Runs alternate in a fresh random order per prompt; the busy
process runs through a whole condition (so whole runs, llama.cpp's included, see the same load).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdecode.api import LLM
from specdecode.bench import load_questions
from specdecode.bench.hardware import machine_description
from specdecode.bench.llamacpp import LlamaCppPeer
from specdecode.common.progress import progress_bar
from specdecode.policy import threads

METHODS = ("ours, governed threads", "ours, fixed threads", "llama.cpp")


def ours(llm: LLM, prompt: list[int], tokens: int, governed: bool) -> tuple[int, float]:
    """Decode tokens and seconds (the prefill left out) of one plain run."""
    governor = threads.governor()
    governor.enabled = governed
    if not governed:  # back to the count it started with, and kept there
        governor.threads = governor.most
        torch.set_num_threads(governor.most)
    gen = llm.start(prompt, method="none", k=0, max_new_tokens=tokens, temperature=0.0, seed=0)
    steps = iter(gen)
    next(steps)  # the prefill and the first token
    started = time.perf_counter()
    for _ in steps:
        pass
    return gen.stats.new_tokens - 1, time.perf_counter() - started


def peer(llama: LlamaCppPeer, prompt: list[int], tokens: int) -> tuple[int, float]:
    rec = llama.run("none", prompt, tokens, 0.0, 0)
    return rec["new_tokens"] - 1, rec["seconds"] - rec["prefill_seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    llm = LLM.load(args.model)
    llama = LlamaCppPeer(args.model, llm.stop_token_ids, llm.model.config.max_position_embeddings)
    prompts = [llm.encode(q.prompt, chat=True) for q in load_questions(None, "all", args.prompts_per_category)]
    ours(llm, prompts[0], 8, True)  # warm-up
    peer(llama, prompts[0], 8)
    rates: dict[str, dict[str, list[float]]] = {}
    rng = random.Random(0)
    with progress_bar("plain decoding, idle and beside a busy core", 2 * len(prompts) * len(METHODS)) as advance:
        for condition in ("idle", "busy"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
            time.sleep(1.0)
            try:
                for prompt in prompts:
                    for method in rng.sample(METHODS, len(METHODS)):
                        if method == "llama.cpp":
                            n, seconds = peer(llama, prompt, args.max_new_tokens)
                        else:
                            n, seconds = ours(llm, prompt, args.max_new_tokens, method == METHODS[0])
                        rates.setdefault(condition, {}).setdefault(method, []).append(n / seconds)
                        advance()
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    threads.governor().enabled = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine_description(), "rates": rates,
                                                  "command": "python " + " ".join(sys.argv)}, indent=1))
    lines = ["# Plain decoding beside a busy core", "", f"- machine: {machine_description()}",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- {len(prompts)} Spec-Bench prompts, {args.max_new_tokens} greedy tokens, decode steps only (prefill "
             "left out); busy: one process busy-looping for the whole condition; tokens/s as median [min–max] "
             "over prompts", "", "| method | idle | beside a busy core | busy / idle |", "|---|---:|---:|---:|"]
    for method in METHODS:
        idle, busy = rates["idle"][method], rates["busy"][method]
        lines.append(f"| {method} | {statistics.median(idle):.1f} [{min(idle):.1f}–{max(idle):.1f}] | "
                     f"{statistics.median(busy):.1f} [{min(busy):.1f}–{max(busy):.1f}] | "
                     f"{statistics.median(busy) / statistics.median(idle):.2f} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
