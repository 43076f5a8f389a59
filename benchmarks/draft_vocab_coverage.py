"""How large an EAGLE head's draft vocabulary should be: the share of answer tokens that a vocabulary of the N
tokens most frequent in training answers holds, on held-out training answers and on the answers of other traffic.

A head can guess only tokens of its draft vocabulary, so a token outside it ends a chain of guesses there: at
depth d the head's acceptance is bounded by about coverage^d. The vocabulary is chosen, as `specdecode train eagle`
chooses it, from the training answers (the target's own, samples.jsonl, plain or xz); the other traffic's answers
(policy_replay's cached greedy outputs: Spec-Bench, the repetitive workload) are only measured, never chosen from.

    python benchmarks/draft_vocab_coverage.py --samples OUT/work/samples.jsonl --out benchmarks/results/X.md
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
from collections import Counter
from pathlib import Path

REPLAY = Path.home() / ".cache" / "specdecode" / "replay"


def read_lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    if ".xz" in path.suffixes:  # also a split piece, .xz.00
        raw = lzma.decompress(raw)
    return raw.decode().splitlines()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", required=True, nargs="+", help="samples.jsonl files (or .xz) of the target's answers")
    p.add_argument("--heldout", type=float, default=0.2, help="share of the answers kept out of the choice")
    p.add_argument("--sizes", default="4096,8192,12288,16384,24576,32768")
    p.add_argument("--traffic", nargs="*", default=sorted(str(f) for f in REPLAY.glob("smollm2-*.json")),
                   help="policy_replay caches whose outputs are measured (default: the SmolLM2 ones here)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    samples = [json.loads(line) for f in args.samples for line in read_lines(Path(f)) if line.strip()]
    random.Random(0).shuffle(samples)
    cut = int(len(samples) * (1 - args.heldout))
    counts = Counter(t for s in samples[:cut] for t in s["tokens"][s["prompt_len"]:])
    ranked = [t for t, _ in counts.most_common()]
    sets = {f"held-out training answers ({len(samples) - cut})":
            [t for s in samples[cut:] for t in s["tokens"][s["prompt_len"]:]]}
    for f in args.traffic:
        outputs = json.loads(Path(f).read_text())
        sets[f"{Path(f).stem} ({len(outputs)})"] = [t for q in outputs.values() for t in q["output"]]
    lines = ["# Draft vocabulary: the share of answer tokens it holds", "",
             f"- command: `python benchmarks/draft_vocab_coverage.py --samples {' '.join(args.samples)} "
             f"--heldout {args.heldout} --sizes {args.sizes} --out {args.out}`",
             f"- chosen from {cut} training answers ({sum(counts.values())} tokens, {len(ranked)} distinct): the N "
             "most frequent answer tokens", "",
             "| draft vocabulary | " + " | ".join(sets) + " |", "|---:|" + "---:|" * len(sets)]
    for size in (int(s) for s in args.sizes.split(",")):
        vocab = set(ranked[:size])
        cells = [f"{sum(t in vocab for t in tokens) / max(len(tokens), 1):.3f}" for tokens in sets.values()]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
