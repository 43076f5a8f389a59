"""Training data for drafts: prompts from public instruction sets, answers written by the target itself.

Self-distillation (EAGLE, Medusa-2): the draft must predict what *this* target says, so the target
answers every prompt (batched `generate`) and the draft learns from the target's own text.
Spec-Bench is evaluation data and never read here.
"""

from __future__ import annotations

import csv
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..data import TRAIN_SOURCE, train_dir

DEFAULT_TRAIN_DIR = train_dir()  # $SPECDECODE_DATA/train, else shared/data/train beside the checkout: optional


@dataclass
class Sample:
    tokens: list[int]  # chat-templated prompt, then the target's answer
    prompt_len: int  # tokens[:prompt_len] is the prompt; the draft learns to predict the rest


# ------------------------------------------------------------------------------------ prompts
def _sharegpt(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        if line.strip():
            turn = next((t for t in json.loads(line).get("conversations", []) if t.get("from") == "human"), None)
            if turn and turn.get("value", "").strip():
                yield turn["value"]


def _gpteacher(path: Path) -> Iterator[str]:
    for row in json.loads(path.read_text()):
        text = row.get("instruction", "").strip()
        if row.get("input", "").strip():
            text += "\n\n" + row["input"].strip()
        if text:
            yield text


def _gsm8k(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        if line.strip():
            yield json.loads(line)["question"]


def _flan_cot(path: Path) -> Iterator[str]:
    with path.open(newline="") as f:
        for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if row and row[0].strip():
                yield row[0].replace("\\n", "\n") + "\nExplain your reasoning step by step."


SOURCES: dict[str, tuple[str, Callable[[Path], Iterator[str]]]] = {
    "sharegpt": ("sharegpt/*.jsonl", _sharegpt),
    "gpteacher": ("gpteacher/*.json", _gpteacher),
    "gsm8k": ("gsm8k/*.jsonl", _gsm8k),
    "flan_cot": ("flan_cot/*.tsv", _flan_cot),
}


def prompt_texts(data_dir: Path | str = DEFAULT_TRAIN_DIR, limit: int | None = None, seed: int = 0) -> list[str]:
    """User prompts from every source under `data_dir`, interleaved source by source (so a small `limit`
    still covers chat, code, role play, maths and reasoning), deduplicated, in a seeded order."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"training data folder {root} not found: {TRAIN_SOURCE}")
    rng = random.Random(seed)
    pools = []
    for pattern, reader in SOURCES.values():
        texts = [t for path in sorted(root.glob(pattern)) for t in reader(path)]
        rng.shuffle(texts)
        if texts:
            pools.append(texts)
    if not pools:
        raise FileNotFoundError(f"no prompts under {root}: {TRAIN_SOURCE}")
    seen, out = set(), []
    for i in range(max(map(len, pools))):
        for pool in pools:
            if i < len(pool) and pool[i] not in seen:
                seen.add(pool[i])
                out.append(pool[i])
    return out[:limit]


def encode_prompts(tokenizer, texts: list[str], max_prompt_tokens: int = 512) -> list[list[int]]:
    """Chat-templated prompt ids (plain text ids for a tokenizer without a template); over-long prompts skipped."""
    out = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_dict=False)
        else:
            ids = tokenizer(text)["input_ids"]
        if 0 < len(ids) <= max_prompt_tokens:
            out.append(list(ids))
    return out


def load_prompts(tokenizer, data_dir: Path | str = DEFAULT_TRAIN_DIR, limit: int | None = None, seed: int = 0,
                 max_prompt_tokens: int = 512) -> list[list[int]]:
    return encode_prompts(tokenizer, prompt_texts(data_dir, None if limit is None else 2 * limit, seed),
                          max_prompt_tokens)[:limit]


# ---------------------------------------------------------------------------- self-distillation
def timed_batches(prompts: list[list[int]], batch_size: int, seed: int, seconds: float | None) -> Iterator[list[int]]:
    """Batches of prompt indices of similar length, in a seeded random order; with `seconds`, none starts once
    that time is spent (so the prompts answered by then are a fair sample of all, not the shortest)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    random.Random(seed).shuffle(batches)
    deadline = None if seconds is None else time.perf_counter() + seconds
    for idx in batches:
        if deadline is not None and time.perf_counter() >= deadline:
            return
        yield idx


def engine_distill(
    llm,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    seconds: float | None = None,
    progress: Callable[[int], None] | None = None,
    on_batch: Callable[[list[Sample]], None] | None = None,
) -> list[Sample]:
    """The target as loaded (`llm`: quantized as it will serve) answers every prompt through specdecode's own
    engine: plain decoding, `batch_size` prompts at a time in one continuous batch. On a CPU faster than
    transformers' float32 `generate`, and the answers are the served model's own (a float copy of 4-bit weights
    writes other text). Same batching, time budget and hooks as `self_distill`."""
    out: list[Sample | None] = [None] * len(prompts)
    for b, idx in enumerate(timed_batches(prompts, batch_size, seed, seconds)):
        answers = llm.generate([prompts[i] for i in idx], method="none", max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed + b)
        for i, answer in zip(idx, answers, strict=True):  # token_ids end with the stop token, when one came
            out[i] = Sample(prompts[i] + list(answer.token_ids), len(prompts[i]))
        _answered(out, idx, progress, on_batch)
    return [s for s in out if s is not None]


def _answered(out: list[Sample | None], idx: list[int], progress: Callable[[int], None] | None,
              on_batch: Callable[[list[Sample]], None] | None) -> None:
    if on_batch is not None:
        on_batch([s for i in idx if (s := out[i]) is not None])
    if progress is not None:
        progress(len(idx))


@torch.inference_mode()
def self_distill(
    hf_model,
    prompts: list[list[int]],
    *,
    stop_token_ids: list[int],
    pad_token_id: int,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    seconds: float | None = None,
    progress: Callable[[int], None] | None = None,
    on_batch: Callable[[list[Sample]], None] | None = None,
) -> list[Sample]:
    """The target (a transformers model) answers every prompt: batched, left-padded `generate`, prompts sorted
    by length so a batch wastes little padding. Answers end at the first stop token (kept) or the limit.
    With `seconds`, no batch starts once that time is spent: the batches run in a seeded random order, so the
    prompts answered by then are a fair sample of all (not the shortest). `on_batch` gets each batch's samples
    as they are answered (to keep them on disk)."""
    device = next(hf_model.parameters()).device
    out: list[Sample | None] = [None] * len(prompts)
    torch.manual_seed(seed)
    stops = set(stop_token_ids)
    for idx in timed_batches(prompts, batch_size, seed, seconds):
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attention[row, width - len(prompts[i]) :] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        gen = hf_model.generate(ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_new_tokens,
                                eos_token_id=sorted(stops), pad_token_id=pad_token_id, **sampling)
        for row, i in enumerate(idx):
            answer = []
            for tok in gen[row, width:].tolist():
                answer.append(tok)
                if tok in stops:
                    break
            out[i] = Sample(prompts[i] + answer, len(prompts[i]))
        _answered(out, idx, progress, on_batch)
    return [s for s in out if s is not None]


def save_samples(path: Path | str, samples: list[Sample]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sample_lines(samples))


def sample_lines(samples: list[Sample]) -> str:
    """samples.jsonl's text of `samples`: one JSON object a line."""
    return "".join(json.dumps(asdict(s)) + "\n" for s in samples)


def load_samples(path: Path | str) -> list[Sample]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"samples file {path} not found: run self-distillation first")
    return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def load_answered(path: Path) -> list[Sample]:
    """The samples an interrupted self-distillation kept in `path`, one line each as they came (a last line cut
    short by the interruption is dropped); none if there is no such file."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(Sample(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            break  # written when the run stopped: that batch is answered again
    return out


def split(samples: list[Sample], heldout: int, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): a seeded split, at least one training sample."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    heldout = min(heldout, max(0, len(samples) - 1))
    return [samples[i] for i in order[heldout:]], [samples[i] for i in order[:heldout]]
