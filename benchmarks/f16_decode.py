"""Plain greedy decoding of an F16 GGUF Llama with its matrices at 16 bits (HalfLinear in the native blocks) vs the
same model with every matrix widened to float32 (what load_gguf made of F16 files before), alternated.

The file is synthetic (random weights written with GGUFWriter, F16 matrices, F32 norms), of a chosen shape
(default: hidden 1024, 8 layers, ffn 4096, 16 heads, 4 kv heads, vocabulary 16384, untied output layer).

    python benchmarks/f16_decode.py --out benchmarks/results/f16_decode.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from specdecode import kernels
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models.halflinear import HalfEmbedding, HalfLinear
from specdecode.models.linear import Linear
from specdecode.models.loading import load_gguf


def write(path: Path, hidden: int, layers: int, ffn: int, heads: int, kv: int, vocab: int) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    file = path / "f16-llama.gguf"
    w = gguf.GGUFWriter(str(file), "llama")
    for add, value in ((w.add_context_length, 2048), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10_000.0), (w.add_vocab_size, vocab)):
        add(value)

    def matrix(name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols), np.float32) * (gain / cols**0.5)).astype(np.float16))

    head_dim = hidden // heads
    matrix("token_embd.weight", vocab, hidden, gain=hidden**0.5)
    for i in range(layers):
        p = f"blk.{i}."
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv * head_dim, hidden),
                                 ("attn_v", kv * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            matrix(p + name + ".weight", rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + norm + ".weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    matrix("output.weight", vocab, hidden, gain=4.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                  hidden_act="silu")
    (path / "config.json").write_text(json.dumps(config))
    return file


def widened(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every HalfLinear replaced by a float32 Linear of the same values (in place); the embedding
    keeps its 16-bit table (a step reads one row of it)."""
    for parent in list(model.modules()):
        if isinstance(parent, HalfEmbedding):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, HalfLinear):
                dense = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="cpu")
                dense.weight = torch.nn.Parameter(child.dequantize(), requires_grad=False)
                if child.bias is not None:
                    dense.bias = torch.nn.Parameter(child.bias.float(), requires_grad=False)
                setattr(parent, name, dense)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=6, default=[1024, 8, 4096, 16, 4, 16384],
                        metavar=("HIDDEN", "LAYERS", "FFN", "HEADS", "KV_HEADS", "VOCAB"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if kernels.native() is None:
        raise SystemExit("the native kernels are unavailable here: nothing to compare")
    params = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    with tempfile.TemporaryDirectory() as tmp:
        file = write(Path(tmp), *args.shape)
        half = load_gguf(file, Path(tmp), torch.float32)
        dense = widened(load_gguf(file, Path(tmp), torch.float32))
    sizes = {name: sum(b.numel() * b.element_size() for b in [*m.buffers(), *m.parameters()]) / 2**20
             for name, m in (("16-bit", half), ("float32", dense))}
    same = generate_ids(half, prompt, max_new_tokens=args.tokens, params=params, k=0)[0] == generate_ids(
        dense, prompt, max_new_tokens=args.tokens, params=params, k=0)[0]
    times: dict[str, list[float]] = {"16-bit": [], "float32": []}
    for _ in range(args.rounds):
        for name, model in (("16-bit", half), ("float32", dense)):
            started = time.perf_counter()
            generate_ids(model, prompt, max_new_tokens=args.tokens, params=params, k=0)
            times[name].append((time.perf_counter() - started) / args.tokens * 1e3)
    ratios = [d / h for h, d in zip(times["16-bit"], times["float32"], strict=True)]
    lines = [f"# F16 GGUF decode at 16 bits vs float32 ({date.today()})", "",
             f"Command: `python benchmarks/f16_decode.py {' '.join(sys.argv[1:])}`", "",
             f"Shape (hidden, layers, ffn, heads, kv heads, vocab): {args.shape}; {args.tokens} tokens a run, "
             f"{args.rounds} alternated rounds; kernels {kernels.simd()}, {os.cpu_count()} cores, torch threads "
             f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}. Same greedy tokens: {same}.", "",
             "| weights | MiB | ms / token (median, min-max) |", "|---|---:|---|"]
    for name, ms in times.items():
        lines.append(f"| {name} | {sizes[name]:.0f} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")
    lines += ["", f"float32 / 16-bit time: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})."]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
