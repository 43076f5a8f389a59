"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) at the file's bytes: they load at the file's size and dequantize to the `gguf`
package's weights bit for bit; the kernels (AVX-512, AVX2, emulated VNNI, plain C; tiles of 8 and 16) compute
round(x) @ W^T, a row's bits independent of the rows beside it and of the thread count, the same bits as the
widened layout they replace; mixed fused layers (a Q4_K_M file's q|k|v) run as one weight; speculation over a
K-quant target read from a GGUF file is lossless."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode import kernels
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models.kquantize import quantize_k
from specdecode.models.native import weight_struct
from specdecode.models.quant import K_QUANTS, QuantLinear, QuantStack, round_activations
from specdecode.proposers import DraftModelProposer, PromptLookupProposer

from .helpers import tiny_model

gguf = pytest.importorskip("gguf")

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q5_1", "Q3_K", "IQ4_XS"]  # Q5_1: Q5_K's blocks with a float16 d and m each 32 weights
BUILDS = ["", "portable", "emulate-vnni"]  # this CPU's, plain C, AVX2 with the VNNI code path


def random_k_quant(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """A [n, k] K-quant tensor's bytes: random bits (every bit pattern is a valid block) but for the float16
    super-block scales, kept in a realistic range (random bits would give infinities and NaNs)."""
    size, block = K_QUANTS[name][1], 32 if name == "Q5_1" else 256
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if name in ("Q6_K", "Q3_K"):
        raw[..., size - 2:] = scales[..., :2]  # d, last
    else:
        raw[..., 0:4] = scales  # d, dmin (Q5_1: d, m)
    return raw.reshape(n, -1)


def gguf_weights(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).copy())


@pytest.fixture
def build(monkeypatch, request):
    """Run the test's body in a kernel build (`request.param`), skipping builds this CPU cannot run."""
    if request.param:
        monkeypatch.setenv("SPECDECODE_NATIVE", request.param)
    kernels.reset()
    if kernels.native() is None or (kernels.simd() == "scalar" and request.param != "portable"):
        kernels.reset()
        pytest.skip("no AVX2 here: the portable build only")
    yield request.param
    kernels.reset()


@pytest.mark.parametrize("name", TYPES)
def test_k_quants_load_at_the_files_size_and_dequantize_as_gguf_does(name) -> None:
    """Every byte pattern (random blocks): the weights the `gguf` package dequantizes, bit for bit, from exactly
    as many bytes as the file's; read back in row order after tiling, and by rows (a fused layer's parts)."""
    n, k = 44, 768
    raw = random_k_quant(name, n, k, seed=1)
    expected = gguf_weights(raw, name)
    layer = QuantLinear.from_gguf(raw, name)
    assert layer.act8 and layer.exact_scales and layer.kind == K_QUANTS[name][0]
    assert sum(t.numel() * t.element_size() for t in (layer.qs, layer.d, layer.m)) == raw.nbytes
    assert torch.equal(layer.dequantize(), expected)
    for width in (8, 16):
        tiled = QuantLinear.from_gguf(raw, name)
        tiled.tile(width)
        assert torch.equal(tiled.dequantize(), expected)
        index = torch.tensor([n - 1, 0, 17])
        assert torch.equal(tiled.rows(index).dequantize(), expected[index])
    with pytest.raises(ValueError, match="super-block" if name != "Q5_1" else "a block"):
        QuantLinear(layer.kind, layer.qs, layer.d[:, :-1], layer.m)


def test_q5_1_from_gguf_quantize_loads_at_its_size_beside_widths_not_of_256() -> None:
    """Q5_1 as the gguf package writes it (blocks of 32: rows of 96 weights, no super-blocks) and a partial tile."""
    w = np.random.default_rng(3).standard_normal((13, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_1)
    layer = QuantLinear.from_gguf(raw, "Q5_1")
    assert torch.equal(layer.dequantize(), gguf_weights(raw, "Q5_1")) and layer.quantization == "q5_1-a8"
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    reference = round_activations(x).double() @ gguf_weights(raw, "Q5_1").double().T
    torch.testing.assert_close(layer(x).double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("name", TYPES[:3])
def test_quantize_k_writes_blocks_gguf_reads_back_close_to_the_weights(name) -> None:
    w = np.random.default_rng(2).standard_normal((8, 512)).astype(np.float32)
    raw = quantize_k(w, name)
    assert raw.shape == (8, 2 * K_QUANTS[name][1]) and raw.dtype == np.uint8
    back = gguf_weights(raw, name).numpy()
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]
    step = (w.max() - w.min()) / (2**bits - 1)  # the coarsest step a block of these weights could take
    assert np.abs(back - w).max() <= step and np.sqrt(((back - w) ** 2).mean()) <= step / 2
    with pytest.raises(ValueError, match="multiple"):
        quantize_k(w[:, :300], name)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
def test_kernel_is_rounded_activations_times_the_weights_and_rows_are_independent(name, build) -> None:
    """round(x) @ W^T (float64 reference) for tiles of 8 and 16 with a partial last tile; each row's bits the same
    whatever rows share the call; Q4_K and Q6_K give the bits of the widened layout (6 and 10 bits a weight)."""
    n, k = 44, 512
    raw = random_k_quant(name, n, k, seed=3)
    expected = gguf_weights(raw, name).double()
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(4))
    reference = round_activations(x).double() @ expected.T
    results = []
    for width in (8, 16):
        layer = QuantLinear.from_gguf(raw, name)
        layer.tile(width)
        got = layer(x)
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        alone = torch.cat([layer(x[i : i + 1]) for i in range(13)])
        assert torch.equal(got, alone)
        for rows in (2, 3, 4, 5, 8, 9):
            assert torch.equal(layer(x[13 - rows :]), alone[13 - rows :]), rows
        if name in ("Q4_K", "Q6_K"):
            widened = QuantLinear.from_gguf(raw, name).widened()
            assert widened.kind in ("int4", "int8") and torch.equal(widened.dequantize(), expected.float())
            assert torch.equal(widened(x), got)
        results.append(got)
    assert torch.equal(results[0], results[1])  # any build reads both widths, lane for lane the same steps


@pytest.mark.parametrize("name", TYPES)
def test_vnni_emulation_avx2_and_this_cpu_give_the_same_bits(name, monkeypatch) -> None:
    """Integer sums are exact in any order: the VNNI code path (emulated), AVX2 and this CPU's build agree."""
    raw = random_k_quant(name, 40, 512, seed=5)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(6))
    results = {}
    for build in ("", "emulate-vnni"):
        monkeypatch.setenv("SPECDECODE_NATIVE", build or "1")
        kernels.reset()
        if kernels.simd() in ("scalar", "none"):
            pytest.skip("no AVX2 here")
        layer = QuantLinear.from_gguf(raw, name)
        results[build] = layer(x)
    kernels.reset()
    assert torch.equal(results[""], results["emulate-vnni"])


@pytest.mark.parametrize("name", TYPES)
def test_thread_counts_give_the_same_bits(name) -> None:
    """The kernels split outputs over threads; a row's numbers are its outputs' own: 1, 2, 4 threads agree."""
    raw = random_k_quant(name, 72, 512, seed=7)
    layer = QuantLinear.from_gguf(raw, name)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(8))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            results.append(layer(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_a_mixed_fused_layer_runs_each_part_at_its_size() -> None:
    """q|k|v of a Q4_K_M file (q, k Q4_K, v Q6_K; a Q8_0 part as llama.cpp falls back to for widths not a multiple
    of 256) fuse into a QuantStack: each part's kernel, the outputs side by side, rows independent; the native
    block reads it as one weight (block.c's W_STACK)."""
    parts = [QuantLinear.from_gguf(random_k_quant(name, n, 512, seed=i), name)
             for i, (name, n) in enumerate((("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)))]
    q8 = gguf.quants.quantize(np.random.default_rng(5).standard_normal((24, 512)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    parts.append(QuantLinear.from_gguf(q8, "Q8_0"))
    parts[-1].act8 = True
    fused = QuantLinear.cat(parts)
    assert isinstance(fused, QuantStack) and fused.quantization == "q4k+q6k+int8-a8" and fused.out_features == 152
    assert QuantLinear.fusable(parts) and not QuantLinear.fusable([*parts, torch.zeros(1)])
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(9))
    got = fused(x)
    assert torch.equal(got, torch.cat([p(x) for p in parts], dim=-1))
    assert torch.equal(got[2:5], fused(x[2:5]))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    if kernels.native() is not None:
        assert weight_struct(fused).kind == 9


@pytest.mark.parametrize("name", TYPES)
def test_without_native_kernels_a_k_quant_layer_computes_the_same_model(name, monkeypatch) -> None:
    """Where the kernels cannot be built, the weights are dequantized (once) and x rounded as the kernel rounds it."""
    raw = random_k_quant(name, 20, 512, seed=11)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    reference = round_activations(x).double() @ gguf_weights(raw, name).double().T
    monkeypatch.setenv("SPECDECODE_NATIVE", "0")
    kernels.reset()
    try:
        assert kernels.native() is None
        got = QuantLinear.from_gguf(raw, name)(x)
    finally:
        kernels.reset()
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


# ------------------------------------------------------------------------------ a K-quant model from a GGUF file
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 64
# layer 0 a Q4_K_M-like mix (q, k Q4_K and v Q6_K: a stacked q|k|v; o Q5_K, gate and up Q4_K, down Q6_K), layer 1
# every other type (q|k|v Q3_K, o IQ4_XS, gate Q5_1 beside up Q3_K: a stacked gate|up, down Q5_K); the output layer
# Q6_K, the embedding Q4_K (its rows read through the embedding)
MIX = [dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q5_K", ffn_gate="Q4_K", ffn_up="Q4_K",
            ffn_down="Q6_K"),
       dict(attn_q="Q3_K", attn_k="Q3_K", attn_v="Q3_K", attn_output="IQ4_XS", ffn_gate="Q5_1", ffn_up="Q3_K",
            ffn_down="Q5_K")]


def write_k_quant_llama(path: Path) -> None:
    """A tiny random Llama as llama.cpp lays it out (q/k rows permuted as its converter does is irrelevant for
    random weights), its matrices in MIX's K-quants, and the HF config.json beside it."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path / "tiny-llama-kquants.gguf"), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000.0)
    w.add_vocab_size(VOCAB)

    def matrix(name: str, rows: int, cols: int, kind: str, gain: float = 1.25) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        data = (rng.standard_normal((rows, cols)) * gain / cols**0.5).astype(np.float32)
        if kind in ("Q3_K", "IQ4_XS"):  # no writer for these: random blocks whose float16 d gives the same spread
            blocks = rng.integers(0, 256, (rows, cols // 256, K_QUANTS[kind][1]), dtype=np.uint8)
            at = K_QUANTS[kind][1] - 2 if kind == "Q3_K" else 0
            d = gain / cols**0.5 / (18 * (2.3 if kind == "Q3_K" else 70))  # scales ~18 rms, values ~2.3 or ~70
            blocks[..., at:at + 2] = np.full((rows, cols // 256, 1), d, np.float16).view(np.uint8)
            raw = blocks.reshape(rows, -1)
        else:
            raw = gguf.quants.quantize(data, qtype) if kind == "Q5_1" else quantize_k(data, kind)
        w.add_tensor(name, raw, raw_dtype=qtype)

    matrix("token_embd.weight", VOCAB, HIDDEN, "Q4_K", gain=HIDDEN**0.5)
    for i in range(LAYERS):
        p = f"blk.{i}."
        for name, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", KV_HEADS * head_dim, HIDDEN),
                                 ("attn_v", KV_HEADS * head_dim, HIDDEN), ("attn_output", HIDDEN, HIDDEN),
                                 ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)):
            matrix(p + name + ".weight", rows, cols, MIX[i][name])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + norm + ".weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    matrix("output.weight", VOCAB, HIDDEN, "Q6_K", gain=6.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=HIDDEN,
                  intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10_000.0,
                  tie_word_embeddings=False, hidden_act="silu")
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def k_quant_target(tmp_path_factory):
    from specdecode.models.loading import load_gguf

    path = tmp_path_factory.mktemp("kquants")
    write_k_quant_llama(path)
    return load_gguf(path / "tiny-llama-kquants.gguf", path, torch.float32, act8=True)


def test_a_k_quant_file_loads_every_matrix_at_its_size(k_quant_target) -> None:
    model = k_quant_target
    first, second = model.layers
    assert isinstance(first.attn.wqkv, QuantStack) and first.attn.wqkv.quantization == "q4k+q6k-a8"
    assert first.attn.wo.quantization == "q5k-a8"
    assert first.mlp.w13.quantization == "q4k-a8" and first.mlp.w2.quantization == "q6k-a8"
    assert second.attn.wqkv.quantization == "q3k-a8" and second.attn.wo.quantization == "iq4xs-a8"
    assert isinstance(second.mlp.w13, QuantStack) and second.mlp.w13.quantization == "q5_1+q3k-a8"
    assert second.mlp.w2.quantization == "q5k-a8"
    assert model.lm_head.quantization == "q6k-a8" and model.embed.quantization == "q4k-a8"
    if kernels.native() is not None:
        with torch.inference_mode():
            assert model._native_blocks(torch.zeros(1, 1, dtype=torch.long), model.new_cache(4)) is not None


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_over_a_k_quant_target_equals_its_plain_decoding(k_quant_target, k) -> None:
    """Verification of k guesses gives bit for bit the logits k single steps give (rows independent in every
    kernel): greedy speculative output equals plain decoding token for token, a draft's and prompt lookup's."""
    target = k_quant_target
    params = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = generate_ids(target, prompt, max_new_tokens=30, params=params, k=0)[0]
    assert len(set(plain)) > 3  # varied text: a test of something
    small = tiny_model(1, dtype=torch.float32, vocab_size=VOCAB)  # a draft that mostly disagrees: rejections
    for proposer in (PromptLookupProposer(), PromptLookupProposer(branches=3), DraftModelProposer(small, VOCAB)):
        spec, stats = generate_ids(target, prompt, max_new_tokens=30, params=params, k=k, proposer=proposer)
        assert spec == plain, proposer.name
        assert stats.drafted > 0


def test_matrices_without_a_native_kernel_are_named_in_one_line_with_their_memory(caplog) -> None:
    """Types still dequantized to float32 (Q3_K, IQ4_XS, F16 here): one warning naming them, with the file's bytes
    and float32's; float32 matrices, norms and native types are not counted; none where all load natively."""
    from types import SimpleNamespace

    from specdecode.models.quant import log_dequantized

    def tensor(kind: str, shape: tuple[int, ...], nbytes: int) -> SimpleNamespace:
        return SimpleNamespace(tensor_type=SimpleNamespace(name=kind), shape=shape, n_bytes=nbytes,
                               n_elements=int(np.prod(shape)))

    listed = [("a", tensor("Q3_K", (4096, 1024), 2 << 20)), ("b", tensor("F16", (1024, 1024), 2 << 20)),
              ("c", tensor("F32", (1024, 1024), 4 << 20)), ("n", tensor("F16", (1024,), 2048)),
              ("q", tensor("Q4_K", (1024, 1024), 1024 * 1024 * 144 // 256))]
    with caplog.at_level("WARNING", logger="specdecode"):
        line = log_dequantized("m.gguf", listed, {"Q4_K"})
    assert line is not None and caplog.text.count("dequantized once to float32") == 1
    assert "F16, Q3_K matrices" in line and "4 MB in the file -> 20 MB in memory (5.0x)" in line
    assert log_dequantized("m.gguf", listed[2:], {"Q4_K"}) is None
    assert "F16" not in (log_dequantized("m.gguf", listed, {"Q4_K"}, requantized=True) or "")


def test_every_kernel_source_and_header_keys_the_cached_build(tmp_path, monkeypatch) -> None:
    """The build is cached by a hash of what it compiles: every .c and .h under specdecode/kernels is in it, so a
    changed K-quant kernel or kind number (kquants.h) is built anew, never an old library picked up."""
    folder = Path(kernels.__file__).parent
    compiled = {p.name for p in [*kernels.SOURCES, *kernels.HEADERS]}
    assert {p.name for p in folder.glob("*.[ch]")} == compiled
    copies = {}
    for p in [*kernels.SOURCES, *kernels.HEADERS]:
        copies[p.name] = tmp_path / p.name
        copies[p.name].write_bytes(p.read_bytes())
    monkeypatch.setattr(kernels, "SOURCES", [copies[p.name] for p in kernels.SOURCES])
    monkeypatch.setattr(kernels, "HEADERS", [copies[p.name] for p in kernels.HEADERS])
    before = kernels.source_key()
    copies["kquants.h"].write_text(copies["kquants.h"].read_text().replace("K_WIDE = 21", "K_WIDE = 22"))
    assert kernels.source_key() != before
