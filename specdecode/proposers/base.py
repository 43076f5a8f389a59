"""The proposer interface: who guesses the next tokens. Proposers never see the engine.

A proposer's life is four calls, made by the request that owns it:

    begin(request)                    a request starts: its prompt, room, and (k="auto") the cost that prices guesses
    propose(context) -> DraftTree     guess up to context.k tokens deep after context.tokens
    observe(tree, verdict, outputs)   the target's answer: the tree it saw (None for a prefill chunk), its verdict,
                                      and what the forward gave for this proposer (`StepOutput`)
    finish()                          the request ended (done, stopped, cancelled or failed)

and two declarations, read by others: `needs` (what the target's forward returns for it: hidden states of which
layers, over how many positions before the root, teacher logits), read by the engine; `guessing` (how its guesses
are paid for: free, a forward per guess, or sized by itself), read by the policy (policy.policy_for).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..common.method_options import NoOptions
from ..core.acceptance import AcceptanceStats
from ..core.sampling import SamplingParams
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..policy.cost import ForwardCost
from ..policy.speculation import Guessing


@dataclass(frozen=True)
class Needs:
    """What a proposer needs from the target's forward; the engine returns exactly this in `StepOutput`."""

    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states it drafts from (EAGLE, Medusa)
    # how many positions before the root it reads hidden states of (None: all): a prompt found in the prefix cache
    # is prefilled from there on, so the proposer gets those positions' hidden states as after a full prefill
    hidden_context: int | None = None
    teacher: bool = False  # the target's raw logits at the committed positions (an EAGLE head learning online)


NOTHING = Needs()


@dataclass(frozen=True)
class RequestInfo:
    """What a proposer is told of a request as it begins."""

    prompt: list[int]
    max_len: int  # bounds prompt + generated + drafted tokens
    max_new_tokens: int | None = None  # None: not bounded by the request (a proposer driven by hand)
    # under k="auto" (policy.Pricing): the target's forward cost as this request's engine sees it, and the long-run
    # acceptance statistics of a named part of the proposer (e.g. a hybrid's model draft); None: the proposer keeps
    # the cost it was built with
    cost: ForwardCost | None = None
    acceptance: Callable[[str], AcceptanceStats] | None = None


@dataclass
class ProposalContext:
    """One step's question to a proposer, and what it reports of its answer (for the policy and the stats)."""

    tokens: list[int]  # everything committed so far; the tree's root is tokens[-1]
    k: int  # guess at most this deep
    params: SamplingParams
    generator: torch.Generator | None
    # reported by the proposer: a model draft's own measure of one more guess in this proposal (None: not measured);
    # unlike the proposal's whole time it leaves out catching up on text committed while it was not asked
    seconds_per_guess: float | None = None
    drafted_ahead: bool | None = None  # asynchronous drafting: taken from a chain drafted ahead (None: not drafting)


@dataclass
class StepOutput:
    """What the target's forward gave a proposer, as its `needs` declared: for the committed positions
    start..start+n-1 (after a prefill chunk: the chunk's; after a verification: the root and accepted guesses)."""

    tokens: list[int]  # everything committed after this forward, prompt first (the request's own list)
    start: int
    hidden: list[torch.Tensor] | None = None  # [n, H] per layer of needs.hidden_layers (None: not asked)
    teacher: torch.Tensor | None = None  # [n, V] raw logits: row i predicts the token after position start + i
    extra_logits: torch.Tensor | None = None  # [m, V] at the tree's extra nodes (None: it had none)


class Proposer(ABC):
    name: str = "proposer"
    needs: Needs = NOTHING
    guessing: Guessing = Guessing()

    def begin(self, request: RequestInfo) -> None:  # noqa: B027 - most proposers keep nothing per request
        """A new request starts (its prompt is prefilled after this)."""

    @abstractmethod
    def propose(self, context: ProposalContext) -> DraftTree:
        """Guess up to `context.k` tokens deep after `context.tokens`."""

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:  # noqa: B027
        """After each forward: the tree the target saw (maybe cut by the policy) and its verdict, or None and None
        after a prefill chunk; `outputs` holds what `needs` asked for."""

    def finish(self) -> None:  # noqa: B027 - optional
        """The request ended (done, stopped or cancelled); the last `observe` had its committed tokens."""


class NoProposer(Proposer):
    """Plain decoding through the same engine: the baseline."""

    name = "none"
    guessing = Guessing(plain=True, cheap=True)

    def propose(self, context: ProposalContext) -> DraftTree:
        return DraftTree.root_only(context.tokens[-1])


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: NoOptions, draft: Draft, k: int | str) -> Proposer:
    return NoProposer()
