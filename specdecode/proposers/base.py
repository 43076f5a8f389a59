"""The proposer interface: who guesses the next tokens. Proposers never see the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..acceptance import AcceptanceStats
from ..cost import ForwardCost
from ..sampling import SamplingParams
from ..tree import DraftTree
from ..verify import Verdict


@dataclass(frozen=True)
class Capabilities:
    """What a proposer tells the engine and the policy about itself (the only thing they read of it)."""

    # proposing costs next to nothing (no model forward): the policy asks for a deep tree and cuts it afterwards
    cheap: bool = False
    # sizes each step's guesses itself from the cost model it is bound to; k="auto" then just caps the depth
    sizes_itself: bool = False
    max_depth: int = 0  # the depth cap a self-sizing proposer gets under k="auto"
    # False when a measurement found that drafting cannot beat plain steps on this model and machine (layer
    # skipping whose search found no set that pays): k="auto" then runs plain steps without probing
    pays: bool = True
    guesses: bool = True  # False for plain decoding: no policy needed at all
    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states it drafts from (EAGLE, Medusa)
    # how many positions before the root it reads hidden states of (None: all): a prompt found in the prefix cache
    # is prefilled from there on, so the proposer gets those positions' hidden states as after a full prefill
    hidden_context: int | None = None
    # its proposals depend on the token sequence alone (a model draft's cache resynchronizes itself from the tokens):
    # it may draft ahead for a sequence the target has not verified yet (asynchronous drafting)
    token_state: bool = False


class Proposer(ABC):
    name: str = "proposer"
    capabilities: Capabilities = Capabilities()
    # a model draft's own measure of one more guess in its last proposal (None: not measured); unlike the
    # proposal's whole time it leaves out catching up on text committed while it was not asked (the prompt)
    seconds_per_guess: float | None = None

    def bind(self, cost: ForwardCost, acceptance: Callable[[str], AcceptanceStats]) -> None:  # noqa: B027
        """Before a request: the target's forward cost as this request's engine sees it, and the long-run
        acceptance statistics of a named part of the proposer (e.g. a hybrid's model draft)."""

    def begin(self, prompt: list[int], max_len: int) -> None:  # noqa: B027 - optional hook
        """A new request starts; `max_len` bounds prompt + generated + drafted tokens."""

    @abstractmethod
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree:
        """Guess up to `k` tokens deep after `tokens` (everything committed so far, root = tokens[-1])."""

    def reads_hidden(self, tokens_left: int) -> bool:
        """Whether it wants the hidden states of this step's committed positions (a resting EAGLE head does not);
        tokens_left: the most tokens the request may still commit (its max_new_tokens not yet generated)."""
        return bool(self.capabilities.hidden_layers)

    def observe_hidden(self, start: int, hidden: list[torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """The target's hidden states ([n, H] per layer in `capabilities.hidden_layers`) of the committed positions
        start..start+n-1: after each prefill chunk, then after every verification (the root and accepted guesses),
        where `reads_hidden` said so."""

    def reads_teacher(self) -> bool:
        """Whether it wants the target's logits at this step's committed positions (an EAGLE head learning online)."""
        return False

    def observe_teacher(self, start: int, logits: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """The target's raw logits ([n, V]) at the committed positions start..start+n-1 of a verification (row i
        predicts the token after position start + i), where `reads_teacher` said so."""

    def observe(self, tree: DraftTree, verdict: Verdict, extra_logits: torch.Tensor) -> None:  # noqa: B027
        """After verification: the tree the target saw (maybe cut by the policy), its verdict, and the
        target's logits for the tree's extra nodes ([m, V]; empty without extra nodes)."""

    def ahead(self) -> tuple[int, int] | None:
        """Asynchronous drafting: (proposals taken from chains drafted ahead, proposals) since `begin`."""
        return None

    def finish(self, tokens: list[int]) -> None:  # noqa: B027 - optional hook
        """The request ended (done, stopped or cancelled); `tokens` is everything committed, prompt first."""


class NoProposer(Proposer):
    """Plain decoding through the same engine: the baseline."""

    name = "none"
    capabilities = Capabilities(cheap=True, guesses=False)

    def propose(self, tokens, k, params, generator) -> DraftTree:
        return DraftTree.root_only(tokens[-1])
