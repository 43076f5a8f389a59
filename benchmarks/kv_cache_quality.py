"""What a KV cache dtype costs in output quality: float16 and int8 caches against float32, on real prompts.

Per prompt (the chat prompts of the Spec-Bench sample shipped in specdecode/data, chat template applied): the float32
cache's greedy answer (--tokens tokens) is the reference; each other dtype
- decodes greedily too: is its answer the same, and how many tokens agree before the first difference;
- reads the prompt and the reference answer in one forward (teacher forcing): how often its next-token choice equals
  float32's at each answer position, and the largest difference of its logits from float32's there.
Quality only (nothing is timed; kv_cache_depth.py times the dtypes). Not a test: nothing asserted.

    python benchmarks/kv_cache_quality.py --tokens 96 --out benchmarks/results/kv-cache-quality-smollm2.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import torch

import specdecode
from specdecode.bench.hardware import machine_description
from specdecode.engine.loop import generate_ids

SAMPLE = Path(specdecode.__file__).with_name("data") / "spec_bench_sample.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float16,int8")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = specdecode.LLM.load(args.model)
    model = llm.model
    prompts = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    rows = []
    with torch.inference_mode():
        for i, item in enumerate(prompts):
            ids = llm.encode(item["turns"][0], chat=True)
            model.kv_cache_dtype = "float32"
            reference, _ = generate_ids(model, ids, max_new_tokens=args.tokens)
            full = torch.tensor([ids + reference])
            logits32 = model.forward(full, model.new_cache(full.shape[1])).logits[0, len(ids) - 1 : -1]
            row = {"category": item["category"], "tokens": len(reference)}
            for name in args.dtypes.split(","):
                model.kv_cache_dtype = name
                out, _ = generate_ids(model, ids, max_new_tokens=args.tokens)
                same = next((k for k, (a, b) in enumerate(zip(out, reference, strict=False)) if a != b),
                            min(len(out), len(reference)))
                logits = model.forward(full, model.new_cache(full.shape[1])).logits[0, len(ids) - 1 : -1]
                row[name] = {"equal": out == reference, "agree_before_first_difference": same,
                             "forced_top1": float((logits.argmax(-1) == logits32.argmax(-1)).float().mean()),
                             "max_logit_diff": float((logits - logits32).abs().max()),
                             "logit_range": float(logits32.max() - logits32.min())}
            rows.append(row)
            print(f"{i + 1}/{len(prompts)} {item['category']}: "
                  + ", ".join(f"{n} {row[n]['agree_before_first_difference']}" for n in args.dtypes.split(",")),
                  file=sys.stderr)
    names = args.dtypes.split(",")
    lines = [f"# KV cache dtype and output quality ({date.today().isoformat()})", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Model: {args.model} ({model.quantization} weights); {len(rows)} chat prompts of the Spec-Bench sample "
             f"(specdecode/data), greedy, {args.tokens} new tokens; reference: the float32 cache.", "",
             f"Machine: {machine_description()}", "",
             "| cache | answers equal to float32's | tokens agreeing before the first difference (median, min) | "
             "teacher-forced top-1 agreement (mean, min) | largest logit difference / logit range (median, max) |",
             "|---|---:|---:|---:|---:|"]
    for name in names:
        agree = [r[name]["agree_before_first_difference"] for r in rows]
        top1 = [r[name]["forced_top1"] for r in rows]
        rel = [r[name]["max_logit_diff"] / r[name]["logit_range"] for r in rows]
        lines.append(f"| {name} | {sum(r[name]['equal'] for r in rows)}/{len(rows)} | {statistics.median(agree):.0f} "
                     f"({min(agree)}) | {statistics.mean(top1):.4f} ({min(top1):.4f}) | {statistics.median(rel):.4f} "
                     f"({max(rel):.4f}) |")
    report = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(report)


if __name__ == "__main__":
    main()
