"""EAGLE: a head trained here on a tiny target, through the real pipeline (self-distilled samples ->
cached features -> training-time-test training), drafts trees that the target verifies losslessly."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

import specdecode.proposers.eagle as eagle_module
from specdecode import kernels
from specdecode.cli.commands import main as cli_main
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.models.eagle import EagleConfig, EagleHead
from specdecode.models.eagle_ttt import ttt_logits
from specdecode.models.quant import quantize_linears_
from specdecode.policy.speculation import FixedK
from specdecode.proposers import EagleProposer
from specdecode.training.data import Sample, prompt_texts
from specdecode.training.distributed import shard
from specdecode.training.eagle import train_eagle
from specdecode.training.features import FeatureStore, extract_features
from specdecode.training.loop import TrainConfig

from .helpers import FrozenCost, guessing_pays, make_tokenizer, randomize_, tiny_model, write_checkpoint
from .test_distribution import ALPHA, PROMPT, chi_square, exact_joint
from .test_lossless import PROMPTS, VOCAB, KeepSpy

NEW = 40


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB, num_layers=4)


def distilled(target: Transformer, n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
        answer, _ = generate_ids(target, prompt, max_new_tokens=40)
        out.append(Sample(prompt + answer, len(prompt)))
    return out


@pytest.fixture(scope="module")
def store(target: Transformer) -> FeatureStore:
    return extract_features(target, distilled(target, 64, seed=0), [0, 1, 2, 3], topk=4)


@pytest.fixture(scope="module")
def trained(target: Transformer, store: FeatureStore, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle")
    cfg = TrainConfig(steps=120, lr=3e-3, warmup=10, eval_every=60, save_every=60)
    train_eagle(target, store, store, out, cfg, draft_vocab=48, ttt_steps=3, batch_size=16, max_len=64,
                log=lambda *_: None)
    assert target.dtype == torch.float64  # training left the caller's target alone
    return out


@pytest.fixture(scope="module")
def head(trained: Path) -> EagleHead:
    return EagleHead.load(trained, dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    return [generate_ids(target, p, max_new_tokens=NEW)[0] for p in PROMPTS]


def test_training_learns_the_target(trained: Path, head: EagleHead, store: FeatureStore, target: Transformer) -> None:
    """Scores improve with training, and training-time logits (step 0) equal the inference forward's."""
    log = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [60, 120]
    assert log[-1]["heldout_acc1"] > 0.3 and log[-1]["heldout_chain_tau"] > 1.3
    batch = store.batch([0], 64)
    layers = [store.layer_index(i) for i in head.config.target_layers]
    batch["hidden"] = batch["hidden"][:, :, layers].double()
    with torch.no_grad():
        train_logits = ttt_logits(head, target.embed, batch, steps=1)[0][0]
    n = int(store.offsets[1]) - 1
    feats = head.fuse_features(batch["hidden"][0, :n])
    embeds = target.embed(batch["tokens"][:, 1 : n + 1])
    logits, _ = head(feats[None], embeds, head.new_cache(n), torch.arange(n))
    torch.testing.assert_close(train_logits[:n], logits[0])


def test_features_past_float16s_range_are_kept_in_bfloat16(target: Transformer, store: FeatureStore) -> None:
    """Gemma's residual stream runs past float16's 65,504: stored as float16 it was inf, and the head trained to NaN.
    Such features go to bfloat16 (float32's range); those that fit stay in float16's finer steps."""
    loud = copy.deepcopy(target)
    loud.embed.weight.mul_(1e6)  # the residual stream carries the embedding: every hidden state past 1e5
    samples = distilled(target, 4, seed=1)
    big = extract_features(loud, samples, [1, 3], topk=4)
    assert store.hidden.dtype == torch.float16
    assert big.hidden.dtype == torch.bfloat16 and bool(big.hidden.isfinite().all())
    ids = torch.tensor(samples[0].tokens)[None]
    exact = torch.stack(loud.forward(ids, loud.new_cache(ids.shape[1]), hidden_layers=[1, 3]).hidden, dim=2)[0]
    assert float(exact.abs().max()) > 1e5
    torch.testing.assert_close(big.hidden[: ids.shape[1]].double(), exact, rtol=1e-2, atol=0.0)


def test_head_starts_from_a_quantized_targets_dequantized_weights(target: Transformer) -> None:
    """A GGUF target's layers are quantized (no `weight` parameter): the head starts from what they compute with."""
    quantized = quantize_linears_(copy.deepcopy(target).float(), "int4")
    last = quantized.layers[-1]
    head = EagleHead(EagleConfig.for_target(quantized.config, 48))
    vocab = torch.arange(5, 53)
    head.init_from_target(quantized, vocab)
    torch.testing.assert_close(head.block.attn.wqkv.weight, last.attn.wqkv.weight)
    torch.testing.assert_close(head.block.mlp.w2.weight, last.mlp.w2.weight)
    torch.testing.assert_close(head.block.attn_norm.weight, last.attn_norm.weight.float())
    torch.testing.assert_close(head.lm_head.weight, quantized.lm_head.weight[vocab])
    assert not torch.equal(last.attn.wqkv.weight, target.layers[-1].attn.wqkv.weight.float())  # really quantized


@pytest.mark.parametrize("k", [1, 2, 4, 8, "auto"])
@pytest.mark.parametrize("topk,nodes", [(1, 8), (3, 6), (4, 16)])
def test_greedy_eagle_equals_plain(target, head, reference, monkeypatch, k, topk, nodes) -> None:
    spy = KeepSpy(monkeypatch)
    monkeypatch.delattr(head, "rest_state", raising=False)  # what earlier tests' requests taught the shared head
    # "auto": the proposer sizes its trees from a made-up cost (64 tokens cost 2 forwards of one)
    cost = FrozenCost([1, 64], [0, 1000], [[1.0, 2.0], [1.0, 2.0]]) if k == "auto" else None
    proposer = EagleProposer(head, target, topk=topk, nodes=nodes, cost=cost)
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        depth = proposer.guessing.max_depth if k == "auto" else k
        out, stats = generate_ids(target, prompt, proposer=proposer, k=depth, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted += stats.drafted
        accepted += stats.accepted
    # under "auto" a head whose guesses all miss (topk=1 here: 0 of 30) rests, and may never be accepted
    assert (0 < accepted < drafted) if k != "auto" else (accepted < drafted)
    if topk > 1 and k not in (1, "auto"):
        assert spy.gathers > 0, "no non-first branch was ever accepted: the tree path went untested"


@pytest.mark.parametrize("quantized", [False, True])
def test_native_head_block_computes_what_the_pytorch_block_does(trained, monkeypatch, quantized) -> None:
    """A float32 head on the CPU runs its block in the native kernel: the same numbers as the PyTorch block (float
    rounding apart) for a prefix, a chain and a tree mask over its cache, with float or int8 weights."""
    from specdecode.models import eagle as eagle_head_module

    head = EagleHead.load(trained, dtype=torch.float32)
    if quantized:
        head.quantize_("int8")
    native_matches_pytorch(head, eagle_head_module.EagleHead, monkeypatch)


def native_matches_pytorch(head: EagleHead, cls: type, monkeypatch) -> None:
    """`head` (a float32 head on the CPU, of class `cls`) gives the same numbers, float rounding apart, through the
    native kernel and through PyTorch, for a prefix, a chain and a tree over its cache; the caller's features are
    left as they were."""
    if kernels.native() is None:
        pytest.skip("no native kernels on this machine (kernels.native() logged why)")
    native_run = head._native_block(head.new_cache(8))
    assert native_run is not None and native_run[1].head is not None  # else this compares PyTorch with itself
    h, gen = head.config.block.hidden_size, torch.Generator().manual_seed(0)
    features, embeds = torch.randn(1, 12, h, generator=gen), torch.randn(1, 12, h, generator=gen)
    kept = features.clone()
    tree = torch.ones(4, 12, dtype=torch.bool)
    tree[1, 8], tree[2, 8:10], tree[3, 9] = False, False, False  # node 1 and 2 beside each other, 3 under 1
    runs = []
    for path in ("native", "torch"):
        if path == "torch":
            monkeypatch.setattr(cls, "_native_block", lambda self, cache: None)
        cache, outs = head.new_cache(32), []
        outs.append(head(features[:, :5], embeds[:, :5], cache, torch.arange(5)))  # a prefix, causal
        outs.append(head(features[:, 5:8], embeds[:, 5:8], cache, torch.arange(5, 8)))  # a chain after it
        outs.append(head(features[:, 8:12], embeds[:, 8:12], cache, torch.tensor([8, 9, 9, 10]), tree))
        cache.rollback(8)  # the same tree again, the last node's logits only (what a catch-up asks for)
        last, _ = head(features[:, 8:12], embeds[:, 8:12], cache, torch.tensor([8, 9, 9, 10]), tree, slice(-1, None))
        assert torch.equal(last, outs[-1][0][:, -1:])
        runs.append(outs)
    assert torch.equal(features, kept)
    for (a_logits, a_hidden), (b_logits, b_hidden) in zip(*runs, strict=True):
        torch.testing.assert_close(a_hidden, b_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a_logits, b_logits, rtol=1e-4, atol=1e-4)


def test_int8_head_beside_an_int8_activation_target_is_lossless(target, trained) -> None:
    """The default GGUF load multiplies with int8 activations; its EAGLE head is then quantized to int8 too (a float32
    head read a third of the int4 target's bytes per draft token). Greedy output stays the quantized target's own."""
    import copy

    import specdecode
    from specdecode.models.loading import quantize_
    from specdecode.models.quant import QuantLinear

    quantized = quantize_(copy.deepcopy(target).float(), "int4-a8")
    llm = specdecode.LLM(quantized, make_tokenizer())
    head = llm.assets.eagle_head(trained)
    assert isinstance(head.lm_head, QuantLinear) and head.lm_head.quantization == "int8-a8"
    # warmed up as it loads: its kernels' description is built before a request's first run would pay for it
    assert ("_native" in head.__dict__) == (kernels.native() is not None)
    assert isinstance(head.block.mlp.w13, QuantLinear) and head.dtype == torch.float32
    proposer = EagleProposer(head, quantized, topk=3, nodes=8)
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain, _ = generate_ids(quantized, prompt, max_new_tokens=NEW)
        out, stats = generate_ids(quantized, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == plain, prompt
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted  # the int8 head still guesses the quantized target's tokens


def test_head_rests_while_its_steps_do_not_pay(target, head, reference, monkeypatch) -> None:
    """Under a cost where guessing cannot pay, the head stops running (backed-off probes), the next request
    starts resting, and the output stays plain decoding's."""
    monkeypatch.delattr(head, "rest_state", raising=False)
    steep = FrozenCost([1, 2, 64], [0, 1000], [[1.0, 2.5, 64.0], [1.0, 2.5, 64.0]])
    runs = []
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        proposer = EagleProposer(head, target, topk=3, nodes=16, cost=steep)
        calls = []
        monkeypatch.setattr(proposer, "_run", lambda *a, _run=proposer._run, calls=calls: calls.append(1) or _run(*a))
        out, stats = generate_ids(target, prompt, proposer=proposer, k=proposer.guessing.max_depth,
                                  max_new_tokens=NEW)
        assert out == expected
        runs.append(len(calls))
    assert runs[0] < NEW // 2, runs  # resting, not running every step
    assert runs[-1] <= runs[0]  # a later request starts where the last one left off
    assert head.rest_state[0] < 1.0


def test_resting_head_skips_hidden_states_until_its_probe_and_restarts_after_the_gap(target, head, reference,
                                                                                     monkeypatch) -> None:
    """A resting head reads no hidden states until HIDDEN_LEAD steps before it probes (the engine's forwards then
    return none for it); its probe's cache restarts on the positions read since, and the output stays plain's."""
    monkeypatch.delattr(head, "rest_state", raising=False)
    monkeypatch.setattr(eagle_module, "HIDDEN_LEAD", 2)
    steep = FrozenCost([1, 2, 64], [0, 1000], [[1.0, 2.5, 64.0], [1.0, 2.5, 64.0]])
    gaps = restarts = 0
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        proposer = EagleProposer(head, target, topk=3, nodes=16, cost=steep)
        seen: list[tuple[int, int, int]] = []  # (first position, positions, rest) of each reading
        observe = proposer._take_hidden

        def spy(start, hidden, observe=observe, seen=seen, proposer=proposer):
            seen.append((start, hidden[0].shape[0], proposer.resting.left))
            observe(start, hidden)

        def probe(*a, _run=proposer._run, proposer=proposer):
            nonlocal restarts
            restarts += proposer.offset == proposer.known_from > 0
            return _run(*a)

        monkeypatch.setattr(proposer, "_take_hidden", spy)
        monkeypatch.setattr(proposer, "_run", probe)
        out, _ = generate_ids(target, prompt, proposer=proposer, k=proposer.guessing.max_depth, max_new_tokens=NEW)
        assert out == expected
        assert all(rest < 2 for _, _, rest in seen)  # read only within HIDDEN_LEAD steps of a probe
        gaps += sum(b > a + n for (a, n, _), (b, _, _) in zip(seen, seen[1:], strict=False))
    assert gaps > 0 and restarts > 0


@pytest.mark.parametrize(("rest", "reachable"), [(NEW // 2, True), (NEW - 2, True), (NEW - 1, False), (NEW, False),
                                                (NEW + 3, False)])
def test_resting_head_reads_no_hidden_states_when_its_probe_falls_after_the_request(
        target, head, reference, monkeypatch, rest, reachable) -> None:
    """Each step commits a token or more, and a step guesses only where two tokens or more are left, so a head whose
    probe (the step after its rest) falls on the request's last step or after it cannot probe in it: it reads nothing
    (the forwards return no hidden states for it); one whose probe comes in time (NEW - 2 steps of rest: the
    next-to-last step) reads and probes. The output is plain decoding's either way."""
    monkeypatch.setattr(eagle_module, "HIDDEN_LEAD", 10_000)  # only the request's end decides
    steep = FrozenCost([1, 2, 64], [0, 1000], [[1.0, 2.5, 64.0], [1.0, 2.5, 64.0]])
    prompt, expected = PROMPTS[0], reference[0]
    monkeypatch.setattr(head, "rest_state", (0.5, rest, (1.0, 2.0, 8)), raising=False)  # resting when the last ended
    proposer = EagleProposer(head, target, topk=3, nodes=16, cost=steep)
    reads, runs = [], []
    monkeypatch.setattr(proposer, "_take_hidden", lambda start, hidden, observe=proposer._take_hidden:
                        reads.append(start) or observe(start, hidden))
    monkeypatch.setattr(proposer, "_run", lambda *a, _run=proposer._run: runs.append(1) or _run(*a))
    out, _ = generate_ids(target, prompt, proposer=proposer, k=proposer.guessing.max_depth, max_new_tokens=NEW)
    assert out == expected
    assert (len(reads) > 0 and len(runs) > 0) if reachable else (reads == [] and runs == [])


@pytest.mark.parametrize("context", [2, 5])
def test_head_catching_up_on_a_window_stays_lossless_and_drafts(target, head, reference, monkeypatch, context) -> None:
    """A run catches up on at most HEAD_CONTEXT positions (a probe after a rest, a long prompt): the head's cache
    restarts on them. Here a prompt longer than that starts its request from such a window."""
    monkeypatch.setattr(eagle_module, "HEAD_CONTEXT", context)
    proposer = EagleProposer(head, target, topk=3, nodes=8)
    accepted, windowed = 0, 0
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        out, stats = generate_ids(target, prompt, proposer=proposer, k=3, max_new_tokens=NEW)
        assert out == expected
        windowed += proposer.offset > 0
        accepted += stats.accepted
    assert windowed >= sum(len(p) > context + 1 for p in PROMPTS) > 0 and accepted > 0


def test_head_judged_in_plain_steps_while_the_load_moves(target, head, monkeypatch) -> None:
    """Steps that each gain two tokens for about one plain step's price pay, whatever the load when each was priced:
    a run's first steps are priced before the load has followed the machine (a flat table starts at a second per
    forward), and reading them at the later price sent a head that doubles the rate to rest for good."""
    monkeypatch.delattr(head, "rest_state", raising=False)
    flat = FrozenCost([1, 64], [0, 1000], [[1.0, 1.01], [1.0, 1.01]])
    proposer = EagleProposer(head, target, topk=3, nodes=16, cost=flat)
    for load in (50.0,) * 4 + (1.0,) * 4 + (0.02,) * 4:
        flat.load = load
        proposer.step_head = (0.0, 10)
        proposer._judge(nodes=2, accepted=1)
        assert proposer.resting.value == pytest.approx(2.0, rel=0.01) and proposer.resting.left == 0


@pytest.mark.parametrize("greedy", [True, False])
def test_cost_sizes_the_tree(target, head, reference, greedy: bool, monkeypatch) -> None:
    """A flat cost sends deep trees; a cost that more than doubles with each token sends none (plain steps), and
    both stay lossless; the calibration learns how often the head's confidence is borne out. (Sizing alone: the
    head never rests here, see test_head_rests_while_its_steps_do_not_pay.)"""
    monkeypatch.setattr(eagle_module, "MIN_EVIDENCE", 10**9)
    flat = FrozenCost([1, 64], [0, 1000], [[1.0, 1.01], [1.0, 1.01]])
    steep = FrozenCost([1, 2, 64], [0, 1000], [[1.0, 2.5, 64.0], [1.0, 2.5, 64.0]])
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0)
    sizes = {}
    for name, cost in (("flat", flat), ("steep", steep)):
        monkeypatch.delattr(head, "rest_state", raising=False)  # not what other tests taught the shared head
        proposer = EagleProposer(head, target, topk=3, nodes=16, cost=cost)
        drafted = forwards = 0
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            out, stats = generate_ids(target, prompt, proposer=proposer, k=proposer.guessing.max_depth,
                                      max_new_tokens=NEW, params=params, seed=0)
            if greedy:
                assert out == expected, f"{name}: prompt {prompt}"
            drafted, forwards = drafted + stats.drafted, forwards + stats.target_forwards
        sizes[name] = drafted / forwards
        if name == "flat":
            accepted, predicted = proposer.calibration[greedy]
            assert accepted > 0 and predicted > 0
    assert sizes["steep"] == 0 and sizes["flat"] > (3 if greedy else 1.5), sizes


def test_trained_head_beats_chance(target, head, reference) -> None:
    """One guess a step: the head's top token is the target's next token far more often than chance (1/56)."""
    proposer = EagleProposer(head, target, topk=1, nodes=1)
    stats = [generate_ids(target, p, proposer=proposer, k=1, max_new_tokens=NEW)[1] for p in PROMPTS]
    assert sum(s.accepted for s in stats) / sum(s.drafted for s in stats) > 0.1


# --------------------------------------------------------------------------------- distribution
def random_head(target: Transformer, draft_vocab: int, seed: int) -> EagleHead:
    head = EagleHead(EagleConfig.for_target(target.config, draft_vocab))
    randomize_(head, seed, head_gain=2.0)
    with torch.no_grad():
        head.d2t.copy_(torch.arange(target.config.vocab_size - draft_vocab, target.config.vocab_size))
    return head.to(target.dtype).eval().requires_grad_(False)


def sampled_fit(proposer: EagleProposer, target: Transformer, params: SamplingParams, samples: int, k,
                cost=None) -> tuple[float, float]:
    """(chi-square p, total variation) of `samples` sampled 3-token outputs of `target` (on any device) against the
    exact joint (enumerated on a CPU copy)."""
    tokens, counts = 3, Counter()
    drafted = accepted = 0
    for seed in range(samples):
        out, stats = generate_ids(target, PROMPT, proposer=proposer, k=k, cost=cost, max_new_tokens=tokens,
                                  params=params, seed=seed)
        counts[tuple(out)] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted
    return chi_square(counts, exact_joint(copy.deepcopy(target).cpu(), PROMPT, params, tokens), samples)


def sampling_target() -> Transformer:
    return tiny_model(3, head_gain=3.0, vocab_size=8, num_layers=1, hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1, head_dim=16)


def test_sampled_eagle_matches_target_distribution() -> None:
    """A chain drawn from the head's q over a reduced vocabulary (tokens outside it have q = 0), top-p on both."""
    target = sampling_target()
    proposer = EagleProposer(random_head(target, 6, seed=4), target)
    pvalue, tv = sampled_fit(proposer, target, SamplingParams(temperature=0.8, top_p=0.9), 2000, k=2)
    assert pvalue > ALPHA and tv < 0.1, (pvalue, tv)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_sampled_chains_sized_by_the_cost_model_match_target_distribution(device: str) -> None:
    """The cost model decides how deep each chain goes, and whether a depth goes out must not read the token drawn
    there: a cut that weighed each draw's own q(x) sent low-q draws too rarely (this head: p = 3e-10 before; on an
    H200 after the fix, 3,000 samples: p = 0.95)."""
    target = sampling_target().to(device)
    cheap = guessing_pays()
    proposer = EagleProposer(random_head(target, 6, seed=2).to(device), target, cost=cheap)
    pvalue, tv = sampled_fit(proposer, target, SamplingParams(temperature=1.0), 6000, k=FixedK(5), cost=cheap)
    assert pvalue > ALPHA and tv < 0.05, (pvalue, tv)


# ---------------------------------------------------------------------------------- CLI and errors
def write_train_data(root: Path) -> Path:
    (root / "sharegpt").mkdir(parents=True)
    rows = [{"conversations": [{"from": "human", "value": f"say {w} twice"}, {"from": "gpt", "value": w}]}
            for w in ("fox", "dog", "add", "hello", "world", "quick", "brown", "lazy")]
    (root / "sharegpt" / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "train.jsonl").write_text("".join(json.dumps({"question": f"what is {i} + {i}?"}) + "\n"
                                                        for i in range(8)))
    return root


def test_prompts_interleave_sources_and_refuse_a_missing_folder(tmp_path) -> None:
    texts = prompt_texts(write_train_data(tmp_path / "data"), limit=4)
    assert len(texts) == 4 and sum(t.startswith("what is") for t in texts) == 2
    with pytest.raises(FileNotFoundError, match="--data"):
        prompt_texts(tmp_path / "missing")


def test_cli_train_eagle_end_to_end_and_resume(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    ckpt = write_checkpoint(tmp_path / "tiny", make_tokenizer(), layers=4)
    data, out = write_train_data(tmp_path / "data"), tmp_path / "head"
    args = ["train", "eagle", "--target", str(ckpt), "--data", str(data), "--out", str(out), "--samples", "12",
            "--heldout", "3", "--max-new-tokens", "12", "--gen-batch", "4", "--batch-size", "4", "--max-len", "64",
            "--draft-vocab", "64", "--ttt-steps", "2", "--eval-every", "3", "--device", "cpu",
            "--distill-engine", "transformers"]  # the GPU's way of answering (the others run specdecode's)
    assert cli_main([*args, "--steps", "3"]) == 0
    assert (out / "eagle.safetensors").exists() and (out / "report.md").exists()
    assert len((out / "work" / "samples.jsonl").read_text().splitlines()) == 12
    capsys.readouterr()
    assert cli_main([*args, "--steps", "6"]) == 0  # resumes: data and features cached, 3 more steps
    captured = capsys.readouterr()
    assert "resuming from step 3" in captured.out + captured.err
    assert "using 12 target answers" in captured.out + captured.err
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6]
    assert "| 6 |" in (out / "report.md").read_text()
    capsys.readouterr()
    common = ["generate", "say fox twice", "--model", str(ckpt), "--dtype", "float64", "--json", "--max-new-tokens",
              "24", "--k", "3"]
    assert cli_main([*common, "--method", "eagle", "--draft", str(out)]) == 0
    eagle = json.loads(capsys.readouterr().out)
    assert cli_main([*common, "--method", "none"]) == 0
    assert eagle["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert eagle["stats"]["drafted"] > 0
    tuned = tmp_path / "tuned"  # fine-tuned from that head, on answers already made
    assert cli_main([*args[:7], str(tuned), *args[8:], "--steps", "2", "--init", str(out), "--samples-file",
                     str(out / "work" / "samples.jsonl")]) == 0
    assert "the head before fine-tuning" in capsys.readouterr().err
    assert "| 0 |" in (tuned / "report.md").read_text() and (tuned / "eagle.safetensors").exists()


def test_eagle_errors_say_what_to_do(tmp_path, target, head, capsys) -> None:
    with pytest.raises(FileNotFoundError, match="specdecode train eagle"):
        EagleHead.load(tmp_path)
    other = tiny_model(1, vocab_size=VOCAB + 8, num_layers=4)
    with pytest.raises(ValueError, match="train a head for this target"):
        EagleProposer(head, other)
    with pytest.raises(ValueError, match="topk"):
        EagleProposer(head, target, topk=0)
    ckpt = write_checkpoint(tmp_path / "tiny", make_tokenizer())
    import specdecode

    with pytest.raises(ValueError, match="no EAGLE head ships"):
        specdecode.load(ckpt).generate("hi", method="eagle")
    assert cli_main(["train", "eagle", "--target", str(ckpt), "--data", str(tmp_path / "nope"), "--out",
                     str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert cli_main(["train", "eagle", "--target", str(ckpt), "--out", str(tmp_path / "o"), "--init", "shipped"]) == 2
    assert "no EAGLE head ships" in capsys.readouterr().err


def test_cli_trains_in_torchrun_workers_on_a_sharded_feature_cache(tmp_path, monkeypatch, capsys) -> None:
    """`--nproc 2`: torchrun workers (gloo) train one head in DDP, each on its own shard of the features; the
    main worker alone logs and saves."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    ckpt = write_checkpoint(tmp_path / "tiny", make_tokenizer(), layers=4)
    out = tmp_path / "two"
    args = ["train", "eagle", "--target", str(ckpt), "--data", str(write_train_data(tmp_path / "data")), "--out",
            str(out), "--samples", "16", "--heldout", "4", "--max-new-tokens", "16", "--gen-batch", "8",
            "--batch-size", "4", "--max-len", "64", "--steps", "6", "--draft-vocab", "64", "--ttt-steps", "2",
            "--eval-every", "3", "--device", "cpu", "--nproc", "2"]
    assert cli_main(args) == 0
    assert len((out / "work" / "samples.jsonl").read_text().splitlines()) == 16  # both workers' answers, merged
    assert not list((out / "work").glob("samples.part*"))
    shards = sorted((out / "work").glob("features-*-train-*of2"))
    assert [p.name.rsplit("-", 1)[1] for p in shards] == ["0of2", "1of2"]  # the feature cache, sharded
    assert [len(FeatureStore.load(p)) for p in shards] == [6, 6]  # 12 training samples split between the workers
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [3, 6]
    assert (out / "eagle.safetensors").exists() and "| 6 |" in (out / "report.md").read_text()
    assert "- samples: 12 train, 4 held out" in (out / "report.md").read_text()  # both workers' shards
    capsys.readouterr()
    assert cli_main([*args, "--batch-size", "3"]) == 2  # refused before any worker starts
    assert "--batch-size 3 does not split between 2 processes" in capsys.readouterr().err


def train_tiny_head(out: Path) -> EagleHead:
    """A head for the tiny target, on this worker's shard of 64 answers (all of them in one process): 60 steps
    of a global batch of 16, scored on 16 other answers."""
    target = tiny_model(0, vocab_size=VOCAB, num_layers=4)
    store = extract_features(target, shard(distilled(target, 64, seed=0)), [0, 1, 2, 3], topk=4)
    heldout = extract_features(target, distilled(target, 16, seed=1), [0, 1, 2, 3], topk=4)
    cfg = TrainConfig(steps=60, lr=3e-3, warmup=10, eval_every=60, save_every=60)
    return train_eagle(target, store, heldout, out, cfg, draft_vocab=48, ttt_steps=3, batch_size=16, max_len=64,
                       log=lambda *_: None)


def heldout_acc1(out: Path) -> float:
    return json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])["heldout_acc1"]


def ddp_worker(rank: int, size: int, rendezvous: str, out: str) -> None:
    import torch.distributed as dist

    from specdecode.training.distributed import finish

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        head = train_tiny_head(Path(out))
        torch.save(head.state_dict(), Path(out) / f"worker{rank}.pt")
        finish()  # as a torchrun worker ends: a barrier first (a worker that left while its peer still talked to it
        # aborted in gloo's teardown once in CI), then the group goes
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ddp_in_two_processes_scores_as_one_process_at_equal_samples(tmp_path) -> None:
    """The same 64 answers, steps and global batch: two DDP workers (each half the batch, from its own half of
    the data) reach one process's held-out score (the batches differ, so within noise, not bit for bit)."""
    import torch.multiprocessing as mp

    train_tiny_head(tmp_path / "one")
    mp.spawn(ddp_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "two")), nprocs=2)
    one, two = heldout_acc1(tmp_path / "one"), heldout_acc1(tmp_path / "two")
    workers = [torch.load(tmp_path / "two" / f"worker{r}.pt") for r in range(2)]
    for name, weight in workers[0].items():  # gradients averaged: both workers took the same steps
        assert torch.equal(weight, workers[1][name]), name
    chance = 1 / 48
    assert one > 5 * chance and two > 5 * chance
    assert abs(one - two) < 0.05, (one, two)


def test_unshard_undoes_the_round_robin_shards() -> None:
    from specdecode.training.distributed import unshard, without_nproc

    items = list(range(11))
    assert unshard([items[r::3] for r in range(3)]) == items
    assert unshard([[], []]) == []
    assert without_nproc(["train", "--nproc", "2", "--out", "x", "--nproc=3"]) == ["train", "--out", "x"]


def test_fine_tuning_starts_from_the_trained_head_and_takes_the_tokens_it_lacks(target, trained, store, reference,
                                                                               tmp_path) -> None:
    """train_eagle(init=head): step 0 of the log is the head as it was (its held-out score), its layers and
    vocabulary size stay, up to vocab_swaps rows go to the tokens the new answers' teacher picks most that the head
    lacks (at least twice), and the fine-tuned head drafts losslessly."""
    init = EagleHead.load(trained)
    lacking = sorted(set(range(VOCAB)) - set(init.d2t.tolist()))
    assert len(lacking) == VOCAB - 48
    shifted = copy.copy(store)
    shifted.teacher_ids = store.teacher_ids.clone()
    top = shifted.teacher_ids[:, 0]
    top[:800], top[800:1200], top[1200:1201] = lacking[0], lacking[1], lacking[2]  # two taken; one seen once
    least = torch.bincount(top, minlength=VOCAB)[init.d2t].sort().values[:2]
    assert 2 * least[1] <= 400 and len(top) > 2000  # what the rows given away had
    cfg = TrainConfig(steps=10, lr=1e-3, warmup=2, eval_every=10, save_every=10)
    tuned = train_eagle(target, shifted, store, tmp_path, cfg, ttt_steps=3, batch_size=16, max_len=64,
                        log=lambda *_: None, init=init, vocab_swaps=4)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 10]
    before = json.loads((trained / "train_log.jsonl").read_text().splitlines()[-1])["heldout_chain_tau"]
    assert log[0]["heldout_chain_tau"] == pytest.approx(before, abs=2e-3)  # the trained head, as it was
    added = set(tuned.d2t.tolist()) - set(init.d2t.tolist())
    assert added == {lacking[0], lacking[1]} and len(tuned.d2t) == len(init.d2t)
    assert tuned.config.target_layers == init.config.target_layers
    saved = EagleHead.load(tmp_path, dtype=torch.float64)
    proposer = EagleProposer(saved, target, topk=2, nodes=6)
    assert [generate_ids(target, p, proposer=proposer, k=3, max_new_tokens=NEW)[0] for p in PROMPTS] == reference
    kept = train_eagle(target, shifted, store, tmp_path / "kept", cfg, ttt_steps=3, batch_size=16, max_len=64,
                       log=lambda *_: None, init=init, vocab_swaps=0)
    assert kept.d2t.tolist() == init.d2t.tolist()


def test_hybrid_takes_a_head_folder_as_its_head(target, trained, reference, tmp_path) -> None:
    """`method="hybrid", draft=HEAD_DIR`: suffix decoding beside that head (a model's checkpoint there is still a
    model draft); greedy output stays plain decoding's."""
    import specdecode
    from specdecode.proposers.hybrid import eagle_head_dir
    from specdecode.proposers.suffix_eagle import SuffixEagleProposer

    llm = specdecode.LLM(target, make_tokenizer())
    proposer = llm.proposer("hybrid", trained)
    assert isinstance(proposer, SuffixEagleProposer) and proposer.eagle.head is llm.assets.eagle_head(trained)
    out = llm.generate(PROMPTS[0], method="hybrid", draft=trained, k=4, max_new_tokens=NEW)
    assert out.token_ids == reference[0]
    checkpoint = write_checkpoint(tmp_path / "draft", make_tokenizer())
    assert eagle_head_dir(trained) and not eagle_head_dir(checkpoint) and not eagle_head_dir("smollm2-135m-instruct")
