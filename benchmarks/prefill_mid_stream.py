"""A long prompt arriving mid-stream: how much does it slow a running stream? (issue 25's chunked prefill)

    python benchmarks/prefill_mid_stream.py --prompt-tokens 4000 --out benchmarks/results/prefill-mid-stream-smollm2

Starts `specdecode serve` on loopback, streams one greedy completion of --stream-tokens tokens (speculation off, so
every step is alike), and once --after chunks have arrived sends a completion whose prompt is --prompt-tokens long.
Records the running stream's gaps between chunks before, during and after the long prompt's prefill, and the
long request's time to first token. Not a test: nothing is asserted. Writes results.json and report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load import running_server  # noqa: E402 (benchmarks/load.py, beside this script)

from specdecode.bench.hardware import machine_description  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "careful", "reader",
         "counts", "every", "word", "twice"]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary(gaps: list[float]) -> dict:
    return {"chunks": len(gaps), "median_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "p99_ms": 1e3 * percentile(gaps, 0.99), "max_ms": 1e3 * max(gaps) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=4000, help="the long prompt's length (about)")
    ap.add_argument("--stream-tokens", type=int, default=512)
    ap.add_argument("--after", type=int, default=64, help="chunks of the stream before the long prompt is sent")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with running_server(["--model", args.model], args.out / "server.log") as (_, url):
        long_prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_tokens))
        count = len(httpx.post(url + "/tokenize", json={"prompt": long_prompt}).json()["tokens"])
        arrival: dict[str, float] = {}

        def send_long() -> None:
            arrival["sent"] = time.perf_counter()
            with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                    "model": args.model, "prompt": long_prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                    "speculation": False}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and "first" not in arrival:
                        arrival["first"] = time.perf_counter()

        times: list[float] = []
        sender = threading.Thread(target=send_long)
        print(f"streaming {args.stream_tokens} tokens; a {count}-token prompt arrives after {args.after} chunks",
              file=sys.stderr)
        with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                "model": args.model, "prompt": "Write a long story about a lighthouse keeper.",
                "max_tokens": args.stream_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                "speculation": False}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    if len(times) == args.after:
                        sender.start()
        sender.join()
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        sent, first = arrival["sent"], arrival["first"]
        before = [g for g, t in zip(gaps, times[1:], strict=False) if t <= sent]
        during = [g for g, t in zip(gaps, times[1:], strict=False) if sent < t <= first]
        after = [g for g, t in zip(gaps, times[1:], strict=False) if t > first]
        result = {"machine": machine_description(), "model": args.model, "long_prompt_tokens": count,
                  "stream_tokens": args.stream_tokens, "long_ttft_s": first - sent, "whole_stream": summary(gaps),
                  "before": summary(before), "during_prefill": summary(during), "after": summary(after),
                  "command": " ".join(["python", *sys.argv])}
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        rows = "\n".join(f"| {name} | {s['chunks']} | {s['median_ms'] or float('nan'):.1f} | {s['p99_ms']:.1f} | "
                         f"{s['max_ms'] or float('nan'):.1f} |" for name, s in
                         (("whole stream", result["whole_stream"]), ("before", result["before"]),
                          ("during the prefill", result["during_prefill"]), ("after", result["after"])))
        whole = result["whole_stream"]
        report = f"""# A {count}-token prompt arriving mid-stream ({args.model})

- machine: {result['machine']}
- command: `{result['command']}`
- the long request's time to first token: {result['long_ttft_s']:.2f} s

The running stream's gaps between chunks (ms):

| part | chunks | median | p99 | max |
|---|---:|---:|---:|---:|
{rows}

Whole stream: p99 / median = {whole['p99_ms'] / whole['median_ms']:.2f}.
"""
        (args.out / "report.md").write_text(report)
        print(report)


if __name__ == "__main__":
    main()
