"""The decode loop: propose -> verify -> commit, for a batch of requests (a lone request is a batch of one).

An `Engine` holds the running requests, packed in rows 0..B-1 of one `BatchKVCache`, and steps them all at once:

    every request proposes (its own proposer and policy)  ->  one choice of how much of each to verify
    one ragged forward (each row: own length, positions, tree mask)  ->  per row: verify, keep, commit

Requests join (prefilled in their own cache row, from a `PrefixCache` of earlier requests' entries where one
shares their prompt's beginning) and leave between steps. `LLM.generate` runs one request
through an engine of its own (`Generation`); the server runs every request through one shared engine. How
much to guess comes from `BatchCost` (forward seconds per batch size): a guess nearly free for one request
costs real time in a full batch, so speculation backs off as the batch grows and returns when it shrinks.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Generator, Iterator

import torch

from ..core.sampling import SamplingParams
from ..core.tree import DraftTree
from ..core.verify import Verdict, verify
from ..models import BatchKVCache, Transformer
from ..models.llama import BatchForwardOutput
from ..models.paged import OutOfBlocks, PagedKVCache
from ..policy import threads
from ..policy.batch_cost import BatchCost, RowCost
from ..policy.cost import CostModel, ForwardCost
from ..policy.speculation import AdaptiveK, Policy, joint_cut
from ..proposers import NoProposer, Proposer
from ..proposers.base import Needs, StepOutput
from .blocks import Paging, pool_for
from .prefix_cache import PrefixCache
from .request import MAX_DRAFT_NODES, GenerationStats, Request

StepResult = tuple[Request, "list[int] | Exception"]
# prompt tokens in one prefill forward: a chunk's activations stay within the CPU's caches, where a whole long
# prompt's outgrow them (benchmarks/results/prefill-mid-stream-smollm2); a token's numbers never depend on the chunk
# it is in (the native kernels: bit for bit), so every chunking caches the same keys and values
PREFILL_CHUNK = 256


class Engine:
    def __init__(self, model: Transformer, cost: BatchCost, prefix_cache: PrefixCache | None = None, *,
                 kv_memory: int | None = None, block_size: int = 16) -> None:
        """kv_memory: bytes of a paged KV cache (blocks of `block_size` tokens: admission, preemption, blocks shared
        by prefix where a prefix cache is given, see blocks.py); None: one tensor that grows by rows and positions."""
        cfg = model.config
        self.model, self.cost, self.prefix_cache = model, cost, prefix_cache
        self.view = RowCost(cost)  # forward cost at the batch's current size: every request's policy prices by it
        self.cache: BatchKVCache | PagedKVCache
        self.paging: Paging | None = None
        if kv_memory is not None:
            self.cache = PagedKVCache(pool_for(model, kv_memory, block_size))
            sharing = prefix_cache is not None and prefix_cache.max_bytes > 0
            self.paging = Paging(self, self.cache, sharing)
        else:
            self.cache = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, dtype=model.kv_dtype,
                                      device=model.device, limit=cfg.max_position_embeddings + MAX_DRAFT_NODES)
        self.rows: list[Request] = []
        self.pending: Request | None = None  # a request whose prompt is being cached, in the row after the batch's
        self.last_depths: list[int] = []  # per row, the depth verified in the last step (tests, metrics)
        # forwards run on the cores other processes leave free where the thread count cannot change a number
        self.threads = threads.governor() if model.native_kernels else None

    def add(self, request: Request, like: Request | None = None) -> None:
        """Prefill the request's prompt in a cache row of its own and let it join the batch (`start` and `prefill`
        step by step, which a server interleaves with the batch's steps)."""
        self.start(request, like)
        while self.pending is not None:
            self.prefill(PREFILL_CHUNK)

    def start(self, request: Request, like: Request | None = None) -> None:
        """The request takes the cache row after the batch's (it is `pending`) until `prefill` has cached its
        prompt; then it joins the batch. like: a request in the batch with the same prompt (another choice of an
        n > 1 request), whose prompt entries are copied instead (unless this request's proposer needs the prompt's
        hidden states): it joins at once. Else the prefix cache's entries for the longest beginning of the prompt that
        an earlier request's text shared are copied, and only the rest is prefilled (at least the positions whose
        hidden states the request's proposer reads)."""
        if self.pending is not None:
            raise RuntimeError("one prompt is prefilled at a time: finish or cancel the pending one first")
        prompt, row = request.tokens, len(self.rows)
        check_tokens(prompt, self.model.config.vocab_size)
        if self.paging is not None:
            self.paging.check(request)
        request.begin(len(prompt) + request.max_new_tokens + MAX_DRAFT_NODES)
        if self.paging is not None:
            self._start_paged(request, row, like)
            return
        self.cache.reserve(row + 1, len(prompt) + MAX_DRAFT_NODES)
        self.cache.lengths[row] = 0
        needs = request.needs
        if like is not None and not needs.hidden_layers and like.tokens[: len(prompt)] == prompt and len(prompt) > 1:
            # its prompt's entries were written by its prefill and never after
            self.cache.copy(self.rows.index(like), row, len(prompt) - 1)
        elif self.prefix_cache is not None:
            reusable = len(prompt) - 1
            if needs.hidden_layers:  # the positions whose hidden states its proposer reads are prefilled
                reusable = 0 if needs.hidden_context is None else reusable - needs.hidden_context
            hit = self.prefix_cache.lookup(prompt[:reusable]) if reusable > 0 else None
            if hit is not None:
                self.cache.kv[:, :, row, :, : hit.tokens] = hit.kv
                self.cache.lengths[row] = request.stats.cached_tokens = hit.tokens
        self.pending = request
        if self.cache.lengths[row] >= len(prompt) - 1:  # the cache holds every committed token but the last
            self._join()

    def _start_paged(self, request: Request, row: int, like: Request | None) -> None:
        """start's paged cache: a sibling's prompt blocks shared (copy on write), else kept blocks of the same
        beginning shared and fresh ones for the rest (OutOfBlocks: nothing taken; see `admits`)."""
        assert self.paging is not None and isinstance(self.cache, PagedKVCache)
        prompt = request.tokens
        if like is not None and not request.needs.hidden_layers and like.tokens[: len(prompt)] == prompt \
                and len(prompt) > 1:
            self.cache.share(self.rows.index(like), row, len(prompt) - 1)
            self.cache.grow(row, len(prompt))
            self.paging.order[id(request)] = self.paging.admissions
            self.paging.admissions += 1
        else:
            self.paging.place(request, row)
        self.pending = request
        if self.cache.lengths[row] >= len(prompt) - 1:
            self._join()

    def admits(self, request: Request) -> bool:
        """Whether `request` may start now (a paged cache holds its prompt; see blocks.Paging.admits)."""
        return self.paging is None or self.paging.admits(request)

    def prefill(self, tokens: int) -> int:
        """Cache up to `tokens` more of the pending request's prompt, at most PREFILL_CHUNK in one forward (a
        proposer that reads hidden states gets them chunk by chunk); it joins the batch once the prompt is cached.
        Returns the tokens run."""
        request, row, model = self.pending, len(self.rows), self.model
        if request is None:
            return 0
        prompt, done = request.tokens, self.cache.lengths[row]
        end = min(len(prompt) - 1, done + min(max(tokens, 1), PREFILL_CHUNK))
        if self.threads is not None:
            self.threads.update()
        layers = request.needs.hidden_layers
        out = model.forward(torch.tensor([prompt[done:end]], device=model.device), self.cache.row(row),
                            logits_at=None, hidden_layers=layers)
        if layers:
            request.proposer.observe(None, None, StepOutput(request.tokens, done, [h[0] for h in out.hidden]))
        if end == len(prompt) - 1:
            self._join()
        return end - done

    def _join(self) -> None:
        request, self.pending = self.pending, None
        assert request is not None
        if self.paging is not None:
            self.paging.joined(len(self.rows), request)
        self.rows.append(request)
        request.stats.prefill_seconds = time.perf_counter() - request.started

    def cancel_pending(self) -> None:
        """The pending request leaves before joining (its partly cached prompt is dropped)."""
        request, self.pending = self.pending, None
        if request is not None:
            if isinstance(self.cache, PagedKVCache):
                self.cache.free_row(len(self.rows))
            self.cache.lengths[len(self.rows)] = 0
            if not self.rows:
                self.cache.release()
            request.finish()

    def remove(self, request: Request, failed: bool = False) -> None:
        """Drop a request (its cache row is freed now, its entries kept in the prefix cache unless a step `failed`
        it); the last row moves into its place (and a pending prompt's row after it); an empty batch gives its cache
        memory back."""
        if self.paging is not None and request not in self.rows and self.paging.forget(request):
            request.finish()  # preempted, waiting to be prefilled anew: it holds no blocks
            return
        i, last = self.rows.index(request), len(self.rows) - 1
        if self.paging is not None:
            self.paging.leave(i, request, failed)
        elif self.prefix_cache is not None and not failed:  # entries of every committed token but (often) the last
            n = min(self.cache.lengths[i], len(request.tokens))
            self.prefix_cache.store(request.tokens[:n], self.cache.kv[:, :, i])
        self.cache.move(last, i)
        self.cache.lengths[last] = 0
        self.rows[i] = self.rows[last]
        self.rows.pop()
        if self.pending is not None:
            self.cache.move(last + 1, last)  # the pending prompt's row stays right after the batch's
        elif not self.rows:
            self.cache.release()  # the batch emptied: its memory goes back (a burst's long rows included)
        request.finish()

    def choose(self, proposals: list[DraftTree], contexts: list[int]) -> list[DraftTree]:
        """How much of each proposal to verify: cheap proposals under an adaptive policy share one depth cap chosen
        for the batch as a whole (policy.joint_cut); the others are verified as their policy says."""
        rows = len(proposals)
        return joint_cut([row.policy for row in self.rows], proposals, contexts,
                         lambda width, context: self.cost.seconds(rows, width, context))

    def _make_room(self, proposals: list[DraftTree], results: list[StepResult]) -> list[DraftTree]:
        """Paged: every row's blocks must hold what it writes; the youngest rows wait (preempted) while they cannot,
        and a lone row the budget cannot hold fails alone."""
        if self.paging is None or not self.rows:
            return proposals
        try:
            return self.paging.make_room(proposals)
        except OutOfBlocks as e:
            results.append((self.rows[0], e))
            self.remove(self.rows[0], failed=True)
            return proposals

    def _learn_cost(self, trees: list[DraftTree], width: int, context: int, seconds: float, carry: object) -> None:
        """The batch table learns from a real step: by its width, and a ragged step that guessed by the tokens it
        held (its width does not say; a prompt chunk carried along would count as guesses)."""
        b = len(trees)
        self.cost.observe(b, width, context, seconds)
        if self.cost.ragged and b > 1 and width != 1 and not carry:
            self.cost.observe_tokens(b, sum(len(t) for t in trees), context, seconds)

    def step(self, prefill: int = 0) -> list[StepResult]:
        """One step of every request: its newly committed tokens, or the exception that failed it (it has left).
        prefill: up to this many tokens of the pending request's prompt cached in the same forward (where the
        model carries a chunk along: the native blocks; else in a forward of their own)."""
        if self.paging is not None:  # preempted requests come back first, where blocks have freed up
            self.paging.resume()
        proposals, results, drafting_ahead = self._plan()  # every row proposes; a row that fails to leaves now
        proposals = self._make_room(proposals, results)
        if not self.rows:
            return results
        b, pending = len(self.rows), self.pending if prefill else None
        contexts = self.cache.lengths[:b]
        needs = [row.needs for row in self.rows]  # asked once a step, after the proposals
        layers = list(dict.fromkeys(layer for wanted in needs for layer in wanted.hidden_layers))
        lengths = self.cache.lengths[: b + 1]  # the pending prompt's row included (a chunk may ride along)
        started = time.perf_counter()
        failed: dict[int, Exception] = {}
        try:  # cut: how much of each proposal to verify; forward: every row's tree (and maybe a prompt chunk) at once
            trees = self.choose(proposals, contexts)
            out, width, carry = self._forward(trees, contexts, layers, pending, prefill)
            batched = True
        except Exception:  # noqa: BLE001 - something of the batch's shared work failed: which row's, each alone tells
            self.cache.lengths[: len(lengths)] = lengths
            trees, out, failed = self._rows_alone(proposals, contexts, layers)
            width, carry, batched = max(len(t) for t in trees), False, False
        self.last_depths = [t.depth for t in trees]
        seconds = time.perf_counter() - started
        if batched and not drafting_ahead:  # a drafter's cores or rows run one by one: not a batch's time
            self._learn_cost(trees, width, max(contexts), seconds, carry)
        plain = self.cost.seconds(b, 1, max(contexts)) if self.cost.priced else 0.0  # the speedup's measure
        for i, (row, tree) in enumerate(zip(list(self.rows), trees, strict=True)):
            try:  # verify, keep the accepted path's cache entries, commit (the proposer observes the outcome)
                if i in failed:
                    raise failed[i]
                outputs = self._outputs(i, row, tree, out, layers, needs[i], contexts[i])
                results.append((row, self._settle(i, row, tree, out, outputs, contexts[i], seconds, plain)))
            except Exception as e:  # noqa: BLE001 - one bad request must not take the batch down
                results.append((row, e))
        for row, result in results:  # failed rows leave now (their cache rows may be half-updated)
            if isinstance(result, Exception) and row in self.rows:
                self.remove(row, failed=True)
        if pending is not None and pending is self.pending:
            self._prefill_after(pending, prefill, carry, results)
        return results

    def _plan(self) -> tuple[list[DraftTree], list[StepResult], bool]:
        """Every row's proposal, priced for the threads the step runs on: (the proposals of the rows left, the rows
        whose proposer failed (they have left), whether a drafter drafting ahead took cores for this step)."""
        results: list[StepResult] = []
        self.view.rows = len(self.rows)
        if self.threads is not None:  # before planning: the steps are priced for the threads they run on
            self.cost.use_threads(self.threads.update())
        planned_on = torch.get_num_threads()
        planned: dict[int, DraftTree] = {}
        for i, row in enumerate(self.rows):
            try:
                planned[id(row)] = row.plan(self.cache.lengths[i])
            except Exception as e:  # noqa: BLE001 - one bad request must not take the batch down
                results.append((row, e))
        for row, _ in results:
            self.remove(row, failed=True)
        self.view.rows = len(self.rows)  # the batch that runs now
        # a drafter drafting ahead during this forward took cores (async_draft): the step is priced on what is left,
        # and not learned from (the table's plain steps, paired with it, ran on every core)
        drafting_ahead = torch.get_num_threads() != planned_on
        if drafting_ahead and self.threads is not None and self.rows:
            self.cost.use_threads(self.threads.update())
        return [planned[id(row)] for row in self.rows], results, drafting_ahead

    def _outputs(self, i: int, row: Request, tree: DraftTree, out: BatchForwardOutput, layers: list[int],
                 needs: Needs, context: int) -> tuple[Verdict, StepOutput]:
        """Row i's verdict, and what its proposer asked of the forward (`needs`) at the committed positions."""
        logits = out.logits[i]
        nodes = logits[: len(tree)]
        target = row.target_logits(tree, nodes)
        # the kernel's greedy tokens stand for these logits where nothing processed them
        greedy = out.greedy[i][: len(tree)] if out.greedy is not None and target is nodes else None
        verdict = verify(tree, target, row.params, row.generator, row.constraint, greedy)
        outputs = StepOutput(row.tokens, context, extra_logits=logits[len(tree) :])
        if needs.hidden_layers:  # a chain's kept prefix is a slice (most steps): no gather
            kept = verdict.path
            path = slice(len(kept)) if kept[-1] == len(kept) - 1 else torch.tensor(kept, device=logits.device)
            outputs.hidden = [out.hidden[i][layers.index(layer)][path] for layer in needs.hidden_layers]
        if needs.teacher:  # the target's distributions, to learn from (online EAGLE)
            outputs.teacher = logits[verdict.path]
        return verdict, outputs

    def _settle(self, i: int, row: Request, tree: DraftTree, out: BatchForwardOutput,
                verified: tuple[Verdict, StepOutput], context: int, seconds: float, plain: float) -> list[int]:
        """Keep the accepted path's cache entries, commit its tokens, record their log-probabilities if asked."""
        verdict, outputs = verified
        self.cache.keep(i, context, verdict.path)
        new = row.commit(tree, verdict, outputs, context, seconds, plain)
        if row.logprobs is not None:  # token j was predicted at the path's node j
            row.record_logprobs(out.logits[i][verdict.path], new)
        return new

    def _prefill_after(self, pending: Request, prefill: int, carry: bool, results: list[StepResult]) -> None:
        """The pending prompt after the batch's step: its chunk rode along (it joins once cached), or it gets a forward
        of its own (its proposer reads hidden states, which a batch does not return); failing, it fails alone."""
        try:
            if not carry:
                self.prefill(prefill)
            elif self.cache.lengths[len(self.rows)] >= len(pending.tokens) - 1:
                self._join()  # its prompt is cached: it steps from the next step on
        except Exception as e:  # noqa: BLE001 - the pending prompt fails alone
            self.cancel_pending()
            results.append((pending, e))

    def _forward(self, trees: list[DraftTree], contexts: list[int], layers: list[int], pending: Request | None,
                 prefill: int) -> tuple[BatchForwardOutput, int, bool]:
        """The batch's one forward over every row's tree (and, where the model carries it, a chunk of the pending
        prompt): (its output, the widest row, whether the chunk rode along)."""
        b = len(trees)
        positions: torch.Tensor | None
        masks: list[torch.Tensor | None]
        if b == 1 and trees[0].extra is None and trees[0].is_chain:  # a lone chain (a plain step): its positions
            sizes, masks = [len(trees[0])], [None]  # follow the cache (building them took tensor operators)
            tokens, positions = torch.tensor([trees[0].tokens]), None
        else:
            inputs = [t.forward_inputs(c) for t, c in zip(trees, contexts, strict=True)]
            sizes, masks = [len(toks) for toks, _, _ in inputs], [mask for _, _, mask in inputs]
            if b == 1:  # a lone request's inputs as they are (padding them took six tensor operators a step)
                tokens, positions = torch.tensor([inputs[0][0]]), inputs[0][1][None]
            else:
                n = max(sizes)
                tokens = torch.zeros(b, n, dtype=torch.long)
                positions = torch.zeros(b, n, dtype=torch.long)
                for i, (toks, pos, _) in enumerate(inputs):
                    m = sizes[i]
                    tokens[i, :m] = torch.tensor(toks)
                    positions[i, :m] = pos
                    positions[i, m:] = contexts[i] + torch.arange(m, n)
        chunk = None
        carry = pending is not None and not pending.needs.hidden_layers and \
            self.model.carries_prefill(tokens, self.cache)
        if pending is not None and carry:  # the prompt's next tokens ride along in the batch's forward: one pass
            done = self.cache.lengths[b]   # over the weights for both
            chunk = pending.tokens[done : min(len(pending.tokens) - 1, done + min(prefill, PREFILL_CHUNK))]
        out = self.model.forward_batch(tokens, self.cache, positions=positions, sizes=sizes,
                                       tree_masks=None if all(m is None for m in masks) else masks,
                                       hidden_layers=layers, prefill=chunk)
        return out, max(sizes), carry

    @torch.inference_mode()
    def _rows_alone(self, proposals: list[DraftTree], contexts: list[int],
                    layers: list[int]) -> tuple[list[DraftTree], BatchForwardOutput, dict[int, Exception]]:
        """The batch's shared work failed (choosing how much to verify, building the inputs, or the forward): each
        row does it alone, on its own cache row, so that only a row whose own work fails is failed (the rows' numbers
        are those of the batch: every row of a batched forward computes what it computes alone). Returns the trees,
        the forward's output per row and the failures by row."""
        trees, logits, hidden, greedy = [], [], [], []
        failed: dict[int, Exception] = {}
        for i, (row, proposal) in enumerate(zip(self.rows, proposals, strict=True)):
            tree = proposal
            try:
                (tree,) = joint_cut([row.policy], [proposal], [contexts[i]],
                                    lambda width, context: self.cost.seconds(1, width, context))
                toks, positions, mask = tree.forward_inputs(contexts[i])
                self.cache.reserve(len(self.rows), contexts[i] + len(toks))
                out = self.model.forward(torch.tensor([toks]), self.cache.row(i), positions=positions,
                                         tree_mask=mask, hidden_layers=layers)
                assert out.logits is not None  # every position's logits were asked for
                logits.append(out.logits[0])
                hidden.append([h[0] for h in out.hidden])
                greedy.append(out.greedy)
            except Exception as e:  # noqa: BLE001
                self.cache.lengths[i] = contexts[i]
                failed[i] = e
                logits.append(torch.empty(0))
                hidden.append([])
                greedy.append(None)
            trees.append(tree)
        kernel_greedy = None if any(g is None for i, g in enumerate(greedy) if i not in failed) else \
            [g or [] for g in greedy]
        return trees, BatchForwardOutput(logits, hidden, kernel_greedy), failed


def check_tokens(tokens: list[int], vocab: int) -> None:
    """A prompt the model can read: ints in [0, vocab) (a row's bad ids would fail the batch's shared forward, not
    the row alone)."""
    if not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
        bad = next(t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab)
        raise ValueError(f"prompt tokens must be ints in [0, {vocab}), got {bad!r}")


class Generation:
    """One request run alone: an engine of its own with a batch of one. Iterate it for lists of newly committed
    tokens (each iteration one step); read `stats` at any time."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self.engine, self.request = engine, request
        self._steps = self._run()

    def __iter__(self) -> Iterator[list[int]]:
        return self._steps

    def close(self) -> None:
        self._steps.close()

    @property
    def stats(self):
        return self.request.stats

    @property
    def finish_reason(self) -> str | None:
        return self.request.finish_reason

    @property
    def tokens(self) -> list[int]:
        return self.request.tokens

    @property
    def new_tokens(self) -> list[int]:
        return self.request.new_tokens

    @property
    def policy(self) -> Policy:
        return self.request.policy

    def _run(self) -> Generator[list[int], None, None]:
        engine, request = self.engine, self.request
        try:
            engine.add(request)
            while request.finish_reason is None:
                ((_, result),) = engine.step()
                if isinstance(result, Exception):
                    raise result
                yield result
        finally:
            if request in engine.rows:
                engine.remove(request)
            else:
                request.finish()


def start(target: Transformer, prompt: list[int], *, proposer: Proposer | None = None, max_new_tokens: int = 64,
          params: SamplingParams | None = None, k: int | Policy = 4, stop_token_ids: Collection[int] = (),
          seed: int | None = None, cost: ForwardCost | None = None, logprobs: int | None = None,
          prefix_cache: PrefixCache | None = None) -> Generation:
    """A request on token ids in an engine of its own, priced by `cost`, else its adaptive policy's (if any), its
    prompt's beginning read from `prefix_cache` where an earlier text there shares it."""
    cost = cost or (k.cost if isinstance(k, AdaptiveK) else CostModel.flat())
    request = Request(target.config.max_position_embeddings, proposer or NoProposer(), prompt,
                      max_new_tokens=max_new_tokens, params=params or SamplingParams(), k=k,
                      stop_token_ids=stop_token_ids, seed=seed, logprobs=logprobs)
    return Generation(Engine(target, BatchCost.single(cost), prefix_cache), request)


def generate_ids(target: Transformer, prompt: list[int], **kwargs) -> tuple[list[int], GenerationStats]:
    """Run a whole request on token ids (options as `start`); returns (new tokens, stats)."""
    gen = start(target, prompt, **kwargs)
    for _ in gen:
        pass
    return gen.new_tokens, gen.stats
