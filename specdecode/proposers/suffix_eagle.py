"""Hybrid of suffix decoding and the EAGLE head: one tree, the cost model choosing how many of its nodes to verify.

Each step the suffix proposer's candidates come first (they cost a lookup). The head runs only when it could add
something: while the suffix's best tree expects fewer accepted tokens than the head's recent trees did (decayed
mean of its calibrated predictions), so text that copies its prompt or an earlier output takes the copy path and
pays no head forward, and chat text takes the head. The head sizes its own tree (EAGLE-2, see eagle.py) and rests
while its steps do not pay.

Greedy: the head's nodes join the suffix trie (a path both offer is one branch, with the larger chance); nodes
ranked by chance form a tree at every prefix, and `policy.best_count` picks how many to send. Sampling: the
suffix's point masses, cut by their own best count, then the head's chain drawn from q as a separate sibling
(the multi-round rule tries each sibling against the residual the ones before it left, so it stays exact).

The suffix part runs every step (about 1% of one); the head rests on its own rule while its part does not pay
(eagle.py), and what it costs beyond what it saves takes at most HEAD_SHARE of the decoding time (a budget, below).
Resting the whole hybrid besides (up to 16 steps) left it 4% behind suffix alone on the repetitive workload, where
the suffix carries it.
"""

from __future__ import annotations

import math
import time

from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..policy.speculation import Guessing
from .base import Needs, ProposalContext, Proposer, RequestInfo, StepOutput
from .eagle import HIDDEN_LEAD, EagleProposer
from .suffix import GLOBAL, MAX_DEPTH, SuffixProposer

EAGLE = 4  # node source flag, beside suffix.LOCAL and suffix.GLOBAL
# A head that does not pay (on a CPU, most chat text) still probes after each rest, and a lucky probe ends its rest:
# a run is its catch-up and a tree, dearer than a plain step, and those runs are all the hybrid trails suffix
# decoding by. The head's budget: every run is charged its seconds and the forward
# seconds of the nodes only it offered, and credited a plain step for each guess only it offered that was accepted;
# each step adds HEAD_SHARE of a plain step. A run the budget cannot pay yet rests the head until it can (at most
# HEAD_SAVINGS seconds saved up). A head that pays earns more than it spends and is never held back. (A run was
# charged at most a plain step, lest a process's first one, which builds the head's kernels, rest the head for
# long; runs then cost more than their charge. The head is warmed up as it loads instead.)
HEAD_SHARE = 0.001
HEAD_SAVINGS = 0.02


class SuffixEagleProposer(Proposer):
    name = "hybrid"
    guessing = Guessing(sizes_itself=True, max_depth=MAX_DEPTH)

    def __init__(self, suffix: SuffixProposer, eagle: EagleProposer) -> None:
        if suffix.cost is None or eagle.cost is None:
            raise ValueError("the suffix + EAGLE hybrid sizes its trees by the cost model: give both a cost")
        self.suffix, self.eagle = suffix, eagle
        self.hidden_layers = eagle.hidden_layers
        self.head_expects = 1.0  # decayed mean of the head's predicted accepted tokens per tree
        self.budget = 0.0  # seconds the head may still spend beyond what it saved (below 0: owed), kept on the head
        self.plain = 0.0  # a plain step's price (a step adds HEAD_SHARE of it to the budget)
        self.last: tuple[DraftTree, DraftTree | None, list[int], int] | None = None  # the tree sent, the head's tree,
        # each node's sources, and the context

    @property
    def needs(self) -> Needs:  # type: ignore[override]
        """The head's; a prompt found in the prefix cache prefills the head's catch-up window after a rest
        (HIDDEN_LEAD), not its full one: behind suffix's trees the head mostly rests."""
        needs = self.eagle.needs
        return Needs(needs.hidden_layers, HIDDEN_LEAD, needs.teacher) if needs.hidden_layers else needs

    def begin(self, request: RequestInfo) -> None:
        if request.cost is not None:  # a request's engine prices its trees: both parts by the same cost
            self.suffix.cost = self.eagle.cost = request.cost
        self.suffix.begin(request)
        self.eagle.begin(request)  # resting when the last request ended: this one starts resting
        self.last = None
        prompt = request.prompt
        # debts carry over, savings do not: what the head saved on one text (code it continues well) must not pay
        # for its runs on the next (chat it does not): in Spec-Bench they cost the hybrid 1% in qa after summarization
        self.budget = min(getattr(self.eagle.head, "head_budget", 0.0), 0.0)
        self.plain = self.suffix.cost.forward_seconds(1, len(prompt))
        self._defer()

    def _defer(self) -> None:
        """A head whose run the budget cannot pay yet rests until it can (reading no hidden states meanwhile). A head
        learning online is never held back: its runs are how it learns."""
        if self.budget < 0 and self.eagle.online is None:
            resting = self.eagle.resting
            resting.left = max(resting.left, math.ceil(-self.budget / max(HEAD_SHARE * self.plain, 1e-12)))

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k, params = context.tokens, context.k, context.params
        self.suffix.tokens = tokens
        found = self.suffix.candidates(tokens, k)
        ranked, n, expected = [], 0, 0.0
        if len(found.tokens) > 1:  # something matched (in chat text, under half the steps)
            ranked = found.ranked()[: self.suffix.nodes]
            n = self.suffix.best_count(found, ranked, len(tokens))
            expected = sum(map(found.chances.__getitem__, ranked[:n]))
        head, eagle = None, self.eagle
        self.budget = min(self.budget + HEAD_SHARE * self.plain, HEAD_SAVINGS)
        # a step of the head's rest (counted only where the head would run) costs no call (one learning online runs)
        if expected < self.head_expects and (eagle.online is not None or not eagle.resting.take()):
            if self.budget < 0 and eagle.online is None:
                self._defer()
            else:
                started = time.perf_counter()
                head = eagle.propose(ProposalContext(tokens, min(k, eagle.MAX_DEPTH), params, context.generator))
                self.budget -= time.perf_counter() - started  # all of it (see HEAD_SHARE)
                if head.num_drafted and len(eagle.node_chances) == head.num_drafted:
                    self.head_expects = 0.9 * self.head_expects + 0.1 * sum(eagle.node_chances)
                else:
                    head = None
        if head is None:
            tree, sources = found.tree(tokens[-1], ranked[:n]) if n else (DraftTree.root_only(tokens[-1]), [0])
        elif params.greedy:
            found.graft(head, self.eagle.node_chances, EAGLE)
            ranked = found.ranked()[: self.suffix.nodes + head.num_drafted]
            tree, sources = found.tree(tokens[-1], ranked[: self.suffix.best_count(found, ranked, len(tokens))])
        else:
            own, sources = found.tree(tokens[-1], ranked[:n])
            offset = len(own.tokens)
            parents = [0 if p == 0 else p - 1 + offset for p in head.parents[1:]]  # the head's chain, re-rooted
            tree = DraftTree(own.tokens + head.tokens[1:], own.parents + parents,
                             own.draft_probs + head.draft_probs[1:])
            sources = sources + [EAGLE] * head.num_drafted
        self.suffix.scorer.cut(self.suffix.scored, tree.depth)
        self.last = (tree, head, sources, len(tokens))
        return tree

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        """The head keeps what the forward gave it, and calibrates on (and judges) its own part of the tree: the
        accepted path as it ran through it."""
        self.suffix.tokens = outputs.tokens
        if tree is None or verdict is None or self.last is None or self.last[0] is not tree:
            self.last = None if tree is not None else self.last
            self.eagle.observe(None, None, outputs)
            return
        _, head, sources, context = self.last
        self.last = None
        if self.suffix.cache is not None:
            self.suffix.judge_global(sum(sources[i] == GLOBAL for i in verdict.path[1:]))
        if head is None:
            self.eagle.observe(None, None, outputs)
            return
        self._settle(tree, verdict, sources, context)
        path, node = [0], 0
        for accepted in verdict.path[1:]:
            child = next((c for c in head.children(node) if head.tokens[c] == tree.tokens[accepted]), None)
            if child is None:
                break
            path.append(child)
            node = child
        self.eagle.observe(head, Verdict(path, verdict.next_token), outputs)

    def _settle(self, tree: DraftTree, verdict: Verdict, sources: list[int], context: int) -> None:
        """The head's budget after a step it ran: charged the forward seconds of the nodes only it offered, credited
        a plain step for each of them accepted (the suffix's own guesses would have been there without it)."""
        cost, own = self.suffix.cost, sum(source == EAGLE for source in sources)
        saved = sum(sources[i] == EAGLE for i in verdict.path[1:]) * cost.forward_seconds(1, context)
        verified = cost.forward_seconds(len(tree), context) - cost.forward_seconds(len(tree) - own, context)
        self.budget = min(self.budget + saved - verified, HEAD_SAVINGS)

    def finish(self) -> None:
        self.suffix.finish()
        self.eagle.finish()
        self.eagle.head.head_budget = self.budget  # the next request (any that shares the head) starts from it
