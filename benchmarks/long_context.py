"""Long contexts (issue 56 item 4): decode tokens/s and time to first token after 100 ... 8,000 cached tokens, our
plain decoding and speculative methods beside llama.cpp at the same depth.

    python benchmarks/long_context.py --depths 100,500,1000,2000,4000,8000 --rounds 2 \
        --out benchmarks/results/long-context-smollm2

The prompt at a depth is real text to work on: Spec-Bench's summarization and RAG documents, concatenated and cut to
the depth (chat template included), then "Summarize the text above." (what a long context is for: the answer reuses
the document's words, where prompt lookup and suffix decoding find them); each depth's text starts elsewhere in the
documents, so no depth's prompt begins as another's. Per round, per depth (interleaved):
- TTFT (the first --ttft-rounds rounds): the prompt from nothing, plain decoding, one token: the prefill and the first
  step (a prefill of 8,000 tokens is minutes on a loaded 2-core machine: once is what fits);
- decode: each method (--methods, the order rotated each round) writes --tokens tokens (min_tokens = max_new_tokens:
  a fixed length) from the same prompt, whose entries the prefix cache holds from the TTFT run (the prefill is the
  same for every method and measured there): tokens / (seconds - prefill seconds);
- llama.cpp (where /work/llamacpp/READY names its binaries, or --llamacpp-bins): `llama-bench -d DEPTH -n TOKENS
  -p 0` (its decode after DEPTH cached tokens) and `-p DEPTH -n 0` (its prefill rate: TTFT ~ DEPTH / rate) on the
  model's GGUF file, the same threads.
KV cache float16 (the default; --kv-cache-dtype). Writes results.json and report.md. Not a test: nothing asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from llamacpp_build import built_bins  # noqa: E402

QUESTION = "\n\nSummarize the text above."
PREFIX_CACHE_MB = 4096  # every depth's prompt entries (8,000 float16 tokens of SmolLM2: 184 MB)


def documents() -> str:
    """Spec-Bench's summarization and RAG first turns, one after another (the full set where ../shared/data has it,
    else the shipped sample, repeated)."""
    from specdecode.bench.data import load_questions

    questions = load_questions(categories=["summarization", "rag"])
    return "\n\n".join(str(q.prompt) for q in questions)


def prompt_at(llm, text_ids: list[int], depth: int) -> list[int]:
    """Chat prompt ids of about `depth` tokens: the documents cut to fit, then the question."""
    overhead = len(llm.encode([{"role": "user", "content": QUESTION}], chat=True))
    keep = max(depth - overhead, 8)
    if keep > len(text_ids):
        text_ids = (text_ids * (keep // len(text_ids) + 1))
    body = llm.tokenizer.decode(text_ids[:keep])
    return llm.encode([{"role": "user", "content": body + QUESTION}], chat=True)


def llama_bench(bins: Path, gguf: Path, threads: int, args: list[str]) -> float:
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def spread(values: list[float], fmt: str = ".1f") -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--depths", default="100,500,1000,2000,4000,8000")
    ap.add_argument("--methods", default="none,prompt-lookup,suffix,eagle")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per decode run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ttft-rounds", type=int, default=1, help="rounds that time the prefill from nothing")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kv-cache-dtype", default="float16")
    ap.add_argument("--llamacpp-bins", type=Path, help="llama.cpp's binaries (default: /work/llamacpp/READY's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("SPECDECODE_ADAPTIVE_THREADS", "0")  # both sides on exactly --threads threads

    import specdecode
    from specdecode.bench.hardware import machine_description
    from specdecode.engine.prefix_cache import PrefixCache
    from specdecode.models.loading import gguf_source

    depths = [int(d) for d in args.depths.split(",")]
    methods = args.methods.split(",")
    llm = specdecode.LLM.load(args.model, kv_cache_dtype=args.kv_cache_dtype, prefix_cache_mb=PREFIX_CACHE_MB)
    limit = llm.model.config.max_position_embeddings
    if max(depths) + args.tokens + 64 > limit:
        raise SystemExit(f"{args.model} holds {limit} positions: the deepest depth + --tokens must fit in it")
    text_ids = llm.tokenizer.encode(documents(), add_special_tokens=False)
    # each depth's text from its own place in the documents: no prompt begins as another's (the prefix cache)
    prompts = {d: prompt_at(llm, text_ids[(i * 2003) % max(len(text_ids) - d, 1):], d) for i, d in enumerate(depths)}
    bins = args.llamacpp_bins or built_bins()
    gguf = gguf_source(args.model)
    peer = bins is not None and (bins / "llama-bench").is_file() and gguf is not None
    results: dict = {"model": args.model, "depths": depths, "methods": methods, "tokens": args.tokens,
                     "threads": args.threads, "kv_cache_dtype": args.kv_cache_dtype, "machine": machine_description(),
                     "llamacpp": str(bins) if peer else None, "prompt_tokens": {d: len(p) for d, p in prompts.items()},
                     "ttft": {d: [] for d in depths}, "decode": {f"{m}@{d}": [] for m in methods for d in depths},
                     "tau": {f"{m}@{d}": [] for m in methods for d in depths},
                     "llama_decode": {d: [] for d in depths}, "llama_ttft": {d: [] for d in depths},
                     "same_text": True}
    texts: dict[int, str] = {}
    llm.generate(llm.encode("Hello.", chat=True), method="none", max_new_tokens=4)  # kernels built, caches touched
    for r in range(args.rounds):
        for d in depths:
            if r < args.ttft_rounds:
                llm.prefix_cache = PrefixCache(PREFIX_CACHE_MB << 20)  # nothing cached: the prefill from nothing
                out = llm.generate(prompts[d], method="none", max_new_tokens=1)
                results["ttft"][d].append(out.stats.seconds)
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                out = llm.generate(prompts[d], method=m, k="auto" if m != "none" else 0, max_new_tokens=args.tokens,
                                    min_tokens=args.tokens)
                s = out.stats
                results["decode"][f"{m}@{d}"].append(s.new_tokens / max(s.seconds - s.prefill_seconds, 1e-9))
                results["tau"][f"{m}@{d}"].append(s.tau)
                if texts.setdefault(d, out.text) != out.text:
                    results["same_text"] = False
            if peer:
                assert bins is not None and gguf is not None
                results["llama_decode"][d].append(llama_bench(bins, gguf, args.threads,
                                                              ["-p", "0", "-n", str(args.tokens), "-d", str(d)]))
                results["llama_ttft"][d].append(d / llama_bench(bins, gguf, args.threads, ["-p", str(d), "-n", "0"]))
            line = ", ".join(f"{m} {results['decode'][f'{m}@{d}'][-1]:.1f}" for m in methods)
            print(f"round {r} depth {d}: TTFT {(results['ttft'][d] or [0])[-1]:.2f} s; tok/s {line}"
                  + (f"; llama.cpp {results['llama_decode'][d][-1]:.1f}" if peer else ""), flush=True)
            save(results, args)
    print(save(results, args))


def save(results: dict, args) -> str:
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/long_context.py " + " ".join(sys.argv[1:])
    results["command"] = command
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, command)
    (args.out / "report.md").write_text(text)
    return text


def report(results: dict, command: str) -> str:
    depths, methods = results["depths"], results["methods"]
    peer = results["llamacpp"] is not None
    lines = [f"# Long contexts: decode and time to first token by depth ({date.today().isoformat()})", "",
             f"Command: `{command}`", "",
             f"Model {results['model']}, KV cache {results['kv_cache_dtype']}, {results['threads']} threads; "
             f"{results['tokens']} new tokens a decode run (a fixed length), greedy; prompts: Spec-Bench summarization "
             "and RAG documents cut to the depth, then \"Summarize the text above.\"; rounds interleaved (per depth: "
             "TTFT, each method in a rotated order, llama.cpp). Machine: " + results["machine"] + ".",
             "llama.cpp: " + (f"llama-bench from {results['llamacpp']} (-d DEPTH -n TOKENS -p 0: decode after DEPTH "
                              "cached tokens; -p DEPTH -n 0: prefill rate, TTFT ~ DEPTH / rate)."
                              if peer else "not run (no binaries: /work/llamacpp/READY missing)."), "",
             "Decode tokens/s (median, min-max over rounds); tau = tokens a target forward; TTFT in seconds.", "",
             "| depth | prompt tokens | TTFT | " + " | ".join(methods) + (" | llama.cpp | llama.cpp TTFT |"
                                                                  if peer else " |"),
             "|---:|---:|---:|" + "---:|" * len(methods) + ("---:|---:|" if peer else "")]
    for d in depths:
        key = str(d) if str(d) in results["ttft"] else d
        taus = {m: statistics.mean(results["tau"][f"{m}@{d}"] or [0]) for m in methods}
        cells = [f"{spread(results['decode'][f'{m}@{d}'])} (tau {taus[m]:.2f})" for m in methods]
        row = f"| {d} | {results['prompt_tokens'][key]} | {spread(results['ttft'][key], '.2f')} | " + " | ".join(cells)
        if peer:
            row += f" | {spread(results['llama_decode'][key])} | {spread(results['llama_ttft'][key], '.2f')}"
        lines.append(row + " |")
    lines += ["", "Ratios (medians): each method's decode at a depth over its decode at the smallest depth; ours over "
              "llama.cpp's at the same depth.", "",
              "| depth | " + " | ".join(f"{m} / {m}@{depths[0]}" for m in methods)
              + (" | " + " | ".join(f"{m} / llama.cpp" for m in methods) if peer else "") + " |",
              "|---:|" + "---:|" * (len(methods) * (2 if peer else 1))]
    for d in depths:
        key = str(d) if str(d) in results["llama_decode"] else d
        med = {m: statistics.median(results["decode"][f"{m}@{d}"]) if results["decode"][f"{m}@{d}"] else 0.0
               for m in methods}
        base = {m: statistics.median(results["decode"][f"{m}@{depths[0]}"] or [1.0]) for m in methods}
        cells = [f"{med[m] / base[m]:.2f}x" for m in methods]
        if peer:
            theirs = statistics.median(results["llama_decode"][key] or [float("nan")])
            cells += [f"{med[m] / theirs:.2f}x" for m in methods]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    lines += ["", f"Greedy text equal across the methods at every depth: {'yes' if results['same_text'] else 'NO'}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
