"""Asynchronous drafting (speculative speculative decoding, SSD: Kumar, Dao, May, ICLR 2026): the draft proposes
the next step while the target verifies this one.

While the target verifies a chain d1..dk, a drafter thread guesses how the verification ends (a guesses accepted,
then a bonus token b) and drafts the next step for each likely (a, b), so the next proposal is ready at once when
the guess was right (a hit) and drafted as usual when it was not (a miss). Outcomes are ranked by the draft's own
probabilities: "all accepted, then the draft's next token" weighs prod q_i(d_i); "a accepted, then token t != d_a+1"
weighs prod_{i<=a} q_i(d_i) x q_a+1(t) (a rejection at a+1 resamples away from d_a+1). The drafter works down that
list until the target's answer arrives, so how many outcomes it covers follows the verification's time and the
draft's speed; if it is drafting the outcome that came true, the engine waits for that one chain.

Lossless by construction: verification is unchanged, and a chain drafted ahead is drawn from the draft's q given
exactly the tokens then committed, with a generator of its own (never the draws that accept or reject).
Only proposers whose drafts depend on the tokens alone can draft ahead (`DraftModelProposer`: draft models,
the quantized self-draft, layer skipping): EAGLE and Medusa heads draft from the target's hidden states of the very
tokens being verified, which exist only once verification has run.

The drafter is one worker thread (shared by a model's requests) with its own thread count (torch's OpenMP builds
keep the count per calling thread) and, on a GPU, a CUDA stream of its own. It drafts for a request from the end of
the request's proposal to the end of its verification, and on a CPU its cores are taken from the target's forwards
for just that long. A draft model's cache is touched by one thread at a time: the engine's thread stops the drafter
(and waits for it) before anything else touches the draft.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..core.sampling import SamplingParams
from ..core.tree import DraftTree
from ..core.verify import Verdict
from ..policy.threads import usable_cores
from .base import ProposalContext, Proposer, RequestInfo, StepOutput
from .draft_model import DraftModelProposer

log = logging.getLogger("specdecode")
MAX_OUTCOMES = 8  # most outcomes drafted ahead per step (the drafter usually runs out of time first)
OTHERS = 2  # tokens ranked as the bonus after a rejection at each depth


class Drafter:
    """The worker thread that drafts ahead (one per model, shared by its asynchronous requests: in a batch, the rows'
    chains are drafted one row after another, as far as the verification's time goes). On a CPU it takes `threads`
    cores: while it drafts ahead, the target's forwards (in the thread that runs the engine) keep the others."""

    def __init__(self, threads: int = 1, device: torch.device | None = None) -> None:
        if threads < 1:
            raise ValueError(f"the drafter needs at least 1 thread, got {threads}")
        self.threads, self.on_cpu = threads, device is None or device.type == "cpu"
        self.cores = len(usable_cores())
        self._holders, self._engine_threads = 0, 0
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specdecode-drafter",
                                       initializer=torch.set_num_threads, initargs=(threads,))

    def submit(self, fn: Callable[[], None]) -> Future:
        if self.stream is None:
            return self.pool.submit(fn)
        stream, engine = self.stream, torch.cuda.current_stream(self.stream.device)
        ready = torch.cuda.Event()
        ready.record(engine)  # the drafter reads what the engine's stream wrote before (the draft's cache)

        def on_stream() -> None:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                fn()
        return self.pool.submit(on_stream)

    def hold(self) -> None:
        """The drafter starts drafting ahead (in the engine's thread): the target's forwards leave its cores."""
        if self._holders == 0 and self.on_cpu:
            self._engine_threads = torch.get_num_threads()
            share = min(self._engine_threads, max(1, self.cores - self.threads))  # one core: the two share it
            if share != self._engine_threads:
                log.info("asynchronous drafting: the drafter takes %d of %d cores, the target's forwards run on %d "
                         "threads", self.threads, self.cores, share)
                torch.set_num_threads(share)
        self._holders += 1

    def release(self) -> None:
        """A request's drafting ahead ended: with none left, the target's forwards get their threads back."""
        self._holders -= 1
        if self._holders == 0 and self.on_cpu and torch.get_num_threads() != self._engine_threads:
            torch.set_num_threads(self._engine_threads)

    def joined(self) -> None:
        """The engine's stream waits for the drafter's work (call after its job ended)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@dataclass
class AsyncStats:
    steps: int = 0  # proposals made
    hits: int = 0  # ... taken from a chain drafted ahead
    ahead: int = 0  # outcomes drafted ahead (whole chains)
    spans: list[tuple[str, float, float]] | None = field(default=None, repr=False)  # (what, start, end): a timeline

    @property
    def hit_rate(self) -> float:
        return self.hits / self.steps if self.steps else 0.0

    def span(self, what: str, start: float, end: float | None = None) -> None:
        if self.spans is not None:
            self.spans.append((what, start, time.perf_counter() if end is None else end))


class AsyncDraftProposer(Proposer):
    """A token-state proposer (a model draft) drafting ahead in `drafter` while the target verifies.

    The drafter works for this request only from the end of its proposal to the end of its verification (`observe`
    stops it, and gives back the cores it took from the target's forwards): other requests' steps in between, in a
    batch or a benchmark's interleaving, never share their cores with it."""

    def __init__(self, inner: Proposer, drafter: Drafter, *, max_outcomes: int = MAX_OUTCOMES,
                 patient: bool = False, timeline: bool = False) -> None:
        """max_outcomes: 0 drafts nothing ahead (every step a miss); patient: wait for every outcome each step
        (deterministic hits: tests); timeline: record when the engine waited, drafted and verified."""
        if not isinstance(inner, DraftModelProposer) or inner.needs.hidden_layers:
            raise ValueError(f"asynchronous drafting needs a model draft that depends on the tokens alone (draft, "
                             f"quantized, layer-skip), not {inner.name!r}: EAGLE and Medusa heads draft from the "
                             "target's hidden states of the tokens being verified, which exist only after "
                             "verification; n-gram methods cost nothing to hide")
        self.inner, self.drafter = inner, drafter
        self.name = f"{inner.name}+async"
        self.needs, self.guessing = inner.needs, inner.guessing
        self.max_outcomes, self.patient = max_outcomes, patient
        self.stats = AsyncStats(spans=[] if timeline else None)
        self._job: Future | None = None
        self._stop = threading.Event()
        self._wanted: tuple[int, ...] | None = None  # the outcome that came true (the drafter may finish it)
        self._ready: dict[tuple[int, ...], tuple[DraftTree, list[torch.Tensor]]] = {}  # by committed suffix
        self._committed: list[int] = []  # tokens committed when the outcomes were drafted
        self._taken: tuple[list[int], DraftTree, list[torch.Tensor]] | None = None  # the chain for what came true
        self._waited = 0.0  # seconds observe() waited for the drafter to finish that chain
        self._generator: torch.Generator | None = None
        self._handed = 0.0  # when the last proposal went to the target

    def begin(self, request: RequestInfo) -> None:
        self._halt()
        self.inner.begin(request)
        self._taken, self._generator, self._handed = None, None, 0.0

    def finish(self) -> None:
        self._halt()
        self.inner.finish()

    def observe(self, tree: DraftTree | None, verdict: Verdict | None, outputs: StepOutput) -> None:
        """The verification is over: stop the drafter (it may finish the chain for the outcome that came true)."""
        if tree is None or verdict is None:
            return  # a prefill chunk (a model draft reads no hidden states: never asked)
        started = time.perf_counter()
        if self._handed:
            self.stats.span("target", self._handed, started)
            self._handed = 0.0
        if self._job is not None:
            suffix = (*(tree.tokens[i] for i in verdict.path[1:]), verdict.next_token)
            found = self._stop_job(suffix)
            self._taken = (self._committed + list(suffix), *found) if found is not None else None
            self._waited = time.perf_counter() - started
            self.stats.span("wait", started)
        self.inner.observe(tree, verdict, outputs)  # token-state drafts keep no drafting state there

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k, params, generator = context.tokens, context.k, context.params, context.generator
        started = time.perf_counter()
        if self._generator is None:  # the drafts' own draws, seeded from the request's
            self._generator = torch.Generator()
            if generator is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(int(torch.randint(2**62, (), generator=generator)))
        self._halt()  # (a proposal without a verification in between: a drafter still at work stops)
        taken, self._taken = self._taken, None
        hit = taken is not None and taken[0] == tokens and taken[1].num_drafted >= k
        if hit:
            assert taken is not None
            _, tree, logits = taken
            if tree.num_drafted > k:
                tree = DraftTree.chain(tree.tokens[0], tree.tokens[1 : k + 1], tree.draft_probs[1 : k + 1])
                logits = logits[:k]
            if self.drafter.stream is not None:  # made on the drafter's stream, read on the engine's
                for q in tree.draft_probs:
                    if q is not None:
                        q.record_stream(torch.cuda.current_stream(q.device))
        else:
            tree = self.inner.draft(tokens, k, params, self._generator)
            logits = list(self.inner.last_logits)
        waited = time.perf_counter() - started + (self._waited if hit else 0.0)
        self._waited = 0.0
        self.stats.steps += 1
        self.stats.hits += hit
        self.stats.span("hit" if hit else "miss", started)
        # what a guess cost the engine: on a hit the waits; on a miss the draft's own steady cost (its first forward
        # also caught up on text committed while it did not draft, which the next steps will not pay again)
        context.seconds_per_guess = (waited / tree.num_drafted if tree.num_drafted else None) if hit \
            else self.inner.seconds_per_guess
        context.drafted_ahead = hit
        if tree.num_drafted and self.max_outcomes:
            self._ahead(list(tokens), tree.tokens[1:], logits, k, params)
        self._handed = time.perf_counter()
        return tree

    # ---------------------------------------------------------------------------------------- drafting ahead
    def _stop_job(self, suffix: tuple[int, ...] | None) -> tuple[DraftTree, list[torch.Tensor]] | None:
        """Stop the drafter (letting it finish `suffix`'s chain if it is drafting it), give the target its cores
        back, and return that chain if it was drafted."""
        assert self._job is not None
        self._wanted = suffix
        if not self.patient or suffix is None:
            self._stop.set()
        try:
            self._job.result()  # the drafter's error, if any, fails this request
        finally:
            self.drafter.joined()
            self.drafter.release()
            self._job = None
        found = self._ready.get(suffix) if suffix is not None else None
        self._ready = {}
        return found

    def _halt(self) -> None:
        if self._job is not None:
            self._stop_job(None)

    def _ahead(self, tokens: list[int], drafted: list[int], logits: list[torch.Tensor], k: int,
               params: SamplingParams) -> None:
        outcomes = self.outcomes(drafted, logits, params)[: self.max_outcomes]
        self._committed, self._wanted, self._ready = tokens, None, {}
        self._stop.clear()
        self.drafter.hold()  # the target's forward of this step leaves the drafter's cores
        self._job = self.drafter.submit(lambda: self._draft_outcomes(tokens, drafted, outcomes, k, params))

    @staticmethod
    def outcomes(drafted: list[int], logits: list[torch.Tensor], params: SamplingParams) -> list[list[int]]:
        """The likely committed suffixes after this step, likeliest first: `drafted` itself stands for "all
        accepted" (its bonus token is the draft's next guess); a shorter one ends with the bonus after a
        rejection."""
        scored: list[tuple[float, list[int]]] = []
        path = 1.0
        plain = SamplingParams(temperature=params.temperature or 1.0, top_k=params.top_k, top_p=params.top_p)
        for a, (token, row) in enumerate(zip(drafted, logits, strict=True)):
            q = plain.probs(row)
            kept = float(q[token])
            rest = q.clone()
            rest[token] = 0.0
            values, others = rest.topk(OTHERS)
            scored += [(path * float(v), [*drafted[:a], int(t)]) for v, t in zip(values, others, strict=True)
                       if float(v) > 0.0]
            path *= kept
        scored.append((path, list(drafted)))
        scored.sort(key=lambda item: -item[0])
        return [suffix for _, suffix in scored]

    def _draft_outcomes(self, tokens: list[int], drafted: list[int], outcomes: list[list[int]], k: int,
                        params: SamplingParams) -> None:
        for suffix in outcomes:
            full = suffix == drafted  # all accepted: draft one deeper, the first token being the guessed bonus

            def stop(chain: list[int], suffix: list[int] = suffix, full: bool = full) -> bool:
                """Asked between draft forwards: stop, unless this chain may be for the outcome that came true."""
                if not self._stop.is_set():
                    return False
                wanted = self._wanted
                if wanted is None or not full:
                    return wanted != tuple(suffix)
                return wanted[: len(suffix)] != tuple(suffix) or (bool(chain) and wanted[len(suffix):] != (chain[0],))

            if stop([]):
                return
            started = time.perf_counter()
            chain = self.inner.draft(tokens + suffix, k + full, params, self._generator, stop)
            if chain.num_drafted < k + full:
                return  # cut short: the outcome that came true is another
            key, lead = tuple(suffix), self.inner.last_logits
            if full:
                bonus = chain.tokens[1]
                key += (bonus,)
                chain = DraftTree.chain(bonus, chain.tokens[2:], chain.draft_probs[2:])
                lead = lead[1:]
            self._ready[key] = (chain, list(lead))
            self.stats.ahead += 1
            self.stats.span("ahead", started)
