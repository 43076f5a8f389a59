"""The thread governor: forwards run on the cores other processes leave free, and the count never changes a token."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch

from specdecode import kernels
from specdecode.core.sampling import SamplingParams
from specdecode.engine.loop import generate_ids
from specdecode.models.loading import quantize_
from specdecode.policy import threads
from specdecode.proposers import DraftModelProposer, PromptLookupProposer

from .helpers import noisy_copy, tiny_model

linux = pytest.mark.skipif(not threads.STAT.exists(), reason="reads /proc/stat")


@pytest.mark.parametrize(("others", "cores", "most", "expected"), [
    (0.0, 2, 2, 2), (0.05, 2, 2, 2), (0.4, 2, 2, 2), (0.67, 2, 2, 1), (1.0, 2, 2, 1), (3.0, 2, 2, 1),
    (1.0, 16, 16, 15), (1.0, 16, 4, 4), (0.0, 2, 4, 2),
])
def test_threads_are_the_cores_left_free(others, cores, most, expected) -> None:
    assert threads.threads_for(others, cores, most) == expected


@linux
def test_a_busy_process_takes_a_thread_and_giving_the_core_back_returns_it(monkeypatch) -> None:
    cores = threads.usable_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    monkeypatch.setattr(threads, "REFRESH", 0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(len(cores))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        governor = threads.ThreadGovernor()
        time.sleep(1.0)  # the hog starts (an interpreter) and runs
        assert governor.update() == threads.threads_for(governor.others, len(cores), len(cores))
        assert governor.others >= 0.5, "a process busy-looping on a core was not seen"
        assert governor.threads < len(cores) and torch.get_num_threads() == governor.threads
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(before)


def test_without_proc_stat_it_says_so_and_keeps_the_threads(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="specdecode"):
        governor = threads.ThreadGovernor(stat=tmp_path / "missing")
    assert "cannot read how busy the cores are" in caplog.text
    assert not governor.enabled and governor.update() == torch.get_num_threads()


def test_a_changed_thread_count_is_adopted_as_the_most_it_runs(monkeypatch) -> None:
    """A caller's torch.set_num_threads after the governor started is the new ceiling, not undone."""
    monkeypatch.setattr(threads, "REFRESH", 1e9)  # no reading: only the adoption is under test
    governor = threads.ThreadGovernor()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert governor.update() == 3 and governor.most == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", [None, "int4-a8", "int8", "int4"])
def test_native_forwards_are_bit_for_bit_the_same_on_any_thread_count(kind) -> None:
    """Why the governor may change the count between any two forwards: prefill, a token tree and a step."""
    model = tiny_model(0, dtype=torch.float32, hidden_size=256, intermediate_size=512, num_heads=8, head_dim=32,
                       vocab_size=300)
    if kind:
        quantize_(model, kind)
    if kernels.native() is None:
        pytest.skip("no native kernels")
    prompt = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    runs = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        cache = model.new_cache(64)
        a = model.forward(prompt, cache).logits
        b = model.forward(torch.tensor([[3, 4, 5]]), cache, tree_mask=tree, positions=torch.tensor([40, 41, 41])).logits
        runs.append((a, b))
    for other in runs[1:]:
        for got, expected in zip(other, runs[0], strict=True):
            assert torch.equal(got, expected), kind


class Flipping(threads.ThreadGovernor):
    """A governor whose count changes at every forward."""

    def update(self) -> int:
        self.threads = 3 - self.threads
        torch.set_num_threads(self.threads)
        return self.threads


def test_speculation_while_the_thread_count_changes_every_forward_equals_plain_decoding(monkeypatch) -> None:
    target = quantize_(tiny_model(0, dtype=torch.float32), "int4-a8")
    draft = noisy_copy(target, 1)
    params = SamplingParams(temperature=0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    plain = generate_ids(target, prompt, max_new_tokens=40, params=params, k=0)[0]
    flipping = Flipping(1)
    monkeypatch.setattr(threads, "_governor", flipping)
    for proposer in (PromptLookupProposer(branches=3), DraftModelProposer(draft, target.config.vocab_size)):
        assert generate_ids(target, prompt, max_new_tokens=40, params=params, k=3, proposer=proposer)[0] == plain
    assert flipping.threads in (1, 2)
