"""Time budgets of draft training: self-distillation and the training loop end within the seconds given,
on a fake clock (the budget logic, not the machine's speed, is under test)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import specdecode.training.data as data_module
import specdecode.training.loop as loop_module
from specdecode.training.data import self_distill
from specdecode.training.loop import TrainConfig, lr_at, train


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeHF(torch.nn.Module):
    """Answers every prompt with [7, 2] (2 is the stop token); each batch costs one second of the fake clock."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.clock, self.batches = clock, []

    def generate(self, ids, attention_mask, max_new_tokens, **_):
        self.clock.now += 1.0
        self.batches.append(ids.shape[0])
        return torch.cat((ids, torch.tensor([[7, 2]]).expand(ids.shape[0], 2)), dim=1)


def test_self_distillation_stops_starting_batches_when_its_time_is_spent(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(data_module.time, "perf_counter", clock)
    prompts = [[5] * n for n in range(1, 21)]
    every = self_distill(FakeHF(clock), prompts, stop_token_ids=[2], pad_token_id=0, batch_size=2)
    assert [s.tokens for s in every] == [p + [7, 2] for p in prompts]  # prompt order, whatever the batch order
    hf = FakeHF(clock)
    some = self_distill(hf, prompts, stop_token_ids=[2], pad_token_id=0, batch_size=2, seconds=2.5)
    assert hf.batches == [2, 2, 2]  # started at 0, 1 and 2 s; none at 3 s
    assert len(some) == 6 and all(s.tokens[: s.prompt_len] in prompts for s in some)
    lengths = sorted(s.prompt_len for s in some)
    assert lengths != [1, 2, 3, 4, 5, 6]  # batches in a random order: not the shortest prompts first


def test_training_fits_its_steps_to_the_time_budget_and_stays_finished(tmp_path, monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(loop_module.time, "perf_counter", clock)
    module = torch.nn.Linear(4, 1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)

    def loss_fn(m, batch):
        clock.now += 0.5  # a step costs half a second
        return ((m(batch[0]) - batch[1]) ** 2).mean(), {}

    def batches(start):
        while True:
            yield x, y

    cfg = TrainConfig(steps=10_000, lr=1e-2, warmup=5, eval_every=40, save_every=40, seconds=100.0)
    def evaluate(m):
        clock.now += 1.0  # an evaluation costs a second: the later fits count it in
        return {"score": 1.0}

    history = train(module, loss_fn, batches, tmp_path, cfg, evaluate=evaluate, log=lambda *_: None)
    last = history[-1]["step"]
    # fitted after 21 steps (10.5 s), then again at each evaluation: most of the budget is used, never more
    assert 95.0 <= clock.now <= 100.0 and last < cfg.steps
    assert json.loads((tmp_path / "train_log.jsonl").read_text().splitlines()[-1])["step"] == last
    assert lr_at(last - 1, cfg, last) < 0.11 * cfg.lr  # the schedule decayed by the fitted end, not by step 10,000
    # resumed (same budget again), the finished run is not trained further; without a budget, on to cfg.steps
    assert train(module, loss_fn, batches, tmp_path, cfg, evaluate=evaluate, log=lambda *_: None) == history
    more = TrainConfig(steps=last + 10, lr=1e-2, warmup=5, eval_every=40, save_every=40)
    resumed = train(module, loss_fn, batches, tmp_path, more, evaluate=evaluate, log=lambda *_: None)
    assert resumed[-1]["step"] == last + 10


def test_training_ends_at_the_deadline_even_before_its_steps_are_fitted(tmp_path, monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(loop_module.time, "perf_counter", clock)
    module = torch.nn.Linear(2, 1)

    def loss_fn(m, batch):
        clock.now += 3.0
        return m(batch).sum() ** 2, {}

    cfg = TrainConfig(steps=1000, eval_every=100, save_every=100, seconds=10.0)
    history = train(module, loss_fn, lambda start: iter(lambda: torch.ones(1, 2), None), tmp_path, cfg,
                    evaluate=lambda m: {"score": 0.0}, log=lambda *_: None)
    assert [h["step"] for h in history] == [4]  # 12 s >= 10 s: evaluated and saved after the 4th step
    assert (tmp_path / "checkpoint.pt").exists()


FLUSHED_POOL = """
import sys, torch
from specdecode.cli.commands import main
torch.set_num_threads(2)
if sys.argv[1] == "late":
    torch.ones(256, 256) @ torch.ones(256, 256)  # the worker threads start unflushed
assert main(["train", "eagle", "--out", "unused", "--nproc", "0"]) == 2  # refused, after its first line
tiny = torch.full((64, 4096), 1 << 20, dtype=torch.int32).view(torch.float32)  # denormal bits, no arithmetic
print(int(((tiny @ torch.ones(4096, 64)) != 0).sum()))
"""


def test_training_flushes_denormals_in_every_thread_of_the_pool() -> None:
    """Denormal floats (a peaked softmax's gradients) cost a CPU ~100x a product: `specdecode train` flushes them to
    zero first thing, as PyTorch's worker threads inherit that only from a thread that set it before starting them.
    Flushed first, a parallel product of denormals is zero in every thread's share; flushed after the pool started,
    it is not."""
    def nonzero(when: str) -> int:
        out = subprocess.run([sys.executable, "-c", FLUSHED_POOL, when], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert nonzero("first") == 0
    if torch.backends.openmp.is_available():
        assert nonzero("late") > 0  # the check can fail: a worker thread that missed the setting keeps its share
