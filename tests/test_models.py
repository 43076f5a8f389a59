"""The Transformer itself: parity with transformers, tree attention, incremental decoding, outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.core.tree import DraftTree
from specdecode.models import ModelConfig, load_transformer

from .helpers import save_hf_checkpoint, tiny_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def hf_logits(path: Path, ids: torch.Tensor, **kwargs):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return reference(ids, **kwargs)


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {}),
    ("mistral", {"sliding_window": 7}),  # the 48-token test sequence runs far past the window
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {"rope_parameters": LLAMA3_ROPE}),
    ("llama", {"rope_parameters": LINEAR_ROPE}),
    ("llama", {"num_key_value_heads": 4}),  # plain multi-head attention (no GQA)
], ids=["llama", "qwen2", "mistral", "mistral-window", "llama-tied", "qwen2-tied", "llama3-rope", "linear-rope", "mha"])
def test_logits_match_transformers(tmp_path: Path, model_type: str, overrides: dict) -> None:
    save_hf_checkpoint(tmp_path, model_type, seed=1, **overrides)
    ours = load_transformer(tmp_path)
    # the architecture against transformers' float32 in a float32 cache (test_kv_cache.py bounds float16's)
    ours.kv_cache_dtype = "float32"
    cfg = ours.config
    assert cfg.model_type == model_type
    assert cfg.attention_bias == (model_type == "qwen2")
    assert (ours.lm_head.weight is ours.embed.weight) == bool(overrides.get("tie_word_embeddings"))
    if "rope_parameters" in overrides:
        assert cfg.rope_scaling is not None and cfg.rope_theta == overrides["rope_parameters"]["rope_theta"]

    ids = random_ids(48, cfg.vocab_size, seed=0)
    theirs = hf_logits(tmp_path, ids).logits
    logits = ours.forward(ids, ours.new_cache(ids.shape[1])).logits
    assert ours.dtype == torch.float32 and theirs.abs().max() > 5  # peaked logits: a real comparison
    torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=1e-4)


def test_sliding_window_holds_when_decoding_token_by_token(tmp_path: Path) -> None:
    """One query at a time (no mask in the full-attention case) must still respect Mistral's window."""
    save_hf_checkpoint(tmp_path, "mistral", seed=1, sliding_window=5)
    ours = load_transformer(tmp_path, dtype=torch.float64)
    ids = random_ids(16, ours.config.vocab_size, seed=4)
    full = ours.forward(ids, ours.new_cache(16)).logits
    cache = ours.new_cache(16)
    steps = torch.cat([ours.forward(ids[:, i : i + 1], cache).logits for i in range(16)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-10, rtol=1e-10)
    unwindowed = load_transformer(tmp_path, dtype=torch.float64)
    unwindowed.config.sliding_window = None
    assert not torch.allclose(unwindowed.forward(ids, unwindowed.new_cache(16)).logits, full)


def test_unsupported_weights_are_refused(tmp_path: Path) -> None:
    """Llama with attention_bias also has an o_proj bias, which the runtime lacks: fail, don't drop it."""
    save_hf_checkpoint(tmp_path, "llama", attention_bias=True)
    with pytest.raises(ValueError, match="o_proj.bias"):
        load_transformer(tmp_path)


def test_unsupported_model_type_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf({"model_type": "gpt2", "num_attention_heads": 4})


def test_hidden_layers_match_transformers(tmp_path: Path) -> None:
    """hidden_layers returns each requested block's output, in the order asked for."""
    save_hf_checkpoint(tmp_path, "llama", seed=2, num_hidden_layers=3)
    ours = load_transformer(tmp_path)
    # the architecture against transformers' float32 in a float32 cache (test_kv_cache.py bounds float16's)
    ours.kv_cache_dtype = "float32"
    ids = random_ids(20, ours.config.vocab_size, seed=1)
    # transformers: hidden_states[i + 1] is block i's output, except the last one, which is normed
    reference = hf_logits(tmp_path, ids, output_hidden_states=True).hidden_states
    out = ours.forward(ids, ours.new_cache(20), hidden_layers=(1, 0, -1))
    assert len(out.hidden) == 3 and all(h.shape == (1, 20, ours.config.hidden_size) for h in out.hidden)
    torch.testing.assert_close(out.hidden[0], reference[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[1], reference[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.norm(out.hidden[2]), reference[3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.lm_head(ours.norm(out.hidden[2])), out.logits)
    with pytest.raises(IndexError):
        ours.forward(ids, ours.new_cache(20), hidden_layers=(3,))


def test_tree_forward_equals_each_root_to_node_chain() -> None:
    """Every tree node's logits equal those of running its root-to-node path as a plain sequence."""
    model = tiny_model(3)
    vocab = model.config.vocab_size
    prefix = random_ids(9, vocab, seed=3)[0].tolist()
    # branches of different depths sharing prefixes; first and second children at several levels
    tree = DraftTree.from_paths(prefix[-1], [[5, 6, 7, 8], [5, 6, 9], [5, 10], [11, 12, 13], [14]])
    assert not tree.is_chain and len(tree) == 11

    cache = model.new_cache(64)
    model.forward(torch.tensor([prefix[:-1]]), cache, logits_at=None)
    start = cache.length
    tree_logits = model.forward(
        torch.tensor([tree.tokens]), cache, positions=start + tree.depths(), tree_mask=tree.attention_mask()
    ).logits[0]
    assert cache.length == start + len(tree)

    for node, path in enumerate(tree.node_paths()):
        chain = prefix + path
        expected = model.forward(torch.tensor([chain]), model.new_cache(64), logits_at=slice(-1, None)).logits[0, 0]
        torch.testing.assert_close(tree_logits[node], expected, atol=1e-10, rtol=1e-10, msg=f"node {node}")

    # the comparison has teeth: the same nodes as one causal sequence give different logits
    cache.rollback(start)
    causal = model.forward(torch.tensor([tree.tokens]), cache, positions=start + tree.depths()).logits[0]
    assert not torch.allclose(causal, tree_logits)


def test_incremental_decoding_equals_one_forward() -> None:
    model = tiny_model(4)
    ids = random_ids(40, model.config.vocab_size, seed=4)
    full = model.forward(ids, model.new_cache(40)).logits[0]
    cache, pieces, pos = model.new_cache(40), [], 0
    for size in (12, 1, 1, 7, 1, 18):  # a prefill, single tokens and chunks
        pieces.append(model.forward(ids[:, pos : pos + size], cache).logits[0])
        pos += size
        assert cache.length == pos
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-10, rtol=1e-10)


def test_rope_tables_follow_a_model_that_moved() -> None:
    """A model (or EAGLE head) used, then moved to another device, rebuilds its cos/sin tables there: indexing a
    table left behind failed on a GPU. Here the tables left behind are on the meta device."""
    from specdecode.models.eagle import EagleConfig, EagleHead

    positions = torch.arange(6)
    model = tiny_model(0)
    cos, sin = model.rope(positions)
    model._rope_cache = {False: tuple(t.to("meta") for t in model._rope_cache[False])}
    assert all(torch.equal(a, b) for a, b in zip(model.rope(positions), (cos, sin), strict=True))
    head = EagleHead(EagleConfig.for_target(model.config, 16))
    cos, sin = head.rope(positions)
    head._rope = tuple(t.to("meta") for t in head._rope)
    assert all(torch.equal(a, b) for a, b in zip(head.rope(positions), (cos, sin), strict=True))


def test_logits_at_selects_positions() -> None:
    model = tiny_model(5)
    ids = random_ids(10, model.config.vocab_size, seed=5)
    full = model.forward(ids, model.new_cache(10)).logits

    cache = model.new_cache(10)
    out = model.forward(ids, cache, logits_at=None)
    assert out.logits is None and out.hidden == [] and cache.length == 10

    last = model.forward(ids, model.new_cache(10), logits_at=slice(-1, None)).logits
    assert last.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-12, rtol=1e-12)
    picked = model.forward(ids, model.new_cache(10), logits_at=torch.tensor([0, 4, 9])).logits
    torch.testing.assert_close(picked, full[:, [0, 4, 9]], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("shape", [(2048, 640), (640, 2048), (576, 1536)])
def test_float_linear_rows_do_not_depend_on_the_rows_beside_them(shape) -> None:
    """Bit for bit, as a verified token must compute what its one-token step does: oneDNN broke this on an
    AVX-512 machine at K = 2048 (Gemma 3 270M's down projection), and real Gemma's greedy speculation parted
    from plain decoding. Up to NATIVE_MAX_ROWS rows; beyond (a prefill), only close."""
    from specdecode.models.linear import NATIVE_MAX_ROWS, Linear

    k, n = shape
    g = torch.Generator().manual_seed(2)
    layer = Linear(k, n).eval().requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        layer.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(24, k, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(24)])
    for rows in (2, 3, 4, 5, 8, 16, 24):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
        assert torch.equal(layer(x[24 - rows :]), alone[24 - rows :]), rows
    torch.testing.assert_close(alone, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    long = torch.randn(NATIVE_MAX_ROWS + 1, k, generator=g)
    torch.testing.assert_close(layer(long), torch.nn.functional.linear(long, layer.weight, layer.bias),
                               rtol=1e-4, atol=1e-4)
