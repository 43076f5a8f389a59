"""Gemma 3 on the one model file: parity with transformers' Gemma3ForCausalLM (past the sliding window, with a token
tree, from an HF checkpoint and from a GGUF file), and lossless speculation with every proposer on a tiny Gemma."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import DraftTree
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer, load_transformer
from specdecode.models.config import FULL, SLIDING, ModelConfig
from specdecode.models.eagle import EagleConfig, EagleHead
from specdecode.models.loading import load_gguf, quantize_
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    LayerSkipProposer,
    LookaheadProposer,
    MedusaProposer,
    PromptLookupProposer,
    QuantizedSelfProposer,
)
from specdecode.proposers.layer_skip import skip_layers
from specdecode.proposers.quantized import low_bit_copy

from .helpers import assert_tree_matches_steps, guessing_pays, noisy_copy, randomize_, tiny_model
from .test_distribution import ALPHA, PROMPT, V, chi_square, exact_joint
from .test_lossless import PROMPTS, VOCAB, naive_greedy
from .test_medusa import WIDE, random_heads

WINDOW = 6  # far shorter than the test sequences: sliding layers see a window, full layers everything
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING]
GEMMA = dict(num_layers=4, layer_types=LAYER_TYPES, sliding_window=WINDOW, rope_local_theta=10_000.0,
             rope_theta=1_000_000.0, qk_norm=True, sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=8.0,
             query_scale=24**-0.5, norm_offset=1.0, model_type="gemma3_text")
NATIVE_FAMILIES = ["llama-int8-a8", "gemma-float32"]


def native_tiny(family: str) -> Transformer:
    """A tiny float32 model the native kernels run on the CPU (a family of NATIVE_FAMILIES): an int8-activation Llama
    or a Gemma; the test is skipped where the kernels cannot be built."""
    from specdecode import kernels

    if kernels.native() is None:
        pytest.skip("native kernels unavailable")
    if family == "llama-int8-a8":
        return quantize_(tiny_model(2, dtype=torch.float32, vocab_size=56), "int8-a8")
    return tiny_model(2, vocab_size=56, **GEMMA).float()


def hf_gemma(path: Path, seed: int = 1, **overrides):
    """A random tiny Gemma3ForCausalLM (float64) saved at `path`: 4 layers, the third global, window 6, RoPE
    scaled on the global layer only, a query scale of its own, an output layer of its own (the embedding scaled
    for Gemma's sqrt(hidden) would make tied logits flat; the real model's test covers the tie)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24, tie_word_embeddings=False,
                rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                                 FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}})
    base.update(overrides)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**base))
    randomize_(model, seed)
    with torch.no_grad():  # Gemma scales embeddings by sqrt(64) = 8: keep the residual stream O(1)
        model.model.embed_tokens.weight.mul_(0.125)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)  # Gemma's norms scale by 1 + w: w ~ N(0, 0.1^2)
    model.save_pretrained(str(path))
    return model.to(torch.float64).eval()


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gemma")
    return path, hf_gemma(path)


def test_config_reads_gemma3(checkpoint) -> None:
    path, _ = checkpoint
    cfg = load_transformer(path).config
    assert cfg.layer_types == LAYER_TYPES and [cfg.sliding(i) for i in range(4)] == [True, True, False, True]
    assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling["factor"]) == (10_000.0, 1_000_000.0, 2.0)
    assert cfg.qk_norm and cfg.sandwich_norm and cfg.hidden_act == "gelu_tanh"
    assert cfg.embed_scale == 8.0 and cfg.query_scale == 24**-0.5
    old_style = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
                 "num_hidden_layers": 12, "num_attention_heads": 4, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                 "sliding_window": 512, "sliding_window_pattern": 6}
    cfg = ModelConfig.from_hf(old_style)
    assert [i for i in range(12) if not cfg.sliding(i)] == [5, 11] and cfg.rope_local_theta == 1e4
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf({**old_style, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="text model"):
        ModelConfig.from_hf({**old_style, "model_type": "gemma3"})


def test_logits_match_transformers_past_the_window(checkpoint) -> None:
    path, reference = checkpoint
    ours = load_transformer(path, dtype=torch.float64)
    ids = random_ids(40, 64, seed=0)
    with torch.inference_mode():
        theirs = reference(ids).logits
    logits = ours.forward(ids, ours.new_cache(40)).logits
    assert theirs.abs().max() > 5  # peaked logits: a real comparison
    # transformers' Gemma norms compute in float32 whatever the dtype: float32 tolerance
    torch.testing.assert_close(logits, theirs, atol=1e-5, rtol=1e-5)
    # teeth: without the window the logits past it differ
    unwindowed = load_transformer(path, dtype=torch.float64)
    unwindowed.config.sliding_window = 10**6
    changed = unwindowed.forward(ids, unwindowed.new_cache(40)).logits
    assert torch.allclose(changed[:, :WINDOW], logits[:, :WINDOW], atol=1e-10)
    assert not torch.allclose(changed[:, WINDOW:], logits[:, WINDOW:], atol=1e-3)


def test_token_by_token_and_tree_see_the_window_the_target_would(checkpoint) -> None:
    """A tree verified past the window, after a cache that was filled in pieces and rolled back: every node's logits
    equal transformers' on its root-to-node chain as one plain sequence."""
    path, reference = checkpoint
    ours = load_transformer(path, dtype=torch.float64)
    prefix = random_ids(20, 64, seed=3)[0].tolist()
    cache = ours.new_cache(64)
    steps = [ours.forward(torch.tensor([prefix[:12]]), cache).logits[0]]
    steps += [ours.forward(torch.tensor([[t]]), cache).logits[0] for t in prefix[12:]]
    with torch.inference_mode():
        theirs = reference(torch.tensor([prefix])).logits[0]
    torch.testing.assert_close(torch.cat(steps), theirs, atol=1e-5, rtol=1e-5)

    ours.forward(torch.tensor([[5, 6, 7]]), cache)  # rejected guesses: rolled back below
    cache.rollback(len(prefix) - 1)
    tree = DraftTree.from_paths(prefix[-1], [[5, 6, 7, 8, 9, 10, 11], [5, 6, 9], [5, 10], [11, 12, 13], [14]])
    start = cache.length
    tree_logits = ours.forward(torch.tensor([tree.tokens]), cache, positions=start + tree.depths(),
                               tree_mask=tree.attention_mask()).logits[0]
    for node, path in enumerate(tree.node_paths()):
        chain = prefix + path
        with torch.inference_mode():
            expected = reference(torch.tensor([chain])).logits[0, -1]
        torch.testing.assert_close(tree_logits[node], expected, atol=1e-5, rtol=1e-5, msg=f"node {node}")


@pytest.mark.parametrize("shape", [dict(GEMMA), dict(GEMMA, head_dim=64, query_scale=64**-0.5),
                                   dict(GEMMA, head_dim=256, query_scale=256**-0.5), dict(num_layers=4, head_dim=64)],
                         ids=["gemma", "gemma-head-dim-64", "gemma-head-dim-256", "llama-head-dim-64"])
@pytest.mark.parametrize("in_batch_row", [False, True], ids=["own-cache", "engine-batch-row"])
def test_float32_tree_verifies_bit_for_bit_what_single_steps_compute(in_batch_row: bool, shape: dict) -> None:
    """On the CPU in float32 a token's numbers must not depend on how many tokens share the forward (else a near
    tie decides differently in verification than in plain decoding, and greedy speculation is not lossless; with
    int8 activations a rounding difference flips a quantization step and the tokens part): the blocks run in the
    native kernel, whose every operation is row-invariant (head dims 64 and multiples of 128 weigh the values in
    registers). The engine runs a request on a row of its batch's cache."""
    from specdecode import kernels
    from specdecode.models import BatchKVCache

    if kernels.native() is None:
        pytest.skip("native kernels unavailable")
    model = tiny_model(4, vocab_size=VOCAB, **shape).float()
    prefix = random_ids(14, VOCAB, seed=7)[0].tolist()
    tree = DraftTree.from_paths(prefix[-1], [[5, 6, 7, 8, 9], [5, 6, 9], [5, 10], [11, 12]])
    cfg = model.config
    cache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, batch_size=2).row(1) if in_batch_row \
        else model.new_cache(64)
    assert_tree_matches_steps(model, cache, prefix, tree)


def test_ragged_batch_equals_single_sequences() -> None:
    from specdecode.models import BatchKVCache

    model = tiny_model(2, vocab_size=VOCAB, **GEMMA)
    rows = [random_ids(n, VOCAB, seed=n)[0].tolist() for n in (15, 9)]
    cache = BatchKVCache(4, model.config.num_kv_heads, model.config.head_dim, 32, batch_size=2, dtype=torch.float64)
    for b, ids in enumerate(rows):
        single = model.new_cache(32)
        model.forward(torch.tensor([ids[:-2]]), single, logits_at=None)
        cache.load(b, single)
    tokens = torch.tensor([row[-2:] for row in rows])
    positions = torch.tensor([[len(r) - 2, len(r) - 1] for r in rows])
    out = model.forward_batch(tokens, cache, positions=positions, sizes=[2, 2])
    for b, ids in enumerate(rows):
        expected = model.forward(torch.tensor([ids]), model.new_cache(32)).logits[0, -2:]
        torch.testing.assert_close(out.logits[b], expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", [None, "int8-a8"])
@pytest.mark.parametrize("head_dim", [16, 256])  # 256 (Gemma 3's): the values weighed 128 at a time, twice
def test_native_gemma_blocks_equal_the_pytorch_blocks(kind, head_dim, monkeypatch) -> None:
    """QK-norm, sandwich norms, GeGLU, per-layer windows and RoPE bases in the native kernel: a prefill past the
    window, a token tree, a kept path and a step compute what the PyTorch blocks compute; a layer-skipped view
    (a sliding layer and the global one) too."""
    from specdecode import kernels

    from .test_quant import forward_both_ways, takes_native_path

    if kernels.native() is None:
        pytest.skip("native kernels unavailable")
    model = tiny_model(0, vocab_size=VOCAB, **dict(GEMMA, head_dim=head_dim, query_scale=24**-0.5)).float()
    with torch.no_grad():
        model.embed.weight.mul_(0.125)
    if kind:
        quantize_(model, kind)
    assert takes_native_path(model)
    native, reference = forward_both_ways(model, monkeypatch)
    for got, expected in zip(native, reference, strict=True):
        if kind:  # float rounding can move an activation across an int8 step: 1% of it
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * expected.abs().max().item())
        else:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if not kind:  # a layer-skipped view, in float32 (int8 rounding compounds across a view's layers)
        view = skip_layers(model, [1])
        assert [block.sliding for block in view.layers] == [True, False, True]
        ids = random_ids(12, VOCAB, seed=2)
        got = view.forward(ids, view.new_cache(16)).logits
        monkeypatch.setattr(type(view), "_native_blocks", lambda *a: None)
        expected = view.forward(ids, view.new_cache(16)).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ a Gemma GGUF file
def write_gemma_gguf(path: Path, reference) -> None:
    """The reference model as llama.cpp writes Gemma 3 (models/gguf_write.py: norms stored as 1 + w), the embedding
    and v in Q8_0, q and k in Q5_0 (the fused q|k|v loads as one int8 layer), the rest in float32; no tokenizer."""
    from specdecode.models.gguf_write import write_gguf

    def types(name: str) -> str:
        if name == "token_embd.weight" or ".attn_v." in name:
            return "Q8_0"
        return "Q5_0" if ".attn_q." in name or ".attn_k." in name else "F32"

    write_gguf(path, reference.config.to_dict(), reference.state_dict(), types, with_tokenizer=False)


def test_gguf_file_loads_as_transformers_loads_it(tmp_path: Path, checkpoint) -> None:
    """A Gemma 3 GGUF (Q8_0 / Q5_0 / float tensors, norms as 1 + w) gives transformers' logits on its own GGUF
    reading of the same file: config, names, the norm shift and Q5_0 as int8 all right."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from specdecode.models.gguf_file import config as gguf_config

    _, reference = checkpoint
    gguf_path = tmp_path / "tiny-gemma3.gguf"
    write_gemma_gguf(gguf_path, reference)
    config = gguf_config(gguf_path)
    config["sliding_window_pattern"] = 3  # llama.cpp fixes Gemma 3's at 6; this tiny one has 4 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_gguf(gguf_path, tmp_path, torch.float32)
    # the architecture against transformers' float32 in a float32 cache (test_kv_cache.py bounds float16's)
    ours.kv_cache_dtype = "float32"
    assert ours.config.layer_types == LAYER_TYPES
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}  # the global layers' (rope.scaling.*)
    assert ours.layers[0].attn.wqkv.quantization == "int8" and ours.embed.table.quantization == "int8"
    # transformers' GGUF reader takes neither the layer pattern nor the query scale nor the RoPE scaling from the file
    theirs_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32,
                                                        layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
                                                        rope_parameters=reference.config.rope_parameters)
    ids = random_ids(30, 64, seed=5)
    with torch.inference_mode():
        theirs = theirs_model(ids).logits
    ours.config.query_scale = 24**-0.5  # GGUF carries no query scale: llama.cpp's is 1 / sqrt(head_dim)
    for layer in ours.layers:
        layer.attn.scale = ours.config.query_scale
    logits = ours.forward(ids, ours.new_cache(30)).logits
    torch.testing.assert_close(logits, theirs, atol=2e-4, rtol=2e-4)


# --------------------------------------------------------------------------------- lossless speculation
@pytest.fixture(scope="module")
def target() -> Transformer:
    model = tiny_model(0, vocab_size=VOCAB, **GEMMA)
    with torch.no_grad():
        model.embed.weight.mul_(0.125)  # embed_scale 8: the residual stream stays O(1)
    return model


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    """Plain decoding through the engine (its KV cache checked against full recomputation below)."""
    out = [generate_ids(target, prompt, max_new_tokens=40)[0] for prompt in PROMPTS]
    assert sum(len(set(r)) > 10 for r in out) >= len(out) - 2  # varied text, so the comparison has teeth
    return out


def test_plain_engine_equals_full_recomputation(target, reference) -> None:
    for i in (1, 4):  # a one-token prompt, and a 33-token one: both decode far past the window of 6
        assert reference[i] == naive_greedy(target, PROMPTS[i], 40)


def random_eagle(target: Transformer, seed: int) -> EagleHead:
    with torch.random.fork_rng():  # the layers init_from_target keeps (input, norms) start from `seed`, not from
        torch.manual_seed(seed)  # whatever the tests before this one left in the global generator
        head = EagleHead(EagleConfig.for_target(target.config, VOCAB - 8))
    head.init_from_target(target, torch.arange(VOCAB - 8))
    randomize_(head.fuse, seed)
    return head.to(target.dtype).eval().requires_grad_(False)


def test_a_gemma_head_starts_at_unit_gain(target) -> None:
    """Gemma's norm gains (1 + w; the 270M model's up to 301) are its residual stream's: a head started from them drew
    logits spanning ~100 and learned next to nothing, so its norms start at 1 (a Llama target's gains are copied)."""
    assert target.config.norm_offset and not bool((target.norm.weight + 1 == 1).all())
    head = random_eagle(target, 2)
    for norm in (head.block.attn_norm, head.block.mlp_norm, head.norm):
        assert bool((norm.weight == 1).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: the native block on a CPU
def test_a_gemma_heads_block_sees_what_training_showed_it_past_the_targets_window(target, dtype) -> None:
    """The head is a Llama block with full attention, as training computes it, whatever the target's windows: its
    inference forward (PyTorch's block, or the native one) equals the training-time forward past the window."""
    from specdecode.models.eagle_ttt import ttt_logits

    model = copy.deepcopy(target).to(dtype)
    head = random_eagle(model, 2)
    assert head.config.block.sliding_window is None  # the target's window is not the head's
    n = 5 * WINDOW
    tokens = torch.tensor(PROMPTS[4][: n + 1])[None]
    out = model.forward(tokens, model.new_cache(n + 1), hidden_layers=head.config.target_layers)
    hidden = torch.stack(out.hidden, dim=2)  # [1, n + 1, L, H]
    train_logits = ttt_logits(head, model.embed, {"hidden": hidden, "tokens": tokens}, steps=1)[0][0]
    logits, _ = head(head.fuse_features(hidden[0, :n])[None], model.embed(tokens[:, 1:]), head.new_cache(n),
                     torch.arange(n))
    tolerance = {} if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)  # two float32 orders of summation
    torch.testing.assert_close(train_logits, logits[0], **tolerance)


COST = guessing_pays()
METHODS = {
    "prompt-lookup": lambda t: PromptLookupProposer(branches=3),
    "draft": lambda t: DraftModelProposer(noisy_copy(t, seed=1, noise=0.05), VOCAB),
    "lookahead": lambda t: LookaheadProposer(window=3, ngram=3, guesses=3),
    "layer-skip": lambda t: LayerSkipProposer(t, [1]),  # keeps a sliding and the global layer: types follow blocks
    "hybrid": lambda t: HybridProposer(PromptLookupProposer(branches=2), LayerSkipProposer(t, [3])),
    "quantized": lambda t: QuantizedSelfProposer(t, low_bit_copy(t, "int8")),
    "eagle": lambda t: EagleProposer(random_eagle(t, 2), t, topk=3, nodes=12),
    "medusa": lambda t: MedusaProposer(random_heads(t, 3, seed=1, accuracy=WIDE[:3]), VOCAB, max_nodes=16),
}


# every method at a fixed depth; the adaptive depth for a cheap and a self-sizing proposer (the proposers and
# policies are the same code as on Llama: what is Gemma's here is the target's forward under them)
@pytest.mark.parametrize("method,k", [(m, 4) for m in METHODS] + [("prompt-lookup", "auto"), ("eagle", "auto")])
def test_greedy_speculative_equals_plain_on_gemma(target, reference, method: str, k) -> None:
    proposer = METHODS[method](target)
    drafted = accepted = 0
    shared = AcceptanceStats()
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        policy = AdaptiveK(COST, shared, cheap=proposer.guessing.cheap) if k == "auto" else k
        out, stats = generate_ids(target, prompt, proposer=proposer, k=policy, max_new_tokens=40)
        assert out == expected, f"{method}: prompt {prompt}"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted, (method, accepted, drafted)  # both accepted guesses and corrections happened


def test_sampled_speculation_matches_gemma_distribution() -> None:
    """Prompt lookup's tree at T > 0 on a two-layer Gemma (a sliding and a global layer, window 3) whose prompt runs
    past the window: the first three tokens follow the target's exact joint distribution."""
    target = tiny_model(3, head_gain=3.0, vocab_size=V, hidden_size=32, intermediate_size=64, num_heads=2,
                        num_kv_heads=1, head_dim=16, **{**GEMMA, "num_layers": 2, "layer_types": [SLIDING, FULL],
                                                       "sliding_window": 3})
    with torch.no_grad():
        target.embed.weight.mul_(1 / 8)
    params = SamplingParams(temperature=1.0)
    proposer = PromptLookupProposer(branches=3)
    samples, tokens = 2000, 3
    counts: dict = {}
    drafted = accepted = 0
    for seed in range(samples):
        out, stats = generate_ids(target, PROMPT, proposer=proposer, k=4, max_new_tokens=tokens, params=params,
                                  seed=seed)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted
    from collections import Counter

    pvalue, tv = chi_square(Counter(counts), exact_joint(target, PROMPT, params, tokens), samples)
    assert pvalue > ALPHA and tv < 0.1, (pvalue, tv)


def test_q5_0_loads_as_int8_exactly() -> None:
    gguf = pytest.importorskip("gguf")
    from specdecode.models.quant import QuantLinear

    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    layer = QuantLinear.from_gguf(raw, "Q5_0")
    assert layer.kind == "int8"
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    np.testing.assert_array_equal(layer.dequantize().numpy(), expected)
