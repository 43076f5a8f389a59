"""Rebuild the small data files that ship inside the package (specdecode/data/) from the full public sets.

    python scripts/make_package_data.py --data ../shared/data

- calibration.jsonl: 48 exchanges (a user turn and its answer, ShareGPT's layout) for the layer-skip search,
  12 from each of GPTeacher codegen / roleplay / toolformer and GSM8K train (all MIT), each turn cut to 2,048
  characters. Training sets only, never the benchmark.
- spec_bench_sample.jsonl: the first 2 questions of each of Spec-Bench's 13 categories (26, Apache-2.0), for the
  tests and for `specdecode bench` when the full question.jsonl is not at hand.
Each folder's upstream LICENSE is copied beside its file.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "specdecode" / "data"
PER_SOURCE, CHARS, PER_CATEGORY = 12, 2048, 2
GPTEACHER = ("codegen-instruct", "roleplay-simple-deduped-roleplay-instruct", "toolformer-dedupe-only-dataset")


def exchange(user: str, answer: str, source: str) -> dict:
    return {"source": source, "conversations": [{"from": "human", "value": user.strip()[:CHARS]},
                                                {"from": "gpt", "value": answer.strip()[:CHARS]}]}


def calibration(train: Path) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for name in GPTEACHER:
        data = json.loads((train / "gpteacher" / f"{name}.json").read_text())
        for r in rng.sample(data, PER_SOURCE):
            user = r["instruction"] + (f"\n\n{r['input']}" if r.get("input", "").strip() else "")
            rows.append(exchange(user, r["response"], f"gpteacher/{name}"))
    gsm8k = [json.loads(line) for line in (train / "gsm8k" / "train.jsonl").read_text().splitlines() if line]
    rows += [exchange(r["question"], r["answer"], "gsm8k/train") for r in rng.sample(gsm8k, PER_SOURCE)]
    return rows


def spec_bench_sample(questions: Path) -> list[dict]:
    taken: dict[str, int] = {}
    out = []
    for line in questions.read_text().splitlines():
        row = json.loads(line)
        if taken.get(row["category"], 0) < PER_CATEGORY:
            taken[row["category"]] = taken.get(row["category"], 0) + 1
            out.append(row)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {path} ({len(rows)} rows, {path.stat().st_size // 1024} KB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data",
                   help="the full data folder (train/, eval/ layout)")
    args = p.parse_args()
    write_jsonl(OUT / "calibration.jsonl", calibration(args.data / "train"))
    write_jsonl(OUT / "spec_bench_sample.jsonl", spec_bench_sample(args.data / "eval/spec_bench/question.jsonl"))
    shutil.copyfile(args.data / "train/gpteacher/LICENSE", OUT / "LICENSE-GPTeacher")
    shutil.copyfile(args.data / "train/gsm8k/LICENSE", OUT / "LICENSE-GSM8K")
    shutil.copyfile(args.data / "eval/spec_bench/LICENSE", OUT / "LICENSE-Spec-Bench")


if __name__ == "__main__":
    main()
