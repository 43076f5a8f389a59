"""T(n), a forward of n new tokens after 64 cached ones (--context), with two builds of the native kernels in one
process: the kernels of a revision (`--before REV`, built from `git show REV:specdecode/kernels/...`) against this
checkout's, swapped between calls, the order flipping every round (a drifting machine hits both alike); every call's
logits must be equal across the builds (rows never depend on their company, so a kernel change keeps every bit).

    python benchmarks/kernels_ab.py --model /path/to/1.7b-q4_k_m.gguf --before HEAD~1 --widths 1,4,8,16 --rounds 7
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import specdecode
from specdecode import kernels


def build_before(rev: str, out: Path) -> Path:
    """The native library of `rev`'s kernel sources, built as this checkout builds its own."""
    src = out / "kernels"
    src.mkdir(parents=True)
    for path in kernels.SOURCES + kernels.HEADERS:
        name = f"specdecode/kernels/{path.name}"
        (src / path.name).write_bytes(subprocess.run(["git", "show", f"{rev}:{name}"], check=True,
                                                     capture_output=True).stdout)
    return kernels._build(out, src)  # noqa: SLF001 - the library's own build, from other sources


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--before", required=True, help="git revision whose kernels run as A")
    p.add_argument("--widths", default="1,4,8,16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--context", type=int, default=64, help="cached tokens before the timed forward")
    p.add_argument("--kv-cache-dtype", default="float16")
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    torch.set_num_threads(2)
    model = specdecode.LLM.load(args.model, kv_cache_dtype=args.kv_cache_dtype).model
    after = kernels.native()
    assert after is not None, "no native kernels on this machine"
    with tempfile.TemporaryDirectory() as tmp:
        before = ctypes.CDLL(str(build_before(args.before, Path(tmp))))
    kernels._declare(before)  # noqa: SLF001
    libs = {"before": before, "after": after}
    vocab, context = model.config.vocab_size, args.context
    g = torch.Generator().manual_seed(0)
    ms: dict[tuple[str, int], list[float]] = {(n, w): [] for n in libs for w in widths}
    with torch.inference_mode():
        cache = model.new_cache(context + max(widths) + 1)
        model.forward(torch.randint(0, vocab, (1, context), generator=g), cache, logits_at=None)
        tokens = torch.randint(0, vocab, (1, max(widths)), generator=g)

        def timed(name: str, width: int, reps: int = 3) -> tuple[float, torch.Tensor]:
            kernels._state["lib"] = libs[name]  # noqa: SLF001
            best, logits = float("inf"), None
            for _ in range(reps):
                cache.rollback(context)
                start = time.perf_counter()
                logits = model.forward(tokens[:, :width], cache, logits_at=slice(None)).logits
                best = min(best, time.perf_counter() - start)
            return best * 1e3, logits

        for name in libs:
            for w in widths:
                timed(name, w, 1)  # warm-up: each build's tiles and caches
        for r in range(args.rounds):
            for w in widths:
                first = None
                for name in list(libs) if r % 2 == 0 else list(libs)[::-1]:
                    t, logits = timed(name, w)
                    ms[name, w].append(t)
                    if first is None:
                        first = logits
                    elif not torch.equal(first, logits):
                        raise SystemExit(f"the builds' logits differ at {w} tokens")
    base = {n: statistics.median(ms[n, widths[0]]) for n in libs}
    print(f"| n | before ms | after ms | after / before (paired rounds) | T(n)/T({widths[0]}) before | after |")
    print("|---:|---:|---:|---|---:|---:|")
    for w in widths:
        a, b = statistics.median(ms["before", w]), statistics.median(ms["after", w])
        pairs = sorted(y / x for x, y in zip(ms["before", w], ms["after", w], strict=True))
        print(f"| {w} | {a:.1f} | {b:.1f} | {statistics.median(pairs):.3f} ({pairs[0]:.2f}-{pairs[-1]:.2f}) | "
              f"{a / base['before']:.2f} | {b / base['after']:.2f} |")


if __name__ == "__main__":
    main()
