"""int4 / int8 weights and the native kernels: the matmul equals dequantize-then-matmul, a row's result does
not depend on how many rows share the call, GGUF blocks load as stored, the native block equals the PyTorch
block, the fallback works and says so, and speculation over a quantized target is lossless (greedy and
sampled)."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch

from specdecode import kernels
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models.linear import Linear
from specdecode.models.loading import quantize_
from specdecode.models.native import weight_struct
from specdecode.models.quant import QuantLinear, round_activations
from specdecode.proposers import DraftModelProposer, PromptLookupProposer, QuantizedSelfProposer

from .helpers import noisy_copy, tiny_model
from .test_distribution import ALPHA, PROMPT, V, chi_square, exact_joint

# (in, out): the default model's widths, a tiny one, and outputs that end in a partial tile of 8
SHAPES = [(64, 40), (576, 960), (1536, 96), (96, 44)]
ROW_COUNTS = (2, 3, 4, 5, 7, 8, 9, 13, 16)


@pytest.fixture
def no_native(monkeypatch):
    """The PyTorch fallback, as on a machine where the kernels cannot be built."""
    monkeypatch.setenv("SPECDECODE_NATIVE", "0")
    kernels.reset()
    yield
    kernels.reset()


@pytest.mark.parametrize("kind", ["int4", "int8", "int4-a8", "int8-a8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_equals_dequantize_then_matmul(kind, shape) -> None:
    """Weight-only: x @ dequant(W).T; with int8 activations: round(x) @ dequant(W).T, x rounded per block."""
    assert kernels.native() is not None, "the native kernels must build on CI machines"
    k, n = shape
    g = torch.Generator().manual_seed(0)
    layer = QuantLinear.quantize(torch.randn(n, k, generator=g) * 0.05, kind)
    dense = layer.dequantize().double()
    for rows in (1, 2, 3, 4, 5, 8, 13, 16):
        x = torch.randn(rows, k, generator=g)
        expected = (round_activations(x) if layer.act8 else x).double() @ dense.T
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["int4", "int8", "int4-a8", "int8-a8"])
@pytest.mark.parametrize("shape", [(576, 96), (96, 44)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind, shape) -> None:
    """Bit for bit, whatever the number of rows in the call and wherever the row sits among them."""
    g = torch.Generator().manual_seed(1)
    k, n = shape
    layer = QuantLinear.quantize(torch.randn(n, k, generator=g), kind)
    x = torch.randn(16, k, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    for rows in ROW_COUNTS:
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
        assert torch.equal(layer(x[16 - rows :]), alone[16 - rows :]), rows  # the same rows at other offsets


@pytest.mark.parametrize("width", [None, 8, 16])
@pytest.mark.parametrize("shape", [(576, 96), (96, 44)])
def test_tiles_compute_bit_for_bit_what_the_stored_rows_do(shape, width) -> None:
    """The int8-activation kernel reads its weights from tiles of 8 or 16 outputs (no shuffles to unpack them): the
    same integers and the same float steps as from GGUF's row order, so the same bits, partial last tile included,
    whichever width the build prefers (None) and whichever it runs (every build reads both); the layer tiles in
    place and reads back in row order (dequantize, rows, embedding lookups)."""
    lib = kernels.native()
    assert lib is not None
    k, n = shape
    g = torch.Generator().manual_seed(2)
    for kind in ("int4-a8", "int8-a8"):
        layer = QuantLinear.quantize(torch.randn(n, k, generator=g), kind)
        if width:
            layer.tile(width)
        qs, d, m = (None if t is None else t.clone() for t in layer.row_order())
        dense = layer.dequantize()
        x = torch.randn(5, k, generator=g)
        for rows in (1, 4, 5):
            stored = torch.empty(rows, n)  # the row-order kernel (kinds 1, 2) on GGUF's order
            assert not lib.specdecode_a8_matmul(1 if kind == "int4-a8" else 2, x.data_ptr(), rows, k, qs.data_ptr(),
                                                d.data_ptr(), None if m is None else m.data_ptr(),
                                                stored.data_ptr(), n)
            assert torch.equal(layer(x[:rows]), stored), (kind, rows)
        width = width or kernels.tile_width()
        assert layer.tiled == width and layer.qs.shape[0] == -(-n // width) * width  # in place, no second copy
        assert torch.equal(layer.dequantize(), dense)  # read back in row order
        assert all(torch.equal(a, b) for a, b in zip(layer.row_order(torch.tensor([n - 1, 0])),
                                                     (qs[[n - 1, 0]], d[[n - 1, 0]], None if m is None else
                                                      m[[n - 1, 0]]), strict=True) if b is not None)


def test_quantization_error_is_what_the_format_allows() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    for kind, bound in (("int4", 0.5 / 15), ("int8", 0.5 / 127)):
        layer = QuantLinear.quantize(w, kind)
        blocks = w.reshape(64, 8, 32)
        spread = (blocks.amax(-1) - blocks.amin(-1)) if kind == "int4" else blocks.abs().amax(-1)
        err = (layer.dequantize() - w).abs().reshape(64, 8, 32).amax(-1)
        assert (err <= spread * bound * 1.01 + 1e-3).all(), kind


def test_gguf_blocks_load_as_stored() -> None:
    """Q4_0, Q4_1 and Q8_0 bytes laid out as GGUF stores them give the weights gguf's own dequantizer gives."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        kind = gguf.GGMLQuantizationType[name]
        raw = gguf.quants.quantize(w, kind)
        expected = gguf.quants.dequantize(raw, kind)
        got = QuantLinear.from_gguf(raw, name).dequantize().numpy()
        np.testing.assert_array_equal(got, expected, err_msg=name)
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K"):
        QuantLinear.from_gguf(raw, "Q2_K")


def random_k_quant(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """A [n, k] Q4_K or Q6_K tensor's bytes: random bits (every bit pattern is a valid block) but for the float16
    super-block scales, kept in a realistic range (random bits would give infinities and NaNs)."""
    size = {"Q4_K": 144, "Q6_K": 210}[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if name == "Q4_K":
        raw[..., 0:4] = scales  # d, dmin
    else:
        raw[..., 208:210] = scales[..., :2]  # d
    return raw.reshape(n, -1)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_k_quants_load_as_stored_and_multiply_exactly(name, monkeypatch) -> None:
    """Q4_K and Q6_K bytes give gguf's own dequantized weights exactly (their two-level scales multiplied out in
    float32, never float16), and the int8-activation kernel computes round(x) @ W^T with every row's bits
    independent of the rows beside it, in the AVX2, portable and VNNI builds alike (tests/test_kquants.py: the
    other types, widths and thread counts)."""
    gguf = pytest.importorskip("gguf")
    n, k = 44, 512  # a partial last tile of 8 outputs
    raw = random_k_quant(name, n, k, seed=3)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).copy())
    layer = QuantLinear.from_gguf(raw, name)
    assert layer.act8 and layer.exact_scales and torch.equal(layer.dequantize(), expected)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    reference = round_activations(x).double() @ expected.double().T
    results = {}
    for build in ("", "portable", "emulate-vnni"):
        if build:
            monkeypatch.setenv("SPECDECODE_NATIVE", build)
        kernels.reset()
        try:
            if kernels.simd() == "scalar" and build != "portable":
                continue  # no AVX2 here: the portable build only
            got = layer(x)
            torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
            for rows in ROW_COUNTS[:6]:
                assert torch.equal(layer(x[:rows]), got[:rows]) and torch.equal(layer(x[9 - rows:]), got[9 - rows:])
            results[build] = got
        finally:
            kernels.reset()
    if "emulate-vnni" in results:
        assert torch.equal(results["emulate-vnni"], results[""])  # integer sums: exact in any order
    assert torch.equal(layer.dequantize(), expected)  # tiled in place, read back in row order
    weight_only = QuantLinear.from_gguf(raw, name)
    weight_only.act8 = False  # float activations: no kernel takes float32 scales, the weights are dequantized
    assert weight_struct(weight_only) is None and weight_struct(layer) is not None  # nor does the native block
    dense = x.double() @ expected.double().T
    torch.testing.assert_close(weight_only(x).double(), dense, rtol=1e-5, atol=1e-5 * dense.abs().max().item())


def test_bad_shapes_and_kinds_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="not a multiple of the block size 32.*without quantization"):
        QuantLinear.quantize(torch.randn(8, 48), "int4")
    with pytest.raises(ValueError, match="int4, int8"):
        QuantLinear.quantize(torch.randn(8, 64), "int3")


def takes_native_path(model) -> bool:
    with torch.inference_mode():
        return model._native_blocks(torch.zeros(1, 1, dtype=torch.long), model.new_cache(4)) is not None


def forward_both_ways(model, monkeypatch) -> list[torch.Tensor]:
    """A prefill, a token tree and a one-token step: native blocks, then the PyTorch blocks, in a float32 cache (a
    float16 one rounds the paths' last-bit differences to whole float16 steps: test_kv_cache.py reads it exactly)."""
    model.kv_cache_dtype = "float32"
    prompt = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(type(model), "_native_blocks", lambda *a: None)
        cache = model.new_cache(64)
        a = model.forward(prompt, cache, hidden_layers=[0])
        b = model.forward(torch.tensor([[3, 4, 5, 6]]), cache, tree_mask=tree, positions=torch.tensor([20, 21, 21, 22]))
        cache.keep(20, [0, 2])
        c = model.forward(torch.tensor([[7]]), cache)
        runs.append([a.logits, a.hidden[0], b.logits, c.logits])
    monkeypatch.undo()
    return runs


@pytest.mark.parametrize("kind", [None, "int4", "int8", "int4-a8", "int8-a8"])
@pytest.mark.parametrize("window", [None, 8])
def test_native_block_equals_pytorch_block(kind, window, monkeypatch) -> None:
    model = tiny_model(0, dtype=torch.float32, sliding_window=window)
    if kind:
        quantize_(model, kind)
    assert takes_native_path(model)
    native, reference = forward_both_ways(model, monkeypatch)
    for got, expected in zip(native, reference, strict=True):
        if kind and kind.endswith("-a8"):  # float rounding can move an activation across an int8 step: 1% of it
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * expected.abs().max().item())
        else:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", [None, "int4-a8", "int8"])
def test_logits_from_the_blocks_call_equal_the_output_layer_run_after_it(kind, monkeypatch) -> None:
    """The kernel's final norm and output layer (one call with the blocks) compute what the PyTorch norm and the
    output layer compute; any rows asked (a slice, the last row, an index) hold what all rows hold, bit for bit."""
    model = tiny_model(0, dtype=torch.float32, tie_word_embeddings=kind is not None)
    if kind:
        quantize_(model, kind)
    with torch.inference_mode():
        lib, blocks = model._native_blocks(torch.zeros(1, 1, dtype=torch.long), model.new_cache(4))
    assert blocks.head is not None
    prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))

    def logits(logits_at):
        cache = model.new_cache(16)
        return model.forward(prompt, cache, logits_at=logits_at).logits[0]

    every = logits(slice(None))
    assert torch.equal(logits(slice(-1, None)), every[-1:])
    assert torch.equal(logits(slice(3, 7)), every[3:7])
    assert torch.equal(logits(torch.tensor([9, 2])), every[[9, 2]])
    assert model.forward(prompt, model.new_cache(16), logits_at=None).logits is None
    monkeypatch.setattr(blocks, "head", None)  # the norm and output layer in PyTorch after the blocks' call
    apart = logits(slice(None))
    torch.testing.assert_close(every, apart, rtol=1e-5, atol=1e-5 * apart.abs().max().item())


def test_the_kernel_takes_a_cache_whose_row_blocks_are_dense_and_no_other() -> None:
    """cache_fits reads kv[0, 0, 0].is_contiguous() off the strides (no view a forward): the same answer for every
    layout, one kv head (strides of size-1 dimensions do not count) and a batch's row included."""
    from specdecode.models.cache import BatchKVCache, KVCache
    from specdecode.models.native import cache_fits

    caches = [KVCache(2, 3, 8, 10), KVCache(2, 1, 8, 10), BatchKVCache(2, 3, 8, 10, batch_size=3),
              BatchKVCache(2, 3, 8, 10, batch_size=3).row(1)]
    for dims in ((4, 5), (3, 4), (2, 3)):
        odd = KVCache(2, 3, 8, 10)
        odd.kv = odd.kv.transpose(*dims)
        caches.append(odd)
    answers = [cache_fits(c) for c in caches]
    assert answers == [c.kv[0, 0, 0].is_contiguous() for c in caches]
    assert answers[:4] == [True] * 4 and not all(answers[4:])


def test_embedding_rows_kept_are_the_table_rows_and_stay_unchanged() -> None:
    model = quantize_(tiny_model(0, dtype=torch.float32, tie_word_embeddings=True), "int4-a8")
    embed, table = model.embed, model.lm_head.dequantize()
    embed.ROWS_KEPT = 6
    for tokens in ([[5]], [[5, 5, 9]], [[1, 2, 3, 4]], [[7, 5]], [[i % 50 for i in range(embed.FEW + 1)]]):
        ids = torch.tensor(tokens)
        got = embed(ids)
        assert torch.equal(got, table[ids]), tokens
        got.add_(1.0)  # the native blocks update their input in place: the rows kept must not follow
        assert len(embed._rows) <= embed.ROWS_KEPT
    assert torch.equal(embed(torch.tensor([[5]])), table[torch.tensor([[5]])])
    model.lm_head.tile(16)  # the table stored anew: the rows kept are dropped, and read again from the new storage
    assert torch.equal(embed(torch.tensor([[3, 5]])), table[torch.tensor([[3, 5]])])
    assert set(embed._rows) == {3, 5}


def test_fallback_without_native_kernels_logs_and_computes_the_same(no_native, caplog) -> None:
    g = torch.Generator().manual_seed(4)
    weight, x = torch.randn(40, 64, generator=g), torch.randn(3, 64, generator=g)
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        got = {kind: QuantLinear.quantize(weight, kind)(x) for kind in ("int4", "int4-a8")}
    assert "native quantized kernels unavailable (SPECDECODE_NATIVE=0)" in caplog.text
    dense = QuantLinear.quantize(weight, "int4").dequantize()
    torch.testing.assert_close(got["int4"], x @ dense.T)
    torch.testing.assert_close(got["int4-a8"], round_activations(x) @ dense.T)
    assert not takes_native_path(tiny_model(0, dtype=torch.float32))


def test_portable_build_without_avx2_computes_the_same(monkeypatch, caplog) -> None:
    """The plain-C kernels a CPU without AVX2 gets: same numbers (to rounding), rows still independent."""
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(96, 576, generator=g), torch.randn(6, 576, generator=g)
    layers = {kind: QuantLinear.quantize(weight, kind) for kind in ("int4", "int8", "int4-a8", "int8-a8")}
    fast = {kind: layer(x) for kind, layer in layers.items()}
    monkeypatch.setenv("SPECDECODE_NATIVE", "portable")
    kernels.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="specdecode"):
            assert kernels.simd() == "scalar"
        assert "lacks AVX2" in caplog.text
        for kind, layer in layers.items():
            plain = layer(x)
            torch.testing.assert_close(plain, fast[kind], rtol=1e-5, atol=1e-4)
            assert torch.equal(plain[2:3], layer(x[2:3])), kind
        model = quantize_(tiny_model(0, dtype=torch.float32), "int4-a8")
        native, reference = forward_both_ways(model, monkeypatch)
        for got, expected in zip(native, reference, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    finally:
        kernels.reset()


def test_vnni_code_path_computes_what_the_avx2_path_does(monkeypatch, caplog) -> None:
    """The int8-activation kernels' VNNI path (vpdpbusd), built here with that instruction emulated: its integer sums
    are exact, so a VNNI machine gives bit for bit the AVX2 results; the build names itself in one log line."""
    if kernels.simd() == "scalar":
        pytest.skip("needs AVX2")
    g = torch.Generator().manual_seed(6)
    layers = {kind: QuantLinear.quantize(torch.randn(44, 576, generator=g), kind) for kind in ("int4-a8", "int8-a8")}
    x = torch.randn(7, 576, generator=g)
    fast = {kind: layer(x) for kind, layer in layers.items()}
    monkeypatch.setenv("SPECDECODE_NATIVE", "emulate-vnni")
    kernels.reset()
    try:
        with caplog.at_level(logging.INFO, logger="specdecode"):
            assert kernels.simd() == "avx2+vnni-emulated"
        assert "native kernels for this CPU: avx2+vnni-emulated (int8 dot products by vpdpbusd)" in caplog.text
        for kind, layer in layers.items():
            assert torch.equal(layer(x), fast[kind]), kind
            assert torch.equal(layer(x[3:4]), fast[kind][3:4]), kind
    finally:
        kernels.reset()


def test_kernels_build_once_per_machine_and_name_the_simd(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    kernels.reset()
    try:
        assert kernels.simd() in kernels.SIMD_NAMES.values()
        built = list((tmp_path / "kernels").glob("*.so"))
        assert len(built) == 1
        kernels.reset()
        kernels.native()
        assert list((tmp_path / "kernels").glob("*.so")) == built  # cached, not built again
    finally:
        kernels.reset()


# ------------------------------------------------------------------------------------ lossless
def quantized_pair(kind: str):
    target = quantize_(tiny_model(0, dtype=torch.float32), kind)
    draft = quantize_(tiny_model(1, dtype=torch.float32), kind)
    return target, draft


@pytest.mark.parametrize("kind", ["int4", "int8", "int4-a8", "int8-a8"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_over_a_quantized_target_equals_its_plain_decoding(kind, k) -> None:
    target, draft = quantized_pair(kind)
    params = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = generate_ids(target, prompt, max_new_tokens=40, params=params, k=0)[0]
    for proposer in (PromptLookupProposer(), PromptLookupProposer(branches=3),
                     DraftModelProposer(draft, target.config.vocab_size)):
        spec, stats = generate_ids(target, prompt, max_new_tokens=40, params=params, k=k, proposer=proposer)
        assert spec == plain, proposer.name
        assert stats.drafted > 0


def test_sampled_speculation_over_an_int4_target_follows_its_distribution() -> None:
    """Draft-model speculation at T=1 over an int4-a8 target (native kernels): 3,000 samples of the first 3 tokens
    against the int4 target's exact joint distribution (chi-square), as tests/test_distribution.py does."""
    target = quantize_(tiny_model(3, dtype=torch.float32, head_gain=3.0, vocab_size=V, num_layers=1,
                                  hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16),
                       "int4-a8")
    draft = quantize_(noisy_copy(tiny_model(3, dtype=torch.float32, head_gain=3.0, vocab_size=V, num_layers=1,
                                            hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                                            head_dim=16), seed=5, noise=0.3), "int4-a8")
    assert takes_native_path(target)
    params, samples = SamplingParams(temperature=1.0), 3000
    counts: Counter = Counter()
    accepted = 0
    for seed in range(samples):
        out, stats = generate_ids(target, PROMPT, proposer=DraftModelProposer(draft, V), k=4, max_new_tokens=3,
                                  params=params, seed=seed)
        counts[tuple(out)] += 1
        accepted += stats.accepted
    p_value, tv = chi_square(counts, exact_joint(target, PROMPT, params, 3), samples)
    assert accepted > 0
    assert p_value > ALPHA, (p_value, tv)


# ------------------------------------------------------------------------------- quantized self-speculation
@pytest.mark.parametrize("low_bit", ["int4-a8", "int8"])
def test_quantized_self_speculation_equals_plain_and_leaves_the_target_alone(low_bit) -> None:
    target = tiny_model(0, dtype=torch.float32)
    before = {name: t.clone() for name, t in target.state_dict().items()}
    proposer = QuantizedSelfProposer(target, kind=low_bit)
    assert isinstance(proposer.model.layers[0].attn.wqkv, QuantLinear)
    assert isinstance(target.layers[0].attn.wqkv, Linear)  # the copy replaced its own layers only
    params = SamplingParams(temperature=0.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = generate_ids(target, prompt, max_new_tokens=40, params=params, k=0)[0]
    for k in (1, 4):
        spec, stats = generate_ids(target, prompt, max_new_tokens=40, params=params, k=k, proposer=proposer)
        assert spec == plain
        assert stats.accepted > stats.drafted // 4  # far above chance (1 in 56): the copy tracks the target
    skipping = QuantizedSelfProposer(target, kind=low_bit, skipped=[1])
    assert generate_ids(target, prompt, max_new_tokens=40, params=params, k=3, proposer=skipping)[0] == plain
    assert all(torch.equal(t, before[name]) for name, t in target.state_dict().items())


def test_quantized_self_speculation_refuses_a_target_of_the_same_precision() -> None:
    target = quantize_(tiny_model(0, dtype=torch.float32), "int4-a8")
    with pytest.raises(ValueError, match="already runs int4-a8.*higher precision"):
        QuantizedSelfProposer(target, kind="int4-a8")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        QuantizedSelfProposer(tiny_model(0, dtype=torch.float32), kind="int3")


@pytest.mark.parametrize("build", ["", "portable"], ids=["vector", "portable"])
def test_kernel_argmax_is_numpys_first_maximum(build, monkeypatch) -> None:
    """The native kernel reads each row's greedy token with its logits (specdecode_argmax): the index NumPy's and
    torch's argmax give, first of equal maxima, a NaN counting as the maximum; rows of every length around the vector
    width and the vocabulary's, ties, NaNs, infinities, signed zeros; the vector build and the portable one."""
    if build:
        monkeypatch.setenv("SPECDECODE_NATIVE", build)
    kernels.reset()
    try:
        lib = kernels.native()
        assert lib is not None, "the native kernels must build on CI machines"
        rng = np.random.default_rng(0)
        for trial in range(600):
            n = int(rng.integers(1, 70)) if trial % 2 else 49152 + int(rng.integers(0, 9))
            row = rng.standard_normal(n).astype(np.float32)
            case = trial % 6
            if case == 1:
                row = np.round(row).astype(np.float32)  # ties
            elif case == 2:
                row[rng.integers(0, n, 3)] = np.nan
            elif case == 3:
                row[:] = -np.inf
            elif case == 4:
                row[rng.integers(0, n, 2)] = np.inf
            elif case == 5:
                row[:] = 0.0
                row[rng.integers(0, n, 2)] = -0.0
            expected = int(np.argmax(row))
            assert expected == int(torch.argmax(torch.from_numpy(row)))
            assert lib.specdecode_argmax(row.ctypes.data, n) == expected, (trial, n, case)
    finally:
        kernels.reset()


def test_greedy_steps_take_the_kernels_argmax_where_nothing_processes_the_logits(monkeypatch) -> None:
    """A native forward returns each row's greedy token with the logits, and verification takes it (no argmax over
    the logits in Python); where the logits are processed (a bias), the processed ones decide. Outputs are the ones
    the logits' own argmax gives."""
    import specdecode.core.verify as verify_module

    target = quantize_(tiny_model(3, dtype=torch.float32, vocab_size=56), "int8-a8")
    if kernels.native() is None:
        pytest.skip("native kernels unavailable")
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    cache = target.new_cache(32)
    out = target.forward(torch.tensor([prompt]), cache)
    assert out.greedy == out.logits[0].argmax(dim=-1).tolist()
    reference, _ = generate_ids(target, prompt, max_new_tokens=12, k=0)
    calls = []
    monkeypatch.setattr(verify_module, "greedy_tokens",
                        lambda logits: calls.append(1) or logits.argmax(dim=-1).tolist())
    for proposer, k in ((None, 0), (PromptLookupProposer(), 3)):
        out, _ = generate_ids(target, prompt, max_new_tokens=12, k=k, proposer=proposer)
        assert out == reference
    assert calls == []
    biased = SamplingParams(logit_bias=((reference[0], -100.0),))
    out, _ = generate_ids(target, prompt, max_new_tokens=3, k=0, params=biased)
    assert out[0] != reference[0] and len(calls) > 0
