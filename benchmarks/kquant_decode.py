"""Decode speed of a K-quant GGUF model at the file's bytes (kernels/kquants.c) vs the widened layout it loaded into
before (Q4_K as int4 blocks with float32 scales and mins, 6 bits a weight; Q6_K as int8 blocks with a float32 scale
each 16 weights, 10 bits), and vs the machine's memory-bandwidth bound.

The file is synthetic: a Llama of a chosen shape (default SmolLM2-1.7B's: hidden 2048, 24 layers, ffn 8192, 32
heads, 8 kv heads, vocabulary 49152) written with GGUFWriter in a Q4_K_M-like mix as llama-quantize makes it:
Q4_K everywhere but attn_v and ffn_down in Q6_K on llama.cpp's "more bits" layers (the first and last eighth and
every third between), the output layer in Q6_K, the embedding in Q4_K. Weights are random valid blocks with scales
that keep activations O(1) (speed does not depend on the values). Both layouts fuse q|k|v as one stack of parts.

A token's bytes: every matrix a decode step reads (the blocks' and the output layer's; the embedding's one row
aside). The bound: those bytes / the read bandwidth measured here (a large array summed by torch on all threads,
between the rounds). Then one matrix of each K type alone (Q5_K, Q3_K, IQ4_XS have no widened layout: they were
dequantized to float32 before).
Runs alternate (ours, widened, ours, ...), each a plain greedy decode of --tokens tokens after a short prompt;
the report gives medians and min-max.

    python benchmarks/kquant_decode.py --out benchmarks/results/kquant_decode.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from specdecode import kernels
from specdecode.bench.hardware import sharing_note
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models.loading import load_gguf
from specdecode.models.quant import K_QUANTS, QuantLinear, QuantStack

OURS, WIDENED = "file's bytes", "widened"


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(rng: np.random.Generator, name: str, rows: int, cols: int) -> np.ndarray:
    """Valid random `name` blocks [rows, bytes] whose weights have a standard deviation near 1 / sqrt(cols)."""
    size = K_QUANTS[name][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if name == "Q6_K":  # w = d * sc * (q - 32), sc uniform int8 (~74 rms), q - 32 ~ 18 rms
        raw[..., 208:210] = np.full((rows, cols // 256, 1), 1 / (cols**0.5 * 74 * 18), np.float16).view(np.uint8)
    else:  # w = d * sc * q - dmin * m, sc, m uniform 6-bit (~36 rms), q ~ 4.6 (Q4_K) or 9.2 (Q5_K) rms
        d = 1 / (cols**0.5 * 36 * (4.6 if name == "Q4_K" else 9.2))
        raw[..., 0:4] = np.full((rows, cols // 256, 2), d, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_model(path: Path, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    file = path / "synthetic-q4_k_m.gguf"
    w = gguf.GGUFWriter(str(file), "llama")
    for add, value in ((w.add_context_length, 4096), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 130_000.0), (w.add_vocab_size, vocab)):
        add(value)

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        w.add_tensor(name, random_blocks(rng, kind, rows, cols), raw_dtype=gguf.GGMLQuantizationType[kind])

    matrix("token_embd.weight", vocab, hidden, "Q4_K")
    for i in range(layers):
        big = "Q6_K" if more_bits(i, layers) else "Q4_K"
        kv = kv_heads * head_dim
        for name, rows, cols, kind in (("attn_q", hidden, hidden, "Q4_K"), ("attn_k", kv, hidden, "Q4_K"),
                                       ("attn_v", kv, hidden, big), ("attn_output", hidden, hidden, "Q4_K"),
                                       ("ffn_gate", ffn, hidden, "Q4_K"), ("ffn_up", ffn, hidden, "Q4_K"),
                                       ("ffn_down", hidden, ffn, big)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, kind)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    matrix("output.weight", vocab, hidden, "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=130_000.0, tie_word_embeddings=False, hidden_act="silu")
    (path / "config.json").write_text(json.dumps(config))
    return file


def widen_(model: torch.nn.Module) -> torch.nn.Module:
    """Every Q4_K / Q6_K layer in the widened layout (stacks' parts too), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear) and child.kind in ("q4k", "q6k"):
                setattr(parent, name, child.widened())
            elif isinstance(child, QuantStack):
                setattr(parent, name, QuantStack([p.widened() for p in child.parts], child.bias))
    if hasattr(model, "__dict__"):
        model.__dict__.pop("_native", None)  # the kernel's description of the old weights
    return model


def resident_mib() -> float:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of every matrix a decode step reads (the embedding table, read one row a token, aside)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and module is not getattr(model.embed, "table", None):
            total += sum(t.numel() * t.element_size() for t in (module.qs, module.d, module.m) if t is not None)
    return total


def read_bandwidth(a: torch.Tensor, repeats: int = 3) -> float:
    """Bytes a second summing `a` (a large array: all threads), the best of `repeats`."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * a.element_size() / (time.perf_counter() - start))
    return best


def layer_bytes(layer: QuantLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.qs, layer.d, layer.m) if t is not None)


def kernel_rows(rounds: int, rows: int = 1) -> list[str]:
    """One matrix per type at the 1.7B shape's largest (8192 x 2048; Q6_K as ffn_down, 2048 x 8192): ms per
    matmul of `rows` rows and the bytes streamed a second, the file's bytes vs the widened layout, interleaved."""
    rng = np.random.default_rng(1)
    out = ["| type | layout | MB | ms per matmul, median (min-max) | GB/s streamed | widened time / this |",
           "|---|---|---:|---:|---:|---:|"]
    for name, (n, k) in (("Q4_K", (8192, 2048)), ("Q6_K", (2048, 8192)), ("Q5_K", (8192, 2048)),
                         ("Q3_K", (8192, 2048)), ("IQ4_XS", (8192, 2048))):
        if name in ("Q4_K", "Q5_K", "Q6_K"):
            raw = random_blocks(rng, name, n, k)
        else:  # random valid blocks, their float16 d (Q3_K's last, IQ4_XS's first) realistic
            size = K_QUANTS[name][1]
            blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
            at = size - 2 if name == "Q3_K" else 0
            blocks[..., at:at + 2] = np.full((n, k // 256, 1), 1e-4, np.float16).view(np.uint8)
            raw = blocks.reshape(n, -1)
        layers = {OURS: QuantLinear.from_gguf(raw, name)}
        if name in ("Q4_K", "Q6_K"):
            layers[WIDENED] = QuantLinear.from_gguf(raw, name).widened()
        x = torch.randn(rows, k)
        for layer in layers.values():
            layer(x)  # tiled, warm
        times: dict[str, list[float]] = {key: [] for key in layers}
        for _ in range(rounds):
            for key, layer in layers.items():
                start = time.perf_counter()
                for _ in range(5):
                    layer(x)
                times[key].append((time.perf_counter() - start) / 5)
        for key, layer in layers.items():
            med = statistics.median(times[key])
            ratio = f"{statistics.median(times[WIDENED]) / med:.2f}x" if WIDENED in layers else "-"
            out.append(f"| {name} | {key} | {layer_bytes(layer) / 1e6:.1f} | {med * 1e3:.2f} "
                       f"({min(times[key]) * 1e3:.2f}-{max(times[key]) * 1e3:.2f}) | "
                       f"{layer_bytes(layer) / med / 1e9:.1f} | {ratio} |")
    return out


def decode_seconds(model, prompt: list[int], tokens: int) -> float:
    """Seconds a token of plain greedy decoding (the prompt's prefill taken off: one run of 1 token timed apart)."""
    params = SamplingParams(temperature=0.0)
    start = time.perf_counter()
    generate_ids(model, prompt, max_new_tokens=1, params=params, k=0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    out, _ = generate_ids(model, prompt, max_new_tokens=tokens, params=params, k=0)
    total = time.perf_counter() - start
    assert len(out) == tokens
    return (total - first) / (tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="fixed (the adaptive thread governor off)")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["SPECDECODE_ADAPTIVE_THREADS"] = "0"  # both layouts on the same threads, whatever else runs
    torch.set_num_threads(args.threads)
    shape = f"hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, {args.heads} heads / {args.kv_heads} kv, " \
            f"vocab {args.vocab}"
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        file = write_model(Path(tmp), args.hidden, args.layers, args.ffn, args.heads, args.kv_heads, args.vocab)
        file_mb = file.stat().st_size / 2**20
        print(f"wrote {file.name}: {file_mb:.0f} MiB ({shape}) in {time.perf_counter() - started:.0f} s")
        gc.collect()
        before = resident_mib()
        models = {OURS: load_gguf(file, Path(tmp), torch.float32, act8=True)}
        gc.collect()
        loaded = resident_mib() - before
        models[WIDENED] = widen_(load_gguf(file, Path(tmp), torch.float32, act8=True))
    gc.collect()
    sizes = {name: step_bytes(model) for name, model in models.items()}
    big = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB: the bandwidth probe, read each round
    bandwidths = [read_bandwidth(big)]
    prompt = list(range(1, 9))
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():  # warm: kernels built, weights tiled, caches made
        decode_seconds(model, prompt, 3)
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(decode_seconds(model, prompt, args.tokens))
        bandwidths.append(read_bandwidth(big))
    del big
    bandwidth = statistics.median(bandwidths)
    kernels_table = kernel_rows(args.rounds)
    lines = [
        f"# K-quant decode: the file's bytes vs the widened layout ({date.today()})",
        "",
        f"Command: `python benchmarks/kquant_decode.py --threads {args.threads} --rounds {args.rounds}"
        f"{' --out ' + args.out if args.out else ''}` "
        f"(shape: {shape}; {args.rounds} interleaved rounds of {args.tokens} greedy tokens, prefill taken off)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, kernels "
        f"{kernels.simd()}; {sharing_note(torch.get_num_threads())}: read the ratios (same process, runs "
        "alternated). "
        f"CPU flags: `{kernels.cpu_flags()}`",
        "",
        f"Synthetic Q4_K_M-like file ({file_mb:.0f} MiB; Q4_K, with attn_v / ffn_down on llama.cpp's more-bits "
        "layers and the output layer in Q6_K); read bandwidth measured here between the rounds (1 GiB summed, best "
        f"of 3 each time): median {bandwidth / 1e9:.1f} GB/s "
        f"({min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}).",
        "",
        f"Resident memory the load added (the file's bytes layout): {loaded:.0f} MiB for the {file_mb:.0f} MiB file "
        f"({loaded / file_mb:.2f}x).",
        "",
        "| layout | MB read a token | decode ms/token, median (min-max) | tok/s | bound tok/s (bytes / bandwidth) "
        "| share of the bound | speed vs widened |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in models:
        med = statistics.median(times[name])
        bound = bandwidth / sizes[name]
        lines.append(f"| {name} | {sizes[name] / 1e6:.0f} | {med * 1e3:.1f} ({min(times[name]) * 1e3:.1f}-"
                     f"{max(times[name]) * 1e3:.1f}) | {1 / med:.2f} | {bound:.2f} | {1 / med / bound:.0%} "
                     f"| {statistics.median(times[WIDENED]) / med:.2f}x |")
    ratios = sorted(w / o for o, w in zip(times[OURS], times[WIDENED], strict=True))
    lines += ["", f"Per round, widened time / file's-bytes time: {', '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}); bytes ratio "
              f"{sizes[WIDENED] / sizes[OURS]:.2f}.", "",
              f"One matrix per type, one row (a decode step's matmul), {torch.get_num_threads()} thread(s), "
              f"{args.rounds} interleaved rounds of 5 calls:", "", *kernels_table, ""]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
