"""Online learning of the EAGLE head (proposers/online_learning.py): output stays the target's whatever head serves, a
new head is taken only between steps, learning raises acceptance on the served text, the guard reverts."""

from __future__ import annotations

import pytest
import torch

from specdecode.cli.commands import main as cli_main
from specdecode.engine.loop import generate_ids
from specdecode.models.eagle import EagleConfig, EagleHead
from specdecode.models.eagle_ttt import ttt_loss
from specdecode.proposers import EagleProposer
from specdecode.proposers.online_learning import OnlineConfig, OnlineHead, chunk_batch

from .helpers import tiny_model
from .test_lossless import PROMPTS, VOCAB

NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab_size=VOCAB, num_layers=4)


def fresh_head(target) -> EagleHead:
    """A head started from the target (as training starts it), untrained: it guesses badly, and can learn."""
    with torch.random.fork_rng():  # what init_from_target does not set starts the same whatever ran before
        torch.manual_seed(0)
        head = EagleHead(EagleConfig.for_target(target.config, 48, target_layers=[0, 2, 3]))
    head.init_from_target(target, torch.arange(VOCAB - 48, VOCAB))
    return head.to(target.dtype).eval().requires_grad_(False)


def acceptance(target, head: EagleHead) -> float:
    proposer = EagleProposer(head, target, topk=1, nodes=1)
    stats = [generate_ids(target, p, proposer=proposer, k=1, max_new_tokens=NEW)[1] for p in PROMPTS]
    return sum(s.accepted for s in stats) / sum(s.drafted for s in stats)


def test_output_is_the_targets_while_heads_are_published_under_it(target, monkeypatch) -> None:
    """The learner publishes after every step of its own, in its thread, while requests run: every head forward
    of a step is the head the step began with, and greedy output equals plain decoding's."""
    online = OnlineHead(fresh_head(target), target.embed, OnlineConfig(chunk=8, batch=2, publish_every=1, lr=1e-3))
    run, learn = EagleProposer._run, EagleProposer._learn_online
    seen: list[bool] = []

    def adopting(self, tokens):  # a step's start: it takes the newest head here, and only here
        learn(self, tokens)
        self.step_head_was = self.head

    def checked_run(self, *args):
        seen.append(self.head is self.step_head_was)
        return run(self, *args)

    monkeypatch.setattr(EagleProposer, "_learn_online", adopting)
    monkeypatch.setattr(EagleProposer, "_run", checked_run)
    online.start()
    try:
        versions = set()
        for _ in range(3):
            for prompt in PROMPTS:
                plain, _ = generate_ids(target, prompt, max_new_tokens=NEW)
                proposer = EagleProposer(fresh_head(target), target, topk=2, nodes=6, online=online)
                out, stats = generate_ids(target, prompt, proposer=proposer, k=3, max_new_tokens=NEW)
                assert out == plain
                versions.add(proposer.version)
    finally:
        online.close()
    assert online.recorded > 0 and online.steps > 0 and len(versions) > 1  # heads changed between requests
    assert seen and all(seen)


def test_learning_online_raises_acceptance_on_the_text_it_served(target) -> None:
    head = fresh_head(target)
    before = acceptance(target, head)
    online = OnlineHead(head, target.embed, OnlineConfig(chunk=16, batch=4, publish_every=150, lr=2e-3, seed=1))
    for prompt in PROMPTS:  # what the target verified while the head served (no thread: deterministic)
        generate_ids(target, prompt, proposer=EagleProposer(head, target, topk=1, nodes=1, online=online), k=1,
                     max_new_tokens=NEW)
    assert online.recorded >= len(PROMPTS)
    for _ in range(150):
        online.step()
    assert online.version == 1 and online.current is not head
    after = acceptance(target, online.current)
    assert after > before + 0.1, (before, after)


def test_guard_brings_back_the_head_before_one_that_accepts_less(target) -> None:
    head = fresh_head(target)
    online = OnlineHead(head, target.embed, OnlineConfig(judge_steps=4, tolerance=0.9))
    learnt = {k: v.clone() for k, v in online.learner.state_dict().items()}
    for _ in range(8):
        online.report(0, 3)  # the first head: 3 guesses accepted a step
    with torch.no_grad():
        online.learner.fuse.weight.mul_(-1.0)  # a learner gone wrong
    online.publish()
    assert online.version == 1 and online.current is not head
    assert online.current._rope is not None  # warmed up as it is published, not at a request's first run
    for _ in range(3):
        online.report(1, 0)
    assert online.version == 1  # not judged before judge_steps steps
    online.report(1, 0)
    assert online.current is head and online.version == 2 and online.reverts == 1
    online.step()  # the learner restarts from the head that came back (too little data to train: only that)
    for name, value in online.learner.state_dict().items():
        torch.testing.assert_close(value, learnt[name])
    for _ in range(8):  # a head that does as well is kept
        online.report(2, 3)
    online.publish()
    for _ in range(4):
        online.report(3, 3)
    assert online.version == 3 and online.previous is None


def test_learner_waits_for_each_verdict_and_works_as_hard_as_it_pays(target) -> None:
    online = OnlineHead(fresh_head(target), target.embed, OnlineConfig(chunk=4, batch=2, publish_every=1,
                                                                       judge_steps=2, duty=0.5, tolerance=0.0))
    hidden = torch.zeros(4, 3 * target.config.hidden_size)
    for _ in range(2):
        online.record(hidden, [1, 2, 3, 4, 5])
    online.report(0, 2)
    assert online.step() is not None and online.version == 1  # trained and published ...
    assert online.step() is not None and online.version == 1  # ... learns the next one while its verdict is awaited
    assert online.step() is None  # ... and, that one ready, waits for the verdict
    online.report(1, 1)
    online.report(1, 1)  # accepted less than before (1 < 2; kept, at tolerance 0): the learner's share falls
    assert online.duty == pytest.approx(0.35) and online.step() is not None
    online.report(2, 3)
    online.report(2, 3)  # more than before: the share doubles, up to its bound
    assert online.duty == 0.5
    for _ in range(12):  # head after head that gains nothing: down to the floor, never idle for good
        online.step()
        online.report(online.version, 0)
        online.report(online.version, 0)
    assert online.duty == online.cfg.min_duty


def test_online_learning_errors_say_what_to_do(target, capsys) -> None:
    online = OnlineHead(fresh_head(target), target.embed)
    with pytest.raises(ValueError, match="3 positions need 4 tokens"):
        online.record(torch.zeros(3, 3 * target.config.hidden_size), [1, 2, 3])
    assert cli_main(["generate", "hi", "--model", "nowhere", "--method", "prompt-lookup", "--online-draft"]) == 2
    assert "use it with --method eagle or hybrid" in capsys.readouterr().err


def test_rejected_guesses_are_recorded_and_pushed_down(target) -> None:
    """DVI's reward: the guesses the target rejected are recorded beside the token it committed there, and the
    learner with the reward term lowers their probability more than distillation alone, from the same weights and
    the same batches."""
    head = fresh_head(target)
    online = OnlineHead(head, target.embed, OnlineConfig(chunk=16, batch=4, publish_every=10**6))
    for prompt in PROMPTS:
        generate_ids(target, prompt, proposer=EagleProposer(head, target, topk=2, nodes=4, online=online), k=2,
                     max_new_tokens=NEW)
    chunks = list(online.buffer)
    marked = 0
    for _, tokens, rejected, _ in chunks:
        assert rejected is not None
        for i in (rejected >= 0).any(-1).nonzero().flatten().tolist():
            guesses = rejected[i][rejected[i] >= 0]
            assert int(tokens[i + 1]) not in guesses.tolist()  # a rejected guess is never the committed token
            marked += 1
    assert marked > 0
    layers = head.config.target_layers
    probe = chunk_batch(chunks, layers, reward=1.0)  # scored: the rejected guesses' mean negative log-likelihood
    probe["teacher_probs"] = (probe["teacher_probs"] < 0).to(probe["teacher_probs"].dtype)  # the rejected columns

    def rejected_nll(reward: float) -> float:
        learner = OnlineHead(head, target.embed, OnlineConfig(chunk=16, batch=4, publish_every=10**6, lr=2e-3,
                                                               reward=reward, reward_after=0, seed=3))
        learner.buffer.extend(chunks)
        for _ in range(30):
            learner.step()
        with torch.no_grad():
            return float(ttt_loss(learner.learner, learner.embed, learner.t2d, probe, 1)[0])

    with_reward, without = rejected_nll(0.5), rejected_nll(0.0)
    assert with_reward > without + 0.05


def test_the_teacher_is_the_targets_distribution_at_each_verified_position(target) -> None:
    """What the proposer records for the learner: at every position verified while it drafted, the target's top-8
    probabilities, as a full forward over the committed text computes them (the first id the committed token,
    greedy); each answer position is taught exactly once (the tail after the last whole chunk too), the prompt's
    positions are context only; with `soft` off, the committed tokens of every chunk teach."""
    head = fresh_head(target)
    online = OnlineHead(head, target.embed, OnlineConfig(chunk=8, batch=2, publish_every=10**6))
    prompt = PROMPTS[3]  # 17 tokens: two chunks of prompt positions before the first verification
    proposer = EagleProposer(head, target, topk=2, nodes=4, online=online)
    new, _ = generate_ids(target, prompt, proposer=proposer, k=2, max_new_tokens=NEW)
    text = prompt + new
    cache = target.new_cache(len(text) + 8)
    with torch.no_grad():
        full = target.forward(torch.tensor([text]), cache).logits[0].float().softmax(-1)
    for position in range(len(text) - 1):
        ids, probs = proposer.teacher_ids[position], proposer.teacher_probs[position].float()
        if position < len(prompt) - 1:  # no verification saw it
            assert (ids < 0).all()
            continue
        top = full[position].topk(8)
        assert ids.tolist() == top.indices.tolist() and int(ids[0]) == text[position + 1]
        torch.testing.assert_close(probs, top.values, atol=2e-3, rtol=0)
    batch = chunk_batch(list(online.buffer), head.config.target_layers, answers_only=True)
    taught = batch["mask"]
    assert int(taught.sum()) == len(new)  # every answer position once, none of the prompt's
    for row, chunk in enumerate(online.buffer):  # greedy: the teacher's first id is the committed next token
        following = chunk[1][1 : taught.shape[1] + 1]
        assert (batch["teacher_ids"][row, taught[row], 0] == following[taught[row]]).all()
    assert all(bool(c[3][0][:, 0].ge(0).any()) for c in online.buffer)  # no chunk of the prompt alone
    hard = OnlineHead(head, target.embed, OnlineConfig(chunk=8, batch=2, publish_every=10**6, soft=False))
    generate_ids(target, prompt, proposer=EagleProposer(head, target, topk=2, nodes=4, online=hard), k=2,
                 max_new_tokens=NEW)
    assert all(teacher is None for *_, teacher in hard.buffer) and len(hard.buffer) >= 2  # the prompt's too
    assert bool(chunk_batch(list(hard.buffer), head.config.target_layers)["mask"].all())


def test_draft_vocabulary_rows_go_to_the_tokens_the_traffic_needs(target) -> None:
    """refresh_vocab: tokens outside the draft vocabulary with teacher mass >= vocab_min_mass and >= twice the row's
    take the rows of the tokens with the least mass (ties: the highest id), starting from the target's output row
    scaled to the rows' mean norm, with fresh optimizer moments; a published head carries the new vocabulary and a
    revert brings the old one back to the learner."""
    head = fresh_head(target)  # vocabulary: tokens 8..55
    online = OnlineHead(head, target.embed, OnlineConfig(chunk=4, batch=2, publish_every=10**6, judge_steps=2))
    hidden = torch.zeros(4, 3 * target.config.hidden_size)
    for _ in range(2):
        online.record(hidden, [9, 10, 11, 12, 13])
    online.step()  # optimizer moments exist now
    before = online.learner.d2t.clone()
    mass = torch.full((VOCAB,), 1.5, dtype=torch.float64)
    mass[:8] = 0.0
    mass[[54, 55]] = 0.0  # the two rows to give away: 55's first
    mass[3], mass[2] = 5.0, 4.0  # outside, wanted
    mass[1] = 2.5  # outside, but under twice the next row's mass (1.5)
    mass[5] = 1.9  # outside, under vocab_min_mass
    norm = online.learner.lm_head.weight.norm(dim=1).mean()
    assert online.refresh_vocab(mass) == 2
    d2t = online.learner.d2t
    assert int(d2t[before.tolist().index(55)]) == 3 and int(d2t[before.tolist().index(54)]) == 2
    assert sorted(set(d2t.tolist()) - set(before.tolist())) == [2, 3]
    assert (online.t2d[d2t] == torch.arange(len(d2t))).all() and int((online.t2d >= 0).sum()) == len(d2t)
    rows = [before.tolist().index(t) for t in (55, 54)]
    weight = online.learner.lm_head.weight
    torch.testing.assert_close(weight[rows].norm(dim=1), norm.expand(2), rtol=1e-3, atol=0)
    assert torch.nn.functional.cosine_similarity(weight[rows[0]], target.embed.weight[3].float(), dim=0) > 0.999
    assert (online.optimizer.state[weight]["exp_avg"][rows] == 0).all()
    online.report(0, 3)
    online.report(0, 3)
    online.publish()
    assert online.current.d2t.tolist() == d2t.tolist()
    online.report(1, 0)
    online.report(1, 0)  # the new head accepts less: the one before comes back, to the learner too
    assert online.reverts == 1
    online.step()
    assert online.learner.d2t.tolist() == before.tolist()
    assert (online.t2d[before] == torch.arange(len(before))).all() and int((online.t2d >= 0).sum()) == len(before)


def test_old_traffic_fades_from_the_vocabulary_choice(target) -> None:
    """The teacher's mass halves every vocab_half_life chunks recorded: a token an earlier traffic wanted (8 of mass,
    three half-lives ago) loses the one row to give to a token today's traffic wants (3 of mass); without fading the
    old one keeps winning."""
    head = fresh_head(target)  # vocabulary: tokens 8..55
    hidden = torch.zeros(4, 3 * target.config.hidden_size)
    chosen = {}
    for half_life in (2, 0):
        online = OnlineHead(head, target.embed, OnlineConfig(chunk=4, batch=2, publish_every=10**6, vocab_swaps=1,
                                                             vocab_half_life=half_life))
        online.mass[8:] = 1.0
        online.mass[3] = 8.0  # wanted by the traffic before
        for _ in range(6):
            online.record(hidden, [9, 10, 11, 12, 13])
        online.fade_mass()  # a head began: the mass recorded so far faded by three half-lives (half_life 2)
        online.mass[8:] += 1.0
        online.mass[2] += 3.0  # wanted now
        assert online.refresh_vocab(online.fade_mass().clone()) == 1  # nothing recorded since: no more fading
        chosen[half_life] = sorted(set(online.learner.d2t.tolist()) - set(head.d2t.tolist()))
    assert chosen == {2: [2], 0: [3]}


def test_a_head_learns_the_tokens_its_vocabulary_lacked(target) -> None:
    """A head whose draft vocabulary misses the tokens the target says most cannot guess them, nor learn them; with
    its vocabulary following the traffic it learns them, from the same served text."""
    said = torch.zeros(VOCAB)
    for prompt in PROMPTS:
        said += torch.bincount(torch.tensor(generate_ids(target, prompt, max_new_tokens=NEW)[0]), minlength=VOCAB)
    vocab = said.argsort(stable=True)[: VOCAB - 8].sort().values  # all but the 8 most said
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = EagleHead(EagleConfig.for_target(target.config, len(vocab), target_layers=[0, 2, 3]))
    head.init_from_target(target, vocab)
    head = head.to(target.dtype).eval().requires_grad_(False)

    def learnt(swaps: int) -> float:
        online = OnlineHead(head, target.embed, OnlineConfig(chunk=16, batch=4, publish_every=150, lr=2e-3, seed=1,
                                                             vocab_swaps=swaps))
        for prompt in PROMPTS:
            generate_ids(target, prompt, proposer=EagleProposer(head, target, topk=1, nodes=1, online=online), k=1,
                         max_new_tokens=NEW)
        for _ in range(150):
            online.step()
        assert online.version == 1
        return acceptance(target, online.current)

    fixed, following = learnt(0), learnt(8)
    assert following > fixed + 0.1, (fixed, following)
