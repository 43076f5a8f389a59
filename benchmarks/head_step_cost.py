"""What one draft step of an EAGLE head costs on this CPU: the shipped specdecode head (its block in the native
kernel) beside an EAGLE-3-architecture head of the same size (PyTorch operators), both quantized as they run beside
the default int4 target (int8 weights and activations). Interleaved, median of paired ratios (a shared machine).

    python benchmarks/head_step_cost.py --other path/to/eagle3/head --rounds 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.engine.assets import EAGLE_BESIDE_A8, SHIPPED_EAGLE
from specdecode.models.eagle import EagleHead
from specdecode.models.head_files import load_head


def step_seconds(head: EagleHead, context: int, reps: int) -> float:
    """Seconds of one one-token forward after `context` cached entries (a draft's deeper step)."""
    h = head.config.block.hidden_size
    x = torch.randn(1, 1, h)
    cache = head.new_cache(context + reps + 1)
    head(torch.randn(1, context, h), torch.randn(1, context, h), cache, torch.arange(context))
    start = time.perf_counter()
    for i in range(reps):
        head(x, x, cache, torch.tensor([context + i]), None, slice(-1, None))
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", required=True, help="a head folder to time beside the shipped SmolLM2 head")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--context", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    heads = [EagleHead.load(SHIPPED_EAGLE["smollm2-135m-instruct"]).quantize_(EAGLE_BESIDE_A8),
             load_head(args.other).quantize_(EAGLE_BESIDE_A8)]
    for h in heads:
        h.warm_up()
    ratios: list[float] = []
    times: list[list[float]] = [[], []]
    for _ in range(args.rounds):
        a, b = (step_seconds(h, args.context, 5) for h in heads)
        times[0].append(a)
        times[1].append(b)
        ratios.append(b / a)
    print(f"shipped {statistics.median(times[0]) * 1e3:.3f} ms, other {statistics.median(times[1]) * 1e3:.3f} ms "
          f"a step (medians); other / shipped: median {statistics.median(ratios):.2f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.2f}-{statistics.quantiles(ratios, n=4)[2]:.2f})")


if __name__ == "__main__":
    main()
