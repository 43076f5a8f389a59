"""Where specdecode's data comes from.

Shipped in this folder (small; rebuilt by scripts/make_package_data.py, upstream licenses beside them):
- calibration.jsonl: 48 training-set exchanges (GPTeacher, GSM8K; MIT) the layer-skip search scores layers on;
- spec_bench_sample.jsonl: 2 questions of each Spec-Bench category (Apache-2.0), for the tests and for
  `specdecode bench` when the full set is not at hand.

Optional, from their public sources (never fetched at run time): the full Spec-Bench questions and the training
prompts of `specdecode train`, in a folder laid out as `eval/spec_bench/question.jsonl` and `train/...`: the one
named by $SPECDECODE_DATA, else `shared/data` beside the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent
CALIBRATION = PACKAGE_DATA / "calibration.jsonl"
SPEC_BENCH_SAMPLE = PACKAGE_DATA / "spec_bench_sample.jsonl"

SPEC_BENCH_SOURCE = ("download data/spec_bench/question.jsonl from https://github.com/hemingkx/Spec-Bench and pass "
                     "--questions PATH (or put it at $SPECDECODE_DATA/eval/spec_bench/question.jsonl)")
TRAIN_SOURCE = ("pass --data DIR, a folder of prompts laid out as sharegpt/*.jsonl, gpteacher/*.json, gsm8k/*.jsonl "
                "or flan_cot/*.tsv (e.g. GSM8K's train.jsonl from https://github.com/openai/grade-school-math), "
                "or --samples-file with the target's answers")


def data_root() -> Path:
    """The optional data folder: $SPECDECODE_DATA, else shared/data beside the checkout."""
    env = os.environ.get("SPECDECODE_DATA")
    return Path(env).expanduser() if env else PACKAGE_DATA.parents[2] / "shared" / "data"


def spec_bench_questions() -> Path:
    """Spec-Bench's full question.jsonl where it is (data_root), else the sample shipped with the package."""
    full = data_root() / "eval" / "spec_bench" / "question.jsonl"
    return full if full.is_file() else SPEC_BENCH_SAMPLE


def train_dir() -> Path:
    """Where `specdecode train` reads prompts by default (it may not exist: see TRAIN_SOURCE)."""
    return data_root() / "train"
