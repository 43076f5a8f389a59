"""The int8 KV cache (`kv_cache_dtype="int8"`): what a row stores, how the native attention reads it, and that
speculation stays lossless with it (sampling exactly the target's distribution, the real model's greedy output).
test_kv_cache.py runs its float16 tests on int8 rows too: long caches' steps, trees and block tables bit for bit,
trees against one-token steps, greedy speculation equal to plain decoding for every method.

A row (one token's key or value for one kv head) is quantized once, when written: its values q_e = round(x_e / s) in
-127..127 with s = max |x| / 127, then s as float32 in the row's last 4 bytes. The attention quantizes each query head
the same way, so a score is an exact integer dot product times the two scales, and weighs each value row by p * s:
the same operations in every path, so a query's numbers never depend on how many tokens share its forward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdecode import kernels
from specdecode.engine.loop import generate_ids
from specdecode.models.cache import read_rows, row_width, store_rows
from specdecode.models.paged import BlockPool

from .helpers import noisy_copy, tiny_model
from .test_distribution import CASES, PROMPT, V, chi_square, exact_joint
from .test_kv_cache import attention, expected_attention, random_cache
from .test_lossless import VOCAB


def test_a_row_holds_its_values_and_scale() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0, 0.3, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    stored = store_rows(x, torch.int8)
    assert stored.dtype == torch.int8 and stored.shape == (2, row_width(5, torch.int8)) == (2, 12)
    scale = stored[:, -4:].contiguous().view(torch.float32)[:, 0]
    assert scale.tolist() == [pytest.approx(1.27 / 127), 0.0]
    assert stored[0, :5].tolist() == [50, -127, 0, 30, 100]  # x / scale rounded
    assert stored[0, 5:8].tolist() == [0, 0, 0]  # padding to a multiple of 4
    assert stored[1].tolist() == [0] * 12  # a row of zeros: scale 0, values 0 (no division by zero)
    back = read_rows(stored, 5, torch.float32)
    assert back.shape == x.shape and (back - x).abs().max() <= 1.27 / 127 / 2 + 1e-7
    assert torch.equal(read_rows(x.half(), 5, torch.float32), x.half().float())  # other dtypes: widened
    assert row_width(64, torch.int8) == 68 and row_width(64, torch.float16) == 64


def test_rounding_is_to_nearest_even() -> None:
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.5]])  # scale exactly 1: the halves round to even
    assert store_rows(x, torch.int8)[0, :5].tolist() == [127, 2, -2, 4, 0]


def test_the_cache_is_a_quarter_of_float32_and_a_scale() -> None:
    model = tiny_model(0, dtype=torch.float32, head_dim=64)
    model.kv_cache_dtype = "int8"
    cache = model.new_cache(32)
    assert cache.kv.dtype == torch.int8 and cache.kv.shape[-1] == 68
    cfg = model.config
    half = BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, 64, 16, torch.float16)
    assert BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, 64, 16, torch.int8) / half == 68 / 128


@pytest.mark.parametrize("hd", [16, 64, 128])
@pytest.mark.parametrize("n", [1, 5])
def test_native_attention_over_int8_rows(lib, hd: int, n: int) -> None:  # noqa: F811 - the fixture
    """softmax(q k^T * scale) v over the rows' numbers (q * s), each query head quantized as a row is (its products
    with the keys exact integers), within float32 rounding, the cache ending inside a group of 8 keys; a tree's root
    computes what a one-token step computes, bit for bit."""
    g = torch.Generator().manual_seed(hd + n)
    kv_heads, heads, max_len, start = 2, 4, 45, 37
    cache = random_cache(g, kv_heads, max_len, hd, "int8")
    q = torch.randn(n, heads * hd, generator=g)
    mask = None if n == 1 else torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                             [1, 0, 1, 0, 1]], dtype=torch.uint8)
    got = attention(lib, q, cache, start, n, mask, hd)
    for i in range(n):
        seen = list(range(start)) + [start + j for j in range(n) if (mask is None or mask[i, j])]
        torch.testing.assert_close(got[i].double(), expected_attention(q[i].view(heads, hd), cache, seen, hd),
                                   rtol=1e-5, atol=1e-5)
    if mask is not None:
        assert torch.equal(attention(lib, q[:1].contiguous(), cache, start, 1, None, hd)[0], got[0])


def test_native_blocks_store_what_store_rows_computes(lib, monkeypatch) -> None:  # noqa: F811
    """The first layer's stored rows, written by the native blocks (kernels/block.c's store_kv), are the bits
    store_rows makes of the float32 cache's rows."""
    model = tiny_model(0, dtype=torch.float32, head_dim=64, num_heads=2, num_kv_heads=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    stored = {}
    for name in ("int8", "float32"):
        model.kv_cache_dtype = name
        cache = model.new_cache(16)
        model.forward(ids, cache)
        stored[name] = cache.kv[0, :, :, :, :11]
    assert torch.equal(stored["int8"], store_rows(stored["float32"], torch.int8))


def logits_by_cache(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("int8", "float16", "float32"):
        model.kv_cache_dtype = name
        out[name] = model.forward(ids, model.new_cache(ids.shape[1])).logits
    return out


def test_int8_cache_stays_within_its_rounding_of_float32() -> None:
    """Each stored number moves by at most half a step, 1/254 of its row's largest: 16x float16's 2^-11 bound of
    the test beside (test_kv_cache), and the int8 logits must differ from float16's (the int8 cache is in use)."""
    model = tiny_model(3, dtype=torch.float32, head_dim=64)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    logits = logits_by_cache(model, ids)
    full = logits["float32"]
    bound = 8 * (1 / 254) * (full.max() - full.min()).item()
    assert 0 < (logits["int8"] - full).abs().max().item() <= bound
    assert not torch.equal(logits["int8"], logits["float16"])


def test_without_kernels_the_int8_cache_computes_what_the_kernels_compute(monkeypatch) -> None:
    """The PyTorch path (no kernels; the GPU's) stores the same kind of rows and reads q * s for SDPA: logits within
    the int8 rounding bound of the kernels'."""
    model = tiny_model(3, dtype=torch.float32, head_dim=64)
    model.kv_cache_dtype = "int8"
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(8))
    runs = []
    for build in ("1", "0"):
        monkeypatch.setenv("SPECDECODE_NATIVE", build)
        kernels.reset()
        cache = model.new_cache(30)
        runs.append(model.forward(ids, cache).logits)
        assert cache.kv.dtype == torch.int8
    kernels.reset()
    native, torch_path = runs
    bound = 8 * (1 / 254) * (native.max() - native.min()).item()
    assert (torch_path - native).abs().max().item() <= bound


@pytest.mark.parametrize("name", ["draft", "prompt-lookup-tree"])
def test_sampling_with_an_int8_cache_follows_the_target_exactly(name: str) -> None:
    """test_distribution's chi-square test on a float32 target whose cache is int8 (the draft's too): the joint of
    the first tokens, enumerated with full forwards over int8 caches, is what speculative sampling draws."""
    target = tiny_model(3, torch.float32, head_gain=3.0, vocab_size=V, num_layers=1, hidden_size=32,
                        intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)
    target.kv_cache_dtype = "int8"
    draft = noisy_copy(target, seed=5, noise=0.3)
    case = CASES[name]
    joint = exact_joint(target, PROMPT, case.params, case.tokens)
    proposer = case.proposer(target, draft)
    counts: Counter = Counter()
    accepted = drafted = 0
    for seed in range(case.samples):
        out, stats = generate_ids(target, PROMPT, proposer=proposer, k=4, max_new_tokens=case.tokens,
                                  params=case.params, seed=seed)
        counts[tuple(out)] += 1
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert 0 < accepted < drafted
    pvalue, tv = chi_square(counts, joint, case.samples)
    assert pvalue > 1e-4 and tv < 0.1, (pvalue, tv)


@pytest.mark.real_model
@pytest.mark.parametrize("method,options", [("prompt-lookup", {"k": 8, "branches": 3}), ("suffix", {"k": 6})])
def test_real_model_greedy_speculation_equals_plain_decoding_with_an_int8_cache(method, options) -> None:
    """SmolLM2 (its Q4_1 weights, int8 activations) with the int8 cache, on Spec-Bench prompts: every method's greedy
    text is plain decoding's with the same cache."""
    import specdecode

    from .real_model import require_smollm2, spec_bench_prompts

    require_smollm2()
    llm = specdecode.load("smollm2-135m-instruct", kv_cache_dtype="int8")
    assert llm.model.kv_dtype == torch.int8
    drafted = accepted = 0
    for prompt in spec_bench_prompts(4):
        plain = llm.generate(prompt, method="none", chat=True, max_new_tokens=40)
        spec = llm.generate(prompt, chat=True, max_new_tokens=40, method=method, **options)
        assert spec.token_ids == plain.token_ids, prompt
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert 0 < accepted < drafted
