"""What the server's prefix cache saves a conversation's next turn: time to first token and end to end, with the cache
(`--prefix-cache-mb 256`, the default) and without (0), two servers side by side.

    python benchmarks/prefix_cache.py --sessions 8 --out benchmarks/results/prefix-cache-smollm2

Sends the `sessions` workload (specdecode/bench/workloads.py): each session's first turn to the server with the
cache (the model's own answer; greedy, as the other would answer), then its next turn, which re-sends the first turn
and that answer, to both in alternating order, so machine drift hits both alike. Records per next turn the prompt
tokens, the tokens read from the cache (usage.prompt_tokens_details.cached_tokens), TTFT and end-to-end time, and
whether both servers gave the same text. Writes results.json and report.md. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import running_server  # noqa: E402

from specdecode.bench.hardware import machine_description  # noqa: E402
from specdecode.bench.workloads import load_workload  # noqa: E402


async def turn(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat turn (the server's default speculation): text, TTFT, end to end, usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage = None, [], {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for choice in data.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    first = first or time.perf_counter() - started
                    text.append(choice["delta"]["content"])
    end = time.perf_counter() - started
    return {"text": "".join(text), "ttft": first or end, "e2e": end, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": usage["completion_tokens"]}


def run(args) -> dict:
    sessions = load_workload("sessions", per_category=args.sessions)
    servers = {"cache": ["--prefix-cache-mb", "256"], "none": ["--prefix-cache-mb", "0"]}
    records = []
    logs = Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    with ExitStack() as stack:
        urls = {name: stack.enter_context(running_server(["--model", args.model, *extra], logs / f"{name}.log"))[1]
                for name, extra in servers.items()}
        for url in urls.values():  # warm-up: one-off costs stay out of the numbers
            asyncio.run(turn(url, args.model, [{"role": "user", "content": "Hello!"}], 8))
        for i, q in enumerate(sessions):
            messages: list[dict] = []
            for m in q.prompt[:-1]:
                if m["content"] is None:  # the model answers (greedy: as the other server would); kept in the cache
                    answer = asyncio.run(turn(urls["cache"], args.model, messages, args.first_tokens))
                    m = {"role": "assistant", "content": answer["text"]}
                messages.append(m)
            messages.append(q.prompt[-1])
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]
            done = {name: asyncio.run(turn(urls[name], args.model, messages, args.max_tokens)) for name in order}
            records.append({"question_id": q.question_id, "category": q.category, "first": order[0],
                            "same_text": done["cache"]["text"] == done["none"]["text"],
                            **{f"{name}_{key}": value for name, rec in done.items() for key, value in rec.items()
                               if key != "text"}})
            print(f"{q.category} {q.question_id}: TTFT {done['none']['ttft'] * 1e3:.0f} -> "
                  f"{done['cache']['ttft'] * 1e3:.0f} ms ({done['cache']['cached_tokens']} of "
                  f"{done['cache']['prompt_tokens']} prompt tokens cached)", flush=True)
    return {"command": " ".join(sys.argv), "machine": machine_description(), "model": args.model,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "records": records}


def report(results: dict) -> str:
    lines = [f"# Prefix cache: a conversation's next turn, {results['model']}", "",
             f"- date: {results['date']}", f"- machine: {results['machine']}", f"- command: `{results['command']}`",
             "- two servers side by side (`--prefix-cache-mb 256` and `0`); the first answered each session's first "
             "turn (kept in its cache), then the next turn went to both in alternating order; greedy, the server's "
             "default speculation (prompt lookup, k=auto)", "",
             "| category | sessions | prompt tokens (median) | cached | TTFT without (ms, median) | TTFT with | "
             "end to end without (s) | with | same text |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict[str, list[dict]] = {}
    for rec in results["records"]:
        groups.setdefault(rec["category"], []).append(rec)
    groups["overall"] = results["records"]
    for category, recs in groups.items():
        def med(key: str, recs=recs) -> float:
            return statistics.median(r[key] for r in recs)

        cached = sum(r["cache_cached_tokens"] for r in recs) / sum(r["cache_prompt_tokens"] for r in recs)
        lines.append(f"| {category} | {len(recs)} | {med('cache_prompt_tokens'):.0f} | {cached:.0%} | "
                     f"{med('none_ttft') * 1e3:.0f} | {med('cache_ttft') * 1e3:.0f} | {med('none_e2e'):.2f} | "
                     f"{med('cache_e2e'):.2f} | {sum(r['same_text'] for r in recs)}/{len(recs)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sessions", type=int, default=8, help="sessions per category")
    p.add_argument("--first-tokens", type=int, default=256, help="most tokens of a first turn's answer")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of a next turn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
