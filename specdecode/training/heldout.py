"""The measure that matters for a trained draft: tau and acceptance when it really drafts for the target,
greedy, on held-out prompts (never trained on), appended to the training report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..engine.loop import generate_ids
from ..models import Transformer
from ..proposers import Proposer
from .features import FeatureStore


def heldout_prompts(store: FeatureStore, limit: int) -> list[list[int]]:
    offsets, prompt_lens = store.offsets.tolist(), store.prompt_lens.tolist()
    return [store.tokens[a : a + p].tolist() for a, p in zip(offsets, prompt_lens, strict=False)][:limit]


def decoding_stats(target: Transformer, make_proposer: Callable[[], Proposer], prompts: list[list[int]], *,
                   k: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy decoding of every prompt with a fresh proposer at a fixed depth k: totals over all prompts."""
    new = drafted = accepted = forwards = 0
    for prompt in prompts:
        _, stats = generate_ids(target, prompt, proposer=make_proposer(), k=k, max_new_tokens=max_new_tokens)
        new, drafted = new + stats.new_tokens, drafted + stats.drafted
        accepted, forwards = accepted + stats.accepted, forwards + stats.target_forwards
    return {"prompts": len(prompts), "tokens": new, "tau": new / max(forwards, 1),
            "acceptance_rate": accepted / max(drafted, 1), "drafted_per_step": drafted / max(forwards, 1)}


def append_decoding_report(report: Path, target: Transformer, make_proposer: Callable[[], Proposer],
                           heldout: FeatureStore, n_prompts: int, *, k: int, max_new_tokens: int) -> dict[str, float]:
    stats = decoding_stats(target, make_proposer, heldout_prompts(heldout, n_prompts), k=k,
                           max_new_tokens=max_new_tokens)
    with Path(report).open("a") as f:
        f.write(f"\n## Greedy decoding on {stats['prompts']} held-out prompts (k={k}, up to {max_new_tokens} "
                "new tokens each)\n\n| tau | acceptance | guesses verified per step | tokens |\n"
                f"|---:|---:|---:|---:|\n| {stats['tau']:.2f} | {stats['acceptance_rate']:.3f} | "
                f"{stats['drafted_per_step']:.1f} | {stats['tokens']} |\n")
    return stats
