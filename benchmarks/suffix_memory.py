"""Memory and speed of the global suffix cache after many requests' worth of text.

Feeds the cache the token ids of N answers from the training data (GPTeacher, ShareGPT; cycled when N is larger),
as a server's finished requests would, and reports the arrays' bytes, the peak of memory allocated while filling it
(tracemalloc: timings are slower under it), the time to add an output and to match a context, at a small budget,
the default one and unbounded.

    python benchmarks/suffix_memory.py --requests 10000 --out benchmarks/results/suffix-memory.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

from transformers import AutoTokenizer

from specdecode.models import resolve
from specdecode.proposers.suffix import DEFAULT_CACHE_TOKENS
from specdecode.proposers.suffix_index import SuffixIndex

TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


def answers() -> list[str]:
    rows = json.loads((TRAIN / "gpteacher" / "codegen-instruct.json").read_text())
    rows += json.loads((TRAIN / "gpteacher" / "toolformer-dedupe-only-dataset.json").read_text())
    return [r["response"] for r in rows if r["response"].strip()]


def run(outputs: list[list[int]], budget: int | None) -> dict:
    tracemalloc.start()  # numpy reports its buffers to tracemalloc: the peak counts the arrays and the Python lists
    index = SuffixIndex(max_tokens=budget)
    started = time.perf_counter()
    for out in outputs:
        index.add_sequence(out)
    added = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    contexts = [out[: len(out) // 2] for out in outputs[-200:] if len(out) > 8]
    started = time.perf_counter()
    for ctx in contexts:
        index.match(ctx, 32)
    matched = time.perf_counter() - started
    return {"budget": budget, "tokens": index.live_tokens, "outputs held": index.sequences,
            "array MB": index.nbytes / 1e6, "peak allocated MB": peak / 1e6,
            "add ms/output": 1e3 * added / len(outputs), "match us": 1e6 * matched / len(contexts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(args.model)))
    texts = answers()
    print(f"tokenizing {len(texts)} answers...", file=sys.stderr)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    outputs = [ids[i % len(ids)] for i in range(args.requests)]
    total = sum(map(len, outputs))
    rows = [run(outputs, budget) for budget in (100_000, DEFAULT_CACHE_TOKENS, None)]
    lines = [f"Global suffix cache after {args.requests:,} outputs ({total:,} tokens; training answers, cycled)",
             "", "| " + " | ".join(rows[0]) + " |", "|" + "---:|" * len(rows[0])]
    lines += ["| " + " | ".join(f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if v is not None else "none"
                                for v in row.values()) + " |" for row in rows]
    lines += ["", f"command: python benchmarks/suffix_memory.py --requests {args.requests}"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
