"""Shared test setup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tiny models are dominated by per-op overhead; extra intra-op threads only add contention.

    One thread makes the tiny-model suite several times faster on a small CPU (and steadier when other
    processes share it). Tests that load the real model keep torch's default.
    """
    if request.node.get_closest_marker("real_model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
