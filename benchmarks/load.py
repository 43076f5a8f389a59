"""Load test of `specdecode serve`: throughput and latency percentiles at several concurrency levels, with
speculation on (the server's default method, k=auto) and off (`"speculation": false`) on the same server.

    python benchmarks/load.py --model smollm2-135m-instruct --concurrency 1,4,16 \
        --out benchmarks/results/server-load-smollm2-cpu

Starts the server on loopback (or uses --url), sends Spec-Bench first turns (chat, greedy, streamed, a fixed
number of new tokens) from `c` concurrent clients, and for each level runs "off" and "on" alternately
(`--rounds` times, the order rotated each round) so machine drift hits both. Per request it records time to
first token, the gaps between streamed chunks (ITL), time per output token after the first (TPOT) and the
end-to-end time. Writes results.json and report.md. Not a test: nothing is asserted.

Methods side by side on one server: `--modes off,suffix,prompt-lookup` (each request picks its method;
the server sets them all up at start). `--workload repetitive` sends the repetitive workload's chats instead
(`specdecode bench --workload`), answers ending where the model ends them (up to --max-tokens), and `--warm N`
first sends N other prompts of the workload with every method, so the suffix cache of earlier outputs is warm
(never with the measured prompts' own answers).

`--modes off,on,llama.cpp` adds llama.cpp's own server beside ours (where /work/llamacpp/READY names its binaries,
or --llamacpp-bins): `llama-server` on the model's GGUF file with `-np --max-batch` slots (continuous batching), the
same threads, the same requests through the same OpenAI chat endpoint, interleaved with our modes. Its greedy text
comes from other arithmetic than ours, so it is left out of the outputs' equality.
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
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from llamacpp_build import built_bins  # noqa: E402

from specdecode.bench.data import load_questions  # noqa: E402
from specdecode.bench.hardware import machine_description  # noqa: E402
from specdecode.bench.workloads import WORKLOADS, load_workload  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    pos = (len(values) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int, speculation,
                      ignore_eos: bool = True) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
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
            elif data.get("timings", {}).get("predicted_n"):  # llama-server without include_usage
                usage = {"completion_tokens": data["timings"]["predicted_n"]}
            for choice in data.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    chunk_times.append(time.perf_counter() - started)
                    text.append(content)
    end = time.perf_counter() - started
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    tokens = usage["completion_tokens"]
    ttft = chunk_times[0] if chunk_times else end
    return {
        "ttft": ttft, "e2e": end, "tokens": tokens,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
        "tpot": (end - ttft) / (tokens - 1) if tokens > 1 else 0.0, "drafted": usage.get("drafted", 0),
        "accepted": usage.get("accepted", 0), "tau": usage.get("tau", 1.0), "text": "".join(text),
    }


async def run_level(url: str, model: str, prompts: list[list[dict]], concurrency: int, max_tokens: int, speculation,
                    api_key: str | None, ignore_eos: bool = True) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue = list(enumerate(prompts))
    results: dict[int, dict] = {}
    # a connection per request: llama-server may close a kept-alive one just as the next request goes out
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await one_request(client, model, prompt, max_tokens, speculation, ignore_eos)

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
    print("starting the server (the first start may convert the weights and measure batch costs)...",
          file=sys.stderr)
    return proc, healthy(proc, port, "the server", 900)


def healthy(proc: subprocess.Popen, port: int, name: str, seconds: float) -> str:
    """The server's loopback URL once its /health answers; it is killed if it has not within `seconds`."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited during start-up: {' '.join(map(str, proc.args))}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"{name} did not start")


LLAMACPP = "llama.cpp"


def start_llama_server(bins: Path, gguf: Path, slots: int, max_tokens: int, threads: int | None,
                       extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own server on the GGUF file, `slots` requests at once (each slot a context of 4,096 positions:
    a Spec-Bench prompt and its answer), with `extra` arguments, once its /health answers."""
    port = free_port()
    cmd = [str(bins / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * 4096), "-n", str(max_tokens), "--no-webui", *(["-t", str(threads)] if threads else []),
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("starting llama-server...", file=sys.stderr)
    return proc, healthy(proc, port, "llama-server", 300)


def llamacpp_bins(given: Path | None) -> Path:
    bins = given or built_bins()
    if bins is None or not (bins / "llama-server").is_file():
        raise SystemExit("--modes llama.cpp needs llama.cpp's binaries: build them with scripts/build_llamacpp.sh, "
                         "or give --llamacpp-bins")
    return bins


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


def serve_args(args, modes: list[str]) -> list[str]:
    """This load test's server: the model, method and batch it measures, every method the modes name enabled."""
    out = ["--model", args.model, "--method", args.method, "--k", "auto", "--max-batch", str(args.max_batch),
           "--prefix-cache-mb", str(args.prefix_cache_mb)]
    named = [m for m in modes if m not in ("off", "on", LLAMACPP)]
    if named:
        out += ["--methods", ",".join(dict.fromkeys([args.method, "none", *named]))]
    if args.draft:
        out += ["--draft", args.draft]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.replicas:
        out += ["--replicas", str(args.replicas), "--replica-cpus", str(args.replica_cpus)]
    return out


def speculation_of(mode: str):
    """A mode's `speculation` field: off (plain), on (the server's method), or a method by name."""
    return {"off": False, "on": None, LLAMACPP: None}.get(mode, {"method": mode, "k": "auto"})


def report(results: dict, command: str) -> str:
    modes = results.get("modes", ["off", "on"])
    base = "off" if "off" in modes else modes[0]
    workload = results.get("workload", "spec-bench")
    prompts = (f"the {workload} workload's chats (answers end where the model ends them)"
               if workload != "spec-bench" else "chat requests from Spec-Bench first turns")
    warm = (f" Before the levels, {results['warm']} other prompts of the workload ran with every method (the suffix "
            "cache of earlier outputs warm)." if results.get("warm") else "")
    lines = [
        "# Server load: speculation on vs off" if modes == ["off", "on"] else "# Server load: " + ", ".join(modes),
        "",
        f"Command: `{command}`",
        "",
        f"Model {results['model']}, method `{results['method']}` with k=auto when on, `\"speculation\": false` "
        f"when off, a method by name with k=auto, all on the same server (--max-batch {results['max_batch']}); "
        f"{prompts}, greedy, up to {results['max_tokens']} new tokens each, streamed; {results['rounds']} rounds "
        f"per level, the modes' order rotated each round.{warm} "
        f"Server threads: {results.get('threads') or 'torch default'}. "
        f"Machine: {results['machine']}.",
        "",
        f"Speedup: tokens/s over `{base}`'s at the same level (prefills included); decode: `{base}`'s TPOT p50 over "
        "the mode's (a request's pace once its first token is out: what speculation changes, apart from the prefills "
        "a loaded machine makes long). Latencies in ms. ITL: gap between streamed chunks (a chunk may carry several "
        "tokens when guesses are accepted); TPOT: (end-to-end - TTFT) / (tokens - 1).",
        "",
        "| concurrency | speculation | requests | tokens/s | speedup | decode | tau | accept | TTFT p50/p90/p99 | "
        "ITL p50/p90/p99 | TPOT p50/p90/p99 | E2E p50/p90/p99 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for level in results["levels"]:
        reference = level[base]["tokens_per_second"]
        for mode in modes:
            s = level[mode]

            def ms(name: str, s=s) -> str:
                return "/".join(f"{1e3 * s[f'{name}_p{q}']:.0f}" for q in (50, 90, 99))

            lines.append(
                f"| {level['concurrency']} | {mode} | {s['requests']} | {s['tokens_per_second']:.1f} | "
                f"{s['tokens_per_second'] / reference:.2f}x | {level[base]['tpot_p50'] / s['tpot_p50']:.2f}x | "
                f"{s['tau']:.2f} | {s['acceptance_rate']:.2f} | "
                f"{ms('ttft')} | {ms('itl')} | {ms('tpot')} | {ms('e2e')} |")
    same = all(level["outputs_match"] for level in results["levels"])
    lines += ["", f"Greedy outputs equal across our modes: {'yes' if same else 'NO'}."]
    if LLAMACPP in modes:
        lines.append("llama.cpp: its own `llama-server` (-np = --max-batch slots, continuous batching, the same "
                     "threads) on the model's GGUF file, the same requests; its text is its own arithmetic's, not "
                     "compared.")
    return "\n".join(lines) + "\n"


def workload_prompts(name: str, count: int) -> list[list[dict]]:
    """Chats, categories interleaved: Spec-Bench first turns (4 a category, cycled through), or `count` of a
    repetitive workload's."""
    if name == "spec-bench":
        questions = load_questions(per_category=4)
    else:
        questions = load_workload(name, per_category=max(1, -(-count // len(WORKLOADS[name]))))
    by_category: dict[str, list] = {}
    for q in questions:
        messages = q.prompt if isinstance(q.prompt, list) else [{"role": "user", "content": q.prompt}]
        by_category.setdefault(q.category, []).append(messages)
    most = max(len(v) for v in by_category.values())
    return [lst[i] for i in range(most) for lst in by_category.values() if i < len(lst)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="prompt-lookup")
    p.add_argument("--modes", default="off,on", help="comma list: off (plain), on (--method), or method names; "
                   "the server is started with every named method enabled")
    p.add_argument("--workload", default="spec-bench", choices=["spec-bench", *WORKLOADS])
    p.add_argument("--warm", type=int, default=0, help="workload prompts (not measured) sent first with every mode")
    p.add_argument("--draft")
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", default="4,8,16", help="requests per level, mode and round (a comma list, one "
                   "per --concurrency level)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--prefix-cache-mb", type=int, default=0,
                   help="the server's prefix cache (default off: the modes send the same prompts, and a mode must not "
                        "find another's prefill)")
    p.add_argument("--threads", type=int, help="the server's CPU threads for its forwards (default: torch's "
                   "choice; 1 on a machine whose cores other processes keep busy: threads that wait on each other "
                   "there lose more than a second core gains)")
    p.add_argument("--replicas", type=int, help="serve on Ray Serve with this many replicas (see README)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: CPUs per replica")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llamacpp-bins", type=Path, help="with --modes ...,llama.cpp: llama.cpp's binaries (default: "
                   "the directory /work/llamacpp/READY names)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    modes = args.modes.split(",")
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(levels):
        raise SystemExit("--requests needs one count per --concurrency level")
    ignore_eos = args.workload == "spec-bench"  # Spec-Bench: a fixed length; a workload: its answers' own
    measured = sum(counts) * args.rounds
    everything = workload_prompts(args.workload, measured + args.warm)
    prompts, warm = everything[: len(everything) - args.warm], everything[len(everything) - args.warm :]
    peer, urls = None, {}
    if LLAMACPP in modes:
        from specdecode.models.loading import gguf_source

        gguf = gguf_source(args.model)
        if gguf is None:
            raise SystemExit(f"--modes llama.cpp needs a GGUF model; {args.model} is not one")
        peer, urls[LLAMACPP] = start_llama_server(llamacpp_bins(args.llamacpp_bins), gguf, args.max_batch,
                                                  args.max_tokens, args.threads)
    proc, url = (None, args.url) if args.url else start_server(serve_args(args, modes))
    results: dict[str, Any] = {"model": args.model, "method": args.method, "modes": modes, "workload": args.workload,
               "warm": args.warm, "max_batch": args.max_batch, "replicas": args.replicas, "threads": args.threads,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "machine": machine_description(), "levels": []}
    try:
        for where in {url, *urls.values()}:  # warm-up
            asyncio.run(run_level(where, args.model, prompts[:2], 2, 16, None, args.api_key))
        for mode in modes if warm else []:
            print(f"warming with {len(warm)} prompts, {mode}...", file=sys.stderr, flush=True)
            asyncio.run(run_level(urls.get(mode, url), args.model, warm, 1, args.max_tokens, speculation_of(mode),
                                  args.api_key, ignore_eos))
        offset = 0
        for c, n in zip(levels, counts, strict=True):
            level: dict[str, Any] = {"concurrency": c, "runs": {mode: [] for mode in modes}}
            for r in range(args.rounds):
                batch = [prompts[(offset + i) % len(prompts)] for i in range(n)]
                offset += n
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    run = asyncio.run(run_level(urls.get(mode, url), args.model, batch, c, args.max_tokens,
                                                speculation_of(mode), args.api_key, ignore_eos))
                    run["prompts"] = [prompts.index(b) for b in batch]
                    level["runs"][mode].append(run)
                    s = summarize([run])
                    print(f"c={c} round {r} {mode}: {s['tokens_per_second']:.1f} tok/s, tau {s['tau']:.2f}, "
                          f"TTFT p50 {1e3 * s['ttft_p50']:.0f} ms, E2E p50 {s['e2e_p50']:.1f} s", flush=True)
            for mode in modes:
                level[mode] = summarize(level["runs"][mode])
            ours = [runs for mode, runs in level["runs"].items() if mode != LLAMACPP]
            level["outputs_match"] = all(
                len({run["requests"][i]["text"] for run in runs}) == 1
                for runs in zip(*ours, strict=True) for i in range(len(runs[0]["requests"])))
            results["levels"].append(level)
            save(results, Path(args.out), "python benchmarks/load.py " + " ".join(sys.argv[1:]))  # so far
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        if peer is not None:
            peer.terminate()
            peer.wait(30)
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
