"""Asynchronous drafting and cascades: the drafter's chains are taken on hits, drafted again on misses, the draft's
cache is never touched by two threads at once, and a cascade drafts exactly the draft's own chain with fewer
forwards. Greedy identity over every method and K is in test_lossless, the sampled distribution in
test_distribution."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import specdecode.policy.threads
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.policy.cost import CostModel
from specdecode.policy.threads import usable_cores
from specdecode.proposers import (
    AsyncDraftProposer,
    Drafter,
    DraftModelProposer,
    PromptLookupProposer,
)
from specdecode.proposers.base import Needs, RequestInfo

from .helpers import ask, noisy_copy, tiny_model
from .test_lossless import PROMPTS, VOCAB, naive_greedy

NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def drafter():
    worker = Drafter()
    yield worker
    worker.close()


def test_a_draft_that_agrees_is_taken_from_the_drafter(target, drafter) -> None:
    """The target drafting for itself: every guess accepted, so the likeliest outcome (all accepted, then the
    draft's next token) comes true every step and its chain is ready (patient: the engine waits for it)."""
    proposer = AsyncDraftProposer(DraftModelProposer(target, VOCAB), drafter, patient=True)
    for prompt in PROMPTS[2:5]:
        out, stats = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == naive_greedy(target, prompt, NEW)
        assert stats.accepted == stats.drafted  # never a rejection
    assert proposer.stats.hit_rate > 0.8  # every step but each request's first
    assert proposer.stats.ahead >= proposer.stats.hits


def test_forced_misses_draft_again_and_stay_exact(target, drafter) -> None:
    proposer = AsyncDraftProposer(DraftModelProposer(noisy_copy(target, 1, 0.05), VOCAB), drafter, max_outcomes=0)
    for prompt in PROMPTS[4:7]:
        out, _ = generate_ids(target, prompt, proposer=proposer, k=3, max_new_tokens=NEW)
        assert out == naive_greedy(target, prompt, NEW)
    assert proposer.stats.steps > 0 and proposer.stats.hits == 0 and proposer.stats.ahead == 0


def test_rejections_are_predicted_too(target, drafter) -> None:
    """A draft that is often wrong: outcomes with a rejection (and the bonus the draft ranks next) come true too."""
    proposer = AsyncDraftProposer(DraftModelProposer(noisy_copy(target, 3, 0.3), VOCAB), drafter, patient=True)
    partial = 0
    for prompt in PROMPTS:
        before = proposer.stats.hits
        out, stats = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == naive_greedy(target, prompt, NEW)
        partial += (proposer.stats.hits - before) and stats.accepted < stats.drafted
    assert proposer.stats.hits > 0 and partial > 0


def test_the_draft_is_never_run_by_two_threads(target, drafter, monkeypatch) -> None:
    """A slow draft (the target verifies while the drafter is mid-chain): the engine stops the drafter and waits
    before it touches the draft's cache; chains cut short are never taken."""
    inner = DraftModelProposer(noisy_copy(target, 1, 0.05), VOCAB)
    busy, overlaps = threading.Lock(), []
    feed = inner._logits

    def slow(new, last=1):
        if not busy.acquire(blocking=False):
            overlaps.append(threading.current_thread().name)
            return feed(new, last)
        try:
            time.sleep(0.002)
            return feed(new, last)
        finally:
            busy.release()

    monkeypatch.setattr(inner, "_logits", slow)
    proposer = AsyncDraftProposer(inner, drafter)
    for prompt in PROMPTS[3:6]:
        out, _ = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == naive_greedy(target, prompt, NEW)
    assert not overlaps


def test_outcomes_are_ranked_by_the_drafts_probabilities() -> None:
    """Two guesses, the first surely right (q=0.9), the second a coin flip: "all accepted" ranks first, then a
    rejection at the second guess; a rejection at the first (prob 0.1 at most) comes after."""
    v = 6
    logits = [torch.log(torch.tensor([0.9, 0.06, 0.04, 0, 0, 0]) + 1e-12),
              torch.log(torch.tensor([0.02, 0.5, 0.4, 0.08, 0, 0]) + 1e-12)]
    assert len(logits[0]) == v
    ranked = AsyncDraftProposer.outcomes([0, 1], logits, SamplingParams())
    assert ranked[0] == [0, 1]  # all accepted: 0.9 * 0.5
    assert ranked[1] == [0, 2]  # first accepted, then token 2: 0.9 * 0.4
    assert ranked.index([1]) > ranked.index([0, 3])  # 0.06 against 0.9 * 0.08


def test_only_token_state_drafts_may_draft_ahead(drafter) -> None:
    with pytest.raises(ValueError, match="hidden states"):
        AsyncDraftProposer(PromptLookupProposer(), drafter)  # type: ignore[arg-type]

    class Head(DraftModelProposer):
        needs = Needs(hidden_layers=(1,))

    with pytest.raises(ValueError, match="depends on the tokens alone"):
        AsyncDraftProposer(Head(tiny_model(0), VOCAB), drafter)
    with pytest.raises(ValueError, match="at least 1 thread"):
        Drafter(0)


def test_the_cascade_drafts_the_drafts_own_chain_in_fewer_forwards(target) -> None:
    """Greedy: prompt lookup's guesses checked by the draft give exactly the chain the draft drafts alone, and on
    repetitive text with fewer draft forwards."""
    draft = noisy_copy(target, 1, 0.05)
    start = len(PROMPTS[8]) + 10
    prompt = PROMPTS[8] + naive_greedy(draft, PROMPTS[8], 30)  # the draft's text repeats itself from token 11 on
    plain, cascade = DraftModelProposer(draft, VOCAB), DraftModelProposer(draft, VOCAB, lookup=PromptLookupProposer())
    forwards = {}
    for name, proposer in (("plain", plain), ("cascade", cascade)):
        calls = []
        feed = proposer._logits
        proposer._logits = lambda new, last=1, feed=feed, calls=calls: (calls.append(len(new)), feed(new, last))[1]
        proposer.begin(RequestInfo(prompt, 256))
        chains = [proposer.propose(ask(prompt[:n], 8)).tokens for n in range(start, start + 16)]
        forwards[name] = (chains, len(calls))
    assert forwards["cascade"][0] == forwards["plain"][0]
    assert forwards["cascade"][1] < forwards["plain"][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_async_drafting_on_a_gpu_stream() -> None:
    """The drafter on a CUDA stream of its own: greedy output is plain decoding's on the GPU, hits happen, and
    sampling runs (the drafts' generator lives on the draft's device)."""
    device = torch.device("cuda")
    target = tiny_model(0, vocab_size=VOCAB).to(device)
    worker = Drafter(1, device)
    proposer = AsyncDraftProposer(DraftModelProposer(target, VOCAB), worker)
    for prompt in PROMPTS[2:6]:
        out, _ = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
        assert out == generate_ids(target, prompt, max_new_tokens=NEW)[0]
    assert proposer.stats.hits > 0
    params = SamplingParams(temperature=1.0)
    noisy = noisy_copy(tiny_model(0, vocab_size=VOCAB), 1, 0.3).to(device)
    for draft in (proposer, DraftModelProposer(noisy, VOCAB)):
        out, stats = generate_ids(target, PROMPTS[4], proposer=draft, k=4, max_new_tokens=NEW, params=params, seed=0)
        assert len(out) == NEW and stats.drafted > 0
    worker.close()


@pytest.mark.skipif(len(usable_cores()) < 2, reason="the drafter shares the only core: the target keeps its threads")
def test_steps_drafted_ahead_do_not_teach_the_cost_table(monkeypatch) -> None:
    """A step the drafter drafts ahead during runs on the cores it left: such steps are not learned from (the cost
    table pairs every size with plain steps on all cores), and the target gets its cores back afterwards."""
    target = tiny_model(0, dtype=torch.float32, vocab_size=VOCAB)
    assert target.native_kernels  # the engine governs threads only where the kernels do not depend on them
    observed = []
    monkeypatch.setattr(CostModel, "observe", lambda self, *step: observed.append(step))
    monkeypatch.setattr(specdecode.policy.threads.governor(), "enabled", False)  # other processes' load changes nothing
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        worker = Drafter(1)
        generate_ids(target, PROMPTS[4], proposer=DraftModelProposer(target, VOCAB), k=3, max_new_tokens=NEW)
        synchronous = len(observed)
        observed.clear()
        generate_ids(target, PROMPTS[4], proposer=AsyncDraftProposer(DraftModelProposer(target, VOCAB), worker),
                     k=3, max_new_tokens=NEW)
        worker.close()
        assert synchronous > 0 and not observed
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_failing_drafter_fails_its_request_and_gives_the_cores_back(target, drafter, monkeypatch) -> None:
    inner = DraftModelProposer(noisy_copy(target, 1, 0.05), VOCAB)
    draft = inner.draft

    def broken(*args, **kwargs):
        if threading.current_thread().name.startswith("specdecode-drafter"):
            raise RuntimeError("drafter out of memory")
        return draft(*args, **kwargs)

    monkeypatch.setattr(inner, "draft", broken)
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="drafter out of memory"):
        generate_ids(target, PROMPTS[4], proposer=AsyncDraftProposer(inner, drafter), k=3, max_new_tokens=NEW)
    assert torch.get_num_threads() == threads and drafter._holders == 0
