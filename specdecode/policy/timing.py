"""Timing a target's forwards on this machine: the paired measurement a `cost.CostModel` starts from (seconds at
first use, minutes for `specdecode tune cost`), and the key that says which machine and precision a table is for."""

from __future__ import annotations

import hashlib
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from ..common.paths import default_cache_dir
from ..common.progress import progress_bar
from ..models import KVCache, Transformer

# `specdecode tune cost`: every size up to 8 (a size between two measured ones is priced by interpolation, and
# small forwards need not be linear in size: oneDNN picks its kernels by row count), 32 paired rounds
COST_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
THOROUGH_ROUNDS = 32
# first use: fewer sizes and rounds (seconds, not the thorough table's minutes on a loaded machine); the steps the
# engine runs refine it (CostModel.observe)
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
CALIBRATION_ROUNDS = 4
ONE_THREAD_ROUNDS = 3  # paired rounds of each size on one thread and on all (a second or two at first use)
# how far one paired ratio strays (relative): the thorough table's 32 rounds know a small size to +-3%
SPREAD = 0.17


def cached_context(model: Transformer, context: int, room: int, g: torch.Generator) -> KVCache:
    """A cache holding `context` random tokens, with room for `room` more."""
    cache = model.new_cache(context + room)
    model.forward(torch.randint(0, model.config.vocab_size, (1, context), generator=g), cache, logits_at=None)
    return cache


def timed_forward(model: Transformer, cache: KVCache, context: int, n: int, g: torch.Generator) -> float:
    """Seconds of one forward of n random tokens after the `context` cached ones (logits for every token, as a
    verification does); the cache is rolled back to them."""
    tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(model.device)
    started = time.perf_counter()
    model.forward(tokens, cache)
    elapsed = time.perf_counter() - started
    cache.rollback(context)
    return elapsed


def time_forwards(model: Transformer, repeats: int = THOROUGH_ROUNDS, *, sizes: tuple[int, ...] = COST_SIZES,
                  long: tuple[int, ...] = (1024, 4096), sparse_above: int | None = 16, bounded: bool = False,
                  description: str = "timing target forwards") -> tuple[list[int], list[list[float]], list[float]]:
    """Time forwards of each size after a short cached context and each `long` one (as far as the model's positions
    go), each next to a 1-token forward: (contexts, seconds [context][size], weight per size: how many paired
    timings it is worth).

    A size's price is the 1-token median times the median of its paired ratios: the machine's speed drifts
    within seconds, and unpaired medians of 10 rounds were off by up to 10% for 3-4 tokens at long context
    (pricing Medusa's small trees as paying when they cost more than they saved). Sizes past `sparse_above`
    tokens are timed every fourth round: they cost as much as all the small ones and are far from any
    decision's margin. Still, one forward's time strays by +-15% on a 2-core machine, so a small size's price
    is known to +-3% after 32 rounds. The medians are kept as measured, not forced non-decreasing: with oneDNN
    a forward of 3-6 tokens can cost less than one of 2 at a short context (the same in a direct paired timing),
    so a guess of one token is dear and guesses two to five deep are cheaper than a
    plain step. One forward per size warms up first (allocations, kernel choice).

    bounded: a size's price is kept within what physics allows: at least a smaller size's (pooled where the
    medians say otherwise) and at most n plain forwards (which do the same work). A few rounds on a loaded
    machine once priced 16 tokens below 6. Each size's weight is its paired timings, scaled by how much more (or
    less) they strayed than SPREAD: a noisy calibration is doubted (a margin on guesses) and soon outweighed by
    real steps.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    limit = model.config.max_position_embeddings
    longs = sorted({min(c, limit - sizes[-1]) for c in long})
    if longs[0] < 8:
        raise ValueError(f"context of {limit} tokens is too short to measure forward costs")
    contexts = [min(64, longs[0] // 4), *longs]
    g = torch.Generator().manual_seed(0)

    def sparse(n: int) -> bool:
        return sparse_above is not None and n > sparse_above

    rounds = [[(ci, si) for ci in range(len(contexts)) for si, n in enumerate(sizes)
               if n > 1 and (not sparse(n) or rep % 4 == 0)] for rep in range(repeats)]
    total = len(contexts) + len(sizes) + 2 * sum(len(cells) for cells in rounds)
    order = random.Random(0)
    single: list[list[float]] = [[] for _ in contexts]
    ratios: list[list[list[float]]] = [[[] for _ in sizes] for _ in contexts]
    with progress_bar(description, total) as advance:
        caches = []
        for c in contexts:
            caches.append(cached_context(model, c, sizes[-1], g))
            advance()

        def timed(ci: int, n: int) -> float:
            elapsed = timed_forward(model, caches[ci], contexts[ci], n, g)
            advance()
            return elapsed

        for n in sizes:  # warm-up
            timed(len(contexts) - 1, n)
        for cells in rounds:
            for ci, si in order.sample(cells, len(cells)):
                n = sizes[si]
                took = {m: timed(ci, m) for m in order.sample([1, n], 2)}  # either may run first
                single[ci].append(took[1])
                ratios[ci][si].append(took[n] / took[1])
    seconds = []
    for ci in range(len(contexts)):
        plain = statistics.median(single[ci])
        relative = [1.0] + [statistics.median(r) for r in ratios[ci][1:]]
        if bounded:
            relative = [min(max(x, 1.0), n) for x, n in zip(nondecreasing(relative), sizes, strict=True)]
        seconds.append([plain * x for x in relative])
    scale = (SPREAD / max(spread(ratios), 0.01)) ** 2
    weight = [float(repeats)] + [len(ratios[0][si]) * scale for si in range(1, len(sizes))]
    return contexts, seconds, weight


def time_one_thread_shape(model: Transformer, sizes: tuple[int, ...], context: int, rounds: int,
                          description: str = "timing forwards on one thread") -> list[float]:
    """Per size, how much dearer relative to a plain step it is on one thread than on the threads set: its paired
    ratio to a 1-token forward on 1 thread over the same on all of them (1.0 for the plain step), `rounds` of
    each, interleaved. Beside a busy core the forwards run on the cores left free (threads.py), and there the
    sizes are not priced alike: a many-token forward costs more plain steps on 1 thread than on 2 (a
    verification is compute the second core shared; a plain step is mostly reading the weights). Each factor is
    kept within what the threads allow, [1 / threads, threads] (a forward runs at most `threads` times faster on
    all of them than on one, and no slower): a few rounds beside another busy process read factors far outside it."""
    most = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    cache = cached_context(model, context, sizes[-1], g)
    order = random.Random(0)
    ratios: dict[tuple[int, int], list[float]] = {(t, n): [] for t in (1, most) for n in sizes if n > 1}
    try:
        with progress_bar(description, 2 * len(ratios) * (rounds + 1)) as advance:
            def timed(n: int) -> float:
                elapsed = timed_forward(model, cache, context, n, g)
                advance()
                return elapsed

            for rep in range(rounds + 1):  # the first round warms up each thread count's sizes
                for t, n in order.sample(sorted(ratios), len(ratios)):
                    torch.set_num_threads(t)
                    took = {m: timed(m) for m in order.sample([1, n], 2)}
                    if rep:
                        ratios[t, n].append(took[n] / took[1])
    finally:
        torch.set_num_threads(most)
    factors = [1.0 if n == 1 else statistics.median(ratios[1, n]) / statistics.median(ratios[most, n]) for n in sizes]
    return [min(max(f, 1 / most), float(most)) for f in factors]


def spread(ratios: list[list[list[float]]]) -> float:
    """How far one paired ratio strays (relative): the robust standard deviation (1.4826 x the median absolute
    deviation) of the log ratios around their size's median, pooled over sizes with 3 or more; SPREAD if none."""
    deviations = [abs(math.log(x) - math.log(statistics.median(cell))) for per_size in ratios for cell in per_size
                  if len(cell) >= 3 for x in cell]
    return 1.4826 * statistics.median(deviations) if deviations else SPREAD


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): the batch table takes the fastest of a few
    unpaired runs and the calibration the medians of a few pairs, so their dips are mostly noise, averaged away
    with their neighbours (the thorough single-request table is kept as measured: there, some sizes really are
    cheaper than smaller ones)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def table_path(model: Transformer, cache_dir: Path | None = None, suffix: str = "") -> Path:
    """Where a cost table of this model on this machine is kept: named by a digest of its `machine_key`."""
    digest = hashlib.sha1(machine_key(model).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "costs" / f"{digest}{suffix}.json"


def machine_key(model: Transformer) -> str:
    """What forward costs depend on: the model's shape, dtype, KV cache dtype, device, CPU, threads and torch
    build."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if model.device.type == "cuda":
        cpu = torch.cuda.get_device_name(model.device)
    cfg = model.config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    threads = torch.get_num_threads()
    kv = getattr(model, "kv_dtype", model.dtype)  # an attention reads its cache: float16 halves the bytes
    return (f"{shape}|{model.dtype}|kv {kv}|{model.weights_kind()}|{model.device.type}|{cpu}|{threads} threads"
            f"|torch {torch.__version__}")

