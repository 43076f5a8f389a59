"""Spec-Bench prompts: the standard speculative-decoding benchmark (never train on them)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..data import SPEC_BENCH_SAMPLE, SPEC_BENCH_SOURCE, spec_bench_questions


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    prompt: str | list[dict]  # the first user turn, or chat messages (the repetitive workloads; see workloads.OWN)


def load_questions(
    path: str | Path | None = None, categories: str | list[str] = "all", per_category: int | None = None
) -> list[Question]:
    """Questions in file order, the first `per_category` of each selected category. path None: the full
    Spec-Bench where it is (see specdecode.data), else the 2 per category shipped with the package."""
    if path is None and is_sample(None):  # asked for the full set, which is not here
        logging.getLogger("specdecode").warning(
            "Spec-Bench's full question set is not here: using the shipped sample (2 questions per category); "
            "for all of it, %s", SPEC_BENCH_SOURCE)
    path = spec_bench_questions() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}: {SPEC_BENCH_SOURCE}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    known = list(dict.fromkeys(r["category"] for r in rows))
    wanted = known if categories == "all" else list(categories)
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise ValueError(f"unknown Spec-Bench categories {unknown}; known: {', '.join(known)}")
    taken: dict[str, int] = {}
    out = []
    for r in rows:
        c = r["category"]
        if c in wanted and (per_category is None or taken.get(c, 0) < per_category):
            taken[c] = taken.get(c, 0) + 1
            out.append(Question(r["question_id"], c, r["turns"][0]))
    return out


def is_sample(path: str | Path | None) -> bool:
    """Whether `load_questions(path)` reads the shipped sample rather than the full set."""
    return (spec_bench_questions() if path is None else Path(path)).resolve() == SPEC_BENCH_SAMPLE
