"""Layer-skip self-speculation: the view shares the target's weights, decoding stays lossless, and the
skip-set search picks layers that matter least and persists its choice."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers import LayerSkipProposer
from specdecode.proposers.layer_skip import (
    DEFAULT_CALIBRATION,
    calibration_tokens,
    load_skip_layers,
    model_key,
    save_skip_layers,
    search_skip_layers,
    skip_layers,
)

from .helpers import FrozenCost, make_tokenizer, tiny_model
from .test_distribution import ALPHA, PROMPT, Case, V, chi_square, exact_joint, sample_counts
from .test_lossless import PROMPTS

VOCAB = 56
NEW = 30
# Verification costs: flat (k guesses verified for the price of one token) and linear (no gain possible).
FLAT = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 1.0], [1.0, 1.0]])
LINEAR = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 64.0], [1.0, 64.0]])


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB, num_layers=4)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    return [generate_ids(target, prompt, max_new_tokens=NEW)[0] for prompt in PROMPTS[:6]]  # plain decoding


def calibration(n: int = 4, length: int = 48) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


# ------------------------------------------------------------------------------------------ the view


def test_view_shares_weights_and_runs_only_kept_layers(target: Transformer) -> None:
    view = skip_layers(target, [2, 1])
    assert view.config.num_layers == 2 and list(view.layers) == [target.layers[0], target.layers[3]]
    assert len(target.layers) == 4 and target.config.num_layers == 4  # the target is untouched
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in view.parameters())  # no copies
    for name in ("embed", "norm", "lm_head"):
        assert getattr(view, name) is getattr(target, name)
    assert view.new_cache(10).kv.shape[0] == 2

    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    n = tokens.shape[1]
    cache = view.new_cache(n)  # the manual run: the target's blocks 0 and 3, in cache slots 0 and 1
    cos, sin = target.rope(torch.arange(n))
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    x = target.embed(tokens)
    for slot, layer in enumerate((0, 3)):
        x = target.layers[layer](x, cos, sin, cache, slot, 0, mask)
    expected = target.lm_head(target.norm(x))
    torch.testing.assert_close(view.forward(tokens, view.new_cache(n)).logits, expected, rtol=0, atol=1e-12)
    # in two chunks through the view's own cache: the same
    split = view.new_cache(n)
    view.forward(tokens[:, :5], split, logits_at=None)
    torch.testing.assert_close(view.forward(tokens[:, 5:], split).logits, expected[:, 5:], rtol=0, atol=1e-12)
    # skipping nothing is the target itself
    full = target.forward(tokens, target.new_cache(n)).logits
    torch.testing.assert_close(skip_layers(target, []).forward(tokens, target.new_cache(n)).logits, full)


@pytest.mark.parametrize("skipped,match", [
    ([0, 1, 2, 3], "cannot skip all 4 layers"),
    ([1, 4], r"\[4\] out of range"),
    ([-1], r"\[-1\] out of range"),
    ([2, 1, 2], r"\[2\] are listed more than once"),
])
def test_bad_skip_sets(target: Transformer, skipped: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        skip_layers(target, skipped)
    with pytest.raises(ValueError, match=match):
        LayerSkipProposer(target, skipped)


# ---------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("skipped", [[1], [2], [1, 2], [0, 3]])
def test_greedy_layer_skip_equals_plain(target, reference, skipped: list[int], k: int) -> None:
    proposer = LayerSkipProposer(target, skipped)
    assert proposer.name == "layer-skip" and not proposer.guessing.cheap
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, reference, strict=False):
        out, stats = generate_ids(target, prompt, proposer=proposer, k=k, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted  # corrections and accepted guesses were both checked


def test_greedy_layer_skip_with_adaptive_k(target, reference) -> None:
    cost, shared = CostModel.measure(target, repeats=1), AcceptanceStats()
    proposer = LayerSkipProposer(target, [2])
    for prompt, expected in zip(PROMPTS[:3], reference, strict=False):
        policy = AdaptiveK(cost, shared, cheap=proposer.guessing.cheap)
        assert generate_ids(target, prompt, proposer=proposer, k=policy, max_new_tokens=NEW)[0] == expected


def test_sampled_layer_skip_matches_target_distribution() -> None:
    target = tiny_model(3, head_gain=3.0, vocab_size=V, num_layers=3, hidden_size=32, intermediate_size=64,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    case = Case(lambda t, d: LayerSkipProposer(t, [1]), SamplingParams(temperature=1.0), tokens=3, samples=2000)
    counts, totals = sample_counts(target, target, case, case.samples)
    assert 0 < totals["accepted"] < totals["drafted"], totals
    pvalue, tv = chi_square(counts, exact_joint(target, PROMPT, case.params, case.tokens), case.samples)
    assert pvalue > ALPHA and tv < 0.1, (pvalue, tv)


# ------------------------------------------------------------------------------------------ search


def test_search_picks_a_valid_paying_set() -> None:
    model = tiny_model(0, vocab_size=VOCAB, num_layers=6, gain=0.5)  # weak blocks: skipping them costs little
    steps = []
    result = search_skip_layers(model, calibration(), FLAT, progress=steps.append)
    trajectory = result.trajectory
    assert trajectory[0].skipped == [] and trajectory[0].agreement == 1.0 and trajectory[0].speedup == 1.0
    assert trajectory[1:] == steps and len(steps) >= 2
    for before, after in zip(trajectory, trajectory[1:], strict=False):
        assert set(before.skipped) < set(after.skipped) and len(after.skipped) == len(before.skipped) + 1
        assert after.agreement <= before.agreement + 0.05
        assert 0 not in after.skipped and 5 not in after.skipped
    best = max(trajectory, key=lambda s: s.speedup)
    assert result.pays and result.speedup == best.speedup > 1.0 and result.skipped == best.skipped
    assert 1 <= result.k <= 8 and result.num_layers == 6
    assert len(search_skip_layers(model, calibration(), FLAT, max_skip=1).trajectory) == 2


def test_search_patience() -> None:
    """Here skipping 1-3 layers does not pay but 4 does: the default patience waits for it, patience=1 not."""
    model = tiny_model(0, vocab_size=VOCAB, num_layers=6, gain=0.8)
    patient = search_skip_layers(model, calibration(), FLAT)
    assert [s.speedup > 1 for s in patient.trajectory[1:]] == [False, False, False, True]
    assert patient.skipped == [1, 2, 3, 4]
    hasty = search_skip_layers(model, calibration(), FLAT, patience=1)
    assert len(hasty.trajectory) == 2 and hasty.skipped == []


def test_search_returns_the_empty_set_when_nothing_pays(target: Transformer) -> None:
    result = search_skip_layers(target, calibration(), LINEAR)  # verifying k tokens costs k plain steps
    assert result.skipped == [] and result.speedup == 1.0 and result.k == 0 and not result.pays


def test_search_removes_a_do_nothing_layer_first(target: Transformer) -> None:
    model = copy.deepcopy(target)
    block = model.layers[2]
    block.attn.wo.weight.zero_()  # the block now adds nothing to the residual stream
    block.mlp.w2.weight.zero_()
    result = search_skip_layers(model, calibration(), FLAT)
    assert result.trajectory[1].skipped == [2] and result.trajectory[1].agreement == 1.0
    assert 2 in result.skipped and result.speedup > 1.0
    with pytest.raises(ValueError, match="calibration"):
        search_skip_layers(model, [[1]], FLAT)


def test_save_and_load_round_trip(target: Transformer, tmp_path: Path) -> None:
    model = tiny_model(0, vocab_size=VOCAB, num_layers=6, gain=0.5)
    result = search_skip_layers(model, calibration(2, 24), FLAT, max_skip=2)
    assert load_skip_layers(model, tmp_path) is None
    path = save_skip_layers(model, result, tmp_path)
    assert path.parent == tmp_path / "layer_skip" and path.stem == model_key(model)
    assert load_skip_layers(model, tmp_path) == result.skipped
    saved = json.loads(path.read_text())
    assert saved["agreement"] == result.agreement and len(saved["trajectory"]) == len(result.trajectory)
    # a same-shape checkpoint with other weights has its own key; the dtype a checkpoint is loaded in does not
    assert model_key(tiny_model(1, vocab_size=VOCAB, num_layers=6, gain=0.5)) != model_key(model)
    assert model_key(copy.deepcopy(model).to(torch.float32)) == model_key(model)
    assert model_key(target) != model_key(model)
    path.write_text("{not json")
    assert load_skip_layers(model, tmp_path) is None


def test_calibration_tokens_ship_with_the_package(tmp_path: Path) -> None:
    """The search's calibration text is part of the package (a fresh clone needs nothing else)."""
    assert DEFAULT_CALIBRATION.is_file() and DEFAULT_CALIBRATION.parent.name == "data"
    tokenizer = make_tokenizer()
    texts = calibration_tokens(tokenizer, n_texts=3, max_tokens=64)
    assert len(texts) == 3 and all(32 <= len(t) <= 64 for t in texts)
    assert texts == calibration_tokens(tokenizer, n_texts=3, max_tokens=64)  # deterministic
    assert len(calibration_tokens(tokenizer, n_texts=40, max_tokens=64)) == 40
    with pytest.raises(ValueError, match="at most that many calibration texts"):
        calibration_tokens(tokenizer, n_texts=1000, max_tokens=64)
    with pytest.raises(FileNotFoundError, match="calibration data"):
        calibration_tokens(tokenizer, path=tmp_path / "missing.jsonl")
