"""The float16 KV cache (a float32 model's default): what it stores, how the native attention reads it, and that
greedy speculation stays equal to plain decoding with it.

A key or value is rounded to float16 once, when written; every reader widens it back, which is exact. So the native
attention over a float16 cache computes bit for bit what it computes over a float32 cache holding the same rounded
numbers, and a token's numbers still never depend on how many tokens share its forward.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from specdecode import kernels
from specdecode.core.tree import DraftTree
from specdecode.engine.loop import generate_ids
from specdecode.models import BatchKVCache
from specdecode.models.cache import KV_KINDS, KVCache, kv_dtype, read_rows, store_rows

from .helpers import assert_tree_matches_steps, noisy_copy, tiny_model
from .test_lossless import METHODS, NEW, PROMPTS, VOCAB


def test_cache_dtype_follows_the_model_and_the_option() -> None:
    assert kv_dtype(torch.float32) == torch.float16  # the default: half the memory
    assert kv_dtype(torch.float32, "float32") == torch.float32
    assert kv_dtype(torch.float32, "int8") == torch.int8
    assert kv_dtype(torch.float64) == torch.float64  # the tiny test models keep theirs
    assert kv_dtype(torch.bfloat16, "float16") == torch.bfloat16
    assert kv_dtype(torch.float64, "int8") == torch.float64
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float16, float32, int8, got 'int4'"):
        kv_dtype(torch.float32, "int4")
    model = tiny_model(0, dtype=torch.float32)
    assert model.new_cache(8).kv.dtype == torch.float16
    model.kv_cache_dtype = "float32"
    assert model.new_cache(8).kv.dtype == torch.float32
    assert tiny_model(0).new_cache(8).kv.dtype == torch.float64


def attention(lib, q: torch.Tensor, kv: torch.Tensor, start: int, n: int, mask: torch.Tensor | None,
              hd: int | None = None, full_mask: torch.Tensor | None = None) -> torch.Tensor:
    """block.c's attention of q [n, heads * hd] over kv [2, kv_heads, max_len, row] (float32, float16, or int8 rows
    of hd values and a scale); full_mask [n, start + n] (uint8) where given."""
    hd = hd or kv.shape[3]
    heads = q.shape[1] // hd
    out = torch.empty_like(q)
    failed = lib.specdecode_attention(q.data_ptr(), q.shape[1], out.data_ptr(), out.shape[1], kv[0].data_ptr(),
                                      kv[1].data_ptr(), kv.shape[2], start, n,
                                      None if mask is None else mask.data_ptr(),
                                      None if full_mask is None else full_mask.data_ptr(), heads, kv.shape[1], hd,
                                      hd**-0.5, KV_KINDS[kv.dtype])
    assert failed == 0
    return out


def random_cache(g: torch.Generator, kv_heads: int, length: int, hd: int, kv: str) -> torch.Tensor:
    """[2, kv_heads, length, row]: random keys and values as a float16 or int8 cache stores them (int8: one row of
    zeros among them, whose scale is 0)."""
    x = torch.randn(2, kv_heads, length, hd, generator=g) * 2
    if kv == "float16":
        return x.half()
    x[:, 0, 3] = 0
    return store_rows(x, torch.int8)


def expected_attention(q_heads: torch.Tensor, cache: torch.Tensor, seen: list[int], hd: int) -> torch.Tensor:
    """softmax(q k^T * hd^-0.5) v in float64 over the stored numbers of keys `seen` (q_heads [heads, hd], each group
    of heads meeting its kv head's; over int8 keys the query quantized as a row is, as the kernel quantizes it)."""
    wide = read_rows(cache, hd, torch.float64)
    keys, values = wide[0][:, seen], wide[1][:, seen]
    group = q_heads.shape[0] // keys.shape[0]
    q = read_rows(store_rows(q_heads, torch.int8), hd, torch.float64) if cache.dtype == torch.int8 else q_heads.double()
    weights = torch.softmax(torch.einsum("hd,hkd->hk", q, keys.repeat_interleave(group, 0)) * hd**-0.5, -1)
    return torch.einsum("hk,hkd->hd", weights, values.repeat_interleave(group, 0)).reshape(-1)


@pytest.mark.parametrize("hd", [16, 64, 128, 256])  # plain loops, values weighed 64 / 128 / 2 x 128 at a time
@pytest.mark.parametrize("n", [1, 5])
def test_native_attention_reads_float16_exactly(lib, hd: int, n: int) -> None:
    """Over a float16 cache the kernel computes bit for bit what it computes over float32 holding the same numbers
    (the cache ends inside a group of 8 keys: the padded group too); a tree's query computes what it computes alone."""
    g = torch.Generator().manual_seed(hd + n)
    kv_heads, heads, max_len, start = 2, 4, 45, 37
    half = (torch.randn(2, kv_heads, max_len, hd, generator=g) * 2).half()
    q = torch.randn(n, heads * hd, generator=g)
    mask = None if n == 1 else torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                             [1, 0, 1, 0, 1]], dtype=torch.uint8)
    got = attention(lib, q, half, start, n, mask)
    assert torch.equal(got, attention(lib, q, half.float(), start, n, mask))
    for i in range(n):  # the reference: softmax(q k^T * scale) v in float64 over the widened numbers
        seen = list(range(start)) + [start + j for j in range(n) if (mask is None or mask[i, j])]
        torch.testing.assert_close(got[i].double(), expected_attention(q[i].view(heads, hd), half, seen, hd),
                                   rtol=1e-5, atol=1e-5)
    if mask is not None:  # the tree's root alone (a one-token step) sees the same keys: the same bits
        assert torch.equal(attention(lib, q[:1].contiguous(), half, start, 1, None)[0], got[0])


def attention_rows(lib, q: torch.Tensor, kv: torch.Tensor, start: int, n: int, mask: torch.Tensor | None,
                   heads_per_kv: int, table: torch.Tensor | None, block: int, hd: int | None = None) -> torch.Tensor:
    """block.c's call of the attention: kv [2, kv_heads, max_len, row] contiguous (table None), or blocks
    [2, n_blocks, kv_heads, block, row] read through the table (rows of hd values: int8's with a scale)."""
    hd, kv_heads = hd or kv.shape[-1], kv.shape[-3] if table is not None else kv.shape[1]
    lib.specdecode_attention_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                              ctypes.c_void_p, ctypes.c_int64]
    out = torch.empty_like(q)
    failed = lib.specdecode_attention_rows(
        q.data_ptr(), q.shape[1], out.data_ptr(), out.shape[1], kv[0].data_ptr(), kv[1].data_ptr(),
        block if table is not None else kv.shape[2], start, n, None if mask is None else mask.data_ptr(), None,
        heads_per_kv * kv_heads, kv_heads, hd, hd**-0.5, KV_KINDS[kv.dtype],
        None if table is None else table.data_ptr(), kv_heads * block * kv.shape[-1])
    assert failed == 0
    return out


@pytest.mark.parametrize("kv", ["float16", "int8"])
@pytest.mark.parametrize(("hd", "heads_per_kv"), [(64, 3), (96, 1), (128, 4), (256, 5)])
def test_long_cache_steps_and_trees_compute_what_a_prefill_computes(lib, hd: int, heads_per_kv: int, kv: str) -> None:
    """Over a long cache, one-token steps and small trees take the shared passes (keys scored in ranges, weights by
    query and head, value sums by element slice, shared out among the threads), a prefill's many queries a task per
    (kv head, token): a query gets the same bits either way, whatever the thread count and whether the rows are read
    through a block table; and softmax(q k^T) v within float32 rounding. float16 and int8 rows alike."""
    g = torch.Generator().manual_seed(hd + heads_per_kv)
    kv_heads, start, n, block = 2, 300, 400, 64  # the prefill's last queries see 512+ keys: steps there share
    cache = random_cache(g, kv_heads, start + n + 2, hd, kv)
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
    last = start + n - 1  # a tree on the last query: its root sees what the step sees
    tree_q = torch.cat([q[-1:], torch.randn(2, q.shape[1], generator=g)])
    root_only = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.uint8)
    tree = attention_rows(lib, tree_q, cache, last, 3, root_only, heads_per_kv, None, 0, hd)
    assert torch.equal(tree[0], prefill[-1])
    n_blocks, width = (last + 3 + block - 1) // block, cache.shape[-1]
    order = torch.randperm(n_blocks, generator=g)  # block i of the sequence at order[i] of the pool
    pool = torch.zeros(2, n_blocks, kv_heads, block, width, dtype=cache.dtype)
    padded = torch.zeros(2, kv_heads, n_blocks * block, width, dtype=cache.dtype)
    padded[:, :, : last + 3] = cache[:, :, : last + 3]
    pool[:, order] = padded.view(2, kv_heads, n_blocks, block, width).transpose(1, 2)
    paged = attention_rows(lib, tree_q, pool, last, 3, root_only, heads_per_kv, order.int(), block, hd)
    assert torch.equal(paged, tree)
    torch.testing.assert_close(prefill[-1].double(), expected_attention(q[-1].view(-1, hd), cache,
                                                                        list(range(last + 1)), hd),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["float32", "float16", "int8"])
@pytest.mark.parametrize("hd", [64, 96])
@pytest.mark.parametrize("start", [250, 764])  # paths cross a chunk's edge (256, 768): the verify and shared passes
@pytest.mark.parametrize("window", [None, 600])
def test_tree_queries_cut_their_value_sums_where_single_steps_do(lib, kv: str, hd: int, start: int,
                                                                 window: int | None) -> None:
    """Value sums run over chunks of a query's visible keys (by rank), added in order: a tree's node, whose path
    lies elsewhere in the cache than one-token steps put it, sums the same keys in the same chunks, bit for bit, also
    where a chunk's edge falls inside the path and where a sliding window (a full mask) hides the oldest keys."""
    g = torch.Generator().manual_seed(start + hd)
    kv_heads, heads_per_kv = 2, 3
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 2, 8, 0]  # a chain of depth 7, a branch from node 2, a sibling of node 1
    n = len(parents)
    cache = random_cache(g, kv_heads, start + n + 8, hd, "float16" if kv == "float32" else kv)
    cache = cache.float() if kv == "float32" else cache
    q = torch.randn(n, heads_per_kv * kv_heads * hd, generator=g)
    paths = []
    for i in range(n):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    mask = torch.zeros(n, n, dtype=torch.uint8)
    for i, path in enumerate(paths):
        mask[i, path] = 1

    def windowed(positions: torch.Tensor, key_positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor | None:
        if window is None:
            return None
        return (seen.bool() & (key_positions[None, :] > positions[:, None] - window)).to(torch.uint8).contiguous()

    depth = torch.tensor([len(p) - 1 for p in paths])
    full = windowed(start + depth, torch.cat([torch.arange(start), start + depth]),
                    torch.cat([torch.ones(n, start, dtype=torch.uint8), mask], 1))
    tree = attention(lib, q, cache, start, n, None if full is not None else mask.contiguous(), hd, full)
    for i, path in enumerate(paths):
        steps = cache.clone()  # the path's keys and values where one-token steps write them
        steps[:, :, start : start + len(path)] = cache[:, :, [start + node for node in path]]
        at = start + len(path) - 1
        full_i = windowed(torch.tensor([at]), torch.arange(at + 1), torch.ones(1, at + 1, dtype=torch.uint8))
        step = attention(lib, q[i : i + 1].contiguous(), steps, at, 1, None, hd, full_i)
        assert torch.equal(step[0], tree[i]), i


def test_keys_and_values_are_rounded_once_as_pytorch_rounds_them(lib, monkeypatch) -> None:
    """The first layer's stored keys and values (its inputs the same whatever the cache) are the float32 cache's
    rounded to nearest even by PyTorch, in the native blocks and in the PyTorch ones alike."""
    model = tiny_model(0, dtype=torch.float32, head_dim=64, num_heads=2, num_kv_heads=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    stored = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(type(model), "_native_blocks", lambda *a: None)
        for name in ("float16", "float32"):
            model.kv_cache_dtype = name
            cache = model.new_cache(16)
            model.forward(ids, cache)
            stored[native, name] = cache.kv[0, :, :, :, :11]
    for native in (True, False):
        assert stored[native, "float16"].dtype == torch.float16
        assert torch.equal(stored[native, "float16"], stored[native, "float32"].half())
    torch.testing.assert_close(stored[True, "float32"], stored[False, "float32"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["float16", "int8"])
@pytest.mark.parametrize("in_batch_row", [False, True], ids=["own-cache", "engine-batch-row"])
def test_tree_verifies_bit_for_bit_what_single_steps_compute(in_batch_row: bool, kv: str) -> None:
    """Lossless verification rests on it, with each cache type: a tree's node gets the logits one-token steps along
    its path get."""
    if kernels.native() is None:
        pytest.skip("native kernels unavailable")
    model = tiny_model(4, dtype=torch.float32, head_dim=64, num_layers=3)
    model.kv_cache_dtype = kv
    cfg = model.config
    prefix = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(7)).tolist()
    tree = DraftTree.from_paths(prefix[-1], [[5, 6, 7, 8, 9], [5, 6, 9], [5, 10], [11, 12]])
    cache: KVCache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, batch_size=2,
                                  dtype=model.kv_dtype).row(1) if in_batch_row else model.new_cache(64)
    assert cache.kv.dtype == getattr(torch, kv)
    assert_tree_matches_steps(model, cache, prefix, tree)


def test_float16_cache_stays_within_float16_rounding_of_float32() -> None:
    """Logits over a float16 cache against a float32 cache: each key and value moves by at most half a float16 step
    (2^-11 of itself), so each attention output by about that much of the values' size, carried through the layers
    to the logits; the bound is 2^-11 of the logits' range times 8 (two layers, keys and values, the softmax's
    sensitivity), and the two caches must differ (the float16 cache is really in use)."""
    model = tiny_model(3, dtype=torch.float32, head_dim=64)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    half = model.forward(ids, model.new_cache(40)).logits
    model.kv_cache_dtype = "float32"
    full = model.forward(ids, model.new_cache(40)).logits
    bound = 8 * 2**-11 * (full.max() - full.min()).item()
    assert 0 < (half - full).abs().max().item() <= bound


@pytest.fixture(scope="module", params=["float16", "int8"])
def models(request):
    """A float32 target (its cache float16, the default, or int8) and a draft that mostly agrees with it (copied
    before any forward, its cache the same type)."""
    model = tiny_model(0, dtype=torch.float32, vocab_size=VOCAB)
    model.kv_cache_dtype = request.param
    assert model.kv_dtype == getattr(torch, request.param)
    return model, noisy_copy(model, seed=1, noise=0.05)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculation_equals_plain_decoding_with_each_cache_type(models, method: str) -> None:
    """test_lossless's methods on a float32 target with the float16 or the int8 cache: every prompt's output equals
    plain decoding's with the same cache type."""
    target32, draft = models
    proposer = METHODS[method](target32, draft)
    drafted = accepted = 0
    for prompt in PROMPTS:
        expected, _ = generate_ids(target32, prompt, max_new_tokens=NEW)
        out, stats = generate_ids(target32, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


def test_without_kernels_the_float16_cache_computes_what_the_kernels_compute(monkeypatch) -> None:
    """The PyTorch path (no kernels: another CPU's fallback, and the GPU's) stores float16 and widens it for SDPA:
    stored keys within one float16 step of the kernels' (a last-bit difference before rounding may cross a step),
    logits within float16's rounding bound (test above)."""
    model = tiny_model(3, dtype=torch.float32, head_dim=64)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(8))
    runs = []
    for build in ("1", "0"):
        monkeypatch.setenv("SPECDECODE_NATIVE", build)
        kernels.reset()
        cache = model.new_cache(30)
        runs.append((model.forward(ids, cache).logits, cache.kv[0, :, :, :, :30].float()))
    kernels.reset()
    (native, stored), (torch_path, torch_stored) = runs
    assert model.new_cache(1).kv.dtype == torch.float16
    torch.testing.assert_close(torch_stored, stored, rtol=2**-10, atol=2**-24)
    bound = 8 * 2**-11 * (native.max() - native.min()).item()
    assert (torch_path - native).abs().max().item() <= bound


def test_a_bad_cache_dtype_is_refused_before_loading() -> None:
    import specdecode

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float16, float32, int8, got 'int4'"):
        specdecode.load("no-such-model", kv_cache_dtype="int4")


@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench", "--out"]], ids=["generate", "bench"])
def test_the_command_line_passes_the_cache_dtype_to_the_model(argv, monkeypatch, tmp_path) -> None:
    from specdecode.api import LLM
    from specdecode.cli import commands as cli
    from specdecode.server import replica

    seen: list[str] = []

    def load(name, **options):
        seen.append(options["kv_cache_dtype"])
        raise RuntimeError("loaded: stop here")

    monkeypatch.setattr(LLM, "load", load)
    for flag in ([], ["--kv-cache-dtype", "float32"]):
        try:
            out = [str(tmp_path)] if argv[-1] == "--out" else []
            cli.main([*argv, *out, "--model", "smollm2-135m-instruct", *flag])  # (LLM.load stops before loading)
        except RuntimeError:
            pass
    assert seen == ["float16", "float32"]
    with pytest.raises(RuntimeError, match="stop here"):
        replica.build({"model": "no-such-model", "kv_cache_dtype": "float32"})
    assert seen[-1] == "float32"
    with pytest.raises(SystemExit):
        cli.build_parser("generate").parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])
