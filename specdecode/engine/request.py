"""One request in flight: its tokens, sampling, stops, stats, proposer and policy.

The engine runs every forward; a request's step is split around it: `plan` asks the proposer for guesses,
and after the engine's forward and verification, `commit` counts the step and commits its tokens, cut
exactly at a stop token or max_new_tokens. The library and the server hold the same `Request`.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import asdict, dataclass

import torch

from ..core.grammar import Constraint
from ..core.logits_processing import process
from ..core.sampling import SamplingParams
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..policy.speculation import FixedK, Policy, Pricing, StepRecord, policy_for
from ..proposers import Proposer
from ..proposers.base import Needs, ProposalContext, RequestInfo, StepOutput

MAX_DRAFT_NODES = 256  # room kept in the KV cache for one step's guesses
MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's limit)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (not prefilled)
    new_tokens: int = 0
    drafted: int = 0  # guessed tokens sent to the target
    accepted: int = 0  # guessed tokens the target kept
    target_forwards: int = 0  # decoding forwards (the prefill is not counted)
    prefill_seconds: float = 0.0
    target_seconds: float = 0.0  # decoding forwards and verification (in a batch: the batch's, shared)
    draft_seconds: float = 0.0
    seconds: float = 0.0  # wall time of the whole request, prefill included
    # what the same tokens would have cost in plain steps, priced by the cost model at the load of each step
    # (0 where steps are not priced: a fixed k, plain decoding)
    plain_seconds_estimate: float = 0.0
    # asynchronous drafting: proposals taken from a chain drafted while the target verified, of all proposals
    ahead_hits: int = 0
    ahead_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses over guessed tokens sent to the target (a tree's siblings count as guesses)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (accepted guesses + 1); 1.0 for plain decoding."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def estimated_speedup(self) -> float | None:
        """The policy's own measure of what speculation won: the decoding steps' estimated plain-step seconds over
        what they took (forward and drafting). None where steps are not priced."""
        spent = self.target_seconds + self.draft_seconds
        return self.plain_seconds_estimate / spent if self.plain_seconds_estimate and spent else None

    def as_dict(self) -> dict[str, float | None]:
        out: dict[str, float | None] = dict(asdict(self))
        out.update(acceptance_rate=self.acceptance_rate, tau=self.tau, tokens_per_second=self.tokens_per_second,
                   estimated_speedup=self.estimated_speedup)
        return out


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target (its raw logits, before sampling parameters and
    processing, as vLLM reports by default), and the most likely tokens at its position, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class Request:
    def __init__(
        self,
        context: int,
        proposer: Proposer,
        prompt: list[int],
        *,
        max_new_tokens: int,
        params: SamplingParams,
        k: int | str | Policy,
        pricing: Pricing | None = None,
        stop_token_ids: Collection[int] = (),
        seed: int | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """context: the target's context length; k: a fixed number of tokens to guess per step, "auto" (the cost
        model decides each step: `pricing` needed), or a Policy that decides each step (AdaptiveK); pricing: what
        k="auto" prices guesses with (the proposer is given it too, as it begins); logprobs: None, or record each
        token's log-probability and this many most likely alternatives (`token_logprobs`); constraint: the grammar of
        a structured output (grammar.py)."""
        # the policy first: a bad k is named before the prompt's checks
        if isinstance(k, Policy):
            self.policy = k
        elif pricing is not None:
            self.policy = policy_for(k, proposer.guessing, pricing)
        elif k == "auto":
            raise ValueError("k='auto' prices guesses: give the request a Pricing (or a Policy as k)")
        else:
            self.policy = FixedK(int(k))
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {logprobs}")
        if len(prompt) + max_new_tokens > context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {context} tokens: shorten the prompt or lower max_new_tokens"
            )
        self.proposer, self.params, self.pricing = proposer, params, pricing
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
        self.proposal: DraftTree | None = None
        self.asked: ProposalContext | None = None  # the last proposal's question and the proposer's report
        self.draft_seconds = 0.0
        self.started = time.perf_counter()  # reset when the request joins an engine
        self.finished = False
        self.logprobs = logprobs
        self.constraint = constraint
        self.token_logprobs: list[TokenLogprob] = []

    @property
    def needs(self) -> Needs:
        """What the next forward returns for this request's proposer (asked anew: a resting EAGLE head reads
        nothing)."""
        return self.proposer.needs

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.stats.prompt_tokens :]

    def begin(self, max_len: int) -> None:
        """The request joins an engine (its prefill follows): the clock starts, the proposer sees the prompt."""
        self.started = time.perf_counter()
        pricing = self.pricing
        self.proposer.begin(RequestInfo(list(self.tokens), max_len, self.max_new_tokens,
                                        pricing.cost if pricing else None, pricing.acceptance if pricing else None))

    def plan(self, context: int) -> DraftTree:
        """Ask the proposer for this step's guesses (`context`: tokens cached before the step)."""
        remaining = self.max_new_tokens - self.stats.new_tokens
        k = self.policy.depth_to_propose(context, remaining - 1)  # the target adds one token of its own
        started = time.perf_counter()
        self.asked = asked = ProposalContext(self.tokens, k, self.params, self.generator) if k > 0 else None
        proposal = self.proposer.propose(asked) if asked is not None else DraftTree.root_only(self.tokens[-1])
        self.draft_seconds = time.perf_counter() - started
        if asked is not None and asked.drafted_ahead is not None:
            self.stats.ahead_steps += 1
            self.stats.ahead_hits += asked.drafted_ahead
        nodes = proposal.num_drafted + (len(proposal.extra.tokens) if proposal.extra is not None else 0)
        if nodes > MAX_DRAFT_NODES:
            raise ValueError(f"{self.proposer.name} sent {nodes} tokens besides the root; at most {MAX_DRAFT_NODES}")
        self.proposal = proposal
        return proposal

    def target_logits(self, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits at the tree's nodes as this request samples from them: processed by what each node's
        history holds (bias, min_tokens, penalties; processing.py), the logits themselves when nothing is asked."""
        return process(logits, tree, self.tokens, self.stats.prompt_tokens, self.params, self.stop_token_ids)

    def commit(self, tree: DraftTree, verdict: Verdict, outputs: StepOutput, context: int,
               forward_seconds: float, plain_seconds: float = 0.0) -> list[int]:
        """Count a verified step and commit its tokens, cut exactly at a stop token or max_new_tokens, then show the
        proposer the verdict and `outputs` (the engine's, for it). forward_seconds: the step's forward (in a batch,
        shared with the other rows: the engine, not the policy, learns costs from it); plain_seconds: what a plain
        step of the same batch costs now (0: not priced)."""
        stats, remaining = self.stats, self.max_new_tokens - self.stats.new_tokens
        stats.draft_seconds += self.draft_seconds
        stats.target_seconds += forward_seconds
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
        self.proposer.observe(tree, verdict, outputs)
        proposal = self.proposal or tree
        per_guess = self.asked.seconds_per_guess if proposal.num_drafted and self.asked is not None else None
        self.policy.observe(StepRecord(proposal, tree, start, self.tokens, context, self.draft_seconds, per_guess))
        stats.new_tokens += len(new)
        stats.plain_seconds_estimate += len(new) * plain_seconds
        stats.seconds = time.perf_counter() - self.started
        return new

    def record_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """Log-probabilities of the tokens a step committed; logits [>= len(tokens), V]: row i is the target's at
        token i's position (the verified path's nodes)."""
        if self.logprobs is None or not tokens:
            return
        logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, device=logprobs.device)].tolist()
        top: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if self.logprobs:
            best = logprobs.topk(self.logprobs, dim=-1)
            top = [list(zip(ids, values, strict=True)) for ids, values in zip(best.indices.tolist(),
                                                                               best.values.tolist(), strict=True)]
        self.token_logprobs += [TokenLogprob(*entry) for entry in zip(tokens, chosen, top, strict=True)]

    def finish(self) -> None:
        """The request left its engine (done, stopped by a stop string, cancelled or failed)."""
        if not self.finished:
            self.finished = True
            self.stats.seconds = time.perf_counter() - self.started
            self.policy.finish(self.tokens)
            self.proposer.finish()
