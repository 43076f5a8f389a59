"""Runs a benchmark: every prompt through every method, interleaved, with a warm-up and a progress bar."""

from __future__ import annotations

import json
import random
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..api import LLM
from ..engine.prefix_cache import PrefixCache
from ..models import resolve
from .data import Question
from .hardware import machine_description, memory_bandwidth_gbs, weight_bytes
from .methods import Method, Runners
from .report import tps
from .workloads import has_own_turns


@dataclass
class BenchConfig:
    model: str
    methods: list[Method]
    questions: list[Question]
    temperatures: list[float]
    max_new_tokens: int
    seed: int = 0
    command: str = ""
    repeats: int = 1  # runs of each (prompt, method); the fastest one is kept (see run_benchmark)
    dtype: str = "float32"
    quantization: str | None = "auto"
    kv_cache_dtype: str = "float16"
    prefix_cache_mb: int = 0  # earlier requests' keys and values reused, as the server does (0: every prompt prefilled)


def run_benchmark(cfg: BenchConfig, llm: LLM | None = None) -> dict:
    llm = llm or LLM.load(cfg.model, dtype=cfg.dtype, quantization=cfg.quantization,
                          kv_cache_dtype=cfg.kv_cache_dtype)
    llm.prefix_cache = PrefixCache(cfg.prefix_cache_mb << 20) if cfg.prefix_cache_mb else None
    needs_peers = any(m.kind == "transformers" for m in cfg.methods)
    llama_cpp = cfg.model if any(m.kind == "llama.cpp" for m in cfg.methods) else None
    runners = Runners(llm, str(resolve(cfg.model)) if needs_peers else "", need_peers=needs_peers,
                      llama_cpp_model=llama_cpp, context=llm.model.config.max_position_embeddings)
    context = llm.model.config.max_position_embeddings
    prompts: dict[int, list[int]] = {}

    def prompt_of(q: Question) -> list[int]:
        """A question's tokens (a session's own turns answered first: once, before its first run)."""
        if q.question_id not in prompts:
            messages = q.prompt
            if isinstance(messages, list) and has_own_turns(messages):
                messages = answer_own_turns(llm, messages, cfg.max_new_tokens)
            prompts[q.question_id] = llm.encode(messages, chat=True)
            if len(prompts[q.question_id]) + cfg.max_new_tokens > context:
                raise ValueError(f"question {q.question_id} is too long for the model's context ({context})")
        return prompts[q.question_id]

    for q in cfg.questions:  # fail before the runs (a session's length is known once its own turns are answered)
        if not has_own_turns(q.prompt):
            prompt_of(q)
    first = prompt_of(cfg.questions[0])
    with held_outputs(llm, cfg.methods, keep=False):  # the warm-up's answers must not help the first prompt's runs
        for m in cfg.methods:  # warm-up: one-off costs (weight packing, allocator growth) stay out of the numbers
            m.run(runners, first, 8, cfg.temperatures[0], cfg.seed)

    records = []
    total = len(cfg.questions) * len(cfg.methods) * len(cfg.temperatures) * cfg.repeats
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("benchmark", total=total)
        speedups: dict[str, list[float]] = {}
        for temperature in cfg.temperatures:
            for i, q in enumerate(cfg.questions):
                runs: dict[str, list[dict]] = {m.label: [] for m in cfg.methods}
                if has_own_turns(q.prompt) and q.question_id not in prompts:
                    progress.update(task, description=f"q{q.question_id} {q.category}: the model answers the "
                                    "session's earlier turns (plain decoding, not timed)")
                prompt = prompt_of(q)
                with held_outputs(llm, cfg.methods):  # no run of this prompt finds another's answer
                    for r in range(cfg.repeats):
                        progress.update(task, description=f"T={temperature} q{q.question_id} {q.category:<14} "
                                        f"round {r + 1}/{cfg.repeats}" + running(speedups))
                        # a fresh random order per prompt and round: neither drift nor what ran just before favours
                        # a method
                        rng = random.Random(f"{cfg.seed}-{temperature}-{i}" + (f"-{r}" if r else ""))
                        done = run_round(runners, cfg.methods, prompt, cfg.max_new_tokens,
                                         temperature, cfg.seed + i, rng)
                        for label, rec in done.items():
                            runs[label].append(rec)
                        progress.advance(task, len(cfg.methods))
                by_label = {}
                for m in cfg.methods:
                    rec = fastest(runs[m.label])
                    rec.update(question_id=q.question_id, category=q.category, method=m.label, kind=m.kind,
                               k=m.k, temperature=temperature, prompt_tokens=len(prompt))
                    records.append(rec)
                    by_label[m.label] = rec
                base = by_label["none"]
                this = {label: tps(rec) / tps(base) for label, rec in by_label.items()
                        if label != "none" and rec["seconds"] and base["seconds"]}
                for label, speedup in this.items():
                    speedups.setdefault(label, []).append(speedup)
                progress.console.log(f"T={temperature} q{q.question_id} {q.category}: none {tps(base):.1f} tok/s;"
                                     + " ".join(f" {label}={x:.2f}x" for label, x in this.items())
                                     + ";" + running(speedups))

    bandwidth = memory_bandwidth_gbs()
    bytes_per_token = weight_bytes(llm.model)
    return {
        "model": cfg.model,
        "command": cfg.command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "weights": llm.model.weights_kind(),
        "peer_versions": runners.peer_versions(),
        "prefix_cache_mb": cfg.prefix_cache_mb,
        "max_new_tokens": cfg.max_new_tokens,
        "repeats": cfg.repeats,
        "interleave": "step",  # see run_round
        "temperatures": cfg.temperatures,
        "methods": [asdict(m) for m in cfg.methods],
        "memory_bandwidth_gbs": bandwidth,
        "weight_bytes": bytes_per_token,
        "plain_decoding_bound_tokens_per_s": bandwidth * 1e9 / bytes_per_token,
        "records": records,
    }


def run_round(runners: Runners, methods: list[Method], prompt: list[int], max_new_tokens: int,
              temperature: float, seed: int, rng: random.Random) -> dict[str, dict]:
    """Every method once on a prompt. Ours advance one step at a time, in a fresh random order each
    round of steps, so load that comes and goes (a shared machine's bursts outlast many steps)
    hits them all alike and their ratios stay sharp; each is timed by the sum of its own steps (prefill
    included). Peers (transformers' generate, llama.cpp) cannot be stepped: they run whole, in random order, first."""
    records = {}
    peers = [m for m in methods if m.kind != "ours"]
    for m in rng.sample(peers, len(peers)):
        records[m.label] = m.run(runners, prompt, max_new_tokens, temperature, seed)
    gens = {m.label: runners.start(m, prompt, max_new_tokens, temperature, seed) for m in methods if m.kind == "ours"}
    steps = {label: iter(gen) for label, gen in gens.items()}
    seconds: dict[str, list[float]] = {label: [] for label in gens}
    while steps:
        for label in rng.sample(sorted(steps), len(steps)):
            started = time.perf_counter()
            try:
                next(steps[label])
            except StopIteration:
                del steps[label]
            seconds[label].append(time.perf_counter() - started)
    for label, gen in gens.items():
        records[label] = Runners.record(gen, sum(seconds[label]), prefill_seconds=seconds[label][0])
    return {m.label: records[m.label] for m in methods}


def held_outputs(llm: LLM, methods: list[Method], keep: bool = True) -> ExitStack:
    """While a prompt's rounds run, the global suffix cache keeps their outputs aside (they join it after the last
    round; keep=False: never), and the prefix cache their texts: every run of every method then starts from what
    earlier prompts left only (no method's prefill is another's), so the fastest of a method's runs can be kept
    as for the others."""
    stack = ExitStack()
    if any(m.remembers_outputs for m in methods):
        stack.enter_context(llm.assets.suffix_cache().holding(keep))
    if llm.prefix_cache is not None:
        stack.enter_context(llm.prefix_cache.holding(keep))
    return stack


def answer_own_turns(llm: LLM, messages: list[dict], max_new_tokens: int) -> list[dict]:
    """A session's messages with the turns the model answers itself (`OWN`) written: plain greedy decoding, as a
    server answered them the turn before (with the prefix cache on, their entries are kept as a server keeps them).
    The answer is the same whatever method later runs the session: every method meets the same prompt."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "assistant" and message["content"] is None:
            answer = llm.generate(out, chat=True, method="none", max_new_tokens=max_new_tokens)
            message = {"role": "assistant", "content": answer.text}
        out.append(message)
    return out


def fastest(runs: list[dict]) -> dict:
    """The fastest of a (prompt, method)'s runs, as timeit does: on a shared machine the slower runs measure
    interference, not the method. The prefill is one long step (a fifth of a long prompt's time) that a
    burst of load hits alone, not shared out as over the decode steps; it is the same work in every run,
    so the prefill and the decode steps each keep their fastest. All run times are kept; outputs that
    differ between runs are flagged."""
    best = dict(min(runs, key=lambda rec: rec["seconds"]))
    best["seconds_runs"] = [rec["seconds"] for rec in runs]
    if all("cached_tokens" in rec for rec in runs):
        best["cached_tokens_runs"] = [rec["cached_tokens"] for rec in runs]
    if all(rec.get("prefill_seconds") is not None for rec in runs):
        prefill = min(rec["prefill_seconds"] for rec in runs)
        best.update(seconds=prefill + min(rec["seconds"] - rec["prefill_seconds"] for rec in runs),
                    prefill_seconds=prefill, prefill_seconds_runs=[rec["prefill_seconds"] for rec in runs])
    if len({rec["output_hash"] for rec in runs}) > 1:
        best["output_hash"] = "differs-between-runs"
    return best


def running(speedups: dict[str, list[float]]) -> str:
    """Median speedup so far per method (not the last prompt's)."""
    return "  median so far: " + " ".join(f"{k}={statistics.median(v):.2f}x" for k, v in speedups.items() if v)


def save_results(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1))
    return path
