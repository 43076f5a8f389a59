"""The int8 KV cache (`kv_cache_dtype="int8"`): what a row stores, how the native attention reads it, and that
speculation stays lossless with it (greedy equal to plain decoding, sampling exactly the target's distribution).

A row (one token's key or value for one kv head) is quantized once, when written: its values q_e = round(x_e / s) in
-127..127 with s = max |x| / 127, then s as float32 in the row's last 4 bytes. The attention applies each key's scale
to its dot product and each value row's scale to its weight, in the same order in every path, so a query's numbers
never depend on how many tokens share its forward (a tree verifies what one-token steps compute).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdecode import kernels
from specdecode.core.tree import DraftTree
from specdecode.engine.loop import generate_ids
from specdecode.models import BatchKVCache
from specdecode.models.cache import KVCache, read_rows, row_width, store_rows
from specdecode.models.paged import BlockPool

from .helpers import noisy_copy, tiny_model
from .test_distribution import CASES, PROMPT, V, chi_square, exact_joint
from .test_kv_cache import attention, attention_rows, lib  # noqa: F401 - lib: the fixture (native, portable)
from .test_lossless import METHODS, NEW, PROMPTS, VOCAB


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


def quantized_cache(g: torch.Generator, kv_heads: int, length: int, hd: int) -> torch.Tensor:
    """[2, kv_heads, length, row] int8 rows of random keys and values (one row of zeros: scale 0)."""
    x = torch.randn(2, kv_heads, length, hd, generator=g) * 2
    x[:, 0, 3] = 0
    return store_rows(x, torch.int8)


@pytest.mark.parametrize("hd", [16, 64, 128])
@pytest.mark.parametrize("n", [1, 5])
def test_native_attention_over_int8_rows(lib, hd: int, n: int) -> None:  # noqa: F811 - the fixture
    """softmax(q k^T * scale) v over the rows' numbers (q * s), each query head quantized as a row is (its products
    with the keys exact integers), within float32 rounding, the cache ending inside a group of 8 keys; a tree's root
    computes what a one-token step computes, bit for bit."""
    g = torch.Generator().manual_seed(hd + n)
    kv_heads, heads, max_len, start = 2, 4, 45, 37
    cache = quantized_cache(g, kv_heads, max_len, hd)
    q = torch.randn(n, heads * hd, generator=g)
    mask = None if n == 1 else torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                             [1, 0, 1, 0, 1]], dtype=torch.uint8)
    got = attention(lib, q, cache, start, n, mask, hd)
    wide = read_rows(cache, hd, torch.float64)
    for i in range(n):
        seen = list(range(start)) + [start + j for j in range(n) if (mask is None or mask[i, j])]
        keys, values = wide[0][:, seen], wide[1][:, seen]
        qi = read_rows(store_rows(q[i].view(heads, hd), torch.int8), hd, torch.float64)  # quantized as a row is
        weights = torch.softmax(torch.einsum("hd,hkd->hk", qi, keys.repeat_interleave(2, 0)) * hd**-0.5, -1)
        expected = torch.einsum("hk,hkd->hd", weights, values.repeat_interleave(2, 0)).reshape(-1)
        torch.testing.assert_close(got[i].double(), expected, rtol=1e-5, atol=1e-5)
    if mask is not None:
        assert torch.equal(attention(lib, q[:1].contiguous(), cache, start, 1, None, hd)[0], got[0])


@pytest.mark.parametrize(("hd", "heads_per_kv"), [(64, 3), (128, 4)])
def test_long_int8_cache_steps_trees_and_pages_compute_what_a_prefill_computes(lib, hd, heads_per_kv) -> None:  # noqa: F811
    """Steps and trees over a long cache take the shared passes (keys widened, their scales kept aside), a prefill
    a task per (kv head, token): the same bits either way, at any thread count, and through a block table."""
    g = torch.Generator().manual_seed(hd)
    kv_heads, start, n, block = 2, 300, 400, 64
    cache = quantized_cache(g, kv_heads, start + n + 2, hd)
    q = torch.randn(n, heads_per_kv * kv_heads * hd, generator=g)
    prefill = attention_rows(lib, q, cache, start, n, None, heads_per_kv, None, 0, hd)
    threads = torch.get_num_threads()
    try:
        for i, count in ((212, 1), (331, 3), (n - 1, 2)):
            torch.set_num_threads(count)
            step = attention_rows(lib, q[i : i + 1].contiguous(), cache, start + i, 1, None, heads_per_kv, None, 0,
                                  hd)
            assert torch.equal(step[0], prefill[i]), (i, count)
    finally:
        torch.set_num_threads(threads)
    last = start + n - 1
    tree_q = torch.cat([q[-1:], torch.randn(2, q.shape[1], generator=g)])
    root_only = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.uint8)
    tree = attention_rows(lib, tree_q, cache, last, 3, root_only, heads_per_kv, None, 0, hd)
    assert torch.equal(tree[0], prefill[-1])
    n_blocks, width = (last + 3 + block - 1) // block, cache.shape[-1]
    order = torch.randperm(n_blocks, generator=g)
    pool = torch.zeros(2, n_blocks, kv_heads, block, width, dtype=torch.int8)
    padded = torch.zeros(2, kv_heads, n_blocks * block, width, dtype=torch.int8)
    padded[:, :, : last + 3] = cache[:, :, : last + 3]
    pool[:, order] = padded.view(2, kv_heads, n_blocks, block, width).transpose(1, 2)
    assert torch.equal(attention_rows(lib, tree_q, pool, last, 3, root_only, heads_per_kv, order.int(), block, hd),
                       tree)


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


@pytest.mark.parametrize("in_batch_row", [False, True], ids=["own-cache", "engine-batch-row"])
def test_int8_tree_verifies_bit_for_bit_what_single_steps_compute(in_batch_row: bool) -> None:
    if kernels.native() is None:
        pytest.skip("native kernels unavailable")
    model = tiny_model(4, dtype=torch.float32, head_dim=64, num_layers=3)
    model.kv_cache_dtype = "int8"
    cfg = model.config
    prefix = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(7)).tolist()
    tree = DraftTree.from_paths(prefix[-1], [[5, 6, 7, 8, 9], [5, 6, 9], [5, 10], [11, 12]])
    cache: KVCache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, batch_size=2,
                                  dtype=torch.int8).row(1) if in_batch_row else model.new_cache(64)
    assert cache.kv.dtype == torch.int8
    model.forward(torch.tensor([prefix[:-1]]), cache, logits_at=None)
    start = cache.length
    tree_logits = model.forward(torch.tensor([tree.tokens]), cache, positions=start + tree.depths(),
                                tree_mask=tree.attention_mask()).logits[0]
    for node in range(len(tree)):
        path, i = [], node
        while i > 0:
            path.append(tree.tokens[i])
            i = tree.parents[i]
        cache.rollback(start)
        for token in [prefix[-1], *path[::-1]]:
            step = model.forward(torch.tensor([[token]]), cache).logits[0, -1]
        assert torch.equal(step, tree_logits[node]), f"node {node}"


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


@pytest.fixture(scope="module")
def models():
    model = tiny_model(0, dtype=torch.float32, vocab_size=VOCAB)
    model.kv_cache_dtype = "int8"
    draft = noisy_copy(model, seed=1, noise=0.05)
    return model, draft


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculation_equals_plain_decoding_with_an_int8_cache(models, method: str) -> None:
    target, draft = models
    assert target.kv_dtype == torch.int8
    proposer = METHODS[method](target, draft)
    drafted = accepted = 0
    for prompt in PROMPTS:
        expected, _ = generate_ids(target, prompt, max_new_tokens=NEW)
        out, stats = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


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
