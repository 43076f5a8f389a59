"""EAGLE: a trained head drafts from the target's own hidden states (see models/eagle.py).

Greedy: an EAGLE-2 dynamic tree. Each depth expands the `topk` most probable children of the `topk`
best frontier nodes (by cumulative draft probability, one head forward per depth), and the best nodes
overall are sent for verification; a child never scores above its parent, so every prefix of the
ranking is a tree. Sampling: a chain drawn from the head's distribution q (after the same temperature /
top-k / top-p as the target), which the one lossless core verifies exactly.

With a cost model the proposer sizes each step itself, as EAGLE-2 does with draft confidence: a node's
path probability (calibrated online against what the target accepts) is its chance of acceptance, so
a tree of n nodes is worth 1 + sum of those chances tokens and costs the target's forward of n + 1
tokens plus the head forwards run. It stops expanding when even the best case of another depth cannot
raise that rate, and sends the count of nodes that maximises it (none: a plain step). A sampled chain
decides each depth before drawing it (its expected chance: the path so far times sum q^2): keeping a draw
for its own q(x) would bias what is sent away from q, and the output away from the target's. Without a
cost model: `k` depths, `nodes` nodes.

Never slower than plain decoding: the head's steps' realized rate, tokens committed over head seconds plus
the target's forward of each tree (decayed sums, each step counted in plain steps at its own load), is compared
with a plain step's; while it is under 1 + MARGIN the head rests (does not run) for a number of steps that
doubles each time (up to MAX_REST), then probes again: a head forward is a sizeable part of a fast target's
step, and paying it for steps that gain too little is slower than plain decoding. Resting, it does not read the
target's hidden states until HIDDEN_LEAD steps before its probe; then
it catches up in one forward on the positions it has (at most HEAD_CONTEXT: its cache restarts there).

The head keeps a KV cache of its own: entries for committed positions hold target features and stay;
draft entries sit after them and are dropped at the next proposal.

Learning online (`online`, see proposers/online_learning.py): the proposer records what the target verified, chunk by
chunk, and takes the newest published head at the start of a step (its cache then restarts: entries made by
the old head's weights would not be the new one's).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..common.method_options import EagleOptions
from ..core.sampling import sample
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..models import Transformer
from ..models.eagle import EagleHead
from ..policy.cost import ForwardCost
from ..policy.speculation import Guessing, Rest, best_count, smoothed
from .assets import is_path
from .base import NOTHING, Needs, ProposalContext, Proposer, RequestInfo, StepOutput
from .online_learning import OnlineHead


def path_sum(probs: list[torch.Tensor], drafted: list[int]) -> float:
    """Sum over a chain's guesses of the draft probability of the path up to each."""
    total, path = 0.0, 1.0
    for q, token in zip(probs, drafted, strict=True):
        path *= float(q[token])
        total += path
    return total


# most steps the head rests while its steps do not pay: a probe that does not pay costs about two plain steps, and a
# longer rest can sleep through a whole conversation where the head would pay
# (benchmarks/results/sessions-smollm2-512-rest512-reverted)
MAX_REST = 128
# most positions one run catches up on (after a rest, or over a long prompt): the head's cache then restarts on
# them, so a probe costs a bounded forward, not one over the whole text
HEAD_CONTEXT = 128
MIN_EVIDENCE = 4  # steps judged before the head may rest: one step gains 0 or several tokens
# a resting head reads the target's hidden states again this many steps before it probes (at least as many positions):
# its catch-up starts there, a quarter of a HEAD_CONTEXT one, and the steps before pay no hidden-state copies
HIDDEN_LEAD = 32
REJECTED = 4  # rejected guesses kept per position for online learning (DVI's reward)
TEACHER_TOPK = 8  # the target's most likely tokens kept per position for online learning (as offline training keeps)


class EagleProposer(Proposer):
    name = "eagle"
    MAX_DEPTH = 8  # deepest tree when the proposer sizes itself (k="auto")

    def __init__(self, head: EagleHead, target: Transformer, *, topk: int = 4, nodes: int = 24,
                 cost: ForwardCost | None = None, online: OnlineHead | None = None) -> None:
        """cost: the target's forward cost; with it each step's tree is sized by expected tokens per second.
        online: the head learns from this request's verified text, and is taken from there (`head` ignored)."""
        self.online = online
        self.version = 0  # of the head in use
        if online is not None:
            head, self.version = online.serving()
        head.check_target(target)
        if topk < 1 or nodes < 1:
            raise ValueError(f"eagle needs topk >= 1 and nodes >= 1, got topk={topk}, nodes={nodes}")
        self.head, self.embed = head, target.embed
        self.vocab_size = target.config.vocab_size
        self.topk, self.nodes, self.cost = topk, nodes, cost
        self.hidden_layers = tuple(head.config.target_layers)
        self.features: torch.Tensor | None = None  # [max_len, H]: fused target features per committed position
        self.raw: torch.Tensor | None = None  # [max_len, layers * H]: the target's hidden states, fused when needed
        self.known = 0  # positions below this one have hidden states ...
        self.known_from = 0  # ... from this one on (those before were skipped while the head rested)
        self.fused = 0  # positions [offset, fused) have features
        self.cached = 0  # positions below this one have committed entries in the head's cache
        self.offset = 0  # the position of the cache's first entry
        self.head_seconds: float | None = None  # one head forward, smoothed
        # calibration per mode (greedy tree, sampled chain): decayed [accepted, predicted] over verified trees
        self.calibration = {True: [0.0, 0.0], False: [0.0, 0.0]}
        self.last: tuple[DraftTree, bool, float] | None = None  # the last tree sent, its mode, predicted accepted
        self._costs: dict[int, float] = {}  # forward seconds by size, for the step being sized
        self.resting = Rest(MAX_REST, MIN_EVIDENCE)
        self.step_head = (0.0, 0)  # the last proposal's head seconds and context
        self.node_chances: list[float] = []  # the last tree's guessed nodes' calibrated chances, in tree order
        # made with a cost it sizes its trees itself (by the request's cost, RequestInfo.cost, where k="auto" gives one)
        self.guessing = Guessing(sizes_itself=cost is not None, max_depth=self.MAX_DEPTH)
        self.tokens: list[int] = []  # the request's committed tokens, as last seen
        self.max_new: int | None = None  # the request's max_new_tokens (None: unbounded)
        self.prompt_len = 0

    def begin(self, request: RequestInfo) -> None:
        if self.cost is not None and request.cost is not None:
            self.cost = request.cost
        prompt, max_len = request.prompt, request.max_len
        self.max_len = max_len
        self.tokens, self.max_new = prompt, request.max_new_tokens
        self.prompt_len = len(prompt)
        self.features = self.raw = None  # made when the first hidden states come: a head resting through a request
        # (most of Spec-Bench's, on a CPU) never zeroes ~5 MB for them (1% of a short request's prefill)
        self.known = self.known_from = self.cached = self.fused = self.offset = 0
        self.recorded = 0  # positions below this one were recorded for online learning (or skipped)
        # for online learning: per position i, the guesses for token i + 1 the target rejected (-1: none)
        self.rejected = torch.full((max_len if self.online is not None else 0, REJECTED), -1, dtype=torch.long)
        # and the target's distribution there (top TEACHER_TOPK; id -1: none kept, the committed token teaches)
        rows = max_len if self.online is not None and self.online.cfg.soft else 0
        self.teacher_ids = torch.full((rows, TEACHER_TOPK), -1, dtype=torch.int32)
        self.teacher_probs = torch.zeros((rows, TEACHER_TOPK), dtype=torch.float16)
        self.root = 0  # the last proposal's root position
        # what earlier requests found carries over (the head is shared): resting at the end of the last request,
        # this one starts resting too, and does not pay the head's pass over the whole prompt for nothing
        self.resting = Rest(MAX_REST, MIN_EVIDENCE)
        carried = getattr(self.head, "rest_state", None) if self.cost is not None else None
        if carried is not None:
            self.resting.resume(carried)

    @property
    def needs(self) -> Needs:  # type: ignore[override]
        """The hidden states of its target layers: learning online, always; resting, within HIDDEN_LEAD steps of its
        probe, and only where the request lasts until it (the last steps of a short request read nothing for
        nothing). Asked after this step's proposal, with `left` steps of rest to go, the probe is the (left + 1)-th
        step after this one; at most tokens_left - 1 follow this one (each commits a token or more), and a probe
        guesses only where two tokens or more are left (the last step's token is its own)."""
        return Needs(self.hidden_layers, HEAD_CONTEXT, self.soft) if self._reads_hidden() else NOTHING

    def _reads_hidden(self) -> bool:
        if self.online is not None:
            return True
        if self.max_new is None:
            return self.resting.left < HIDDEN_LEAD
        tokens_left = self.max_new - (len(self.tokens) - self.prompt_len)
        return self.resting.left < min(HIDDEN_LEAD, tokens_left - 2)

    @property
    def soft(self) -> bool:
        """Learning online from the target's distributions (its teacher logits), not only its tokens."""
        return self.online is not None and self.online.cfg.soft

    def _take_teacher(self, start: int, logits: torch.Tensor) -> None:
        """Keep the target's top TEACHER_TOPK probabilities at the committed positions: the learner distils them."""
        probs, top = logits.float().softmax(-1).topk(TEACHER_TOPK, dim=-1)
        self.teacher_ids[start : start + len(top)] = top.to("cpu", torch.int32)
        self.teacher_probs[start : start + len(top)] = probs.to("cpu", torch.float16)

    def _take_hidden(self, start: int, hidden: list[torch.Tensor]) -> None:
        """Keep the target's hidden states; they are fused into features when the head next runs (a resting
        head costs nothing per step)."""
        if self.raw is None:
            self._allocate()
        if start > self.known:  # positions known..start - 1 were skipped while resting: the head restarts after
            self.known_from = start
        n, h = hidden[0].shape
        for j, layer in enumerate(hidden):  # each layer straight into its columns (no concatenated copy first)
            self.raw[start : start + n, j * h : (j + 1) * h] = layer
        self.known = start + n
        self.fused = min(self.fused, start)
        self.cached = min(self.cached, start)  # entries past a rewritten feature are stale

    def _allocate(self) -> None:
        """The request's buffers: raw hidden states and features per position, and the head's cache."""
        h, device = self.head.config.block.hidden_size, self.head.device
        self.features = torch.zeros(self.max_len, h, dtype=self.head.dtype, device=device)
        self.raw = torch.zeros(self.max_len, h * len(self.hidden_layers), dtype=self.head.dtype, device=device)
        self.cache = self.head.new_cache(self.max_len + self.nodes * 4 + 64)

    def _fuse(self, start: int, end: int) -> None:
        """Features for positions [start, end) (those before `start` are not needed: the cache restarted later)."""
        start = max(start, self.fused)
        if start < end:
            self.features[start:end] = self.head.fuse(self.raw[start:end])
        self.fused = max(self.fused, end)

    def _run(self, features: torch.Tensor, tokens: list[int], positions: list[int], mask: torch.Tensor | None,
             logits_at: slice = slice(None)):
        ids = torch.tensor([tokens], device=self.head.device)
        logits, hidden = self.head(features[None], self.embed(ids).to(features.dtype), self.cache,
                                   torch.tensor(positions, device=self.head.device), mask, logits_at)
        return logits[0], hidden[0]

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k, params, generator = context.tokens, context.k, context.params, context.generator
        self.tokens = tokens
        root = len(tokens) - 1  # entry t reads (feature t, token t + 1): the last one is entry root - 1
        if self.online is not None:  # between steps: the only place the head changes
            self._learn_online(tokens)
        if self.resting.take():  # counted first: while resting the hidden states are not read, so `known` lags
            return DraftTree.root_only(tokens[-1])
        if k < 1 or root < 1 or self.known < root:
            return DraftTree.root_only(tokens[-1])
        proposing = time.perf_counter()
        start = max(min(self.cached, root - 1), self.offset)  # at least the root's entry runs
        if start < self.known_from or root - start > HEAD_CONTEXT:  # its cache restarts on what it has, bounded
            start = self.offset = min(max(root - HEAD_CONTEXT, self.known_from), root - 1)
        self.cache.rollback(start - self.offset)
        self._fuse(start, root)
        started = time.perf_counter()
        self._costs.clear()
        logits, hidden = self._run(self.features[start:root], tokens[start + 1 :], list(range(start, root)), None,
                                   slice(-1, None))
        self.cached = root
        logits, hidden = logits[-1], hidden[-1]
        spent = time.perf_counter() - started
        if params.greedy:
            tree, predicted = self._tree(tokens[-1], root, logits, hidden, k, spent)
        else:
            tree, predicted = self._chain(tokens[-1], root, logits, hidden, k, params, generator, spent)
        self.last = (tree, params.greedy, predicted)
        self.step_head = (time.perf_counter() - proposing, root)
        self.root = root
        return tree

    def _learn_online(self, tokens: list[int]) -> None:
        """Record the verified chunks not yet recorded, then take the newest published head."""
        online = self.online
        chunk = online.cfg.chunk
        self.recorded = max(self.recorded, self.known_from)
        while self.recorded + chunk < min(self.known, len(tokens)):  # a chunk's n + 1 tokens are all committed
            self._record(self.recorded, tokens)
            self.recorded += chunk
        head, version = online.serving()
        if version != self.version:
            self.head, self.version = head, version
            self.cached = self.fused = self.offset  # its cache and features restart: the weights changed

    def _record(self, a: int, tokens: list[int], new_from: int = 0) -> None:
        """Positions a..a+chunk-1 go to the learner (those before `new_from`, recorded already, as context only)."""
        online, chunk = self.online, self.online.cfg.chunk
        teacher = None
        if self.soft:
            ids = self.teacher_ids[a : a + chunk]
            if new_from > a:  # a copy (record copies the rest): these rows stay taught where first recorded
                ids = ids.clone()
                ids[: new_from - a] = -1
            teacher = (ids, self.teacher_probs[a : a + chunk])
            if online.cfg.answers_only and bool((ids[:, 0] < 0).all()):
                return  # the prompt alone: nothing the target answered to learn from
        online.record(self.raw[a : a + chunk], tokens[a : a + chunk + 1], self.rejected[a : a + chunk], teacher)

    def finish(self) -> None:
        """The positions after the last whole chunk (most of a short answer) go to the learner too, in a chunk that
        ends at the last committed token; its positions recorded already are context only."""
        tokens = self.tokens
        if self.online is None or not self.soft or not self.online.cfg.answers_only:
            return
        end = min(self.known, len(tokens) - 1)  # position end - 1's next token is the last committed one
        start = max(end - self.online.cfg.chunk, self.known_from)
        if end - start == self.online.cfg.chunk and end > self.recorded:
            self._record(start, tokens, new_from=self.recorded)
        self.recorded = end

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        """Keep the hidden states and teacher logits it reads, then calibrate (and judge) on the verdict."""
        if outputs.hidden is not None:
            self._take_hidden(outputs.start, outputs.hidden)
        if outputs.teacher is not None:
            self._take_teacher(outputs.start, outputs.teacher)
        self.tokens = outputs.tokens
        if tree is None or verdict is None:
            return
        if self.online is not None and len(tree) > 1:
            self.online.report(self.version, verdict.num_accepted)
            last = verdict.path[-1]  # its guessed children were all rejected (the target chose another token)
            guesses = [tree.tokens[c] for c in tree.children(last)][:REJECTED]
            if guesses:
                self.rejected[self.root + len(verdict.path) - 1, : len(guesses)] = torch.tensor(guesses)
        if self.last is not None and self.last[0] is tree:  # the tree went out as proposed
            counts = self.calibration[self.last[1]]
            counts[0] = 0.95 * counts[0] + verdict.num_accepted
            counts[1] = 0.95 * counts[1] + self.last[2]
            if self.cost is not None:
                self._judge(len(tree), verdict.num_accepted)
        self.last = None

    def _judge(self, nodes: int, accepted: int) -> None:
        """Rest while the head's steps do not beat plain ones (policy.Rest; see the module docstring). Each step is
        counted in plain steps of its own time: a step priced before the load moved must not be read at today's."""
        seconds, context = self.step_head
        self.resting.judge(self.cost, accepted, seconds, nodes, context)
        self.head.rest_state = self.resting.state()

    # ------------------------------------------------------------------------------------ sizing
    def _alpha(self, greedy: bool) -> float:
        """Accepted guesses per unit of predicted path probability (1.0 until seen)."""
        accepted, predicted = self.calibration[greedy]
        return min(max((accepted + 1.0) / (predicted + 1.0), 0.25), 2.0)

    def _timed_run(self, *args):
        started = time.perf_counter()
        out = self._run(*args)
        elapsed = time.perf_counter() - started
        self.head_seconds = smoothed(self.head_seconds, elapsed)
        return out, elapsed

    def _forward(self, tokens: int, context: int) -> float:
        """The target's seconds for a forward of `tokens` (one context per step: memoised by size)."""
        if tokens not in self._costs:
            self._costs[tokens] = self.cost.forward_seconds(tokens, context)
        return self._costs[tokens]

    def _best_count(self, chances: list[float], context: int, spent: float) -> tuple[int, float]:
        """(n, rate): the first n ranked nodes maximising expected tokens per second, and that rate."""
        return best_count(np.array(chances), self.cost, context, spent)

    def _worth_deeper(self, chances: list[float], frontier_chance: float, width: int, context: int,
                      spent: float) -> bool:
        """Could one more depth raise the rate? Its nodes' chances sum to at most the frontier's."""
        n, rate = self._best_count(chances, context, spent)
        head = self.head_seconds or 0.1 * self._forward(1, context)
        best_case = (1.0 + sum(chances[:n]) + frontier_chance) / (self._forward(n + 1 + width, context) + spent + head)
        return best_case > rate

    def _full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        full = draft_logits.new_full((self.vocab_size,), float("-inf"))
        full[self.head.d2t] = draft_logits
        return full

    def _chain(self, root_token, root, logits, hidden, k, params, generator, spent) -> tuple[DraftTree, float]:
        """Sampled: a chain of draws from the head's q. Whether depth d goes out is decided before x_d is drawn, from
        the draws above it and q_d's expected chance (sum of q_d squared): a cut that read q(x_d) would send low-q
        draws less often than q does, and min(1, p/q) with the residual would no longer give exactly p."""
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        chances: list[float] = []
        alpha, path = self._alpha(False), 1.0
        for depth in range(1, k + 1):
            q = params.probs(self._full_logits(logits).float())
            if self.cost is not None:
                expected = min(1.0, alpha * path * float(q.square().sum()))
                if self._best_count([*chances, expected], root, spent)[0] < depth:
                    break
            drafted.append(sample(q, generator))
            probs.append(q)
            path *= float(q[drafted[-1]])
            chances.append(min(1.0, alpha * path))
            if depth == k or (self.cost is not None
                              and not self._worth_deeper(chances, alpha * path, 1, root, spent)):
                break
            (logits, hidden), elapsed = self._timed_run(hidden[None], drafted[-1:], [root - 1 + depth], None)
            logits, hidden, spent = logits[-1], hidden[-1], spent + elapsed
        self.node_chances = chances
        return DraftTree.chain(root_token, drafted, probs), path_sum(probs, drafted)

    def _tree(self, root_token, root, logits, hidden, k, spent) -> tuple[DraftTree, float]:
        """EAGLE-2: grow by cumulative log-probability, then keep the best nodes."""
        tokens: list[int] = []  # target ids of the candidate nodes
        parents: list[int] = []  # -1: a child of the root
        scores: list[float] = []
        slots: list[int] = []  # cache index of each expanded node's head entry (-1: not expanded)
        topk = min(self.topk, self.head.config.draft_vocab_size)

        def add_children(parent: int, logp: torch.Tensor, base: float) -> list[int]:
            values, ids = logp.topk(topk)
            new = []
            for v, i in zip(values.tolist(), self.head.d2t[ids].tolist(), strict=True):
                tokens.append(i)
                parents.append(parent)
                scores.append(base + v)
                slots.append(-1)
                new.append(len(tokens) - 1)
            return new

        frontier = add_children(-1, logits.float().log_softmax(-1), 0.0)
        parent_hidden = {-1: hidden}
        alpha = self._alpha(True)
        for depth in range(2, k + 1):
            frontier = sorted(frontier, key=lambda n: -scores[n])[:topk]
            if self.cost is not None:
                chances = sorted((min(1.0, alpha * math.exp(v)) for v in scores), reverse=True)[: self.nodes]
                reach = alpha * sum(math.exp(scores[n]) for n in frontier)
                if not self._worth_deeper(chances, reach, len(frontier), root, spent):
                    break
            start = self.cache.length
            mask = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)
            mask[:, : self.cached - self.offset] = True  # the committed entries
            for row, node in enumerate(frontier):
                slots[node] = start + row
                mask[row, start + row] = True
                p = parents[node]
                while p >= 0:
                    mask[row, slots[p]] = True
                    p = parents[p]
            feats = torch.stack([parent_hidden[parents[n]] for n in frontier])
            positions = [root - 1 + depth - 1] * len(frontier)
            (out, hid), elapsed = self._timed_run(feats, [tokens[n] for n in frontier], positions, mask)
            spent += elapsed
            logp = out.float().log_softmax(-1)
            new = []
            for row, node in enumerate(frontier):
                parent_hidden[node] = hid[row]
                new += add_children(node, logp[row], scores[node])
            frontier = new
        # a child never scores above its parent and the sort is stable, so every prefix is a tree
        ranked: list[int] = []
        chosen: set[int] = set()
        for n in sorted(range(len(tokens)), key=lambda n: -scores[n]):
            if len(ranked) == self.nodes:
                break
            if parents[n] < 0 or parents[n] in chosen:
                ranked.append(n)
                chosen.add(n)
        chances = [min(1.0, alpha * math.exp(scores[n])) for n in ranked]
        chance_of = dict(zip(ranked, chances, strict=True))
        if self.cost is not None:
            ranked = ranked[: self._best_count(chances, root, spent)[0]]
        keep = sorted(ranked)  # creation order: parents before children
        self.node_chances = [chance_of[n] for n in keep]
        index = {node: i + 1 for i, node in enumerate(keep)}
        tree = DraftTree([root_token] + [tokens[n] for n in keep],
                         [-1] + [0 if parents[n] < 0 else index[parents[n]] for n in keep])
        return tree, sum(math.exp(scores[n]) for n in keep)


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: EagleOptions, draft: Draft, k: int | str) -> EagleProposer:
    """draft: a trained head's folder (None: the one shipped for this model)."""
    if not is_path(draft):
        raise ValueError("method 'eagle' drafts with trained heads: pass draft=<their folder>, not a model")
    return EagleProposer(assets.eagle_head(draft), assets.model, topk=options.topk, nodes=options.nodes,
                         cost=assets.cost_model(), online=assets.online_head(draft) if options.online_draft else None)
