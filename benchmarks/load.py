"""Load test of `specdecode serve`: throughput and latency percentiles at several concurrency levels, with
speculation on (the server's default method, k=auto) and off (`"speculation": false`) on the same server.

    python benchmarks/load.py --model smollm2-135m-instruct --concurrency 1,4,16 \
        --out benchmarks/results/server-load-smollm2-cpu

Starts the server on loopback (or uses --url), sends Spec-Bench first turns (chat, greedy, streamed, a fixed
number of new tokens) from `c` concurrent clients, and for each level runs "off" and "on" alternately
(`--rounds` times, the order flipped each round) so machine drift hits both. Per request it records time to
first token, the gaps between streamed chunks (ITL), time per output token after the first (TPOT) and the
end-to-end time. Writes results.json and report.md. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdecode.bench.data import load_questions  # noqa: E402
from specdecode.bench.hardware import machine_description  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    pos = (len(values) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, speculation) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if speculation is not None:
        body["speculation"] = speculation
    started = time.perf_counter()
    chunk_times, text, usage = [], [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    chunk_times.append(time.perf_counter() - started)
                    text.append(content)
    end = time.perf_counter() - started
    tokens = usage["completion_tokens"]
    ttft = chunk_times[0] if chunk_times else end
    return {
        "ttft": ttft, "e2e": end, "tokens": tokens,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
        "tpot": (end - ttft) / (tokens - 1) if tokens > 1 else 0.0, "drafted": usage.get("drafted", 0),
        "accepted": usage.get("accepted", 0), "tau": usage.get("tau", 1.0), "text": "".join(text),
    }


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, speculation,
                    api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue = list(enumerate(prompts))
    results: dict[int, dict] = {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await one_request(client, model, prompt, max_tokens, speculation)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    rows = [results[i] for i in range(len(prompts))]
    return {"wall": wall, "requests": rows}


def summarize(runs: list[dict]) -> dict:
    rows = [r for run in runs for r in run["requests"]]
    tokens = sum(r["tokens"] for r in rows)
    wall = sum(run["wall"] for run in runs)
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    out = {"requests": len(rows), "tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
           "requests_per_second": len(rows) / wall, "acceptance_rate": accepted / drafted if drafted else 0.0,
           "tau": statistics.mean(r["tau"] for r in rows)}
    for name, values in (("ttft", [r["ttft"] for r in rows]), ("itl", [x for r in rows for x in r["itl"]]),
                         ("tpot", [r["tpot"] for r in rows]), ("e2e", [r["e2e"] for r in rows])):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q / 100)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], log=None) -> tuple[subprocess.Popen, str]:
    """`specdecode serve` with these arguments on a free loopback port, once its /health answers (its output into
    `log`, an open file, or this process's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", *serve_args, "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=None if log is None else subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    print("starting the server (the first start may convert the weights and measure batch costs)...",
          file=sys.stderr)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError("the server did not start")


@contextmanager
def running_server(serve_args: list[str], log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """start_server with its output in the file `log`; the server stops when the block ends."""
    with log.open("w") as out:
        proc, url = start_server(serve_args, log=out)
        try:
            yield proc, url
        finally:
            proc.terminate()
            proc.wait(30)


def serve_args(args) -> list[str]:
    """This load test's server: the model, method and batch it measures."""
    out = ["--model", args.model, "--method", args.method, "--k", "auto", "--max-batch", str(args.max_batch)]
    if args.draft:
        out += ["--draft", args.draft]
    if args.replicas:
        out += ["--replicas", str(args.replicas), "--replica-cpus", str(args.replica_cpus)]
    return out


def report(results: dict, command: str) -> str:
    lines = [
        "# Server load: speculation on vs off",
        "",
        f"Command: `{command}`",
        "",
        f"Model {results['model']}, method `{results['method']}` with k=auto when on, `\"speculation\": false` "
        f"when off, same server (--max-batch {results['max_batch']}); chat requests from Spec-Bench first turns, "
        f"greedy, {results['max_tokens']} new tokens each (ignore_eos), streamed; {results['rounds']} rounds per "
        f"level, on/off order flipped each round. Machine: {results['machine']}.",
        "",
        "Latencies in ms. ITL: gap between streamed chunks (a chunk may carry several tokens when guesses are "
        "accepted); TPOT: (end-to-end - TTFT) / (tokens - 1).",
        "",
        "| concurrency | speculation | requests | tokens/s | speedup | tau | accept | TTFT p50/p90/p99 | "
        "ITL p50/p90/p99 | TPOT p50/p90/p99 | E2E p50/p90/p99 |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for level in results["levels"]:
        off = level["off"]["tokens_per_second"]
        for mode in ("off", "on"):
            s = level[mode]

            def ms(name: str, s=s) -> str:
                return "/".join(f"{1e3 * s[f'{name}_p{q}']:.0f}" for q in (50, 90, 99))

            lines.append(
                f"| {level['concurrency']} | {mode} | {s['requests']} | {s['tokens_per_second']:.1f} | "
                f"{s['tokens_per_second'] / off:.2f}x | {s['tau']:.2f} | {s['acceptance_rate']:.2f} | {ms('ttft')} | "
                f"{ms('itl')} | {ms('tpot')} | {ms('e2e')} |")
    same = all(level["outputs_match"] for level in results["levels"])
    lines += ["", f"Greedy outputs with speculation on equal those with it off: {'yes' if same else 'NO'}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="prompt-lookup")
    p.add_argument("--draft")
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", default="4,8,16", help="requests per level, mode and round (a comma list, one "
                   "per --concurrency level)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--replicas", type=int, help="serve on Ray Serve with this many replicas (see README)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: CPUs per replica")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    questions = load_questions(per_category=4)
    by_category: dict[str, list[str]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q.prompt)
    prompts = [lst[i] for i in range(4) for lst in by_category.values() if i < len(lst)]  # categories interleaved

    proc, url = (None, args.url) if args.url else start_server(serve_args(args))
    results = {"model": args.model, "method": args.method, "max_batch": args.max_batch, "replicas": args.replicas,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "machine": machine_description(), "levels": []}
    try:
        asyncio.run(run_level(url, args.model, prompts[:2], 2, 16, None, args.api_key))  # warm-up
        offset = 0
        levels = [int(x) for x in args.concurrency.split(",")]
        counts = [int(x) for x in args.requests.split(",")]
        if len(counts) != len(levels):
            raise SystemExit("--requests needs one count per --concurrency level")
        for c, n in zip(levels, counts, strict=True):
            level = {"concurrency": c, "runs": {"on": [], "off": []}}
            for r in range(args.rounds):
                batch = [prompts[(offset + i) % len(prompts)] for i in range(n)]
                offset += n
                order = [("off", False), ("on", None)]
                for mode, spec in order if r % 2 == 0 else order[::-1]:
                    run = asyncio.run(run_level(url, args.model, batch, c, args.max_tokens, spec, args.api_key))
                    run["prompts"] = [prompts.index(b) for b in batch]
                    level["runs"][mode].append(run)
                    s = summarize([run])
                    print(f"c={c} round {r} {mode}: {s['tokens_per_second']:.1f} tok/s, tau {s['tau']:.2f}, "
                          f"TTFT p50 {1e3 * s['ttft_p50']:.0f} ms, E2E p50 {s['e2e_p50']:.1f} s", flush=True)
            level["on"], level["off"] = summarize(level["runs"]["on"]), summarize(level["runs"]["off"])
            level["outputs_match"] = all(
                a["text"] == b["text"] for ron, roff in zip(level["runs"]["on"], level["runs"]["off"], strict=True)
                for a, b in zip(ron["requests"], roff["requests"], strict=True))
            results["levels"].append(level)
            save(results, Path(args.out), "python benchmarks/load.py " + " ".join(sys.argv[1:]))  # so far
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    print(save(results, Path(args.out), "python benchmarks/load.py " + " ".join(sys.argv[1:])))
    return 0


def save(results: dict, out: Path, command: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    results["command"] = command
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, command)
    (out / "report.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
