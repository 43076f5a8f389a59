"""Suffix decoding: guess from what followed the end of the text where it occurred before, in this request's own
prompt and output or in earlier requests' outputs, a tree sized by how often each continuation followed.

Two suffix indexes (specdecode/proposers/suffix_index.py) are searched each step: the request's own (prompt + output,
extended as tokens commit) and the model's global one (`SuffixCache`: the outputs of earlier requests, shared by
every request of one model, bounded with FIFO eviction). Each finds the occurrences of the longest suffix of the
text; their continuations merge into a trie in which a node's frequency is the share of occurrences that
continued with its path (a suffix tree's count over its parent's, multiplied down the path).

A node's chance of acceptance is its frequency times the reach learned for its source and match length: the
chance that guesses copied from such a match still hold d tokens deep, learned from every proposal against the
text committed after it (scored whether or not it was verified, so learning is free). Nodes ranked by chance
form a tree at every prefix (a child never beats its parent), and with a cost model the proposer sends the count
that maximises expected tokens per second of the target's forward, none when a plain step is better
(`policy.best_count`); without one, `k` nodes. Ties go to the request's own text, which is searched first.

Proposing is a small share of a step (the request's own text searched in dicts, a trie of a few dozen nodes), so
the proposer runs every step, as prompt lookup does: resting while its steps did not pay lost more tau than it saved
time. The global cache is searched only where a filter says it probably holds the text's last 3 tokens (its 1-2
token matches added no tau), and not while its matches add no accepted token (up to GLOBAL_MAX_REST steps). The
measurements behind these rules: benchmarks/results/comment-timings.md.

Guesses are point masses (q = 1), so greedy and sampled verification are exact through the one verify core.
The global cache changes speed only: every committed token is the target's.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from typing import TYPE_CHECKING

from ..common.held_back import HoldsBack
from ..common.method_options import SuffixOptions
from ..core.acceptance import AcceptanceStats, Proposal, ProposalScorer
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..policy.cost import ForwardCost
from ..policy.speculation import Guessing, best_count
from .base import ProposalContext, Proposer, RequestInfo, StepOutput
from .suffix_index import SEPARATOR, SuffixIndex, TextIndex

MAX_DEPTH = 32  # deepest guess
MATCH_CLASSES = (2, 3, 4, 6, 10, 16)  # match lengths that start a new acceptance class (1 token: class 0)
GLOBAL_BUCKET = 16  # added to the class of guesses from the global cache: they are learned apart
# most steps the global cache is not searched while its matches add no accepted token the request's own text did
# not offer (a search is a sixth of a step's proposing time right after a forward)
GLOBAL_MAX_REST = 16
DEFAULT_CACHE_TOKENS = 1_000_000  # global cache budget: about 45 MB of arrays
LOCAL, GLOBAL = 1, 2  # node sources (bit flags)
# guesses less likely than this are never worth their place in a forward (on a CPU a guessed token costs a tenth of
# a plain step or more; where it costs next to nothing, 24 such nodes would add a quarter of a token)
MIN_CHANCE = 0.01


class SuffixCache(HoldsBack):
    """What suffix decoding keeps across the requests of one model: earlier outputs, what guessing from matches
    taught (long-run acceptance per class and depth), and counters for metrics. Thread-safe. Outputs of requests
    that end inside `holding()` join it when the block ends, each distinct one once."""

    def __init__(self, max_tokens: int | None = DEFAULT_CACHE_TOKENS, max_match: int = 32,
                 max_occurrences: int = 64) -> None:
        self.index = SuffixIndex(max_tokens, max_match, max_occurrences)
        self.stats = AcceptanceStats(max_depth=MAX_DEPTH)
        self._lock = threading.Lock()
        self.lookups = 0  # steps that searched the global cache
        self.hits = 0  # ... and found the text's end in it
        self.accepted = 0  # guesses accepted that only the global cache offered

    def count(self, hit: bool) -> None:
        with self._lock:
            self.lookups += 1
            self.hits += hit

    def credit(self, accepted: int) -> None:
        with self._lock:
            self.accepted += accepted

    def fork(self) -> AcceptanceStats:
        with self._lock:
            return self.stats.fork()

    def finish(self, output: list[int], stats: AcceptanceStats) -> None:
        """A request ended: its output joins the cache (or waits, see `holding`), what it learned the long-run
        estimate."""
        with self._lock:
            self.stats.absorb(stats)
            if self._hold(tuple(output)):
                return
        if output:
            self.index.add_sequence(output)

    def _join(self, items: list[tuple[int, ...]]) -> None:
        for output in dict.fromkeys(items):
            if output:
                self.index.add_sequence(list(output))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def tokens(self) -> int:
        return self.index.live_tokens

    @property
    def sequences(self) -> int:
        return self.index.sequences

    @property
    def nbytes(self) -> int:
        return self.index.nbytes


class Candidates:
    """Guessed continuations of both sources merged into one trie; node 0 is the root. (A plain class: made every
    step, where a dataclass's six default factories cost more than the search of a request's own text.)"""

    __slots__ = ("tokens", "parents", "depths", "chances", "sources", "index")

    def __init__(self) -> None:
        self.tokens: list[int] = [-1]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.chances: list[float] = [1.0]
        self.sources: list[int] = [0]
        self.index: dict[tuple[int, int], int] = {}

    def add(self, rows: list[list[int]], counts: list[int], reach: list[float], source: int) -> list[int]:
        """Continuations (rows, SEPARATOR-padded) seen counts[i] times each; returns the most frequent path."""
        total = float(sum(counts))
        tokens, parents, depths, index = self.tokens, self.parents, self.depths, self.index
        seen: dict[int, float] = {}  # node -> occurrences through it, this source
        for row, count in zip(rows, counts, strict=True):
            length = row.index(SEPARATOR) if SEPARATOR in row else len(row)  # padding ends a row
            node, d = 0, 0
            while d < length:  # the part some path already has
                child = index.get((node, row[d]))
                if child is None:
                    break
                node = child
                seen[node] = seen.get(node, 0.0) + count
                d += 1
            if d < length:  # the rest is new: one chain, appended at once
                first, base = len(tokens), depths[node]
                new = range(first, first + length - d)
                tokens.extend(row[d:length])
                parents.append(node)
                parents.extend(new[:-1])
                depths.extend(range(base + 1, base + 1 + len(new)))
                index.update(zip(zip(parents[first:], row[d:length], strict=True), new, strict=True))
                seen.update(dict.fromkeys(new, float(count)))
        grown = len(tokens) - len(self.chances)
        self.chances.extend([0.0] * grown)
        self.sources.extend([0] * grown)
        chances, sources = self.chances, self.sources
        for node, count in seen.items():
            chance = count / total * reach[depths[node] - 1]
            if chance > chances[node]:
                chances[node] = chance
            sources[node] |= source
        if len(rows) == 1:  # its path: the nodes it went through, one a token
            return rows[0][: len(seen)]
        best: dict[int, int] = {}  # parent -> its most frequent child (the first created of equals)
        for node, count in seen.items():
            parent = parents[node]
            if parent not in best or count > seen[best[parent]]:
                best[parent] = node
        path, node = [], 0
        while node in best:
            node = best[node]
            path.append(tokens[node])
        return path

    def graft(self, tree: DraftTree, chances: list[float], source: int) -> None:
        """Another proposer's tree (its guessed nodes' chances in tree order) joins the trie."""
        where = [0]
        for i in range(1, len(tree)):
            key = (where[tree.parents[i]], tree.tokens[i])
            node = self.index.get(key)
            if node is None:
                node = self.index[key] = len(self.tokens)
                self.tokens.append(tree.tokens[i])
                self.parents.append(key[0])
                self.depths.append(self.depths[key[0]] + 1)
                self.chances.append(0.0)
                self.sources.append(0)
            self.chances[node] = max(self.chances[node], chances[i - 1])
            self.sources[node] |= source
            where.append(node)

    def tree(self, root: int, nodes: list[int]) -> tuple[DraftTree, list[int]]:
        """The DraftTree of these nodes (a prefix of `ranked`), and each node's sources (root: 0)."""
        keep = sorted(nodes)  # creation order: parents before children
        position = {node: i for i, node in enumerate(keep, start=1)}
        tree = DraftTree([root] + [self.tokens[i] for i in keep],
                         [-1] + [position.get(self.parents[i], 0) for i in keep])
        return tree, [0] + [self.sources[i] for i in keep]

    def ranked(self) -> list[int]:
        """Nodes best first; every prefix is a tree (a child's chance never exceeds its parent's, and ties keep
        creation order: parents first, the request's own text first)."""
        chances = self.chances  # a stable sort: equal chances stay in creation order
        return sorted(range(1, len(chances)), key=chances.__getitem__, reverse=True)


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, *, nodes: int = 24, cost: ForwardCost | None = None,
                 max_match: int = 32) -> None:
        """cache: the model's global cache (None: the request's own text only); nodes: the most guesses a step;
        cost: the target's forward cost, with which each step's tree is sized (else `k` nodes a step)."""
        if nodes < 1:
            raise ValueError(f"suffix needs nodes >= 1, got {nodes}")
        self.cache, self.nodes, self.cost, self.max_match = cache, nodes, cost, max_match
        self.local = TextIndex(max_match=max_match)
        self.stats = cache.fork() if cache is not None else AcceptanceStats(max_depth=MAX_DEPTH)
        self.scorer = ProposalScorer(self.stats)
        self.indexed = self.prompt_len = self.scored = 0
        self.finished = True
        self.last: tuple[DraftTree, list[int]] | None = None  # the tree sent and each node's sources
        self.global_rest = self.global_backoff = 0  # steps left without a global search; the next rest
        self.searched_global = False  # this step's candidates searched the global cache
        self.tokens: list[int] = []  # the request's committed tokens, as last seen
        self.guessing = Guessing(cheap=True, sizes_itself=cost is not None, max_depth=MAX_DEPTH)

    def begin(self, request: RequestInfo) -> None:
        """The request's engine prices its trees (RequestInfo.cost), where the proposer sizes them (made with a cost:
        k="auto"); made without one (a fixed k) it sends k nodes a step and never rests."""
        if self.cost is not None and request.cost is not None:
            self.cost = request.cost
        prompt = self.tokens = request.prompt
        self.local = TextIndex(max_match=self.max_match)
        self.local.extend(prompt)
        self.indexed = self.prompt_len = len(prompt)
        if self.cache is not None:
            self.stats = self.cache.fork()
        self.scorer = ProposalScorer(self.stats)
        self.finished = False
        self.global_rest = self.global_backoff = 0

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens = self.tokens = context.tokens
        k = context.k
        found = self.candidates(tokens, k)
        if len(found.tokens) == 1:  # nothing matched (most steps of chat text): no tree to rank, size or build
            tree = DraftTree.root_only(tokens[-1])
            self.last = (tree, [0])
            return tree
        ranked = found.ranked()[: self.nodes]
        n = min(k, len(ranked)) if self.cost is None else self.best_count(found, ranked, len(tokens))
        tree, sources = found.tree(tokens[-1], ranked[:n])
        self.scorer.cut(self.scored, tree.depth)
        self.last = (tree, sources)
        return tree

    def best_count(self, found: Candidates, ranked: list[int], context: int) -> int:
        """How many of the ranked nodes maximise expected tokens per second (0: a plain step)."""
        if not ranked:
            return 0
        return best_count([found.chances[i] for i in ranked], self.cost, context)[0]

    def candidates(self, tokens: list[int], depth: int) -> Candidates:
        """Both sources' continuations up to `depth` deep, merged; each source's most frequent path is scored
        against the text committed later (what teaches the reach). Tokens committed since the last call join
        the request's own index first."""
        if len(tokens) > self.indexed:
            self.local.extend(tokens[self.indexed :])
            self.indexed = len(tokens)
        self.scorer.update(tokens)
        self.scored = 0  # proposals this step added to the scorer (cut once the tree sent is known)
        found = Candidates()
        sources = [(LOCAL, self.local, 0)]
        self.searched_global = self.cache is not None and not self.global_rest
        if self.searched_global and not self.cache.index.may_have(tokens[-3:]):
            self.cache.count(False)  # it cannot match 3 tokens (shorter matches added no tau in replay), and a
            self.searched_global = False  # search costs far more than the filter; no rest follows a miss here
        if self.searched_global:
            sources.append((GLOBAL, self.cache.index, GLOBAL_BUCKET))
        elif self.global_rest:
            self.global_rest -= 1
        for source, index, offset in sources:
            match = index.match(tokens, depth)
            if source == GLOBAL:
                self.cache.count(match is not None)
            if match is None:
                continue
            bucket = offset + bisect_right(MATCH_CLASSES, match.length)  # the classes it reaches
            # a node's chance is at most its depth's reach: past the first depth where that is under MIN_CHANCE no
            # guess is worth sending, and merging those columns was most of a step's proposing time (the depths
            # before keep learning, so the cut moves deeper as soon as they pay)
            reach = self.reach(bucket, until=MIN_CHANCE)
            deep = len(reach) - 1 if reach[-1] < MIN_CHANCE else len(reach)
            path = found.add(*match.distinct(max(deep, 1)), reach, source)
            if path:
                self.scorer.pending.append(Proposal(len(tokens), [path], bucket))
                self.scored += 1
        return found

    def reach(self, bucket: int, until: float = 0.0) -> list[float]:
        """[d - 1]: the learned chance that a guess of this class still holds d tokens deep (up to the first depth
        under `until`). A longer match is continued at least as often as a shorter one, so a class starts from the
        next shorter class's rates (a copy's matches grow 2-3 tokens a step through every class; each learning from
        nothing kept guesses 2 deep for a dozen steps of a copy)."""
        return self.stats.reach(bucket, bucket - 1 if bucket % GLOBAL_BUCKET else None, until)

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        self.tokens = outputs.tokens
        if tree is None or verdict is None or self.last is None or self.last[0] is not tree:
            return
        sources = self.last[1]
        self.last = None
        if self.cache is not None:
            self.judge_global(sum(1 for node in verdict.path[1:] if sources[node] == GLOBAL))

    def judge_global(self, only_global: int) -> None:
        """After a verified step: `only_global` accepted tokens came from the global cache alone. A search that
        added none rests the next ones (0, 1, 2, 4, ... up to GLOBAL_MAX_REST steps); one that did ends the rest."""
        if only_global:
            self.cache.credit(only_global)
            self.global_backoff = 0
        elif self.searched_global:
            self.global_rest, self.global_backoff = self.global_backoff, min(2 * self.global_backoff or 1,
                                                                             GLOBAL_MAX_REST)
        self.searched_global = False

    def finish(self) -> None:
        if self.finished:
            return
        tokens = self.tokens
        self.finished = True
        self.scorer.update(tokens, final=True)
        if self.cache is not None:
            self.cache.finish(tokens[self.prompt_len :], self.stats)


if TYPE_CHECKING:
    from .assets import Assets, Draft


def build(assets: Assets, options: SuffixOptions, draft: Draft, k: int | str) -> SuffixProposer:
    """Matches the request's own text and the model's cache of earlier outputs (`Assets.suffix_cache`)."""
    return SuffixProposer(assets.suffix_cache(), nodes=options.nodes, cost=assets.cost_model() if k == "auto" else None)
