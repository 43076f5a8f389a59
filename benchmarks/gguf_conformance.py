"""Conformance with llama.cpp on the same GGUF file: our next-token logits beside llama.cpp's, for every
architecture x storage type we load, on synthetic files written at run time (nothing large committed).

Each architecture is a tiny random model that transformers builds (rows of 256 weights, so every K-quant applies),
written by specdecode.models.gguf_write in the converter's layout as each type or mix; both engines read the same
file and the same token ids. Two of our loads are compared: "as stored" (the file's types on our kernels, int8
activations for the quantized types, as llama.cpp runs them) and "dequantized" (every weight widened to float32: the
file's exact weights, float arithmetic). The report gives, per file, the top-1 agreement over all positions and the
largest difference relative to the logits' scale.

llama.cpp is read through llama-cpp-python (`pip install llama-cpp-python`, which builds it for this CPU; or
`--peer-path` where a build lies); without it only our two loads are compared with each other.

    python benchmarks/gguf_conformance.py --out benchmarks/results/gguf-conformance.md [--peer-path DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode.models.gguf_write import write_gguf  # noqa: E402
from specdecode.models.loading import load_model  # noqa: E402

VOCAB, POSITIONS = 320, 32
BASE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _build(kind: str, **kw) -> torch.nn.Module:
    import transformers as tf

    config_class, model_class = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM), "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[kind]
    return model_class(config_class(**{**BASE, **kw}))


ARCHITECTURES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama3.1": lambda: _build("llama", rope_theta=500_000.0, rope_scaling=LLAMA3),
    "llama3-tied": lambda: _build("llama", rope_theta=500_000.0, rope_scaling=LLAMA3, tie_word_embeddings=True),
    "qwen2.5": lambda: _build("qwen2", rope_theta=1_000_000.0),
    "qwen3": lambda: _build("qwen3", rope_theta=1_000_000.0, tie_word_embeddings=True),
    # windows wider than the test's positions: llama.cpp reads none from a Mistral file and has Phi-3's turned off
    "mistral": lambda: _build("mistral", sliding_window=4096),
    "phi3": lambda: _build("phi3", sliding_window=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma3": lambda: _build("gemma3", sliding_window=4096, query_pre_attn_scalar=64),
}


def _mix(base: str, more: str) -> Callable[[str], str]:
    """llama.cpp's *_K_M recipe in short: `more` bits for the output, value and down projections."""
    return lambda name: more if name == "output.weight" or ".attn_v." in name or ".ffn_down." in name else base


TYPES: dict[str, str | Callable[[str], str]] = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
    "Q5_1": "Q5_1", "Q6_K": "Q6_K", "Q4_K_M": _mix("Q4_K", "Q6_K"), "Q5_K_M": _mix("Q5_K", "Q6_K"),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights that give peaked, varied logits: embeddings N(0, 1), matrices N(0, 1.25^2 / fan_in), norms
    1 + N(0, 0.1^2), biases N(0, 0.2^2), the output layer N(0, 6^2 / hidden)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                value = 1 + 0.1 * z
            elif name.endswith("bias"):
                value = 0.2 * z
            elif "embed" in name:
                value = z
            elif "lm_head" in name:
                value = 6.0 * z / p.shape[1] ** 0.5
            else:
                value = 1.25 * z / p.shape[1] ** 0.5
            p.copy_(value)


def ours(path: Path, ids: list[int], quantization: str | None) -> np.ndarray:
    model, _ = load_model(path, quantization=quantization)
    model.kv_cache_dtype = "float32"
    with torch.inference_mode():
        return model.forward(torch.tensor([ids]), model.new_cache(len(ids))).logits[0].float().numpy()


def theirs(path: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=2 * len(ids), n_batch=len(ids), logits_all=True, verbose=False,
                          n_threads=1, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def compare(a: np.ndarray, b: np.ndarray) -> str:
    top = float((a.argmax(-1) == b.argmax(-1)).mean())
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    return f"{top:.3f} / {rel:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the report here (markdown)")
    ap.add_argument("--peer-path", help="a folder holding the llama_cpp package (added to sys.path)")
    ap.add_argument("--architectures", default=",".join(ARCHITECTURES))
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    if args.peer_path:
        sys.path.insert(0, args.peer_path)
    try:
        import llama_cpp

        peer = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        peer = None
        print("llama-cpp-python is not installed: only our two loads are compared", file=sys.stderr)
    os.environ.setdefault("SPECDECODE_CACHE", tempfile.mkdtemp(prefix="conformance-cache-"))
    ids = torch.randint(0, VOCAB, (POSITIONS,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.architectures.split(","):
            torch.manual_seed(0)
            model = ARCHITECTURES[arch]()
            randomize_(model, seed=1)
            for kind in args.types.split(","):
                path = write_gguf(Path(tmp) / f"{arch}-{kind}.gguf", model.config.to_dict(), model.state_dict(),
                                  TYPES[kind])
                stored, widened = ours(path, ids, "auto"), ours(path, ids, None)
                row = [arch, kind, compare(stored, widened)]
                if peer:
                    reference = theirs(path, ids)
                    row += [compare(stored, reference), compare(widened, reference)]
                rows.append(row)
                print(" | ".join(row), file=sys.stderr, flush=True)
                path.unlink()
    header = ["architecture", "file", "as stored vs dequantized"]
    if peer:
        header += ["as stored vs llama.cpp", "dequantized vs llama.cpp"]
    flags = subprocess.run(["grep", "-m1", "^flags", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    simd = " ".join(f for f in flags.split() if f.startswith(("avx", "f16c", "fma")))
    lines = ["# GGUF conformance: our logits beside llama.cpp's on the same files", "",
             f"Command: `python {' '.join(sys.argv)}`", f"Machine: {platform.processor() or platform.machine()}, "
             f"{simd}; peer: {peer or 'none'}", "",
             f"Each cell: top-1 agreement over {POSITIONS} positions / largest |difference| relative to the logits' "
             "largest magnitude. KV caches in float32 on both sides.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
