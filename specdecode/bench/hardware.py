"""The physical limit of plain decoding: every token reads all weights once from memory."""

from __future__ import annotations

import os
import platform
import time

import torch


def memory_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best-of-N read bandwidth (a reduction over a buffer far larger than any cache), in GB/s."""
    buf = torch.ones(megabytes * 2**20 // 4)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decoding step streams: every distinct parameter and buffer once (tied embeddings count once;
    quantized weights are buffers)."""
    seen, total = set(), 0
    for p in [*model.parameters(), *model.buffers()]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from ..kernels import cpu_flags

    flags = set(cpu_flags().split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile")
            if f in flags]
    return (f"{cpu} ({' '.join(simd) or 'no AVX2'}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def sharing_note(threads: int) -> str:
    """What the machine's load says about a run of `threads` threads, for a report's machine line: quiet apart from
    the run, or shared (a load average beyond the run's own threads: other work took cores, read paired ratios)."""
    load = os.getloadavg()[1]
    if load <= threads + 0.75:  # the run's own threads, and the odd daemon
        return f"quiet apart from this run (load average {load:.1f} over the last 5 minutes at the end)"
    return (f"SHARED with other work (load average {load:.1f} over the last 5 minutes at the end, above this run's "
            f"{threads} threads), so read the paired ratios")
