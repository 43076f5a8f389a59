"""Decode speed side by side with llama.cpp's own binaries (llama-bench, built for this CPU by
scripts/build_llamacpp.sh), on the same GGUF files, the same threads: issue 54's speed criteria.

Files: synthetic Llama-3 shapes (benchmarks/llamacpp_files.py: random weights, llama-quantize's own mix of types per
tensor, llama.cpp's names and metadata) at 1.7B in Q4_K_M, Q5_K_M, Q6_K, Q8_0 and at 8B in Q4_K_M, written under
--workdir (never committed), and the shipped SmolLM2-135M Q4_1 file. Per file, in one process, interleaved rounds:
llama-bench's tg (decode tok/s of --tokens tokens, one repetition a call) then our plain greedy decoding of the
same count (prefill taken off, as benchmarks/kquant_decode.py times it), and the machine's read bandwidth (1 GiB
summed by torch) each round. Reported: medians and spread, ours / llama.cpp paired per round, the bandwidth bound
(bytes a decode step reads / the measured bandwidth) and the share of it each reaches, our forward cost T(8)/T(1)
after 64 cached tokens (and llama.cpp's, from llama-bench's pp8 vs tg rates), and the memory our load takes.

    python benchmarks/llamacpp_bench.py --out benchmarks/results/llamacpp-bench-<date>.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from math import nan
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from kquant_decode import decode_seconds, read_bandwidth, step_bytes  # noqa: E402
from llamacpp_build import built_bins, ready_file  # noqa: E402
from llamacpp_files import (  # noqa: E402
    LLAMA3_1_7B,
    LLAMA3_8B,
    Shape,
    llama_quantize_mix,
    rule_mix,
    write_synthetic,
)

from specdecode import kernels  # noqa: E402
from specdecode.bench.hardware import sharing_note  # noqa: E402
from specdecode.models.loading import gguf_source, load_gguf, load_model  # noqa: E402

# llama.cpp's file-type numbers (llama_ftype) of the mixes, written to general.file_type
FILE_TYPES = {"Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
FILES = {"1.7b-q4_k_m": (LLAMA3_1_7B, "Q4_K_M"), "1.7b-q5_k_m": (LLAMA3_1_7B, "Q5_K_M"),
         "1.7b-q6_k": (LLAMA3_1_7B, "Q6_K"), "1.7b-q8_0": (LLAMA3_1_7B, "Q8_0"), "8b-q4_k_m": (LLAMA3_8B, "Q4_K_M"),
         "smollm2-q4_1": (None, "Q4_1")}


def status_mib(key: str) -> float:
    """A /proc/self/status memory line in MiB (VmRSS, VmHWM); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def llama_bench(binary: Path, file: Path, threads: int, args: list[str]) -> dict:
    """One llama-bench run's JSON record (its first test)."""
    cmd = [str(binary), "-m", str(file), "-t", str(threads), "-r", "1", "-o", "json", *args]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)[0]


def forward_ratio(model, sizes: tuple[int, ...], context: int, repeats: int) -> dict[int, float]:
    """Median seconds of a forward of n tokens after `context` cached ones, each n (interleaved), over repeats."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = model.new_cache(context + 64)
    model.forward(torch.randint(0, vocab, (1, context), generator=g), cache, logits_at=None)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # one warm-up round
        for n in sizes:
            tokens = torch.randint(0, vocab, (1, n), generator=g)
            start = time.perf_counter()
            model.forward(tokens, cache)
            if rep:
                times[n].append(time.perf_counter() - start)
            cache.rollback(context)
    return {n: statistics.median(t) for n, t in times.items()}


def make_file(key: str, workdir: Path, bins: Path | None) -> tuple[Path, Path]:
    """(GGUF file, directory of its config.json) for a FILES key, written once under workdir in llama-quantize's
    mix (`bins`' llama-quantize); without `bins`, in the mix read from its source (rule_mix), to be checked later."""
    shape, mix = FILES[key]
    if shape is None:
        model_file = gguf_source("smollm2-135m-instruct")
        assert model_file is not None
        return model_file, model_file.parent
    assert isinstance(shape, Shape)
    folder = workdir / key
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{key}.gguf"
    types = rule_mix(shape, mix) if bins is None else llama_quantize_mix(bins / "llama-quantize", shape, mix, workdir)
    written = folder / "types.json"
    if file.is_file() and written.is_file() and json.loads(written.read_text()) == types:
        return file, folder
    if file.is_file():
        print(f"  {file.name}: its mix differs from llama-quantize's: rewriting it", flush=True)
    started = time.perf_counter()
    partial = folder / f"{key}.partial.gguf"
    write_synthetic(partial, shape, types, FILE_TYPES[mix], progress=lambda s: print(s, flush=True))
    partial.rename(file)
    print(f"wrote {file} ({file.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s",
          flush=True)
    return file, folder


def mix_summary(file: Path) -> str:
    """The types of a file's matrices and how many of each (as llama-quantize mixed them)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(file)).tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def load(key: str, file: Path, config_dir: Path):
    if FILES[key][0] is None:
        return load_model(str(file))[0]
    return load_gguf(file, config_dir, torch.float32, act8=True)


def load_memory(key: str, file: Path, config_dir: Path) -> dict:
    """Resident memory of loading `file` in THIS (fresh) process: VmRSS before, after the load and after a few decode
    steps (the weights tiled), and the peak (VmHWM) by then, MiB."""
    gc.collect()
    before = status_mib("VmRSS")
    started = time.perf_counter()
    model = load(key, file, config_dir)
    seconds = time.perf_counter() - started
    gc.collect()
    loaded, peak_load = status_mib("VmRSS"), status_mib("VmHWM")
    decode_seconds(model, list(range(1, 9)), 3)
    return dict(rss_before=before, rss_loaded=loaded, hwm_load=peak_load, rss_warm=status_mib("VmRSS"),
                hwm_warm=status_mib("VmHWM"), load_s=seconds)


def bench_file(key: str, file: Path, config_dir: Path, bins: Path | None, args) -> dict:
    """One file: memory of our load (a fresh process), interleaved decode rounds, the bound, T(n)/T(1)."""
    memory = json.loads(subprocess.run(
        [sys.executable, __file__, "--load-memory", key, str(file), str(config_dir)], check=True,
        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    model = load(key, file, config_dir)
    big = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # the bandwidth probe, 1 GiB
    prompt = list(range(1, 9))
    decode_seconds(model, prompt, 3)  # warm: tiles, kernels, caches
    tg = ["-p", "0", "-n", str(args.tokens)]
    ours, theirs, bw = [], [], []
    for r in range(args.rounds):
        theirs.append(nan if bins is None else llama_bench(bins / "llama-bench", file, args.threads, tg)["avg_ts"])
        ours.append(1 / decode_seconds(model, prompt, args.tokens))
        bw.append(read_bandwidth(big))
        print(f"  {key} round {r + 1}/{args.rounds}: llama.cpp {theirs[-1]:.2f} tok/s, ours {ours[-1]:.2f} tok/s, "
              f"read {bw[-1] / 1e9:.1f} GB/s", flush=True)
    result = dict(key=key, file=str(file), file_mib=file.stat().st_size / 2**20, mix=mix_summary(file),
                  ours=ours, theirs=theirs, bandwidth=bw, bytes=step_bytes(model), **memory)
    if key in args.forward:
        t = forward_ratio(model, (1, 8), 64, args.forward_repeats)
        pp = nan if bins is None else llama_bench(bins / "llama-bench", file, args.threads, ["-p", "8", "-n", "0"])[
            "avg_ts"]
        result |= dict(t1=t[1], t8=t[8], llama_t8_t1=(8 / pp) / (1 / statistics.median(theirs)))
    del model, big
    gc.collect()
    return result


def spread(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(results: list[dict], args, command: str) -> str:
    peer = "NOT RUN (--no-peer)" if args.bins is None else f"llama-bench from {args.bins}"
    lines = [f"# Decode speed vs llama.cpp's own binaries ({date.today()})", "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores, kernels {kernels.simd()}, {args.threads} threads on both sides; "
             f"llama.cpp: {peer} (scripts/build_llamacpp.sh: llama-cpp-python 0.3.36's vendored llama.cpp, "
             f"GGML_NATIVE=ON). {sharing_note(args.threads)}; paired: each round runs llama-bench tg"
             f"{args.tokens} (one repetition, after its warm-up) then our plain greedy decoding of {args.tokens} "
             "tokens (prefill taken off), in the same minute. CPU flags (AVX and co.): "
             f"`{' '.join(sorted({f for f in kernels.cpu_flags().split() if f.startswith(('avx', 'fma', 'f16c'))}))}`",
             "", "## Decode tok/s, median (min-max) over rounds", "",
             "| file | MiB | matrices (the file's mix) | llama.cpp | ours | ours / llama.cpp, paired | "
             "MB a token | bound tok/s | llama.cpp / bound | ours / bound |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        paired = [o / t for o, t in zip(r["ours"], r["theirs"], strict=True)]
        bound = [b / r["bytes"] for b in r["bandwidth"]]
        lines.append(f"| {r['key']} | {r['file_mib']:.0f} | {r['mix']} | {spread(r['theirs'])} | {spread(r['ours'])} "
                     f"| **{spread(paired)}x** | {r['bytes'] / 1e6:.0f} | {spread(bound)} | "
                     f"{statistics.median(t / b for t, b in zip(r['theirs'], bound, strict=True)):.0%} | "
                     f"{statistics.median(o / b for o, b in zip(r['ours'], bound, strict=True)):.0%} |")
    bw = [b for r in results for b in r["bandwidth"]]
    lines += ["", f"Read bandwidth (1 GiB summed by torch on {args.threads} threads, best of 3, each round): "
              f"{spread([b / 1e9 for b in bw], '.1f')} GB/s. MB a token: every matrix our decode step reads "
              "(the embedding's one row aside); llama.cpp reads the same tensors at the file's sizes.", ""]
    forward = [r for r in results if "t8" in r]
    if forward:
        lines += ["## Forward cost of 8 tokens vs 1 (after 64 cached tokens)", "",
                  "| file | ours T(1) ms | ours T(8) ms | ours T(8)/T(1) | llama.cpp T(8)/T(1) (pp8 vs tg) |",
                  "|---|---:|---:|---:|---:|"]
        for r in forward:
            lines.append(f"| {r['key']} | {r['t1'] * 1e3:.1f} | {r['t8'] * 1e3:.1f} | {r['t8'] / r['t1']:.2f} | "
                         f"{r['llama_t8_t1']:.2f} |")
        lines.append("")
    lines += ["## Our load's memory (a fresh process per file, its /proc/self/status, MiB)", "",
              "| file | file MiB | VmRSS added by the load | / file | peak (VmHWM) during the load | / file | after 3 "
              "decode steps (weights tiled) | peak by then | load s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base, size = r["rss_before"], r["file_mib"]
        added, peak = r["rss_loaded"] - base, r["hwm_load"] - base
        lines.append(f"| {r['key']} | {size:.0f} | {added:.0f} | {added / size:.2f}x | {peak:.0f} | "
                     f"{peak / size:.2f}x | {r['rss_warm'] - base:.0f} | {r['hwm_warm'] - base:.0f} | "
                     f"{r['load_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", default=",".join(FILES), help=f"which of {', '.join(FILES)}")
    ap.add_argument("--bins", type=Path, default=None,
                    help="llama.cpp's binaries (default: the directory named in /work/llamacpp/READY)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/x/llamabench/files"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--forward", default="1.7b-q4_k_m,8b-q4_k_m", help="files whose T(8)/T(1) is measured")
    ap.add_argument("--forward-repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    ap.add_argument("--load-memory", nargs=3, metavar=("KEY", "FILE", "CONFIG_DIR"),
                    help="internal: load one file in this fresh process, print its memory as JSON")
    ap.add_argument("--no-peer", action="store_true",
                    help="our side only (no llama.cpp build): its columns read nan, the files in the source's mix")
    ap.add_argument("--write-only", action="store_true",
                    help="only write the synthetic files (in the mix read from llama-quantize's source when no build "
                         "exists yet); the benchmark checks them against llama-quantize's own mix")
    args = ap.parse_args()
    if args.write_only:
        for key in args.files.split(","):
            print(make_file(key, args.workdir, args.bins)[0], flush=True)
        return
    if args.load_memory:
        key, file, config_dir = args.load_memory
        torch.set_num_threads(args.threads)
        print(json.dumps(load_memory(key, Path(file), Path(config_dir))))
        return
    if args.bins is None and not args.no_peer:
        args.bins = built_bins()
        if args.bins is None:
            sys.exit(f"no llama.cpp build: {ready_file()} is missing; run scripts/build_llamacpp.sh or pass --bins")
    args.forward = args.forward.split(",")
    os.environ["SPECDECODE_ADAPTIVE_THREADS"] = "0"  # our side on exactly --threads threads
    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    keys = args.files.split(",")
    unknown = [k for k in keys if k not in FILES]
    if unknown:
        sys.exit(f"unknown files {unknown}; choose from {', '.join(FILES)}")
    results = []
    for i, key in enumerate(keys):
        print(f"[{i + 1}/{len(keys)}] {key}: writing / finding the file", flush=True)
        file, config_dir = make_file(key, args.workdir, args.bins)
        results.append(bench_file(key, file, config_dir, args.bins, args))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    command = "python benchmarks/llamacpp_bench.py " + " ".join(sys.argv[1:])
    text = report(results, args, command)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
