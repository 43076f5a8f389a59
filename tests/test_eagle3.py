"""EAGLE-3's own architecture trained here (models/eagle3.py): saved in specdecode's files and in the published
EAGLE-3 layout, each read back proposes exactly the same trees (issue 58's round trip); int8 storage; training
with --arch eagle3, and the warm start from a specdecode head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.models.eagle import ARCH_EAGLE3, SCALE, EagleConfig, EagleHead, int8_blocks, int8_weight
from specdecode.models.eagle3 import Eagle3Head, from_specdecode_head
from specdecode.models.head_files import load_head
from specdecode.models.published_heads import export_head, load_eagle_head
from specdecode.models.published_io import EAGLE3, OURS_EAGLE, detect_layout
from specdecode.models.quant import QuantLinear
from specdecode.proposers import EagleProposer
from specdecode.training.loop import TrainConfig

from .helpers import tiny_model
from .test_eagle import distilled, native_matches_pytorch
from .test_lossless import PROMPTS, VOCAB

NEW = 24
CASES = PROMPTS[1:8]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB, num_layers=8)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    return [generate_ids(target, p, max_new_tokens=NEW)[0] for p in CASES]


def made_head(target: Transformer, seed: int = 1, draft_vocab: int = 40) -> Eagle3Head:
    """An EAGLE-3 head as training leaves one: started from the target, every weight moved, float32 values."""
    head = Eagle3Head(EagleConfig.for_target(target.config, draft_vocab, arch=ARCH_EAGLE3))
    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(VOCAB, generator=gen)[:draft_vocab].sort().values
    head.init_from_target(target, vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return head.float().double().eval().requires_grad_(False)


def trees_of(target, reference, head: EagleHead) -> list[tuple[list[int], list[int]]]:
    """Every tree the proposer sends while decoding CASES greedily; the output must be plain decoding's."""
    proposer = EagleProposer(head, target, topk=3, nodes=10)
    trees: list[tuple[list[int], list[int]]] = []
    inner = proposer.propose

    def propose(context):
        tree = inner(context)
        trees.append((list(tree.tokens), list(tree.parents)))
        return tree

    proposer.propose = propose  # type: ignore[method-assign]
    for prompt, expected in zip(CASES, reference, strict=True):
        out, _ = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
    return trees


def test_our_eagle3_head_round_trips_through_the_published_layout_with_identical_trees(tmp_path, target,
                                                                                       reference) -> None:
    head = made_head(target)
    head.save(tmp_path / "ours")
    assert detect_layout(tmp_path / "ours") == OURS_EAGLE
    assert json.loads((tmp_path / "ours/eagle_config.json").read_text())["arch"] == ARCH_EAGLE3
    ours = load_eagle_head(tmp_path / "ours", target)
    assert type(ours) is Eagle3Head
    assert export_head(tmp_path / "ours", tmp_path / "published") == EAGLE3
    assert detect_layout(tmp_path / "published") == EAGLE3
    config = json.loads((tmp_path / "published/config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        head.config.target_layers
    published = load_eagle_head(tmp_path / "published", target)
    assert type(published) is Eagle3Head and published.config.target_layers == head.config.target_layers
    for (name, a), (_, b) in zip(ours.state_dict().items(), published.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    published.save(tmp_path / "ours-again")  # and back to specdecode's files
    again = load_eagle_head(tmp_path / "ours-again", target)
    trees = [trees_of(target, reference, h) for h in (head, ours, published, again)]
    assert len(trees[0]) > 10 and any(len(set(p)) < len(p) - 1 for _, p in trees[0])  # real trees, not chains
    assert trees[1] == trees[0] and trees[2] == trees[0] and trees[3] == trees[0]


def test_int8_storage_is_what_int8_quantization_runs(tmp_path, target, reference) -> None:
    """Stored as int8 blocks of 32 with float16 scales (a quarter of float32), a head loads within a block's
    rounding of its weights, quantized again to int8 it is bit for bit the original quantized, and it stays
    lossless."""
    head = made_head(target, seed=2)
    head.save(tmp_path / "int8", int8=True)
    stored = load_file(str(tmp_path / "int8/eagle.safetensors"))
    assert stored["lm_head.weight"].dtype == torch.int8 and stored["lm_head.weight" + SCALE].dtype == torch.float16
    assert stored["norm.weight"].dtype == torch.float32  # vectors stay as they are
    back = load_eagle_head(tmp_path / "int8", target)
    for name, w in head.state_dict().items():
        if name + SCALE not in stored:
            assert torch.equal(back.state_dict()[name].double(), w.double()), name
            continue
        loaded = back.state_dict()[name].double()
        step = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
        assert ((loaded - w).reshape(step.shape[0], -1, 32).abs() <= step * 0.51 + 1e-6).all(), name
        again, original = QuantLinear.quantize(loaded.float(), "int8"), QuantLinear.quantize(w.float(), "int8")
        assert torch.equal(again.qs, original.qs) and torch.equal(again.d, original.d), name
    trees_of(target, reference, back)  # greedy output is plain decoding's


@pytest.mark.parametrize("quantized", [None, "int8", "int8-a8"])
def test_native_layer_computes_what_the_pytorch_layer_does(target, monkeypatch, quantized) -> None:
    """A float32 EAGLE-3 head on the CPU runs its layer, norm and output layer in the native kernel (q/k/v reading
    the wide input the call passes): the PyTorch layer's numbers, float rounding apart, for a prefix, a chain and a
    tree over its cache, with float or int8 weights; the caller's features are left as they were."""
    from specdecode.models import eagle3

    head = made_head(target, seed=3).float()
    if quantized:
        head.quantize_(quantized)
    native_matches_pytorch(head, eagle3.Eagle3Head, monkeypatch)


def test_a_native_layer_without_its_wide_input_is_refused(target) -> None:
    from specdecode import kernels
    from specdecode.models import native

    if kernels.native() is None:
        pytest.skip("no native kernels on this machine (kernels.native() logged why)")
    head = made_head(target, seed=3).float()
    cache = head.new_cache(8)
    lib, blocks = head._native_block(cache)
    h = head.config.block.hidden_size
    cos, sin = head.rope(torch.arange(1))
    for wide in (None, torch.zeros(1, h), torch.zeros(1, 2 * h, dtype=torch.float64)):
        with pytest.raises(ValueError, match="needs them: wide"):
            blocks.run(lib, torch.zeros(1, h), cache.kv, [native.RowSpan(0, 1, 0, 0, [(None, None)])], [(cos, sin)],
                       head.config.block, wide=wide)


def test_int8_weights_with_the_wrong_scales_are_refused() -> None:
    q, d = int8_blocks(torch.randn(4, 64))
    assert q.shape == (4, 64) and d.shape == (4, 2)
    with pytest.raises(ValueError, match=r"scales \[4, 1\]: expected int8 \[out, in\] and scales \[out, in / 32\]"):
        int8_weight(q, d[:, :1])


def test_training_an_eagle3_head_learns_and_a_specdecode_head_warm_starts_one(tmp_path, target, reference) -> None:
    from specdecode.training.eagle import train_eagle
    from specdecode.training.features import extract_features

    layers = EagleConfig.for_target(target.config, 48).target_layers
    store = extract_features(target, distilled(target, 48, seed=0), layers, topk=4)
    cfg = TrainConfig(steps=80, lr=3e-3, warmup=8, eval_every=40, save_every=40)
    head = train_eagle(target, store, store, tmp_path / "e3", cfg, draft_vocab=48, ttt_steps=3, batch_size=16,
                       max_len=64, log=lambda *_: None, arch=ARCH_EAGLE3)
    assert type(head) is Eagle3Head
    log = [json.loads(line) for line in (tmp_path / "e3/train_log.jsonl").read_text().splitlines()]
    assert log[-1]["heldout_acc1"] > 0.3 and log[-1]["heldout_chain_tau"] > log[0]["heldout_chain_tau"] - 0.05
    loaded = load_eagle_head(tmp_path / "e3", target)
    assert type(loaded) is Eagle3Head
    trees_of(target, reference, loaded)
    # a specdecode head fine-tuned into EAGLE-3's architecture keeps its layers, vocabulary and output layer
    ours = EagleHead(EagleConfig.for_target(target.config, 48))
    ours.init_from_target(target, torch.arange(48))
    warm = from_specdecode_head(ours)
    assert warm.config.target_layers == ours.config.target_layers and torch.equal(warm.d2t, ours.d2t)
    assert torch.equal(warm.lm_head.weight, ours.lm_head.weight.float())
    cfg = TrainConfig(steps=4, lr=1e-3, warmup=1, eval_every=4, save_every=4)
    tuned = train_eagle(target, store, store, tmp_path / "warm", cfg, ttt_steps=2, batch_size=8, max_len=64,
                        log=lambda *_: None, init=ours, arch=ARCH_EAGLE3)
    assert type(tuned) is Eagle3Head
    with pytest.raises(ValueError, match="an eagle3 head cannot be fine-tuned into a specdecode one"):
        train_eagle(target, store, store, tmp_path / "back", cfg, init=tuned, arch="specdecode",
                    log=lambda *_: None)


def test_an_unknown_architecture_is_refused(tmp_path: Path, target) -> None:
    with pytest.raises(ValueError, match="unknown EAGLE head architecture 'eagle9'"):
        EagleConfig.for_target(target.config, 8, arch="eagle9")
    made_head(target).save(tmp_path / "h")
    config = json.loads((tmp_path / "h/eagle_config.json").read_text())
    (tmp_path / "h/eagle_config.json").write_text(json.dumps({**config, "arch": "eagle9"}))
    with pytest.raises(ValueError, match="unknown head architecture 'eagle9'"):
        EagleHead.load(tmp_path / "h")


def test_a_head_directory_loads_as_the_class_its_config_names(tmp_path: Path, target) -> None:
    made_head(target).save(tmp_path / "h")
    assert type(load_head(tmp_path / "h")) is Eagle3Head
    with pytest.raises(ValueError, match="holds an 'eagle3' head, not 'specdecode': load it with .*load_head"):
        EagleHead.load(tmp_path / "h")


def test_the_shipped_smollm2_head_round_trips_through_the_published_layout(tmp_path) -> None:
    """The head shipped for SmolLM2 is EAGLE-3's architecture: exported to the published layout and read back it
    holds the same weights and, over the real model, proposes exactly the same trees (issue 58's round trip)."""
    import specdecode
    from specdecode.engine.assets import SHIPPED_EAGLE

    from .real_model import require_smollm2, spec_bench_prompts

    require_smollm2()
    shipped = SHIPPED_EAGLE["smollm2-135m-instruct"]
    assert export_head(shipped, tmp_path / "published") == EAGLE3
    llm = specdecode.load("smollm2-135m-instruct")
    ours, published = load_eagle_head(shipped, llm.model), load_eagle_head(tmp_path / "published", llm.model)
    assert type(ours) is Eagle3Head and type(published) is Eagle3Head
    for (name, a), (_, b) in zip(ours.state_dict().items(), published.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    prompts = [llm.tokenizer.encode(p) for p in spec_bench_prompts(2)]
    plain = [generate_ids(llm.model, p, max_new_tokens=NEW)[0] for p in prompts]
    runs = []
    for head in (ours, published):
        proposer = EagleProposer(head, llm.model, topk=3, nodes=10)  # no cost model: trees of a fixed size
        trees: list[tuple[list[int], list[int]]] = []

        def propose(context, inner=proposer.propose, trees=trees):
            tree = inner(context)
            trees.append((list(tree.tokens), list(tree.parents)))
            return tree

        proposer.propose = propose  # type: ignore[method-assign]
        for prompt, expected in zip(prompts, plain, strict=True):
            assert generate_ids(llm.model, prompt, proposer=proposer, k=4, max_new_tokens=NEW)[0] == expected
        runs.append(trees)
    assert len(runs[0]) > 4 and runs[1] == runs[0]
