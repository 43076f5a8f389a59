"""Paged KV cache under a memory budget (issue 56 item 2): many long prompts at once, multi-turn time to first token,
and the paged cache's decode cost beside the contiguous one.

    python benchmarks/paged_kv.py --requests 64 --prompt-tokens 2000 --kv-cache-memory 1GiB \
        --out benchmarks/results/paged-kv-smollm2-cpu

1. burst: `--requests` requests with `--prompt-tokens`-token prompts (distinct windows of the repository's docs) all
   waiting at once for a paged engine of `--kv-cache-memory`: each is admitted, in turn, when its blocks are free
   (Engine.admits, as the server's scheduler asks) and prefilled whole; none may fail; the process's resident
   memory is sampled after every step (and its peak read from
   VmHWM), against budget + weights + 20%; then every request runs alone (its own engine, the contiguous cache) and
   the outputs must be equal (greedy; half the requests speculate with prompt lookup).
2. sessions: a conversation's second turn (the first turn's text and answer, then a new message) after the first;
   time to first token of each, on a paged engine that shares blocks by prefix; `--sessions` sessions.
3. decode: the same batch decoded on the contiguous cache and on the paged one, interleaved `--repeats` times (a
   paired ratio on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from specdecode.api import LLM  # noqa: E402
from specdecode.core.sampling import SamplingParams  # noqa: E402
from specdecode.engine.loop import Engine, generate_ids  # noqa: E402
from specdecode.engine.prefix_cache import PrefixCache  # noqa: E402
from specdecode.engine.request import Request  # noqa: E402
from specdecode.models import ModelConfig, Transformer  # noqa: E402
from specdecode.models.loading import load_model  # noqa: E402
from specdecode.policy.batch_cost import BatchCost  # noqa: E402
from specdecode.policy.cost import CostModel  # noqa: E402
from specdecode.policy.speculation import FixedK  # noqa: E402
from specdecode.proposers import NoProposer, PromptLookupProposer  # noqa: E402
from specdecode.server.cli import memory_size  # noqa: E402


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    return " ".join(sorted(set(re.findall(r"\b(avx\w*|f16c|fma)\b", text))))


def weights_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def doc_text() -> str:
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"])


class Bytes:
    """The tiny model's tokenizer: a byte a token."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def tiny_llm(layers: int) -> SimpleNamespace:
    """A random float32 model over bytes with heads of 64 (2 for keys and values), narrow and shallow:
    the burst's mechanics at full scale in minutes on a busy machine."""
    cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            z = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * z if "norm" in name else z if "embed" in name else z * 1.5 / param.shape[-1] ** 0.5)
    return SimpleNamespace(model=model.float().eval().requires_grad_(False), tokenizer=Bytes())


def request(model, prompt: list[int], new: int, lookup: bool) -> Request:
    proposer = PromptLookupProposer() if lookup else NoProposer()
    return Request(model.config.max_position_embeddings, proposer, prompt, max_new_tokens=new,
                   params=SamplingParams(temperature=0.0), k=FixedK(3 if lookup else 0))


def flat_cost() -> BatchCost:
    return BatchCost.single(CostModel.flat())


def burst(llm, args, docs: list[int]) -> dict:
    model = llm.model
    before = rss()  # the interpreter, torch and the weights
    stride = max(1, (len(docs) - args.prompt_tokens) // max(args.requests - 1, 1))
    prompts = [docs[i * stride : i * stride + args.prompt_tokens] for i in range(args.requests)]
    if any(len(p) < args.prompt_tokens for p in prompts):
        raise SystemExit(f"the docs hold {len(docs)} tokens: too few for these windows")
    engine = Engine(model, flat_cost(), None, kv_memory=args.kv_cache_memory, block_size=args.block_size)
    jobs = [SimpleNamespace(row=request(model, p, args.new_tokens, lookup=i % 2 == 1)) for i, p in enumerate(prompts)]
    waiting = list(jobs)
    started, peak, most_running, steps = time.perf_counter(), rss(), 0, 0
    admitted_at: list[int] = []  # the step each request was admitted at
    while waiting or engine.rows or engine.paging.preempted:
        while waiting and engine.admits(waiting[0].row):  # in turn: the first waiting one, when its blocks are free
            engine.add(waiting.pop(0).row)
            admitted_at.append(steps)
        for row, result in engine.step():
            if isinstance(result, Exception):
                raise result
            if row.finish_reason:
                engine.remove(row)
        steps += 1
        most_running = max(most_running, len(engine.rows))
        peak = max(peak, rss())
        if steps % 20 == 0:
            print(f"  step {steps}: {len(engine.rows)} running, {len(waiting)} waiting, "
                  f"{sum(j.row.finish_reason is not None for j in jobs)} done, {engine.cache.pool.used} blocks used, "
                  f"rss {peak >> 20} MiB", flush=True)
    seconds = time.perf_counter() - started
    hwm = rss("VmHWM")  # before the requests run alone
    failed = [i for i, job in enumerate(jobs) if job.row.finish_reason is None]
    print(f"  batch done in {seconds:.0f} s; each alone now", flush=True)
    unequal = []
    for i, (job, prompt) in enumerate(zip(jobs, prompts, strict=True)):
        alone, _ = generate_ids(model, prompt, max_new_tokens=args.new_tokens, k=0)
        if alone != job.row.new_tokens:
            unequal.append(i)
        if i % 8 == 7:
            print(f"  {i + 1}/{len(jobs)} alone", flush=True)
    weights = weights_bytes(model)
    runtime = args.runtime_rss + args.libraries_rss  # the interpreter and the libraries: torch, transformers
    return dict(requests=args.requests, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                pool_blocks=engine.cache.pool.num_blocks, most_running_at_once=most_running,
                admitted_in_turn=len(set(admitted_at)) > 1, admitted_at_step=admitted_at,
                preemptions=engine.paging.preemptions,
                failed=failed, unequal=unequal, seconds=seconds, weights_bytes=weights, rss_before=before,
                peak_rss_sampled=peak, vm_hwm=hwm, runtime_rss=runtime, libraries_rss=args.libraries_rss,
                # what the process holds beyond the interpreter and its libraries (torch; transformers for the
                # tokenizer), against budget + weights + 20%
                held=hwm - runtime, limit=int((args.kv_cache_memory + weights) * 1.2),
                within_limit=hwm - runtime <= (args.kv_cache_memory + weights) * 1.2)


def ttft(engine: Engine, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Seconds from the request's start to its first token, and its output."""
    row = request(engine.model, prompt, new, lookup=False)
    started = time.perf_counter()
    engine.add(row)
    first = None
    while row.finish_reason is None:
        for _, result in engine.step():
            if isinstance(result, Exception):
                raise result
            if first is None and result:
                first = time.perf_counter() - started
    engine.remove(row)
    return first or 0.0, row.tokens


def sessions(llm, args, docs: list[int]) -> dict:
    model, tokenizer = llm.model, llm.tokenizer
    engine = Engine(model, flat_cost(), PrefixCache(), kv_memory=args.kv_cache_memory, block_size=args.block_size)
    ratios, rows = [], []
    for s in range(args.sessions):
        first_prompt = docs[s * 97 : s * 97 + args.session_tokens] + tokenizer.encode("\n\nSummarize the above.\n")
        t1, history = ttft(engine, first_prompt, args.new_tokens)
        second_prompt = history + tokenizer.encode("\n\nNow list three details it mentions.\n")
        t2, _ = ttft(engine, second_prompt, args.new_tokens)
        ratios.append(t2 / t1)
        rows.append(dict(first_prompt=len(first_prompt), second_prompt=len(second_prompt), first_ttft=t1,
                         second_ttft=t2, ratio=t2 / t1))
        print(f"  session {s}: first turn {t1 * 1000:.0f} ms ({len(first_prompt)} tokens), second "
              f"{t2 * 1000:.0f} ms ({len(second_prompt)} tokens): {t2 / t1:.3f}x", flush=True)
    return dict(sessions=rows, median_ratio=statistics.median(ratios))


def decode_pair(llm, args, docs: list[int]) -> dict:
    model = llm.model
    prompts = [docs[i * 300 : i * 300 + args.decode_context] for i in range(args.decode_rows)]

    def run(paged: bool) -> float:
        engine = Engine(model, flat_cost(), None, kv_memory=args.kv_cache_memory if paged else None,
                        block_size=args.block_size)
        rows = [request(model, p, args.decode_tokens, lookup=False) for p in prompts]
        for row in rows:
            engine.add(row)
        started, tokens = time.perf_counter(), 0
        while engine.rows:
            for row, result in engine.step():
                tokens += len(result)
                if row.finish_reason:
                    engine.remove(row)
        return tokens / (time.perf_counter() - started)

    pairs = []
    for r in range(args.repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        speeds = {paged: run(paged) for paged in order}
        pairs.append(dict(contiguous=speeds[False], paged=speeds[True], ratio=speeds[True] / speeds[False]))
        print(f"  repeat {r}: contiguous {speeds[False]:.1f} tok/s, paged {speeds[True]:.1f} tok/s", flush=True)
    return dict(rows=args.decode_rows, context=args.decode_context, tokens=args.decode_tokens, pairs=pairs,
                median_ratio=statistics.median(p["ratio"] for p in pairs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tiny", type=int, default=0, help="a random float32 model of this many layers over bytes")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=memory_size, default=memory_size("1GiB"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="float16", help="a float32 model's cache: float16, int8 or float32")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--session-tokens", type=int, default=1500)
    p.add_argument("--decode-rows", type=int, default=8)
    p.add_argument("--decode-context", type=int, default=1000)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--parts", default="burst,sessions,decode")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.runtime_rss = runtime = rss()  # the interpreter and torch, before any model
    args.libraries_rss = 0
    if args.tiny:
        llm = tiny_llm(args.tiny)
    else:  # LLM.load's two parts, measured apart: the weights, then the tokenizer and the libraries it imports
        model, path = load_model(args.model, dtype=torch.float32, quantization="auto")
        loaded = rss()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        args.libraries_rss = rss() - loaded  # transformers' tokenizer and its imports (accelerate, sympy, ...)
        llm = LLM(model, tokenizer, name=args.model)
        print(f"weights resident {(loaded - runtime) >> 20} MiB; tokenizer and its libraries "
              f"{args.libraries_rss >> 20} MiB", flush=True)
    llm.model.kv_cache_dtype = args.kv_cache_dtype
    docs = llm.tokenizer.encode(doc_text())
    name = f"tiny-random-{args.tiny}-layers" if args.tiny else args.model
    result: dict = dict(command=" ".join(sys.argv), model=name, runtime_rss=runtime, cpu_flags=cpu_flags(),
                        cores=torch.get_num_threads(), machine=platform.machine(), kv_dtype=str(llm.model.kv_dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    for part, fn in (("burst", burst), ("sessions", sessions), ("decode", decode_pair)):
        if part in args.parts.split(","):
            print(f"{part}:", flush=True)
            result[part] = fn(llm, args, docs)
            (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "sessions"}, indent=1)[:3000])


if __name__ == "__main__":
    main()
