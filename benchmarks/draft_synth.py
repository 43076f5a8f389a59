"""Draft-model speculation against an emulated acceptance rate, beside plain decoding (and llama.cpp's draft speculation
in its synthetic-acceptance mode, where a build is given).

Synthetic Llama GGUF files (benchmarks/synthetic_llama.py: SmolLM2's tokenizer, random weights; made under --dir at run
time, never committed): a target (1.7B, 3B or 8B shape) and drafts (135M, 360M shape). Our side: the draft model runs
for real on its own native blocks and KV cache, its guesses set by specdecode/bench/emulated.py (the target's greedy
token with probability a, else a wrong one), verification real (output = plain decoding, checked every run).
llama.cpp's side: llama-server with the same files, `--spec-synth-rates a,a^2,...,a^K` (its verification accepts each
drafted token with conditional probability a, whatever it is), the draft forced to K tokens (p-min 0).

Per prompt, runs alternate: plain, some configurations, plain, ... each configuration's decode time (prefill taken
off) paired with the mean of the plain runs before and after it; speedup = sum of paired plain times / sum of its
times over prompts and rounds.

    python benchmarks/draft_synth.py --target 1.7b --drafts 135m,360m --rates 0.5,0.6,0.7,0.8,0.9 --ks auto,4 \\
        --out benchmarks/results/draft-synth-2026-11-28.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_spec  # noqa: E402
import synthetic_llama  # noqa: E402

import specdecode  # noqa: E402
from specdecode import kernels  # noqa: E402
from specdecode.api import check_same_tokenizer  # noqa: E402
from specdecode.bench.emulated import EmulatedDraft  # noqa: E402
from specdecode.bench.hardware import sharing_note  # noqa: E402
from specdecode.core.acceptance import AcceptanceStats  # noqa: E402
from specdecode.engine.loop import generate_ids  # noqa: E402
from specdecode.models.loading import registry_file  # noqa: E402
from specdecode.policy.cost import CostModel  # noqa: E402
from specdecode.policy.speculation import Policy, Pricing, policy_for  # noqa: E402
from specdecode.proposers import DraftModelProposer  # noqa: E402

COST_SIZES = (1, 2, 3, 4, 5, 6, 8)  # the forwards k='auto' prices here (a chain of up to 7 guesses)
PROMPTS = [  # chat prompts of ordinary length (the text does not matter to random weights: its length does)
    "Write a short story about a robot who learns to paint, in three paragraphs.",
    "Explain how a hash table handles collisions, with a small example in Python.",
    "What are the main causes of inflation, and how do central banks respond to it?",
    "Summarize the plot of a detective novel of your choice in five sentences.",
]


@dataclass
class Config:
    draft: str  # a draft shape
    rate: float
    k: str  # "auto" or a number
    times: list[float] = field(default_factory=list)  # decode seconds, each run
    plain: list[float] = field(default_factory=list)  # the paired plain decode seconds
    accepted: int = 0
    drafted: int = 0
    verified: int = 0  # guesses verified up to the first wrong one (fixed k: exact; auto: the chains drafted)
    right: int = 0
    draft_seconds: float = 0.0  # the draft model's share of the decode time
    forwards: int = 0  # target forwards (steps)

    @property
    def name(self) -> str:
        return f"{self.draft} a={self.rate:.1f} k={self.k}"


@dataclass
class Peer:
    """llama.cpp's runs of a fixed-k configuration (benchmarks/llamacpp_spec.py)."""

    config: Config
    times: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)  # its own plain decoding, paired as ours is
    drafted: int = 0
    accepted: int = 0


def decode_seconds(stats) -> float:
    return stats.seconds - stats.prefill_seconds


def files(folder: Path, target: str, layout: str, drafts: list[str]) -> dict[str, Path]:
    """The synthetic files (written once into `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = registry_file("smollm2-135m-instruct")
    out = {}
    for shape, kind in ((target, layout), *((d, "Q4_1") for d in drafts)):
        path = folder / f"{shape}-{kind}.gguf"
        if not path.exists():
            started = time.perf_counter()
            print(f"writing {path} ...", flush=True)
            synthetic_llama.write(path.with_suffix(".partial"), synthetic_llama.SHAPES[shape], kind, tokenizer)
            path.with_suffix(".partial").rename(path)
            print(f"  {path.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - started:.0f} s", flush=True)
        out[shape] = path
    return out


def run_config(target, draft_model, config: Config, prompt: list[int], truth: list[int], tokens: int,
               acceptance: dict[str, AcceptanceStats], cost: CostModel | None) -> float:
    # coins of its own for each configuration and run (configurations sharing coins would share their luck)
    seed = zlib.crc32(f"{config.name}|{len(config.times)}|{truth[:8]}".encode())
    emulated = EmulatedDraft(DraftModelProposer(draft_model, target.config.vocab_size), truth, config.rate, seed)
    # k='auto': a policy of its own for each request, from the configuration's long-run statistics, as a request of
    # the library gets it (one policy across requests carried its last step's plain streak into the next request)
    k: int | Policy
    if config.k == "auto":
        assert cost is not None  # timed whenever a configuration is 'auto'
        k = policy_for("auto", emulated.guessing, Pricing(cost, lambda part: acceptance[config.name]))
    else:
        k = int(config.k)
    out, stats = generate_ids(target, prompt, proposer=emulated, k=k, max_new_tokens=tokens)
    if prompt + out != truth[: len(prompt) + tokens]:
        raise AssertionError(f"{config.name}: output differs from plain decoding")
    config.accepted += stats.accepted
    config.draft_seconds += stats.draft_seconds
    config.forwards += stats.target_forwards
    config.drafted += stats.drafted
    verified, right = emulated.tally()
    config.verified, config.right = config.verified + verified, config.right + right
    return decode_seconds(stats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="1.7b", choices=list(synthetic_llama.SHAPES))
    ap.add_argument("--layout", default="Q4_1", choices=["Q4_1", "Q4_K_M"])
    ap.add_argument("--drafts", default="135m,360m")
    ap.add_argument("--rates", default="0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--ks", default="auto,4")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--plain-every", type=int, default=3, help="a plain run after this many configurations")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-rounds", type=int, default=2, help="k='auto': paired timings per size of the cost table")
    ap.add_argument("--dir", default="/tmp/x/draftsynth")
    ap.add_argument("--llama-bin", help="llama.cpp's bin folder (llama-server): its draft speculation beside ours")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["SPECDECODE_ADAPTIVE_THREADS"] = "0"  # every run on the same threads
    torch.set_num_threads(args.threads)
    drafts = args.drafts.split(",")
    paths = files(Path(args.dir), args.target, args.layout, drafts)
    llm = specdecode.LLM.load(paths[args.target])
    target = llm.model
    draft_llms = {d: specdecode.LLM.load(paths[d]) for d in drafts}
    for d in draft_llms.values():
        check_same_tokenizer(llm.tokenizer, d.tokenizer)
    prompts = [llm.encode(p, chat=True) for p in PROMPTS[: args.prompts]]
    configs = [Config(d, float(a), k) for d in drafts for a in args.rates.split(",") for k in args.ks.split(",")]
    cost = None
    acceptance: dict[str, AcceptanceStats] = {}
    if any(c.k == "auto" for c in configs):
        started = time.perf_counter()
        print(f"the target's cost table for k='auto' ({args.cost_rounds} rounds; the steps refine it) ...",
              flush=True)
        cost = CostModel.measure(target, args.cost_rounds, sizes=COST_SIZES, long=(512,), sparse_above=None,
                                 bounded=True, description="timing target forwards")
        print(f"  {time.perf_counter() - started:.0f} s", flush=True)
        for c in configs:  # each configuration's long-run statistics, as a server keeps them per method
            if c.k == "auto":
                acceptance[c.name] = AcceptanceStats()
    for model in (target, *(d.model for d in draft_llms.values())):  # warm: kernels built, weights tiled
        generate_ids(model, prompts[0], max_new_tokens=4, k=0)
    truths = [p + generate_ids(target, p, max_new_tokens=args.tokens, k=0)[0] for p in prompts]
    for c in configs:  # a short untimed request each: k='auto' learns the draft's cost and acceptance first
        if c.k == "auto":
            run_config(target, draft_llms[c.draft].model, c, prompts[0], truths[0], min(16, args.tokens), acceptance,
                       cost)
            c.accepted = c.drafted = c.verified = c.right = c.forwards = 0
            c.draft_seconds = 0.0
    plain_times: list[float] = []
    started = time.perf_counter()
    total = args.rounds * len(prompts) * len(configs)
    done = 0
    for r in range(args.rounds):
        for i, (prompt, truth) in enumerate(zip(prompts, truths, strict=True)):
            order = configs[(r + i) % len(configs):] + configs[: (r + i) % len(configs)]
            last_plain = decode_seconds(generate_ids(target, prompt, max_new_tokens=args.tokens, k=0)[1])
            plain_times.append(last_plain)
            pending: list[tuple[Config, float]] = []
            for j, c in enumerate(order):
                pending.append((c, run_config(target, draft_llms[c.draft].model, c, prompt, truth, args.tokens,
                                              acceptance, cost)))
                done += 1
                if len(pending) == args.plain_every or j == len(order) - 1:
                    plain = decode_seconds(generate_ids(target, prompt, max_new_tokens=args.tokens, k=0)[1])
                    plain_times.append(plain)
                    for pc, seconds in pending:
                        pc.times.append(seconds)
                        pc.plain.append((last_plain + plain) / 2)
                    pending, last_plain = [], plain
                    elapsed = time.perf_counter() - started
                    print(f"  {done}/{total} runs, {elapsed:.0f} s, about {elapsed / done * (total - done):.0f} s "
                          f"left (load {os.getloadavg()[0]:.1f})", flush=True)
    peers, peer_plain = llamacpp_side(args, paths, prompts, configs) if args.llama_bin else ([], [])
    report(args, paths, configs, plain_times, peers, peer_plain)


def llamacpp_side(args, paths: dict[str, Path], prompts: list[list[int]], configs: list[Config]
                  ) -> tuple[list[Peer], list[float]]:
    """llama.cpp's draft speculation for each fixed-k configuration, a server each, every run paired with the plain
    runs (a server on the target alone) just before and after it."""
    bins, target = Path(args.llama_bin), paths[args.target]
    peers = [Peer(c) for c in configs if c.k != "auto"]
    plain_times: list[float] = []
    with llamacpp_spec.server(bins, target, args.threads, args.tokens) as plain_url:
        llamacpp_spec.decode(plain_url, prompts[0], 4, 0)  # warm-up
        for n, peer in enumerate(peers, 1):
            c = peer.config
            print(f"llama.cpp {n}/{len(peers)}: {c.name}", flush=True)
            extra = llamacpp_spec.spec_args(paths[c.draft], c.rate, int(c.k), args.threads)
            with llamacpp_spec.server(bins, target, args.threads, args.tokens, extra) as url:
                llamacpp_spec.decode(url, prompts[0], 4, 0)
                for r in range(args.rounds):
                    for i, prompt in enumerate(prompts):
                        before = llamacpp_spec.decode(plain_url, prompt, args.tokens, 0).seconds
                        run = llamacpp_spec.decode(url, prompt, args.tokens, zlib.crc32(f"{c.name}|{r}|{i}".encode()))
                        after = llamacpp_spec.decode(plain_url, prompt, args.tokens, 0).seconds
                        plain_times += [before, after]
                        peer.times.append(run.seconds)
                        peer.plain.append((before + after) / 2)
                        peer.drafted, peer.accepted = peer.drafted + run.drafted, peer.accepted + run.accepted
    return peers, plain_times


def report(args, paths: dict[str, Path], configs: list[Config], plain_times: list[float], peers: list[Peer],
           peer_plain: list[float]) -> None:
    plain_tps = args.tokens / statistics.median(plain_times)
    lines = [
        f"# Draft speculation at an emulated acceptance: {args.target} {args.layout} target ({date.today()})", "",
        "Command: `python benchmarks/draft_synth.py " + " ".join(sys.argv[1:]) + "`", "",
        f"Machine: {os.cpu_count()} cores, {args.threads} threads, kernels {kernels.simd()}; "
        f"{sharing_note(args.threads)}. Speeds are paired ratios.", "",
        "Files: " + ", ".join(f"{name} {p.name} ({p.stat().st_size / 2**20:.0f} MiB)" for name, p in paths.items()),
        "",
        f"Plain decoding: median {plain_tps:.2f} tok/s over {len(plain_times)} runs of {args.tokens} tokens.", "",
        "| draft | a | k | speedup vs plain (paired) | per-run ratios min-max | measured a (verified) | "
        "accepted / drafted | tokens per step | draft's share of the time | tok/s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        ratios = [p / t for p, t in zip(c.plain, c.times, strict=True)]
        speedup = sum(c.plain) / sum(c.times)
        measured = c.right / c.verified if c.verified else 0.0
        lines.append(f"| {c.draft} | {c.rate:.1f} | {c.k} | **{speedup:.2f}x** | {min(ratios):.2f}-{max(ratios):.2f} "
                     f"| {measured:.2f} ({c.verified}) | {c.accepted}/{c.drafted} | "
                     f"{args.tokens * len(c.times) / max(c.forwards, 1):.2f} | {c.draft_seconds / sum(c.times):.0%} | "
                     f"{args.tokens * len(c.times) / sum(c.times):.2f} |")
    if peers:
        peer_tps = args.tokens / statistics.median(peer_plain)
        ours = {c.name: args.tokens * len(c.times) / sum(c.times) for c in configs}
        lines += ["", f"llama.cpp (llama-server, the same files, {args.threads} threads, draft threads the same; "
                  f"benchmarks/llamacpp_spec.py): plain decoding median {peer_tps:.2f} tok/s over {len(peer_plain)} "
                  f"runs (ours / llama.cpp, plain: {plain_tps / peer_tps:.2f}x)", "",
                  "| draft | a | k | llama.cpp speedup vs its plain (paired) | per-run min-max | accepted / drafted | "
                  "llama.cpp tok/s | ours tok/s | ours / llama.cpp |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for peer in peers:
            c, ratios = peer.config, [p / t for p, t in zip(peer.plain, peer.times, strict=True)]
            tps = args.tokens * len(peer.times) / sum(peer.times)
            lines.append(f"| {c.draft} | {c.rate:.1f} | {c.k} | **{sum(peer.plain) / sum(peer.times):.2f}x** | "
                         f"{min(ratios):.2f}-{max(ratios):.2f} | {peer.accepted}/{peer.drafted} | {tps:.2f} | "
                         f"{ours[c.name]:.2f} | **{ours[c.name] / tps:.2f}x** |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
