"""The attention kernel alone, two builds in one process: a revision's kernels (`--before REV`, as kernels_ab.py
builds them) against this checkout's, interleaved (the order flipping every round), over 30 layers' caches of
SmolLM2's shape (9 query heads, 3 kv heads of 64) at each depth; a step's (or a random tree's) outputs must be equal
across the builds unless --allow-diff (a change of the summation order).

    python benchmarks/attention_ab.py --before HEAD~1 --kinds int8,float16 --depths 100,2000,4000 --rounds 11
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernels_ab import build_before

from specdecode import kernels
from specdecode.models.cache import KV_KINDS, store_rows

LAYERS, KV_HEADS, HEADS, HEAD_DIM, MAX_LEN = 30, 3, 9, 64, 8192
DTYPES = {"float16": torch.float16, "int8": torch.int8, "float32": torch.float32}


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, n] uint8: each node sees itself and its ancestors, parents drawn at random."""
    mask = torch.eye(n, dtype=torch.uint8)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=g))]
    return mask.contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="HEAD", help="git revision whose kernels run as A")
    p.add_argument("--depths", default="100,2000")
    p.add_argument("--kinds", default="int8,float16", help="cache dtypes: float16, int8, float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--n", type=int, default=1, help="queries a call (a tree's nodes where --tree)")
    p.add_argument("--tree", action="store_true")
    p.add_argument("--allow-diff", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"A": ctypes.CDLL(str(build_before(args.before, Path(tempfile.mkdtemp())))), "B": kernels.native()}
    for lib in builds.values():
        kernels._declare(lib)  # noqa: SLF001 - the library's own signatures
    g = torch.Generator().manual_seed(0)
    mask = random_tree(args.n, g) if args.tree else None
    q = torch.randn(args.n, HEADS * HEAD_DIM, generator=g)
    for kind in args.kinds.split(","):
        dtype = DTYPES[kind]
        caches = []
        for _ in range(LAYERS):
            kv = torch.randn(2, KV_HEADS, MAX_LEN, HEAD_DIM, generator=g)
            caches.append(store_rows(kv, dtype) if dtype == torch.int8 else kv.to(dtype))
        for depth in map(int, args.depths.split(",")):
            outs = {name: torch.empty_like(q) for name in builds}
            times: dict[str, list[float]] = {name: [] for name in builds}
            for r in range(args.rounds):
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    attend, out = builds[name].specdecode_attention, outs[name]
                    started = time.perf_counter()
                    for kv in caches:
                        attend(q.data_ptr(), q.shape[1], out.data_ptr(), out.shape[1], kv[0].data_ptr(),
                               kv[1].data_ptr(), MAX_LEN, depth, args.n, None if mask is None else mask.data_ptr(),
                               None, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_KINDS[dtype])
                    times[name].append(time.perf_counter() - started)
            same = torch.equal(outs["A"], outs["B"])
            ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
            print(f"{kind:8s} depth {depth:5d} n {args.n}: A {statistics.median(times['A']) * 1e3:6.2f} ms, "
                  f"B {statistics.median(times['B']) * 1e3:6.2f} ms, B/A {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}), equal: {same}", flush=True)
            if not same and not args.allow_diff:
                raise SystemExit("the builds' outputs differ (--allow-diff where the summation order changed)")


if __name__ == "__main__":
    main()
