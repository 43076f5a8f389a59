"""The decode loop: propose -> verify -> commit, with exact stop conditions and per-request stats."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass

import torch

from .models import Transformer
from .policy import FixedK, Policy, StepRecord
from .proposers import NoProposer, Proposer
from .sampling import SamplingParams
from .tree import DraftTree
from .verify import verify

MAX_DRAFT_NODES = 256  # room kept in the KV cache for one step's guesses


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    drafted: int = 0  # guessed tokens sent to the target
    accepted: int = 0  # guessed tokens the target kept
    target_forwards: int = 0  # decoding forwards (the prefill is not counted)
    prefill_seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    seconds: float = 0.0  # wall time of the whole request, prefill included

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (accepted guesses + 1); 1.0 for plain decoding."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, float]:
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, tau=self.tau, tokens_per_second=self.tokens_per_second)
        return out


class Generation:
    """One request in flight. Iterate it for lists of newly committed tokens; read stats at any time."""

    def __init__(
        self,
        target: Transformer,
        proposer: Proposer,
        prompt: list[int],
        *,
        max_new_tokens: int,
        params: SamplingParams,
        k: int | Policy,
        stop_token_ids: Collection[int] = (),
        seed: int | None = None,
    ) -> None:
        """k: a fixed number of tokens to guess per step, or a Policy that decides each step (AdaptiveK)."""
        context = target.config.max_position_embeddings
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.policy = k if isinstance(k, Policy) else FixedK(k)
        if len(prompt) + max_new_tokens > context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {context} tokens: shorten the prompt or lower max_new_tokens"
            )
        self.target, self.proposer, self.params = target, proposer, params
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tokens = list(prompt)
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.finish_reason: str | None = None  # "stop" | "length"
        self.generator = torch.Generator(device="cpu")
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._steps = self._run()

    def __iter__(self) -> Iterator[list[int]]:
        return self._steps

    def close(self) -> None:
        self._steps.close()

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.stats.prompt_tokens :]

    def _run(self) -> Iterator[list[int]]:
        started = time.perf_counter()
        stats, target, prompt = self.stats, self.target, self.tokens
        cache = target.new_cache(len(prompt) + self.max_new_tokens + MAX_DRAFT_NODES)
        self.proposer.begin(list(prompt), cache.max_len)
        layers = self.proposer.hidden_layers
        if len(prompt) > 1:  # the cache holds every committed token but the last (the next root)
            out = target.forward(torch.tensor([prompt[:-1]], device=target.device), cache, logits_at=None,
                                 hidden_layers=layers)
            if layers:
                self.proposer.observe_hidden(0, [h[0] for h in out.hidden])
        stats.prefill_seconds = time.perf_counter() - started
        try:
            while self.finish_reason is None:
                new = self._step(cache)
                stats.new_tokens += len(new)
                stats.seconds = time.perf_counter() - started
                yield new
        finally:
            stats.seconds = time.perf_counter() - started
            self.policy.finish(self.tokens)
            self.proposer.finish(self.tokens)

    def _step(self, cache) -> list[int]:
        remaining = self.max_new_tokens - self.stats.new_tokens
        context = cache.length
        # the target adds one token of its own to any accepted guesses, so guess at most remaining - 1
        k = self.policy.depth_to_propose(context, remaining - 1)
        t0 = time.perf_counter()
        root = DraftTree.root_only(self.tokens[-1])
        proposal = self.proposer.propose(self.tokens, k, self.params, self.generator) if k > 0 else root
        tree = self.policy.choose(proposal, context)
        nodes = tree.num_drafted + (len(tree.extra.tokens) if tree.extra is not None else 0)
        if nodes > MAX_DRAFT_NODES:
            raise ValueError(f"{self.proposer.name} sent {nodes} tokens besides the root; at most {MAX_DRAFT_NODES}")
        t1 = time.perf_counter()
        tokens, positions, mask = tree.forward_inputs(context)
        device = self.target.device
        layers = self.proposer.hidden_layers
        out = self.target.forward(torch.tensor([tokens], device=device), cache, positions=positions.to(device),
                                  tree_mask=mask, hidden_layers=layers)
        logits = out.logits[0]
        verdict = verify(tree, logits[: len(tree)], self.params, self.generator)
        cache.keep(context, verdict.path)
        if layers:
            path = torch.tensor(verdict.path, device=device)
            self.proposer.observe_hidden(context, [h[0, path] for h in out.hidden])
        self.proposer.observe(tree, verdict, logits[len(tree) :])
        t2 = time.perf_counter()
        return self._commit(proposal, tree, verdict, context, t1 - t0, t2 - t1)

    def _commit(self, proposal: DraftTree, tree: DraftTree, verdict, context: int, draft_seconds: float,
                target_seconds: float | None) -> list[int]:
        """Count a verified step and commit its tokens, cut exactly at a stop token or max_new_tokens.
        target_seconds None: the forward was shared with other rows (not this request's own cost)."""
        stats, remaining = self.stats, self.max_new_tokens - self.stats.new_tokens
        stats.draft_seconds += draft_seconds
        stats.target_seconds += target_seconds or 0.0
        stats.target_forwards += 1
        stats.drafted += tree.num_drafted

        new = [tree.tokens[i] for i in verdict.path[1:]] + [verdict.next_token]
        for i, token in enumerate(new):  # stop exactly at the first stop token, never past it
            if token in self.stop_token_ids:
                self.finish_reason = "stop"
                new = new[: i + 1]
                break
        if len(new) >= remaining:
            self.finish_reason = self.finish_reason or "length"
            new = new[:remaining]
        stats.accepted += min(verdict.num_accepted, len(new))  # guesses cut by a stop were not used
        start = len(self.tokens)
        self.tokens.extend(new)
        per_guess = self.proposer.seconds_per_guess if proposal.num_drafted else None
        self.policy.observe(StepRecord(proposal, tree, start, self.tokens, context, draft_seconds, target_seconds,
                                       per_guess))
        return new


def generate_ids(
    target: Transformer,
    prompt: list[int],
    *,
    proposer: Proposer | None = None,
    max_new_tokens: int = 64,
    params: SamplingParams | None = None,
    k: int | Policy = 4,
    stop_token_ids: Collection[int] = (),
    seed: int | None = None,
) -> tuple[list[int], GenerationStats]:
    """Run a whole request on token ids; returns (new tokens, stats)."""
    gen = Generation(
        target, proposer or NoProposer(), prompt, max_new_tokens=max_new_tokens, k=k,
        params=params or SamplingParams(), stop_token_ids=stop_token_ids, seed=seed,
    )
    for _ in gen:
        pass
    return gen.new_tokens, gen.stats
