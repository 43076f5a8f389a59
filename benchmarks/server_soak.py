"""Soak test of `specdecode serve`: many clients for a long time, mixing good, bad and disconnecting requests.
Nothing may be lost (every good request answered in full), nothing crossed (every good greedy output equals the
same request run alone on the same server before the load), no 5xx, /health answering throughout, and the server's
memory bounded (resident memory sampled all along: the last minutes against the first).

    python benchmarks/server_soak.py --clients 16 --minutes 30 --out benchmarks/results/server-soak-smollm2

Starts the server on loopback (the default model, --method suffix and prompt-lookup enabled, --trust-request-chat-
template so that hostile templates are part of the mix). Each client loops: a good request (chat or completion,
streamed or not, greedy, a method of the mix), a bad one (a malformed or hostile body from BAD: each must get its
4xx), or a disconnect (a stream left after a few chunks). Writes results.json and report.md; exits 1 if anything was
lost or crossed, or a 5xx came back.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from load import percentile, running_server  # noqa: E402 (benchmarks/load.py, beside this script)
from memory_after_burst import rss_mb  # noqa: E402

from specdecode.bench.hardware import machine_description  # noqa: E402

MODEL = "soak"
PROMPTS = [  # good requests' prompts: chat turns and completion texts of different lengths
    "Write a short poem about the sea.",
    "List three uses of a paperclip, one per line.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain in two sentences why the sky is blue.",
    "Translate to French: The cat sleeps on the warm windowsill all afternoon.",
    "Summarize: Speculative decoding lets a cheap model guess tokens that a large model then checks in one pass.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is the capital of Japan?\nA:",
]
METHODS = [None, {"method": "suffix"}, {"method": "prompt-lookup"}, False]  # None: the server's; False: plain
MESSAGES = [{"role": "user", "content": "hi"}]
BAD = [  # (route, body as bytes or JSON, headers, the statuses it may get)
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}},
     {}, {400}),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"return_tensors": "np"}},
     {}, {400}),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "chat_template":
     "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}"}, {}, {400}),
    ("/v1/completions", b'{"model": "soak", "prompt": "a\\ud800b"}', {"content-type": "application/json"}, {400}),
    ("/v1/completions", b'{"model": "soak", "prompt": "hi"}', {"content-type": "text/plain"}, {415}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, {}, {400}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 9}, {}, {400}),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 200_000}, {}, {400}),
    ("/v1/completions", b"{not json", {"content-type": "application/json"}, {400}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, {}, {400}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "(unclosed"}, {}, {400}),
    ("/v1/completions", {"model": "other", "prompt": "hi"}, {}, {404}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, {"host": "evil.example"}, {421}),
]


def good_body(rng: random.Random) -> tuple[str, dict, tuple]:
    """(route, body, key of its expected output)."""
    prompt, method = rng.randrange(len(PROMPTS)), rng.randrange(len(METHODS))
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body: dict = {"model": MODEL, "max_tokens": 48, "temperature": 0, "stream": stream}
    if METHODS[method] is not None:
        body["speculation"] = METHODS[method]
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[prompt]}]
    else:
        body["prompt"] = PROMPTS[prompt]
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, (prompt, chat)


def answer_text(response: httpx.Response, stream: bool, chat: bool) -> str:
    """The text of a response read in full (a stream: its chunks; an error event raises)."""
    if not stream:
        response.read()
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    text, done = [], False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"error event: {data['error']}")
            for c in data["choices"]:
                text.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(text)


class Soak:
    def __init__(self, url: str, expected: dict, seconds: float) -> None:
        self.url, self.expected, self.deadline = url, expected, time.monotonic() + seconds
        self.counts: Counter = Counter()
        self.failures: list[str] = []  # lost, crossed or 5xx: each a line
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def note(self, kind: str, failure: str | None = None, seconds: float | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if failure is not None and len(self.failures) < 200:
                self.failures.append(failure)
            if seconds is not None:
                self.latencies.append(seconds)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while time.monotonic() < self.deadline:
                roll = rng.random()
                try:
                    if roll < 0.6:
                        self.good(http, rng)
                    elif roll < 0.85:
                        self.bad(http, rng)
                    else:
                        self.disconnect(rng)
                except Exception as e:  # noqa: BLE001 - a transport failure is a lost request
                    self.note("lost", f"client {seed}: {type(e).__name__}: {e}")

    def good(self, http: httpx.Client, rng: random.Random) -> None:
        route, body, key = good_body(rng)
        started = time.perf_counter()
        with http.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                response.read()
                kind = "5xx" if response.status_code >= 500 else "lost"
                self.note(kind, f"good {route}: HTTP {response.status_code} {response.text[:300]}")
                return
            text = answer_text(response, body["stream"], "messages" in body)
        if text != self.expected[key]:
            self.note("crossed", f"good {route} {key}: {text[:80]!r} != {self.expected[key][:80]!r}")
        else:
            self.note("good", seconds=time.perf_counter() - started)

    def bad(self, http: httpx.Client, rng: random.Random) -> None:
        route, body, headers, statuses = rng.choice(BAD)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = http.post(route, content=content, headers={"content-type": "application/json", **headers})
        if response.status_code >= 500:
            self.note("5xx", f"bad {route}: HTTP {response.status_code} {response.text[:300]}")
        elif response.status_code not in statuses:
            self.note("bad-unexpected", f"bad {route}: HTTP {response.status_code}, expected {statuses}")
        else:
            self.note("bad")

    def disconnect(self, rng: random.Random) -> None:
        body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=300) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= rng.randrange(1, 6):
                    break  # the client goes away mid-stream
        self.note("disconnect")


def solo_outputs(url: str) -> dict:
    """Each good prompt's greedy text, chat and completion, asked alone (plain decoding) before the load."""
    out = {}
    with httpx.Client(base_url=url, timeout=300) as http:
        for i, prompt in enumerate(PROMPTS):
            for chat in (True, False):
                body: dict = {"model": MODEL, "max_tokens": 48, "temperature": 0, "speculation": False}
                body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
                r = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
                r.raise_for_status()
                out[(i, chat)] = answer_text(r, False, chat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--sample-seconds", type=float, default=10.0, help="how often memory and /health are read")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    serve = ["--model", args.model, "--served-model-name", MODEL, "--method", "suffix", "--methods",
             "none,suffix,prompt-lookup", "--max-batch", "16", "--max-queue", "64", "--trust-request-chat-template"]
    print(f"starting the server ({args.model}); the first start on a machine times its forwards (minutes)",
          file=sys.stderr)
    with running_server(serve, args.out / "server.log") as (proc, url):
        expected = solo_outputs(url)
        soak = Soak(url, expected, args.minutes * 60)
        memory: list[tuple[float, float]] = []
        caches: list[float] = []  # MB the prefix and suffix caches hold (bounded by their options), when sampled
        health_failures = 0
        started = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            futures = [pool.submit(soak.client, seed) for seed in range(args.clients)]
            while not all(f.done() for f in futures):
                memory.append((time.monotonic() - started, rss_mb(proc.pid)))
                try:
                    health_failures += httpx.get(url + "/health", timeout=30).status_code != 200
                    caches.append(cache_mb(httpx.get(url + "/metrics", timeout=30).text))
                except httpx.HTTPError:
                    health_failures += 1
                    caches.append(caches[-1] if caches else 0.0)
                elapsed = time.monotonic() - started
                print(f"[{elapsed / 60:5.1f} of {args.minutes:g} min] {dict(soak.counts)} rss {memory[-1][1]:.0f} MB",
                      file=sys.stderr, flush=True)
                time.sleep(args.sample_seconds)
            for f in futures:
                f.result()
        after = solo_outputs(url)  # the server still answers each alone as before the load
        time.sleep(10)
        idle_after = rss_mb(proc.pid)
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "machine": machine_description(),
               "clients": args.clients, "minutes": args.minutes, "counts": dict(soak.counts),
               "failures": soak.failures, "health_failures": health_failures, "memory_mb": memory,
               "cache_mb": caches, "idle_after_mb": idle_after,
               "unchanged_after": after == expected,
               "good_latency_p50": percentile(soak.latencies, 0.5),
               "good_latency_p99": percentile(soak.latencies, 0.99)}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "report.md").write_text(report(results))
    print((args.out / "report.md").read_text())
    bad = soak.counts["lost"] + soak.counts["crossed"] + soak.counts["5xx"] + soak.counts["bad-unexpected"]
    sys.exit(1 if bad or health_failures or not results["unchanged_after"] else 0)


def cache_mb(metrics: str) -> float:
    """MB held by the prefix and suffix caches, from the server's /metrics."""
    total = 0.0
    for family in text_string_to_metric_families(metrics):
        if family.name in ("specdecode_prefix_cache_bytes", "specdecode_suffix_cache_bytes"):
            total += sum(sample.value for sample in family.samples)
    return total / 2**20


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report(r: dict) -> str:
    memory = [mb for _, mb in r["memory_mb"]]
    window = max(1, len(memory) // 6)  # the first and the last sixth of the run
    first, last = memory[:window], memory[-window:]
    others = [mb - cache for mb, cache in zip(memory, r.get("cache_mb", [0.0] * len(memory)), strict=False)]
    c = r["counts"]
    lines = [
        "# Server soak: good, bad and disconnecting requests together", "",
        f"{r['date']}, {r['machine']}. Command: `{r['command']}`", "",
        f"{r['clients']} clients for {r['minutes']:g} minutes against one `specdecode serve` (the default model, "
        "--method suffix, prompt-lookup and plain enabled, request templates trusted). Good requests: greedy, 48 "
        "tokens, chat or completion, streamed or not, each method of the mix; each must equal the same request run "
        "alone before the load. Bad requests: malformed or hostile bodies, each must get its 4xx. Disconnects: "
        "streams left after a few chunks.", "",
        "| outcome | requests |", "|---|---:|",
        *[f"| {kind} | {c.get(kind, 0)} |" for kind in ("good", "bad", "disconnect", "lost", "crossed", "5xx",
                                                       "bad-unexpected")],
        "",
        f"- /health failures while sampled: {r['health_failures']}",
        f"- every prompt answered alone after the load as before it: {'yes' if r['unchanged_after'] else 'NO'}",
        f"- good requests' latency: median {r['good_latency_p50']:.2f} s, p99 {r['good_latency_p99']:.2f} s",
        f"- resident memory (MB): first sixth median {sorted(first)[len(first) // 2]:.0f}, max {max(first):.0f}; "
        f"last sixth median {sorted(last)[len(last) // 2]:.0f}, max {max(last):.0f}; whole run max {max(memory):.0f}",
    ]
    if "cache_mb" in r:
        caches = r["cache_mb"]
        lines += [
            f"- the prefix and suffix caches (bounded by --prefix-cache-mb and --suffix-cache-tokens): "
            f"{median(caches[:window]):.0f} MB in the first sixth, {median(caches[-window:]):.0f} MB in the last",
            f"- resident memory less those caches (MB): first sixth median {median(others[:window]):.0f}, last sixth "
            f"median {median(others[-window:]):.0f}",
            f"- resident memory 10 s after the load: {r['idle_after_mb']:.0f} MB",
            "",
            "Resident memory by 5-minute window (MB, median; the caches' part in brackets):",
            "",
            *[f"- {w}-{w + 5} min: {median(ms):.0f} ({median(cs):.0f})"
              for w in range(0, int(r["minutes"]) + 1, 5)
              if (ms := [mb for (t, mb) in r["memory_mb"] if w * 60 <= t < (w + 5) * 60])
              and (cs := [c for (t, _), c in zip(r["memory_mb"], caches, strict=False) if w * 60 <= t < (w + 5) * 60])],
        ]
    if r["failures"]:
        lines += ["", "Failures (first 200):", "", *[f"- {f}" for f in r["failures"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
