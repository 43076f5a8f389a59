"""GGUF's F16 and BF16 matrices at the file's 16 bits (models/halflinear.py, kernels/f16matmul.c): the kernel sums in
one stated order, the same in every build (AVX-512, AVX2, emulated VNNI, plain C), so it equals a NumPy float32
reference summing in that order bit for bit, and x @ W^T in float64 within float32 rounding; a row's bits do not
depend on the rows beside it or the thread count; a tiny F16 (and a BF16) GGUF Llama loads with its matrices at
16 bits, runs in the native blocks, and greedy speculation over it equals its plain decoding; without the kernels
the matrices load as float32, as before."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode import kernels
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models.halflinear import HalfEmbedding, HalfLinear, widen
from specdecode.models.linear import Linear
from specdecode.models.native import weight_struct
from specdecode.proposers import DraftModelProposer, PromptLookupProposer

from .helpers import tiny_model

gguf = pytest.importorskip("gguf")

BUILDS = ["", "portable", "emulate-vnni"]  # this CPU's (AVX-512 where it has it), plain C, the 256-bit path
TYPES = ["F16", "BF16"]


def random_bits(name: str, n: int, k: int, seed: int, gain: float = 1.0) -> torch.Tensor:
    """[n, k] weights ~ N(0, gain^2) as the file stores them: int16 words of float16 or bfloat16."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * gain).astype(np.float32)
    if name == "F16":
        return torch.from_numpy(w.astype(np.float16).view(np.int16).copy())
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16).view(np.int16).copy())


def in_kernel_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, K] @ w [N, K]^T in float32, summed as f16matmul.c states: lane l adds w[k] * x[k] (rounded, then
    added) for k = l, l + 16, ... below K - K % 16; lanes summed pairwise (l + 8, then + 4, + 2, + 1); the tail
    added in order."""
    k16 = x.shape[1] - x.shape[1] % 16
    products = x[:, None, :] * w[None, :, :]  # float32: each product rounded once
    acc = np.zeros((x.shape[0], w.shape[0], 16), np.float32)
    for c in range(0, k16, 16):
        acc = acc + products[..., c:c + 16]
    for width in (8, 4, 2, 1):
        acc = acc[..., :width] + acc[..., width:2 * width]
    total = acc[..., 0]
    for j in range(k16, x.shape[1]):
        total = total + products[..., j]
    return total


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


def test_bfloat16_and_float16_words_widen_exactly() -> None:
    bits = random_bits("BF16", 8, 64, seed=0)
    assert torch.equal(widen(bits, True), bits.view(torch.bfloat16).float())
    half = random_bits("F16", 8, 64, seed=0)
    assert torch.equal(widen(half, False, torch.float64), half.view(torch.float16).double())


@pytest.mark.parametrize("build", BUILDS, indirect=True)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("k", [512, 100])  # 100: a tail past the last 16
def test_kernel_sums_in_its_stated_order_in_every_build(build, name, k) -> None:
    """Bit for bit the float32 reference in the kernel's order; within float32 rounding of float64's x @ W^T;
    each of 7 rows alone gives the bits it gives in the batch (and 40 outputs: a partial tile of 16)."""
    layer = HalfLinear(random_bits(name, 40, k, seed=1), name == "BF16")
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(2))
    got = layer(x)
    widened = layer.dequantize()
    assert np.array_equal(got.numpy(), in_kernel_order(x.numpy(), widened.numpy()))
    exact = x.double() @ widened.double().T
    bound = 4 * k * np.finfo(np.float32).eps * (x.double().abs() @ widened.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()
    for r in range(x.shape[0]):
        assert torch.equal(layer(x[r:r + 1]), got[r:r + 1])


def test_builds_and_thread_counts_give_the_same_bits(monkeypatch) -> None:
    """The order is stated, not a build's: this CPU's build, the 256-bit path, plain C, and 1, 2, 4 threads agree."""
    layer = HalfLinear(random_bits("F16", 72, 320, seed=3), False)
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(4))
    results = []
    before = torch.get_num_threads()
    try:
        for mode in ("1", "emulate-vnni", "portable"):
            monkeypatch.setenv("SPECDECODE_NATIVE", mode)
            kernels.reset()
            if kernels.native() is None:
                pytest.skip("no native kernels here")
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                results.append(layer(x))
    finally:
        torch.set_num_threads(before)
        kernels.reset()
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_without_kernels_the_layer_widens_its_weight(monkeypatch) -> None:
    monkeypatch.setenv("SPECDECODE_NATIVE", "0")
    kernels.reset()
    try:
        layer = HalfLinear(random_bits("BF16", 24, 64, seed=5), True, bias=torch.randn(24))
        x = torch.randn(3, 64, dtype=torch.float64)
        torch.testing.assert_close(layer(x), x @ layer.dequantize(torch.float64).T + layer.bias.double())
    finally:
        kernels.reset()


# ---------------------------------------------------------------------------------- a tiny F16 / BF16 GGUF Llama
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 128, 256, 2, 4, 2, 64


def write_half_llama(path: Path, name: str, tied: bool) -> Path:
    """A tiny random Llama whose matrices are `name` (F16 or BF16), norms F32; `tied`: no output.weight (the
    embedding is the output layer). The HF config.json beside it."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    file = path / f"tiny-llama-{name.lower()}.gguf"
    w = gguf.GGUFWriter(str(file), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000.0)
    w.add_vocab_size(VOCAB)
    qtype = gguf.GGMLQuantizationType[name]

    def matrix(tensor: str, rows: int, cols: int, gain: float = 1.25) -> None:
        data = (rng.standard_normal((rows, cols)) * gain / cols**0.5).astype(np.float32)
        if name == "F16":
            w.add_tensor(tensor, data.astype(np.float16))
        else:
            w.add_tensor(tensor, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    # rows of rms 1; tied, it is the output layer too: rows of rms 3 / sqrt(HIDDEN) keep greedy text varied
    matrix("token_embd.weight", VOCAB, HIDDEN, gain=HIDDEN**0.5 if not tied else 3.0)
    for i in range(LAYERS):
        p = f"blk.{i}."
        for tensor, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", KV_HEADS * head_dim, HIDDEN),
                                   ("attn_v", KV_HEADS * head_dim, HIDDEN), ("attn_output", HIDDEN, HIDDEN),
                                   ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)):
            matrix(p + tensor + ".weight", rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + norm + ".weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN, gain=6.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=HIDDEN,
                  intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10_000.0,
                  tie_word_embeddings=tied, hidden_act="silu")
    (path / "config.json").write_text(json.dumps(config))
    return file


@pytest.fixture(scope="module", params=[("F16", False), ("BF16", True)], ids=["F16", "BF16-tied"])
def half_file(tmp_path_factory, request) -> tuple[Path, str, bool]:
    name, tied = request.param
    path = tmp_path_factory.mktemp(name.lower())
    return write_half_llama(path, name, tied), name, tied


def load(file: Path) -> torch.nn.Module:
    from specdecode.models.loading import load_gguf

    return load_gguf(file, file.parent, torch.float32)


def test_a_half_file_loads_its_matrices_at_16_bits_and_runs_natively(half_file, caplog) -> None:
    file, name, tied = half_file
    kernels.reset()
    if kernels.native() is None:
        pytest.skip("no native kernels here")
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        model = load(file)
    assert "dequantized once" not in caplog.text  # no warning line names F16 / BF16
    layers = [m for block in model.layers for m in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2)]
    assert all(isinstance(m, HalfLinear) and m.bits.dtype == torch.int16 for m in [*layers, model.lm_head])
    assert {m.quantization for m in layers} == {name.lower()}
    assert isinstance(model.embed, HalfEmbedding) and (model.lm_head is model.embed.table) == tied
    assert all(weight_struct(m) is not None for m in layers)
    with torch.inference_mode():
        assert model._native_blocks(torch.zeros(1, 1, dtype=torch.long), model.new_cache(4)) is not None
    kernels.reset()


def test_a_half_file_gives_the_float32_models_logits(half_file, monkeypatch, caplog) -> None:
    """At 16 bits with the kernels, or widened to float32 at load without them (as before, one warning line naming
    the type): the same model."""
    file, name, _ = half_file
    monkeypatch.setenv("SPECDECODE_NATIVE", "0")
    kernels.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="specdecode"):
            dense = load(file)
        assert f"no native kernel for its {name} matrices here" in caplog.text
        wqkv = dense.layers[0].attn.wqkv
        assert isinstance(wqkv, Linear) and wqkv.weight.dtype == torch.float32
        monkeypatch.delenv("SPECDECODE_NATIVE")
        kernels.reset()
        if kernels.native() is None:
            pytest.skip("no native kernels here")
        half = load(file)
        assert isinstance(half.layers[0].attn.wqkv, HalfLinear)
        tokens = torch.tensor([[1, 5, 9, 2, 7, 7, 3]])
        with torch.inference_mode():
            want = dense(tokens, dense.new_cache(16)).logits.double()
            got = half(tokens, half.new_cache(16)).logits.double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    finally:
        kernels.reset()


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_over_a_half_target_equals_its_plain_decoding(half_file, k) -> None:
    """Verification of k guesses gives bit for bit the logits k single steps give: greedy speculative output
    equals plain decoding token for token, a draft's and prompt lookup's."""
    file, *_ = half_file
    kernels.reset()
    target = load(file)
    params = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = generate_ids(target, prompt, max_new_tokens=30, params=params, k=0)[0]
    assert len(set(plain)) > 3  # varied text: a test of something
    small = tiny_model(1, dtype=torch.float32, vocab_size=VOCAB)  # a draft that mostly disagrees: rejections
    for proposer in (PromptLookupProposer(), PromptLookupProposer(branches=3), DraftModelProposer(small, VOCAB)):
        spec, stats = generate_ids(target, prompt, max_new_tokens=30, params=params, k=k, proposer=proposer)
        assert spec == plain, proposer.name
        assert stats.drafted > 0
