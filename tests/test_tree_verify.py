"""DraftTree geometry, the verification rules on handcrafted logits, logits processing and proposers."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.core.sampling import SamplingParams, greedy_token, greedy_tokens
from specdecode.core.tree import DraftTree, ExtraNodes
from specdecode.core.verify import residual, verify
from specdecode.proposers import DraftModelProposer, PromptLookupProposer
from specdecode.proposers.base import ProposalContext, RequestInfo

from .helpers import ask, tiny_model

V = 10
SAMPLED = SamplingParams(temperature=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax_ties_and_nan_included(dtype) -> None:
    """NumPy's argmax on the CPU (PyTorch's is not vectorised) picks what torch.argmax picks: the first maximum, NaN
    above everything."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 5.0, nan, 1.0], [-inf] * 4, [2.0, inf, inf, 0.0],
                         [0.0, 0.0, 0.0, 0.0], [-1.0, -3.0, 4.0, 4.0]], dtype=dtype)
    random = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    random[2, [7, 40000]] = random[2].max() + 1  # a tie at the top, far apart
    for logits in (rows, random, rows[1:4], random[:, ::2]):  # strided views too
        assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
        assert [greedy_token(row) for row in logits] == logits.argmax(dim=-1).tolist()


# ------------------------------------------------------------------------------------ constructors


def test_chain_and_root_only() -> None:
    q = torch.full((V,), 1 / V, dtype=torch.float64)
    tree = DraftTree.chain(7, [1, 2, 3], [q, q, q])
    assert tree.tokens == [7, 1, 2, 3] and tree.parents == [-1, 0, 1, 2]
    assert tree.is_chain and tree.num_drafted == 3 and tree.attention_mask() is None
    assert tree.draft_probs[0] is None and tree.draft_probs[1] is q
    assert tree.depths().tolist() == [0, 1, 2, 3]
    assert DraftTree.chain(7, [1, 2]).draft_probs == [None, None, None]  # point masses by default
    root = DraftTree.root_only(4)
    assert root.tokens == [4] and root.num_drafted == 0 and root.children(0) == []


def test_from_paths_merges_shared_prefixes_into_a_trie() -> None:
    tree = DraftTree.from_paths(0, [[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]])
    assert tree.tokens == [0, 1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 2, 2, 1, 0]
    assert tree.children(0) == [1, 6] and tree.children(1) == [2, 5] and tree.children(2) == [3, 4]
    assert tree.depths().tolist() == [0, 1, 2, 3, 3, 2, 1]
    assert not tree.is_chain
    assert tree.depth == 3 and tree.forward_sizes() == [1, 3, 5, 7]  # tokens verified when cut at each depth
    assert tree.cut(2).tokens == [0, 1, 2, 5, 6] and tree.cut(0).tokens == [0]
    extra = ExtraNodes([8, 9], [1, 2], torch.ones(2, 2, dtype=torch.bool))
    with_extra = DraftTree(tree.tokens, tree.parents, bucket=1, extra=extra)
    assert with_extra.forward_sizes() == [1, 5, 7, 9]  # extra nodes ride along with any guess, not a plain step
    assert with_extra.cut(0).extra is None and with_extra.cut(1).extra is extra
    # the same token under different parents is a different node
    other = DraftTree.from_paths(0, [[1, 1], [2, 1]])
    assert other.tokens == [0, 1, 1, 2, 1] and other.parents == [-1, 0, 1, 0, 3]
    assert DraftTree.from_paths(9, []).tokens == [9]
    assert DraftTree.from_paths(9, [[3, 4]]).is_chain


@pytest.mark.parametrize("tokens,parents", [
    ([], []),  # no root
    ([1, 2], [-1]),  # one parent per token
    ([1, 2], [0, 0]),  # root must have parent -1
    ([1, 2, 3], [-1, 0, 2]),  # a parent must come before its child
    ([1, 2, 3], [-1, 3, 0]),
    ([1, 2], [-1, -1]),  # a second root
])
def test_invalid_trees_raise(tokens: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_attention_mask_sees_self_and_ancestors() -> None:
    tree = DraftTree.from_paths(0, [[1, 2], [1, 3], [4]])  # nodes: 0 root, 1, 2 (under 1), 3 (under 1), 4
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.attention_mask(), expected)


# ----------------------------------------------------------------------------------- greedy verify


def one_hot_logits(argmaxes: list[int]) -> torch.Tensor:
    """Row i: small random logits with a clear maximum at argmaxes[i]."""
    logits = torch.rand(len(argmaxes), V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[torch.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


# tree nodes: 0 root, 1 '1', 2 '2' (under 1), 3 '3' (under 2), 4 '4' (under 1), 5 '5' (under root)
GREEDY_TREE = DraftTree.from_paths(0, [[1, 2, 3], [1, 4], [5]])


@pytest.mark.parametrize("argmaxes,path,next_token", [
    ([8, 0, 0, 0, 0, 0], [0], 8),  # no guess is right: correction at the root
    ([1, 4, 0, 0, 7, 0], [0, 1, 4], 7),  # second child of node 1, then the bonus after a leaf
    ([1, 9, 0, 0, 0, 0], [0, 1], 9),  # first level right, second wrong
    ([5, 0, 0, 0, 0, 6], [0, 5], 6),  # second child of the root
    ([1, 2, 3, 2, 0, 0], [0, 1, 2, 3], 2),  # the whole deepest path, then its bonus
])
def test_greedy_verify(argmaxes: list[int], path: list[int], next_token: int) -> None:
    verdict = verify(GREEDY_TREE, one_hot_logits(argmaxes), SamplingParams())
    assert verdict.path == path and verdict.next_token == next_token
    assert verdict.num_accepted == len(path) - 1


# ---------------------------------------------------------------------------------- sampled verify


def logits_of(*rows: dict[int, float]) -> torch.Tensor:
    """Logits whose softmax (temperature 1) is exactly the given sparse distributions."""
    out = torch.full((len(rows), V), -math.inf, dtype=torch.float64)
    for i, row in enumerate(rows):
        for token, prob in row.items():
            out[i, token] = math.log(prob)
    return out


def run(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, n: int) -> list[tuple[tuple[int, ...], int]]:
    outcomes = []
    for seed in range(n):
        verdict = verify(tree, logits, params, torch.Generator().manual_seed(seed))
        outcomes.append((tuple(verdict.path), verdict.next_token))
    return outcomes


def test_point_mass_guess_certain_and_impossible() -> None:
    chain = DraftTree.chain(0, [3, 4])
    # p(3) = 1 at the root, p(4) = 1 after it: always accepted; the bonus comes from the last row
    logits = logits_of({3: 1.0}, {4: 1.0}, {6: 0.5, 7: 0.5})
    outcomes = run(chain, logits, SAMPLED, 200)
    assert {path for path, _ in outcomes} == {(0, 1, 2)}
    assert {tok for _, tok in outcomes} == {6, 7}
    # p(3) = 0: always rejected, and the correction never repeats the rejected token
    logits = logits_of({5: 0.5, 8: 0.5}, {4: 1.0}, {6: 1.0})
    outcomes = run(chain, logits, SAMPLED, 200)
    assert {path for path, _ in outcomes} == {(0,)} and {tok for _, tok in outcomes} == {5, 8}


def test_rejected_sibling_is_removed_before_the_next_one() -> None:
    """p = {a: .5, b: .5} with point-mass children a then b: a half the time, else b with certainty."""
    tree = DraftTree.from_paths(0, [[1], [2]])
    logits = logits_of({1: 0.5, 2: 0.5}, {9: 1.0}, {9: 1.0})
    outcomes = run(tree, logits, SAMPLED, 2000)
    paths = [path for path, _ in outcomes]
    assert set(paths) == {(0, 1), (0, 2)}  # never falls through to a fresh sample
    assert abs(paths.count((0, 1)) / 2000 - 0.5) < 0.045  # 4 sigma


def test_sampled_verify_point_mass_frequencies() -> None:
    """Accept point-mass guess x with probability p(x); otherwise sample from p without x."""
    chain = DraftTree.chain(0, [2])
    logits = logits_of({2: 0.3, 5: 0.6, 7: 0.1}, {1: 1.0})
    outcomes = run(chain, logits, SAMPLED, 3000)
    accepted = sum(path == (0, 1) for path, _ in outcomes) / 3000
    assert abs(accepted - 0.3) < 0.034  # 4 sigma
    corrections = [tok for path, tok in outcomes if path == (0,)]
    assert set(corrections) == {5, 7}
    assert abs(corrections.count(5) / len(corrections) - 6 / 7) < 0.04


def test_sampled_verify_with_draft_distribution() -> None:
    """x ~ q accepted with min(1, p/q); after a rejection the residual norm(max(0, p - q)) is used."""
    q = torch.zeros(V, dtype=torch.float64)
    q[0] = 1.0  # the draft was sure of token 0; the target gives it only 0.5
    chain = DraftTree.chain(9, [0], [q])
    logits = logits_of({0: 0.5, 1: 0.5}, {3: 1.0})
    outcomes = run(chain, logits, SAMPLED, 2000)
    assert {(path, tok) for path, tok in outcomes} == {((0, 1), 3), ((0,), 1)}
    assert abs(sum(path == (0, 1) for path, _ in outcomes) / 2000 - 0.5) < 0.045
    # q(x) < p(x): always accepted
    q_low = torch.full((V,), 1 / V, dtype=torch.float64)
    assert {path for path, _ in run(DraftTree.chain(9, [0], [q_low]), logits, SAMPLED, 100)} == {(0, 1)}


def test_sampled_verify_applies_top_k() -> None:
    """Verification uses the processed p: with top_k=1 only the argmax can be accepted or sampled."""
    logits = one_hot_logits([4, 2, 0])  # row 0 argmax 4, row 1 argmax 2
    params = SamplingParams(temperature=1.0, top_k=1)
    assert {v for v in run(DraftTree.chain(0, [4, 2]), logits, params, 50)} == {((0, 1, 2), 0)}
    assert {v for v in run(DraftTree.chain(0, [3]), logits, params, 50)} == {((0,), 4)}


def test_residual() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    torch.testing.assert_close(residual(p, 0, None), torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64))
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    torch.testing.assert_close(residual(p, 1, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(residual(p, 0, p.clone()), p)  # nothing left: rounding guard returns p


# ------------------------------------------------------------------------------ logits processing


def test_probs_top_k() -> None:
    params = SamplingParams(temperature=0.5, top_k=2)
    probs = params.probs(torch.tensor([1.0, 3.0, 2.0, 0.0]))
    expected = torch.softmax(torch.tensor([-math.inf, 6.0, 4.0, -math.inf], dtype=torch.float64), -1)
    torch.testing.assert_close(probs, expected)
    assert probs.dtype == torch.float64  # p and q are compared in float64
    assert torch.equal(SamplingParams(temperature=1.0, top_k=9).probs(torch.zeros(4)), torch.full((4,), 0.25,
                       dtype=torch.float64))  # top_k beyond the vocabulary is a no-op


@pytest.mark.parametrize("top_p,kept", [(0.05, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_probs_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, kept: list[int]) -> None:
    base = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = base.log()[[2, 0, 3, 1]]  # shuffled, so the sort and un-sort are exercised
    probs = SamplingParams(temperature=1.0, top_p=top_p).probs(logits)[[1, 3, 0, 2]]
    expected = torch.zeros(4, dtype=torch.float64)
    expected[kept] = base[kept] / base[kept].sum()
    torch.testing.assert_close(probs, expected)


def test_probs_rows_are_independent() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    probs = SamplingParams(temperature=1.0, top_k=1).probs(logits)
    assert probs.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


# ------------------------------------------------------------------------------------- proposers


def test_prompt_lookup_continuations() -> None:
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert PromptLookupProposer().continuations(seq, 3) == [[7, 1, 2]]  # the most recent match first
    assert PromptLookupProposer(branches=2).continuations(seq, 3) == [[7, 1, 2], [9, 1, 2]]
    # the longest n-gram wins: (4, 5) only follows the 2-gram match, not the more recent 1-gram one
    assert PromptLookupProposer().continuations([4, 5, 6, 8, 5, 0, 4, 5], 2) == [[6, 8]]
    assert PromptLookupProposer().continuations([5, 6, 5], 3) == [[6, 5]]  # clipped at the end
    assert PromptLookupProposer(branches=3).continuations([5, 6, 5, 6, 5], 1) == [[6]]  # duplicates merged
    assert PromptLookupProposer().continuations([1, 2, 3], 4) == []  # nothing repeats
    assert PromptLookupProposer().continuations([1], 4) == []
    assert PromptLookupProposer(min_ngram=2).continuations([4, 1, 9, 4], 2) == []  # 1-gram matches off
    tree = PromptLookupProposer(branches=2).propose(ask(seq, 3))
    assert tree.tokens == [3, 7, 1, 2, 9, 1, 2] and tree.parents == [-1, 0, 1, 2, 0, 4, 5]


@pytest.mark.parametrize("kwargs", [{"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"branches": 0}])
def test_prompt_lookup_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PromptLookupProposer(**kwargs)


def test_draft_model_proposer_follows_the_committed_sequence() -> None:
    """Greedy drafts are the draft's own greedy continuation, whatever was drafted (and rolled back) before."""
    draft = tiny_model(8, vocab_size=V)
    proposer = DraftModelProposer(draft, V)
    with pytest.raises(RuntimeError, match="begin"):
        proposer.propose(ask([1, 2], 3))

    def own_greedy(tokens: list[int], n: int) -> list[int]:
        ids = list(tokens)
        for _ in range(n):
            out = draft.forward(torch.tensor([ids]), draft.new_cache(len(ids)), logits_at=slice(-1, None))
            ids.append(int(out.logits[0, -1].argmax()))
        return ids[len(tokens):]

    proposer.begin(RequestInfo([1, 2, 3], 64))
    tokens = [1, 2, 3]
    for step, k in enumerate([3, 1, 4, 2, 4]):
        tree = proposer.propose(ask(tokens, k))
        assert tree.is_chain and tree.tokens[0] == tokens[-1]
        assert tree.tokens[1:] == own_greedy(tokens, k) and tree.draft_probs == [None] * (k + 1)
        # commit a mix: sometimes the first guess, sometimes a token the draft did not guess
        tokens = tokens + ([tree.tokens[1]] if step % 2 else [(tree.tokens[1] + 1) % V, 4])


def test_draft_model_proposer_sampled_reports_q() -> None:
    draft = tiny_model(8, vocab_size=V)
    proposer = DraftModelProposer(draft, V)
    proposer.begin(RequestInfo([1, 2], 64))
    params = SamplingParams(temperature=1.0, top_k=3)
    tree = proposer.propose(ProposalContext([1, 2], 3, params, torch.Generator().manual_seed(0)))
    assert len(tree) == 4
    for node in range(1, 4):
        q = tree.draft_probs[node]
        assert q.shape == (V,) and abs(float(q.sum()) - 1) < 1e-12 and int((q > 0).sum()) == 3
        assert q[tree.tokens[node]] > 0  # the guess was drawn from the q it reports
