"""Asynchronous drafting on this machine: what the drafter's cores cost the target, and one request's timeline.

On a CPU the drafter needs cores of its own, taken from the target's forwards. `split` times, for each way of
sharing the cores, a verification of k+1 tokens on the target's threads and a draft token on the drafter's, alone
and side by side, and predicts a step both ways: synchronous (verification on every core, then k draft tokens on
every core) and asynchronous on a hit (the verification on the target's share, the drafting hidden behind it).
Then sync and async run the same prompts in turns (tokens/s, tau, hit rate, greedy outputs compared), and one
request's timeline is drawn: when the engine's thread drafted, waited and verified, and when the drafter drafted.

    python benchmarks/async_draft.py --quantization none --method quantized --out DIR         # a CPU, real weights
    python benchmarks/async_draft.py --device cuda --random-shape --method layer-skip --out DIR  # a GPU, no weights
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from specdecode.engine.loop import generate_ids
from specdecode.models import ModelConfig, Transformer
from specdecode.policy.threads import usable_cores
from specdecode.proposers import AsyncDraftProposer, Drafter, LayerSkipProposer, Proposer

# SmolLM2-135M's shape: the GPU run needs no weights (timing and the stream path, not the model's text)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
               head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True)


class Recorded(Proposer):
    """A synchronous proposer that records when the engine's thread drafted and when the target verified."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.needs, self.guessing, self.name = inner, inner.needs, inner.guessing, inner.name
        self.spans: list[tuple[str, float, float]] = []
        self.handed = 0.0

    def begin(self, request) -> None:
        self.inner.begin(request)
        self.handed = 0.0

    def propose(self, context):
        start = time.perf_counter()
        if self.handed:
            self.spans.append(("target", self.handed, start))
        tree = self.inner.propose(context)
        self.handed = time.perf_counter()
        self.spans.append(("draft", start, self.handed))
        return tree


def median_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def split(target: Transformer, draft: Transformer, k: int, context: int = 256) -> list[dict]:
    """Verification of k+1 tokens and one draft token, in ms, for each share of the cores (CPU)."""
    cores = len(usable_cores())
    ids = torch.randint(0, target.config.vocab_size, (1, context + k + 1))
    caches = {m: m.new_cache(context + k + 2) for m in (target, draft)}
    for m, c in caches.items():
        m.forward(ids[:, :context], c, logits_at=None)

    def verify() -> None:
        caches[target].rollback(context)
        target.forward(ids[:, context:], caches[target], logits_at=slice(None))

    def draft_token() -> None:
        caches[draft].rollback(context)
        draft.forward(ids[:, context : context + 1], caches[draft], logits_at=slice(-1, None))

    main_threads = torch.get_num_threads()
    alone = {}
    for t in range(1, cores + 1):
        torch.set_num_threads(t)
        alone[t] = (median_ms(verify), median_ms(draft_token))
    rows = [{"target_threads": cores, "drafter_threads": 0, "verify_ms": alone[cores][0],
             "draft_token_ms": alone[cores][1], "sync_step_ms": alone[cores][0] + k * alone[cores][1]}]
    for t in range(1, cores):
        d = cores - t
        stop, done = threading.Event(), []

        def drafter(d: int = d, stop: threading.Event = stop, done: list[float] = done) -> None:
            torch.set_num_threads(d)
            while not stop.is_set():
                start = time.perf_counter()
                draft_token()
                done.append(time.perf_counter() - start)

        worker = threading.Thread(target=drafter)
        torch.set_num_threads(t)
        worker.start()
        time.sleep(0.1)
        side = median_ms(verify)
        stop.set()
        worker.join()
        rows.append({"target_threads": t, "drafter_threads": d, "verify_ms": side,
                     "verify_alone_ms": alone[t][0], "draft_token_ms": 1e3 * statistics.median(done),
                     "draft_token_alone_ms": alone[d][1], "async_hit_step_ms": side})
    torch.set_num_threads(main_threads)
    return rows


@torch.no_grad()
def random_target(device: torch.device, layers_gain: float) -> Transformer:
    """SmolLM2-135M's shape, seeded random weights; the blocks' small gain leaves the skipped layers little to change,
    so a layer-skipped draft agrees with the target about as often as a real draft does."""
    model = Transformer(ModelConfig(**SMOLLM2))
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        z = torch.randn(param.shape, generator=gen)
        if "norm" in name:
            param.copy_(1 + 0.1 * z)
        elif "embed" in name:
            param.copy_(z)
        else:
            gain = 6.0 if "lm_head" in name else layers_gain
            param.copy_(z * gain / param.shape[-1] ** 0.5)
    return model.to(device).eval()


def plot(timelines: dict[str, list[tuple[str, float, float]]], drafter: list[tuple[str, float, float]],
         out: Path, window_ms: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"draft": "tab:blue", "miss": "tab:blue", "hit": "tab:cyan", "wait": "tab:red", "target": "tab:orange",
              "ahead": "tab:green"}
    rows = [("sync: engine thread", timelines["sync"]), ("async: engine thread", timelines["async"]),
            ("async: drafter thread", drafter)]
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for y, (name, spans) in enumerate(rows):
        if not spans:
            continue
        origin = min(s for _, s, _ in (timelines["sync"] if name.startswith("sync") else
                                       timelines["async"] + drafter))
        for what, start, end in spans:
            left = 1e3 * (start - origin)
            if left < window_ms:
                ax.broken_barh([(left, 1e3 * (end - start))], (y - 0.35, 0.7), color=colors[what])
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_xlim(0, window_ms)
    ax.set_xlabel("ms since the request's first step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["draft (engine)", "draft on a miss", "take a hit", "wait for the drafter", "target verifies",
                        "draft ahead"], ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize=8)
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="none")
    p.add_argument("--method", default="quantized", choices=["quantized", "layer-skip"])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-shape", action="store_true", help="SmolLM2-135M's shape with random weights")
    p.add_argument("--skip", default="6-29", help="layer-skip with --random-shape: layers skipped (a-b)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.random_shape:
        target = random_target(device, layers_gain=0.3)
        lo, hi = map(int, args.skip.split("-"))
        skipped = list(range(lo, hi + 1))
        prompts = [torch.randint(0, target.config.vocab_size, (64,), generator=torch.Generator().manual_seed(i))
                   .tolist() for i in range(args.prompts)]

        def inner() -> Proposer:
            return LayerSkipProposer(target, skipped)
        drafter = Drafter(1, device)
        make = {"sync": lambda: Recorded(inner()),
                "async": lambda: AsyncDraftProposer(inner(), drafter, timeline=True)}
    else:
        from specdecode.api import LLM
        from specdecode.bench import load_questions

        llm = LLM.load(args.model, quantization=None if args.quantization == "none" else args.quantization)
        target = llm.model
        prompts = [llm.encode(q.prompt, chat=True) for q in load_questions(None, "all", 1)][: args.prompts]
        def recorded_async() -> Proposer:
            proposer = llm.proposer(args.method, k=args.k, async_draft=True)
            proposer.stats.spans = []  # type: ignore[attr-defined]
            return proposer
        make = {"sync": lambda: Recorded(llm.proposer(args.method, k=args.k)), "async": recorded_async}
    record: dict = {"command": "python " + " ".join(sys.argv), "device": str(device), "method": args.method,
                    "k": args.k, "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    if device.type == "cpu":
        probe = make["async"]()
        record["split"] = split(target, probe.inner.model, args.k)
    runs: dict[str, list[dict]] = {"none": [], "sync": [], "async": []}
    last: dict[str, Proposer] = {}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            order = ["none", "sync", "async"] if (r + i) % 2 == 0 else ["async", "sync", "none"]
            for name in order:
                proposer = make[name]() if name != "none" else None
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                tokens, stats = generate_ids(target, prompt, proposer=proposer, k=args.k if proposer else 0,
                                             max_new_tokens=args.max_new_tokens)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                runs[name].append({"prompt": i, "round": r, "tokens": tokens, "seconds": seconds, "tau": stats.tau,
                                   "hits": stats.ahead_hits, "steps": stats.ahead_steps})
                if proposer is not None and i == 0 and r == 0:
                    last[name] = proposer
    summary = {}
    for name, rs in runs.items():
        total = sum(len(x["tokens"]) for x in rs)
        summary[name] = {"tokens_per_s": total / sum(x["seconds"] for x in rs),
                         "tau": statistics.mean(x["tau"] for x in rs),
                         "hit_rate": (sum(x["hits"] for x in rs) / sum(x["steps"] for x in rs)
                                      if any(x["steps"] for x in rs) else None)}
    plain = {(x["prompt"], x["round"]): x["tokens"] for x in runs["none"]}
    summary["greedy_mismatches"] = sum(x["tokens"] != plain[(x["prompt"], x["round"])]
                                       for n in ("sync", "async") for x in runs[n])
    summary["async_over_sync"] = summary["async"]["tokens_per_s"] / summary["sync"]["tokens_per_s"]
    summary["sync_over_plain"] = summary["sync"]["tokens_per_s"] / summary["none"]["tokens_per_s"]
    record["summary"] = summary
    sync_spans = last["sync"].spans  # type: ignore[attr-defined]
    stats = last["async"].stats  # type: ignore[attr-defined]
    spans = stats.spans or []
    engine = [s for s in spans if s[0] != "ahead"]
    ahead = [s for s in spans if s[0] == "ahead"]
    steps = [e - s for w, s, e in sync_spans if w == "target"]
    window = 8 * 1e3 * (statistics.median(steps) if steps else 0.05)
    record["timeline"] = {"sync": sync_spans, "async_engine": engine, "async_drafter": ahead}
    record["timeline_png"] = plot({"sync": sync_spans, "async": engine}, ahead, out, window).name
    (out / "results.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k not in ("timeline",)}, indent=1))


if __name__ == "__main__":
    main()
