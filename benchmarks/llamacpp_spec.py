"""llama.cpp's draft-model speculation in its synthetic-acceptance mode, the peer of benchmarks/draft_synth.py.

llama-server (built by scripts/build_llamacpp.sh) with the target and `--spec-type draft-simple -md` a draft (its
plain draft-model speculation; without the type, llama-server starts no speculation): the draft drafts K tokens for
real (`--spec-draft-n-max K --spec-draft-n-min 0 --spec-draft-p-min 0`, so its random guesses are never cut short)
and `--spec-synth-rates a,a^2,...,a^K` makes verification accept guess i with conditional probability a whatever it
is (its output is then not the model's; server-context.cpp's server_sample_and_accept_synth, which never accepts a
drafted end-of-generation token). Plain decoding: a second server on the target alone. Each request is a prompt's
token ids, greedy, a fixed number of tokens (`ignore_eos`), no prompt cache; its decode time is the response's
`timings.predicted_ms` (the prompt's processing taken off, as our runs take prefill off).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from load import start_llama_server


@dataclass
class Decode:
    seconds: float  # decode time (prompt processing off)
    tokens: int
    drafted: int
    accepted: int


def synth_rates(rate: float, k: int) -> str:
    """llama.cpp's unconditional rates for a conditional acceptance `rate` per guess: rate, rate^2, ..., rate^k."""
    return ",".join(f"{rate ** (i + 1):.6g}" for i in range(k))


def spec_args(draft: Path, rate: float, k: int, threads: int) -> tuple[str, ...]:
    return ("--spec-type", "draft-simple", "-md", str(draft), "-td", str(threads), "--spec-draft-n-max", str(k),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--spec-synth-rates", synth_rates(rate, k))


@contextmanager
def server(bins: Path, target: Path, threads: int, tokens: int, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """A llama-server of one slot on `target` (with `extra` arguments) for the block's length: its URL."""
    proc, url = start_llama_server(bins, target, 1, tokens, threads, extra)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def decode(url: str, prompt: list[int], tokens: int, seed: int) -> Decode:
    """One greedy request of exactly `tokens` new tokens after the prompt's ids."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "seed": seed}
    reply = httpx.post(url + "/completion", json=body, timeout=600)
    reply.raise_for_status()
    timings = reply.json()["timings"]
    if timings["predicted_n"] != tokens:
        raise RuntimeError(f"llama-server decoded {timings['predicted_n']} tokens, asked for {tokens}")
    return Decode(timings["predicted_ms"] / 1e3, timings["predicted_n"], timings.get("draft_n", 0),
                  timings.get("draft_n_accepted", 0))
