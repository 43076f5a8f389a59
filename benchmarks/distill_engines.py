"""Self-distillation on a CPU: specdecode's engine (the target as loaded) against transformers' float `generate`.

Both answer the same training prompts (greedy, batches of --batch); prints tokens/s of each and how many answers
are the same text.

    python benchmarks/distill_engines.py --prompts 32 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

import specdecode
from specdecode.models import resolve
from specdecode.training.data import engine_distill, load_prompts, self_distill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    llm = specdecode.load(args.model)
    prompts = load_prompts(llm.tokenizer, limit=args.prompts, seed=3)
    started = time.perf_counter()
    ours = engine_distill(llm, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch)
    ours_s = time.perf_counter() - started
    hf = AutoModelForCausalLM.from_pretrained(str(resolve(args.model)), dtype=torch.float32).eval()
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(llm.stop_token_ids)
    started = time.perf_counter()
    theirs = self_distill(hf, prompts, stop_token_ids=sorted(llm.stop_token_ids), pad_token_id=pad,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch)
    theirs_s = time.perf_counter() - started
    for name, samples, seconds in (("specdecode", ours, ours_s), ("transformers", theirs, theirs_s)):
        tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
        print(f"{name}: {tokens} answer tokens in {seconds:.1f} s = {tokens / seconds:.0f} tokens/s")
    same = sum(a.tokens == b.tokens for a, b in zip(ours, theirs, strict=True))
    print(f"identical answers: {same} of {len(ours)}")


if __name__ == "__main__":
    main()
