"""Logits processing that depends on what was generated: logit bias, min_tokens and the presence, frequency and
repetition penalties (OpenAI's and vLLM's request fields).

The engine applies it to the target's logits at every node of a draft tree before verification, each node with
its own history (the request's tokens, then the tree's path down to the node), so the verifier's p is exactly the
distribution plain decoding would sample from at that point. The drafts need none of it: a guess drawn from any q
is verified exactly against p (a guess the processing forbids has p = 0 and is never accepted).

Order, as vLLM applies them: bias, then min_tokens (stop tokens banned until that many tokens were generated),
then the repetition penalty (over prompt and output: a seen token's logit divided by it when positive, multiplied
when not), then presence and frequency penalties (over the output: minus presence once, minus frequency per use).
Temperature, top-k, top-p and min-p follow in SamplingParams.probs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams
    from .tree import DraftTree


def process(logits: torch.Tensor, tree: DraftTree, tokens: list[int], prompt_len: int, params: SamplingParams,
            stop_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The target's logits [n, V] at the tree's nodes, processed for each node's history (a new tensor; the input
    is returned as it is when no processing is asked for)."""
    if not params.processes:
        return logits
    n, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        if int(ids.max()) >= vocab:
            raise ValueError(f"logit_bias names token {int(ids.max())}, outside the vocabulary of {vocab} tokens")
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=device)
    paths = tree.node_paths() if n > 1 else [[]]  # the root's token is committed already
    generated = len(tokens) - prompt_len
    if params.min_tokens and stop_token_ids:
        short = [i for i in range(n) if generated + len(paths[i]) < params.min_tokens]
        if short:
            out[torch.tensor(short, device=device)[:, None], torch.tensor(sorted(stop_token_ids), device=device)] = \
                float("-inf")
    if params.repetition_penalty != 1.0:  # every row: the seen tokens; then each node's own path tokens
        seen = set(tokens)
        ids = torch.tensor(sorted(seen), device=device)
        out[:, ids] = _penalized(out[:, ids], params.repetition_penalty)
        rows, cols, _ = _pairs({i: dict.fromkeys(set(paths[i]) - seen, 1.0) for i in range(n)})
        if rows:
            at = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
            out[at] = _penalized(out[at], params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:  # every row: the output's counts; then the paths'
        counts = Counter(tokens[prompt_len:])
        if counts:
            ids = torch.tensor(list(counts), device=device)
            out[:, ids] -= params.frequency_penalty * torch.tensor(list(counts.values()), dtype=out.dtype,
                                                                   device=device) + params.presence_penalty
        extra = {i: {t: params.frequency_penalty * k + (params.presence_penalty if t not in counts else 0.0)
                     for t, k in Counter(paths[i]).items()} for i in range(n)}
        rows, cols, values = _pairs(extra)
        if rows:
            out[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] -= torch.tensor(
                values, dtype=out.dtype, device=device)
    return out


def _penalized(values: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(values > 0, values / penalty, values * penalty)


def _pairs(per_row: dict[int, dict[int, float]]) -> tuple[list[int], list[int], list[float]]:
    """(rows, cols, values) of a sparse {row: {col: value}}: distinct cells, so one indexed update takes them all."""
    rows = [i for i, cells in per_row.items() for _ in cells]
    cols = [t for cells in per_row.values() for t in cells]
    return rows, cols, [v for cells in per_row.values() for v in cells.values()]
