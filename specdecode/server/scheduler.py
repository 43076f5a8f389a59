"""The scheduler: one thread runs the batch, requests join and leave it between steps.

Routes hand over a `Job` (a validated `Request` plus its text state); the thread admits waiting jobs while the
batch has room (a bounded queue: beyond it `submit` refuses at once), drops cancelled ones (a client that
went away frees its row and cache before the next step), runs `Engine.step`, turns each row's new
tokens into text pieces (stop tokens and stop strings exact) and sends them to the job's asyncio queue.
A failure inside one row fails that job only; the thread itself never dies of a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..core.detokenize import RequestText
from ..engine.loop import Engine
from ..engine.request import Request
from .errors import APIError, internal_error, overloaded
from .metrics import Metrics
from .schemas import logprob_entries

log = logging.getLogger("specdecode.server")
MIN_PREFILL_CHUNK = 2  # prompt tokens a turn, at least, while requests run
# while prompts wait for a batch with room, a turn may spend this long caching one: a pause within a stream that a
# reader does not notice (llama.cpp's server pauses longer under the same load: benchmarks/results/comment-timings.md)
FILL_SECONDS = 0.1


@dataclass
class Piece:
    text: str
    logprobs: list[dict] | None = None  # entries of the tokens behind the step's text (schemas.logprob_entries)
    index: int = 0  # the choice's (a request with n > 1 has n jobs)


@dataclass
class Done:
    finish_reason: str
    usage: dict
    index: int = 0


@dataclass
class Failed:
    error: APIError


class LockedTokenizer:
    """Fast tokenizers must not be used from two threads at once: routes encode, the scheduler decodes."""

    def __init__(self, tokenizer, lock: threading.Lock) -> None:
        self.tokenizer, self.lock = tokenizer, lock

    def decode(self, *args, **kwargs):
        with self.lock:
            return self.tokenizer.decode(*args, **kwargs)

    def token_text(self, ids: list[int]) -> list[str]:
        """Each token's own text (a byte-fallback piece of a character shows as U+FFFD, as in vLLM)."""
        with self.lock:
            return [self.tokenizer.decode([i]) for i in ids]


class Job:
    def __init__(self, row: Request, tokenizer: LockedTokenizer, stops: list[str], loop: asyncio.AbstractEventLoop,
                 method: str = "none", *, index: int = 0, events: asyncio.Queue | None = None,
                 sibling: Job | None = None):
        """index, events: the choice this job answers and the queue its response reads (shared by the n jobs of
        one request); sibling: a job with the same prompt, whose prefilled cache this one may copy."""
        self.row, self.loop, self.method = row, loop, method  # method: the metrics' label
        self.text = RequestText(tokenizer, stops, row.stop_token_ids)
        self.tokenizer = tokenizer
        self.logprobs_sent = 0  # tokens whose log-probabilities went out
        self.index, self.sibling = index, sibling
        self.events: asyncio.Queue = asyncio.Queue() if events is None else events
        self.cancelled = False
        self.done = False
        self.arrived = time.perf_counter()
        self.scheduled_at: float | None = None  # its prefill began
        self.first_token_at: float | None = None
        self.last_piece_at: float | None = None

    def emit(self, event: Piece | Done | Failed) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def usage(self) -> dict:
        s = self.row.stats
        return {
            "prompt_tokens": s.prompt_tokens, "completion_tokens": s.new_tokens,
            "total_tokens": s.prompt_tokens + s.new_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},  # OpenAI's: read from the prefix cache
            # extensions: how speculation went for this request
            "drafted": s.drafted, "accepted": s.accepted, "tau": round(s.tau, 4),
            "acceptance_rate": round(s.acceptance_rate, 4), "target_forwards": s.target_forwards,
            # the policy's own estimate of its speedup over plain steps (None where steps are not priced)
            "estimated_speedup": None if s.estimated_speedup is None else round(s.estimated_speedup, 4),
        }


class Scheduler:
    def __init__(self, engine: Engine, *, max_batch: int, max_queue: int, metrics: Metrics,
                 prefill_tokens: int = 1024, prefill_share: float = 0.5) -> None:
        """prefill_tokens: the most prompt tokens cached in one turn of the loop while nothing is running (a burst
        of prompts joins over a few turns, the first ones answering sooner); while requests run, prefill_share of
        a turn's time at most goes to caching a new prompt (`prefill_budget`): a long prompt is prefilled in chunks
        between steps (0.5: a chunk costs about a decode step; higher: new requests start sooner, running streams
        slow down more)."""
        if not 0 < prefill_share < 1:
            raise ValueError(f"prefill_share must be in (0, 1), got {prefill_share}")
        self.engine, self.max_batch, self.max_queue, self.metrics = engine, max_batch, max_queue, metrics
        self.prefill_tokens, self.prefill_share = prefill_tokens, prefill_share
        self.waiting: deque[Job] = deque()
        self.prefilling: Job | None = None  # the job whose prompt the engine is caching (engine.pending)
        self.active: dict[int, Job] = {}  # id(row) -> job
        self.stopping = False
        self.deadline: float | None = None  # draining (a graceful shutdown): what still runs then is cut
        self.cut = 0  # requests cut by the deadline or the stop
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self.run, name="specdecode-scheduler", daemon=True)

    # ----------------------------------------------------------------------------- from the routes
    def start(self) -> None:
        """Run the loop in a thread of its own (`serve` runs it in the main thread instead: see `run`)."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (its n choices): all of them, or none (503) when the queue has no room."""
        if len(jobs) > self.max_batch + self.max_queue:
            raise APIError(400, f"n={len(jobs)} choices cannot fit this server's batch and queue "
                                f"({self.max_batch} + {self.max_queue}); ask for fewer", param="n")
        with self._cond:
            if self.stopping or self.deadline is not None:
                self.metrics.requests.labels("rejected").inc()
                raise APIError(503, "the server is shutting down", type="server_unavailable", code="shutting_down")
            if len(self.waiting) + len(self.active) + (self.prefilling is not None) + len(jobs) > \
                    self.max_batch + self.max_queue:
                self.metrics.requests.labels("rejected").inc()
                raise overloaded(f"the server is busy: {len(self.active)} requests running and {len(self.waiting)} "
                                 "waiting (the queue is full); retry shortly")
            self.waiting.extend(jobs)
            self.metrics.queue(len(self.active), len(self.waiting))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the job leaves the batch (or the queue) before the next step."""
        if not job.done:
            job.cancelled = True
            with self._cond:
                self._cond.notify()

    def drain(self, seconds: float) -> None:
        """A graceful shutdown began: new requests are refused (503); what is still running or waiting `seconds`
        from now is cut with an error event, while its connection is still there to carry it."""
        with self._cond:
            self.deadline = time.monotonic() + seconds
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; whatever is still running or waiting is cancelled (503)."""
        with self._cond:
            self.stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def load(self) -> dict[str, int]:
        return {"running": len(self.active), "waiting": len(self.waiting) + (self.prefilling is not None)}

    # ------------------------------------------------------------------------------- the thread
    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """The loop, until `stop` (or until `alive()` turns false). Torch's CPU forwards run faster in the
        process's main thread than in another one, so `serve` calls this there and puts uvicorn in a thread."""
        while True:
            with self._cond:
                while (not self.stopping and not self.waiting and not self.active and self.prefilling is None
                       and alive()):
                    self._cond.wait(0.5)
                if self.stopping or not alive():
                    self.stopping = True
                    break
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._cut_all()
                continue
            try:
                self._drop_cancelled()
                self._prefill()
                if self.active:
                    self._step()
            except Exception:  # a bug outside any one row: fail the batch, keep serving
                error = internal_error("internal error in the batch step")
                for job in [*self.active.values(), *([self.prefilling] if self.prefilling else [])]:
                    self._leave(job)
                    self._close(job, "error", Failed(error))
        self._cut_all()

    def _cut_all(self) -> None:
        """Every request still waiting or running ends now, with an error event that says why."""
        with self._cond:
            jobs = [*self.waiting, *([self.prefilling] if self.prefilling else []), *self.active.values()]
            self.waiting.clear()
        for job in jobs:
            self._leave(job)
            if not job.done:
                self.cut += 1
                self._close(job, "cancelled", Failed(APIError(503, "the server shut down before this request "
                                                              "finished", type="server_unavailable",
                                                              code="shutting_down")))

    def prefill_budget(self) -> int:
        """Prompt tokens to cache this turn: `prefill_tokens` while nothing runs; else the most (a power of two, at
        least MIN_PREFILL_CHUNK) whose forward the cost table prices at no more than prefill_share / (1 -
        prefill_share) decode steps (0.5: one step, so a turn takes about two and a long prompt arriving mid-stream
        slows running streams to about half their pace while it is cached, instead of stopping them), or, while
        prompts wait for a batch with room, FILL_SECONDS if that is more: a small batch's step is short, and
        priced by it a queue's prompts were cached a few tokens a turn while the batch stayed small (seconds of
        waiting for each at 16 concurrent requests); a stream's gap grows by at most FILL_SECONDS meanwhile."""
        if not self.active:
            return self.prefill_tokens
        rows = len(self.engine.rows)
        step = self.engine.cost.seconds(rows, 1, max(self.engine.cache.lengths[:rows]))
        step *= self.prefill_share / (1 - self.prefill_share)
        with self._cond:
            queue = len(self.waiting)
        if queue and rows + (self.prefilling is not None) < self.max_batch:
            step = max(step, FILL_SECONDS)
        cached = self.engine.cache.lengths[rows] if self.engine.pending is not None else 0  # the chunk's context
        tokens = MIN_PREFILL_CHUNK
        while (tokens * 2 <= self.prefill_tokens
               and self.engine.cost.seconds(1, tokens * 2, cached + tokens * 2) <= step):
            tokens *= 2
        return tokens

    def _prefill(self) -> None:
        """Waiting prompts into the engine within this turn's budget, one at a time; each joins the batch once its
        prompt is cached (a sibling choice's copy at once). While requests run, the pending prompt's chunk rides
        in their step's forward (`_step`)."""
        budget = self.prefill_budget()
        while budget > 0:
            if self.prefilling is None:
                job = self._next_waiting()
                if job is None:
                    return
                sibling = job.sibling.row if job.sibling is not None else None
                job.scheduled_at = time.perf_counter()
                self.metrics.scheduled(job, job.scheduled_at)
                try:  # a sibling choice still running lends its prompt's cache: one prefill for the n choices
                    self.engine.start(job.row, like=sibling if sibling in self.engine.rows else None)
                except Exception as e:  # noqa: BLE001
                    self._close(job, "error", Failed(internal_error("the prompt's prefill failed", e)))
                    continue
                self.prefilling = job
            if self.engine.pending is not None:
                if self.active:
                    return  # the step carries this turn's chunk
                try:
                    budget -= max(1, self.engine.prefill(budget))
                except Exception as e:  # noqa: BLE001
                    job, self.prefilling = self.prefilling, None
                    self.engine.cancel_pending()
                    self._close(job, "error", Failed(internal_error("the prompt's prefill failed", e)))
                    continue
            self._joined()

    def _joined(self) -> None:
        """The prefilling job's prompt is cached (the engine has let it join): it is active."""
        if self.prefilling is not None and self.engine.pending is None:
            job, self.prefilling = self.prefilling, None
            self.active[id(job.row)] = job
            self.metrics.admitted(job, job.row.stats.prompt_tokens, job.row.stats.cached_tokens)

    def _next_waiting(self) -> Job | None:
        """The first waiting job (cancelled ones are closed on the way) while the batch has room, else None."""
        while True:
            with self._cond:
                # a paged KV cache admits a prompt when its blocks are free: the others wait, in turn
                if (not self.waiting or len(self.active) >= self.max_batch
                        or not self.engine.admits(self.waiting[0].row)):
                    return None
                job = self.waiting.popleft()
                self.metrics.queue(len(self.active), len(self.waiting))
            if not job.cancelled:
                return job
            self._close(job, "cancelled", None)

    def _drop_cancelled(self) -> None:
        if self.prefilling is not None and self.prefilling.cancelled:
            job = self.prefilling
            self._leave(job)
            self._close(job, "cancelled", None)
        for job in list(self.active.values()):
            if job.cancelled:
                self._leave(job)
                self._close(job, "cancelled", None)

    def _step(self) -> None:
        self.metrics.step_rows.observe(len(self.active))
        before = {key: (job.row.stats.drafted, job.row.stats.accepted) for key, job in self.active.items()}
        started = time.perf_counter()
        results = self.engine.step(prefill=self.prefill_budget() if self.prefilling is not None else 0)
        self._joined()
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        for row, result in results:
            job = self.active.get(id(row))
            if job is None:  # the pending prompt's prefill failed (the engine has dropped it)
                if self.prefilling is not None and self.prefilling.row is row and isinstance(result, Exception):
                    job, self.prefilling = self.prefilling, None
                    self._close(job, "error", Failed(internal_error("the prompt's prefill failed", result)))
                continue
            if isinstance(result, Exception):
                self._leave(job)
                self._close(job, "error", Failed(internal_error("the request failed", result)))
                continue
            drafted, accepted = before[id(row)]
            self.metrics.row_step(job, row.stats.drafted - drafted, row.stats.accepted - accepted, len(result))
            try:
                self._deliver(job, result)
            except Exception as e:  # noqa: BLE001 - its text (detokenizing, stop strings, logprobs) fails it alone
                if not job.done:
                    self._leave(job)
                    self._close(job, "error", Failed(internal_error("the request's text failed", e)))
        self._publish()

    def _publish(self) -> None:
        self.metrics.queue(len(self.active), len(self.waiting))
        held = sum(self.engine.cache.lengths[: len(self.engine.rows)])
        self.metrics.kv(held, self.max_batch * self.engine.model.config.max_position_embeddings)

    def _deliver(self, job: Job, tokens: list[int]) -> None:
        now = time.perf_counter()
        if tokens and job.first_token_at is None:
            job.first_token_at = now
            self.metrics.first_token(job, now)
        piece = job.text.step(tokens, job.row.finish_reason)
        finish = job.text.finish
        logprobs = self._logprobs(job)
        if piece:
            if job.last_piece_at is not None:
                self.metrics.inter_token(job, now - job.last_piece_at)
            job.last_piece_at = now
        if piece or logprobs:
            job.emit(Piece(piece, logprobs, job.index))
        if finish:
            self._leave(job)
            self.metrics.finished(job, finish, now, job.row.stats.new_tokens)
            if (speedup := job.row.stats.estimated_speedup) is not None:
                self.metrics.estimated_speedup.labels(self.metrics.model_name, job.method).observe(speedup)
            self._close(job, finish, Done(finish, job.usage(), job.index))

    @staticmethod
    def _logprobs(job: Job) -> list[dict] | None:
        """Entries of the tokens committed since the last ones sent, up to the text's end (a stop token, and what
        a stop string cut, are not part of the answer)."""
        if job.row.logprobs is None:
            return None
        kept = len(job.text.token_ids) - len(job.text.stop_token)
        new = job.row.token_logprobs[job.logprobs_sent : kept]
        job.logprobs_sent = max(job.logprobs_sent, kept)
        return logprob_entries(new, job.tokenizer.token_text) if new else None

    def _leave(self, job: Job) -> None:
        if job.row in self.engine.rows:
            self.engine.remove(job.row)
        elif job is self.prefilling:
            self.prefilling = None
            self.engine.cancel_pending()
        else:
            job.row.finish()
        self.active.pop(id(job.row), None)
        self._publish()

    def _close(self, job: Job, outcome: str, event: Done | Failed | None) -> None:
        job.done = True
        self.metrics.requests.labels(outcome).inc()
        if outcome in ("cancelled", "error"):  # stop and length were counted as the request finished
            self.metrics.finished(job, "abort" if outcome == "cancelled" else "error", time.perf_counter(),
                                  job.row.stats.new_tokens)
        if event is not None:
            job.emit(event)
