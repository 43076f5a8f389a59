"""Does a server give its memory back after a burst of long requests? (issue 25: RSS within 20% of idle)

    python benchmarks/memory_after_burst.py --out benchmarks/results/memory-after-burst-smollm2

Starts `specdecode serve` on loopback, warms it with one short request, reads the process's resident memory
(idle), sends --burst concurrent completions with --prompt-tokens-long prompts, reads it at the peak and again
once they are done (after --settle seconds). Not a test: nothing is asserted. Writes results.json and report.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load import running_server  # noqa: E402 (benchmarks/load.py, beside this script)

from specdecode.bench.hardware import machine_description  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with running_server(["--model", args.model], args.out / "server.log") as (server, url):

        def complete(prompt: str, tokens: int) -> None:
            httpx.post(url + "/v1/completions", timeout=900, json={"model": args.model, "prompt": prompt,
                                                                   "max_tokens": tokens, "temperature": 0})

        complete("Hello", 16)
        time.sleep(args.settle)
        idle = rss_mb(server.pid)
        peak = [idle]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(server.pid))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        prompts = [" ".join(f"w{(i * 7 + j) % 997}" for j in range(args.prompt_tokens // 2)) for i in range(args.burst)]
        print(f"burst: {args.burst} requests of ~{args.prompt_tokens} prompt tokens", file=sys.stderr)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.burst) as pool:
            list(pool.map(lambda p: complete(p, 32), prompts))
        seconds = time.perf_counter() - started
        done.set()
        watcher.join()
        time.sleep(args.settle)
        after = rss_mb(server.pid)
        result = {"machine": machine_description(), "model": args.model, "burst": args.burst,
                  "prompt_tokens": args.prompt_tokens, "burst_seconds": seconds, "rss_idle_mb": idle,
                  "rss_peak_mb": peak[0], "rss_after_mb": after, "after_over_idle": after / idle,
                  "command": " ".join(["python", *sys.argv])}
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        report = f"""# Memory after a burst ({args.model})

- machine: {result['machine']}
- command: `{result['command']}`
- burst: {args.burst} concurrent completions of ~{args.prompt_tokens} prompt tokens and 32 new tokens, {seconds:.1f} s

| resident memory | MB |
|---|---:|
| idle (after one short request) | {idle:.0f} |
| peak during the burst | {peak[0]:.0f} |
| {args.settle:.0f} s after the burst | {after:.0f} ({after / idle:.2f}x idle) |
"""
        (args.out / "report.md").write_text(report)
        print(report)


if __name__ == "__main__":
    main()
