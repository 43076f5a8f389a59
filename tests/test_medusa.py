"""Medusa: heads and their tree stay lossless (greedy equality, exact sampling distribution), the tree follows
the measured accuracies and the cost model, and heads save, load and refuse the wrong target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import specdecode
import specdecode.core.verify
from specdecode.cli.commands import main as cli_main
from specdecode.core.acceptance import AcceptanceStats
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.models.medusa import MedusaHeads
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import AdaptiveK
from specdecode.proposers.base import ProposalContext, RequestInfo, StepOutput
from specdecode.proposers.medusa import PROBE_EVERY, RANKS, REQUEST_TRIALS, MedusaProposer, RankAccuracy, medusa_tree
from specdecode.training.medusa import frequent_tokens

from .helpers import FrozenCost, ask, make_tokenizer, tiny_model, write_checkpoint
from .test_distill import train_args, write_train_data
from .test_distribution import ALPHA, PROMPT, Case, V, chi_square, exact_joint, sample_counts
from .test_lossless import PROMPTS, VOCAB

GREEDY_PROMPTS = PROMPTS[1:7]  # one without a prefill, random ones, repeats (keeps the suite fast)
NEW = 30

FLAT = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 1.0], [1.0, 1.0]])
# +3% per verified node: random heads are right too rarely to pay on the tiny model's measured costs (the
# adaptive policy would stop guessing); on this table it guesses, at depths that vary with acceptance
MILD = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 2.89], [1.0, 2.89]])


@torch.no_grad()
def random_heads(target: Transformer, heads: int, seed: int, vocab: int | None = None, scale: float = 1.0,
                 accuracy: list[list[float]] | None = None) -> MedusaHeads:
    """Heads as training starts them (the target's norm and lm_head rows), residual blocks made random."""
    size = vocab or target.config.vocab_size
    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:size]
    out = MedusaHeads.from_target(target, heads, ids)
    gen = torch.Generator().manual_seed(seed)
    hidden = target.config.hidden_size
    out.res_weight.copy_(scale * torch.randn(out.res_weight.shape, generator=gen, dtype=torch.float64) / hidden**0.5)
    out.config.accuracy = accuracy
    return out.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    return [generate_ids(target, prompt, max_new_tokens=NEW)[0] for prompt in GREEDY_PROMPTS]


WIDE = [[0.35] * 10, [0.3] * 10, [0.25] * 10, [0.2] * 10]  # flat ranks: wide trees, so guesses get accepted


CASES = [("4-heads", k) for k in (1, 2, 3, 4, 8, "auto")] + [
    (variant, k) for variant in ("1-head", "reduced-vocab", "cost-sized") for k in (4, "auto")]


@pytest.mark.parametrize("variant,k", CASES)
def test_greedy_medusa_equals_plain(target, reference, variant: str, k) -> None:
    heads = {
        "4-heads": lambda: random_heads(target, 4, seed=1, accuracy=WIDE),
        "1-head": lambda: random_heads(target, 1, seed=2, accuracy=WIDE[:1]),
        "reduced-vocab": lambda: random_heads(target, 3, seed=3, vocab=VOCAB - 16, accuracy=WIDE[:3]),
        "cost-sized": lambda: random_heads(target, 4, seed=4),  # default accuracy prior, sized by the cost model
    }[variant]()
    proposer = MedusaProposer(heads, VOCAB, cost=MILD if variant == "cost-sized" else None, max_nodes=32)
    drafted = accepted = 0
    shared = AcceptanceStats()
    for prompt, expected in zip(GREEDY_PROMPTS, reference, strict=True):
        policy = k
        if k == "auto":  # as the api: a proposer sizing itself gets its depth cap, others AdaptiveK
            caps = proposer.guessing
            policy = caps.max_depth if caps.sizes_itself else AdaptiveK(MILD, shared, cheap=caps.cheap)
        out, stats = generate_ids(target, prompt, proposer=proposer, k=policy, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted += stats.drafted
        accepted += stats.accepted
    assert 0 < accepted < drafted  # guesses were accepted and rejected, so both paths were checked


def test_no_hidden_state_no_guess(target) -> None:
    """A 1-token prompt has no prefill, so the first step has nothing to draft from: a plain step."""
    proposer = MedusaProposer(random_heads(target, 2, seed=1), VOCAB, max_nodes=8)
    proposer.begin(RequestInfo([5], 100))
    tree = proposer.propose(ask([5], 4))
    assert tree.num_drafted == 0
    proposer.observe(None, None, StepOutput([], 0, [torch.zeros(3, target.config.hidden_size, dtype=torch.float64)]))
    assert proposer.propose(ask([1, 2, 3, 4], 4)).num_drafted > 0  # hidden of position 2
    assert proposer.propose(ask([1, 2, 3, 4, 5], 4)).num_drafted == 0  # stale: not position 3


# ------------------------------------------------------------------------------------------------ the tree


def test_tree_follows_accuracy() -> None:
    shape = medusa_tree([[0.8, 0.1], [0.5, 0.3], [0.4, 0.1]], max_nodes=5)
    assert shape.ranks == [(0,), (0, 0), (0, 1), (0, 0, 0), (1,)]
    assert shape.parents == [-1, 0, 1, 1, 2, 0]
    assert shape.estimates == pytest.approx([0.8, 0.4, 0.24, 0.16, 0.1])
    # the estimates never increase down the list, and every node's parent comes first
    full = medusa_tree([[0.7, 0.2, 0.05], [0.6, 0.2], [0.5, 0.3], [0.4]], max_nodes=40)
    assert all(a >= b for a, b in zip(full.estimates, full.estimates[1:], strict=False))
    assert all(0 <= p < i for i, p in enumerate(full.parents[1:], start=1))
    assert len(full.ranks) == 3 + 3 * 2 + 3 * 2 * 2 + 3 * 2 * 2  # every rank path, since 40 > all of them


STEEP = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 19.9], [1.0, 19.9]])  # +0.3 per node
GREEDY = SamplingParams()


def sized(target: Transformer, cost: CostModel, accuracy: RankAccuracy | None = None, vocab: int | None = None
          ) -> MedusaProposer:
    """Two heads claiming 60% / 40% per rank, sized by `cost`, holding a hidden state for 4-token texts."""
    heads = random_heads(target, 2, seed=1, vocab=vocab, accuracy=[[0.6] * 10, [0.4] * 10])
    proposer = MedusaProposer(heads, VOCAB, cost=cost, max_nodes=30, accuracy=accuracy)
    proposer.observe(None, None, StepOutput([], 0, [torch.zeros(3, target.config.hidden_size, dtype=torch.float64)]))
    return proposer


def test_tree_size_from_cost(target) -> None:
    tokens = [1, 2, 3, 4]
    assert sized(target, FLAT).propose(ask(tokens, 4)).num_drafted == 30  # verifying is free: all
    # +0.3 per node: the 10 first-head guesses (0.6 each) pay, the second head's (0.24) do not
    tree = sized(target, STEEP).propose(ask(tokens, 4))
    assert tree.num_drafted == 10 and tree.depth == 1
    assert sized(target, STEEP).propose(ask(tokens, 1)).num_drafted == 10  # k caps the depth
    few = MedusaProposer(random_heads(target, 2, seed=1, vocab=3), VOCAB, max_nodes=64)  # a 3-token draft vocab
    few.observe(None, None, StepOutput([], 0, [torch.zeros(3, target.config.hidden_size, dtype=torch.float64)]))
    assert few.propose(ask(tokens, 4)).num_drafted == 3 + 3 * 3  # no more distinct guesses than that


def test_heads_do_not_run_while_they_cannot_pay(target) -> None:
    linear = FrozenCost(sizes=[1, 64], contexts=[0, 1024], seconds=[[1.0, 64.0], [1.0, 64.0]])
    proposer = sized(target, linear)  # each node costs a whole forward: guessing never pays
    for _ in range(PROBE_EVERY):
        assert proposer.propose(ask([1, 2, 3, 4], 4)).num_drafted == 0
    assert proposer.head_seconds is None  # the heads were skipped: those steps cost nothing extra
    assert proposer.propose(ask([1, 2, 3, 4], 4)).num_drafted == 0
    assert proposer.head_seconds is not None  # a probe ran the first head, to keep learning
    assert [len(top) for _, top in proposer.pending] == [1]
    costly = sized(target, STEEP)  # guesses would pay, but not heads costing 4 plain steps each
    costly.head_seconds = 4.0
    drafted = [costly.propose(ask([1, 2, 3, 4], 4)).num_drafted for _ in range(PROBE_EVERY + 1)]
    assert drafted == [0] * PROBE_EVERY + [10]  # the probe's heads are spent: what pays is sent
    costly.head_seconds = 0.1
    assert costly.propose(ask([1, 2, 3, 4], 4)).num_drafted == 10  # cheap heads: every step


def run_text(proposer: MedusaProposer, next_token, steps: int) -> list[int]:
    """Propose after a growing text whose next token is next_token(heads' guesses); tokens drafted per step."""
    tokens, hidden = [1, 2, 3, 4], torch.zeros(1, proposer.heads.config.hidden_size, dtype=torch.float64)
    top = proposer.heads.vocab_ids[proposer.heads(hidden[0]).topk(RANKS, dim=-1).indices].tolist()
    drafted = []
    for _ in range(steps):
        drafted.append(proposer.propose(ask(tokens, 4)).num_drafted)
        tokens.append(next_token(top))
        proposer.observe(None, None, StepOutput([], len(tokens) - 2, [hidden]))
    return drafted


def test_accuracy_follows_the_text_and_carries_to_the_next_request(target) -> None:
    shared = RankAccuracy.of(random_heads(target, 2, seed=1, accuracy=[[0.6] * 10, [0.4] * 10]))
    proposer = sized(target, STEEP, shared, vocab=VOCAB - 16)
    never_guessed = next(t for t in range(VOCAB) if t not in proposer.heads.vocab_ids.tolist())
    drafted = run_text(proposer, lambda top: never_guessed, 40)  # the heads claim 60%; the text never agrees
    assert drafted[0] == 10 and drafted[-1] == 0
    assert proposer.accuracy.rates()[0].max() < 0.3 and shared.rates()[0].max() < 0.3  # a guess costs 0.3
    proposer.begin(RequestInfo([1, 2, 3, 4], 100))  # the next request starts from what this one found
    proposer.observe(None, None, StepOutput([], 0, [torch.zeros(3, target.config.hidden_size, dtype=torch.float64)]))
    assert proposer.propose(ask([1, 2, 3, 4], 4)).num_drafted == 0
    assert proposer.accuracy.trials.max() <= REQUEST_TRIALS  # but worth a few trials: it can change its mind
    # a text that takes the first head's 4th guess every time: that guess comes to lead the tree
    fresh = sized(target, FLAT)
    assert fresh.node_rank[fresh.within(fresh.ranked(fresh.chances()), 1)[0]] == 0
    run_text(fresh, lambda top: top[0][3], 20)
    assert fresh.node_rank[fresh.within(fresh.ranked(fresh.chances()), 1)[0]] == 3
    assert fresh.accuracy.rates()[0, 3] > 0.6


# ------------------------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def small_target() -> Transformer:  # test_distribution's target: its joint distribution is enumerable
    return tiny_model(3, head_gain=3.0, vocab_size=V, num_layers=1, hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1, head_dim=16)


def small_heads(target: Transformer, vocab: int) -> MedusaHeads:
    return random_heads(target, 2, seed=8, vocab=vocab, scale=1.0, accuracy=[[0.5, 0.4, 0.3], [0.4, 0.3, 0.2]])


SAMPLES = 1500
# two tokens the heads can never guess (q = 0 there), and top-k / top-p processing on both p and q
SAMPLING = Case(lambda t, d: MedusaProposer(small_heads(t, V - 2), V, max_nodes=8),
                SamplingParams(temperature=0.9, top_k=7, top_p=0.95), 3)
# the same, sized each step by a cost model from accuracies learned across the samples: trees change shape
SIZED = Case(lambda t, d: MedusaProposer(small_heads(t, V - 2), V, cost=MILD, max_nodes=8), SAMPLING.params, 3)


@pytest.mark.parametrize("case", [SAMPLING, SIZED], ids=["whole-tree", "sized"])
def test_medusa_sampling_matches_target_distribution(small_target, case: Case) -> None:
    joint = exact_joint(small_target, PROMPT, case.params, case.tokens)
    counts, totals = sample_counts(small_target, None, case, SAMPLES)
    assert 0 < totals["accepted"] < totals["drafted"], totals
    pvalue, tv = chi_square(counts, joint, SAMPLES)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}, total variation {tv:.3f}"
    assert tv < 0.12


def test_medusa_negative_control(small_target, monkeypatch) -> None:
    """The same test catches a wrong rejection rule on Medusa trees, so passing it means something."""
    monkeypatch.setattr(specdecode.core.verify, "residual", lambda p, x, q: p)
    counts, _ = sample_counts(small_target, None, SAMPLING, 500)
    pvalue, tv = chi_square(counts, exact_joint(small_target, PROMPT, SAMPLING.params, SAMPLING.tokens), 500)
    assert pvalue < 1e-6, f"the wrong rule went unnoticed: p = {pvalue:.2e}, total variation {tv:.3f}"


def test_sampled_siblings_are_drawn_from_the_heads(small_target) -> None:
    heads = small_heads(small_target, V)
    proposer = MedusaProposer(heads, V, max_nodes=8)
    hidden = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    proposer.observe(None, None, StepOutput([], 0, [hidden]))
    params = SamplingParams(temperature=1.0)
    tree = proposer.propose(ProposalContext(list(range(5)), 4, params, torch.Generator().manual_seed(1)))
    q = params.probs(heads.target_logits(hidden[-1]))
    for node in range(1, len(tree)):
        depth = int(tree.depths()[node])
        torch.testing.assert_close(tree.draft_probs[node], q[depth - 1])
        assert q[depth - 1][tree.tokens[node]] > 0


# ------------------------------------------------------------------------------------- persistence, errors


def test_save_load_round_trip(target, tmp_path) -> None:
    heads = random_heads(target, 3, seed=5, vocab=20, accuracy=WIDE[:3])
    heads.save(tmp_path / "heads")
    loaded = MedusaHeads.load(tmp_path / "heads", dtype=torch.float64)
    assert loaded.config == heads.config
    hidden = torch.randn(5, target.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)
    assert torch.equal(loaded.vocab_ids, heads.vocab_ids)


def test_errors(target, tmp_path) -> None:
    with pytest.raises(ValueError, match="at least one head"):
        MedusaHeads.from_target(target, 0, torch.arange(VOCAB))
    with pytest.raises(FileNotFoundError, match="train medusa"):
        MedusaHeads.load(tmp_path / "nothing")
    heads = random_heads(target, 2, seed=1)
    with pytest.raises(ValueError, match="cannot draft for a target with 99 tokens"):
        MedusaProposer(heads, 99)
    other = tiny_model(0, vocab_size=VOCAB, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="hidden size 64"):
        heads.check_target(other)


def test_frequent_tokens() -> None:
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 1])
    assert frequent_tokens(tokens, 2, 10).tolist() == [2, 5]
    assert frequent_tokens(tokens, 2, 10, always=[7]).tolist() == [5, 7]
    assert frequent_tokens(tokens, 0, 10).tolist() == list(range(10))


# ------------------------------------------------------------------------------------- training end to end


def test_train_medusa_end_to_end(tmp_path, capsys, monkeypatch) -> None:
    """`specdecode train medusa` on a tiny checkpoint: heads saved with measured accuracy, resumable, usable."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # the tiny model's cost table goes there
    target = write_checkpoint(tmp_path / "target", make_tokenizer())
    data = write_train_data(tmp_path / "data")
    out = tmp_path / "heads"
    args = train_args("medusa", target, data, out, "--heads", "2", "--draft-vocab", "64", "--save-dtype", "bfloat16")
    assert cli_main([*args, "--steps", "2"]) == 0
    assert load_file(str(out / "model.safetensors"))["out_weight"].dtype == torch.bfloat16  # half-size files
    heads = MedusaHeads.load(out)
    assert heads.config.heads == 2 and heads.config.draft_vocab_size == 64
    assert len(heads.config.accuracy) == 2 and all(0 <= a <= 1 for row in heads.config.accuracy for a in row)
    assert {"report.md", "checkpoint.pt", "train_log.jsonl"} <= {p.name for p in out.iterdir()}
    assert "held-out prompts" in (out / "report.md").read_text()
    assert cli_main([*args, "--steps", "3"]) == 0  # resumes: one more step
    assert "resuming from step 2" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [2, 3]
    # through the API, greedy output is the target's own
    llm = specdecode.load(target, dtype="float64")
    plain = llm.generate("the quick brown fox", method="none", max_new_tokens=20)
    assert llm.generate("the quick brown fox", max_new_tokens=20, method="medusa", draft=out, k=2).token_ids == \
        plain.token_ids
    # bad input is refused with a message that says what to do
    for argv, message in [
        ([*args, "--heads", "0"], "--heads must be >= 1"),
        (train_args("medusa", target, tmp_path / "missing", tmp_path / "x"), "not found"),
        ([*args, "--heads", "3"], "other settings"),
    ]:
        assert cli_main(argv) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="hidden size"):
        llm.generate("hi", method="medusa", draft=tmp_path_heads_for_other_target(tmp_path))


def tmp_path_heads_for_other_target(tmp_path) -> str:
    other = tiny_model(0, vocab_size=len(make_tokenizer()), hidden_size=32, head_dim=8)
    return str(MedusaHeads.from_target(other, 2, torch.arange(10)).save(tmp_path / "other"))
