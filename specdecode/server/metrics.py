"""Prometheus metrics of one server (its own registry, so several servers in one process do not clash).

Names, types and buckets follow vLLM's (`vllm:...`), so dashboards and alerts written for vLLM work here.
Labels: `model_name` everywhere, plus `method` (the speculation method that served the request) on request
and speculation metrics. A few of our own (`specdecode_...`) say what vLLM's cannot: requests refused or
abandoned, and the batch each step ran.

vLLM's recipes hold: acceptance rate = rate(vllm:spec_decode_num_accepted_tokens_total) /
rate(vllm:spec_decode_num_draft_tokens_total); mean acceptance length = 1 + rate(..._num_accepted_tokens_total)
/ rate(vllm:spec_decode_num_drafts_total); per position = ..._num_accepted_tokens_per_pos_total / ..._drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported for the route
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
MAX_POSITIONS = 64  # per-position acceptance counts this many positions at most (a request may fix k <= 64)


class Timed(Protocol):
    """What the metrics read of a scheduler job."""

    method: str
    arrived: float
    scheduled_at: float | None  # when its prefill began
    first_token_at: float | None


def token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's 1-2-5 buckets for token counts)."""
    out: list[int] = []
    base = 1
    while True:
        for m in (1, 2, 5):
            if m * base > max_len:
                return out
            out.append(m * base)
        base *= 10


class Metrics:
    def __init__(self, model_name: str = "", max_model_len: int = 8192) -> None:
        r = self.registry = CollectorRegistry()
        m, mm = ["model_name"], ["model_name", "method"]
        self.model_name = model_name
        # state of the scheduler
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a batch slot", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Tokens held in the KV cache by running requests, as a "
                              "fraction of what --max-batch rows of the full context hold (1 = 100%)", m, registry=r)
        # tokens and requests
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", mm, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", mm, registry=r)
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason",
                               [*mm, "finished_reason"], registry=r)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", mm,
                                        buckets=token_buckets(max_model_len), registry=r)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request", mm,
                                            buckets=token_buckets(max_model_len), registry=r)
        # latency
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "From arrival to the first generated token", mm,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between successive outputs of one request (one per "
                             "step: a step may commit several tokens)", mm, buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Per request: time after the first token / the "
                              "tokens after it", mm, buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "From arrival to the last token", mm,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "From arrival to the start of the prefill",
                                    mm, buckets=REQUEST_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "From the start of the prefill to the first "
                                      "generated token", mm, buckets=REQUEST_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "From the first generated token to the last",
                                     mm, buckets=REQUEST_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "From the start of the prefill to the "
                                        "last token", mm, buckets=REQUEST_BUCKETS, registry=r)
        # prefix cache (counted in prompt tokens, as vLLM's: hit rate = rate(hits) / rate(queries))
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens read from the prefix cache (not "
                                   "prefilled)", m, registry=r)
        # speculation
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Row steps that verified at least one guess", mm,
                              registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Guessed tokens sent for verification", mm,
                                    registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Guessed tokens accepted", mm,
                                       registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted guesses by position along the accepted path (0 = first guess)",
                                        [*mm, "position"], registry=r)
        # ours
        self.requests = Counter("specdecode_requests", "Requests by outcome: stop, length, cancelled (client gone), "
                                "error, rejected (queue full or shutting down)", ["outcome"], registry=r)
        self.http_errors = Counter("specdecode_http_errors", "Error answers by HTTP status and error code (every 4xx "
                                   "and 5xx, in a route or mid-stream)", ["status", "code"], registry=r)
        self.step_rows = Histogram("specdecode_step_batch_size", "Rows per batched verification forward",
                                   buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_seconds = Histogram("specdecode_step_seconds", "Seconds per batched step (propose, forward, "
                                      "verify)", buckets=STEP_BUCKETS, registry=r)
        self.estimated_speedup = Histogram(
            "specdecode_estimated_speedup", "Per finished request, the policy's estimate of its speedup: plain-step "
            "seconds its tokens would have cost (at the load of each step) over the seconds its steps took", mm,
            buckets=(0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2, 3), registry=r)

    def labels(self, job: Timed) -> tuple[str, str]:
        return self.model_name, job.method

    # -------------------------------------------------------------------------- scheduler hooks
    def queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def kv(self, tokens: int, capacity: int) -> None:
        self.kv_usage.labels(self.model_name).set(tokens / capacity if capacity else 0.0)

    def scheduled(self, job: Timed, now: float) -> None:
        self.queue_time.labels(*self.labels(job)).observe(now - job.arrived)

    def admitted(self, job: Timed, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.labels(*self.labels(job)).inc(prompt_tokens)
        self.request_prompt.labels(*self.labels(job)).observe(prompt_tokens)
        self.prefix_queries.labels(self.model_name).inc(prompt_tokens)
        self.prefix_hits.labels(self.model_name).inc(cached_tokens)

    def error(self, status: int, code: str | None) -> None:
        self.http_errors.labels(str(status), code or "").inc()

    def row_step(self, job: Timed, drafted: int, accepted: int, committed: int) -> None:
        """One row's share of a step: guesses verified and accepted, tokens committed."""
        labels = self.labels(job)
        self.generation_tokens.labels(*labels).inc(committed)
        if drafted:
            self.drafts.labels(*labels).inc()
            self.draft_tokens.labels(*labels).inc(drafted)
            self.accepted_tokens.labels(*labels).inc(accepted)
            for pos in range(min(accepted, MAX_POSITIONS)):
                self.accepted_per_pos.labels(*labels, str(pos)).inc()

    def first_token(self, job: Timed, now: float) -> None:
        self.ttft.labels(*self.labels(job)).observe(now - job.arrived)
        if job.scheduled_at is not None:
            self.prefill_time.labels(*self.labels(job)).observe(now - job.scheduled_at)

    def inter_token(self, job: Timed, seconds: float) -> None:
        self.itl.labels(*self.labels(job)).observe(seconds)

    def finished(self, job: Timed, reason: str, now: float, generated: int) -> None:
        """A request ended: reason stop or length (it ran to its end), abort (its client went away, or the server
        stopped first: vLLM's name) or error."""
        labels = self.labels(job)
        self.success.labels(*labels, reason).inc()
        self.e2e.labels(*labels).observe(now - job.arrived)
        self.request_generation.labels(*labels).observe(generated)
        if job.scheduled_at is not None:
            self.inference_time.labels(*labels).observe(now - job.scheduled_at)
        if job.first_token_at is not None:
            self.decode_time.labels(*labels).observe(now - job.first_token_at)
            if generated > 1:
                self.tpot.labels(*labels).observe((now - job.first_token_at) / (generated - 1))

    def watch_suffix(self, cache: Callable[[], object | None]) -> None:
        """Gauges read at scrape time from the model's suffix cache (`cache()`: a SuffixCache, None before one
        is made): its size and how often it helps."""
        self._watch("specdecode_suffix_cache_", lambda: [c] if (c := cache()) is not None else [], (
            ("tokens", "tokens", "Tokens of earlier outputs held by the global suffix cache"),
            ("bytes", "nbytes", "Bytes of the global suffix cache's arrays"),
            ("sequences", "sequences", "Earlier outputs held by the global suffix cache"),
            ("hit_rate", "hit_rate", "Share of suffix steps whose text's end the global cache had seen"),
            ("accepted_tokens", "accepted", "Accepted guesses that only the global suffix cache offered, since start")))

    def watch_prefix(self, cache: object) -> None:
        """Gauges read at scrape time from the prefix cache: its size (what it saved: vllm:prefix_cache_hits)."""
        self._watch("specdecode_prefix_cache_", lambda: [cache], (
            ("bytes", "bytes", "Bytes of finished requests' keys and values kept for prompts that begin the same way"),
            ("texts", "texts", "Texts whose keys and values the prefix cache keeps")))

    def watch_online(self, heads: Callable[[], list]) -> None:
        """Gauges read at scrape time from the model's heads learning online (`heads()`: its OnlineHeads, summed):
        what the learner did, and what the guard threw back."""
        self._watch("specdecode_online_draft_", heads, (
            ("learner_steps", "steps", "Learner steps of the heads learning online, since start"),
            ("heads", "version", "Heads published or brought back by the guard, since start"),
            ("reverts", "reverts", "Published heads the guard threw back (they accepted less), since start"),
            ("chunks_recorded", "recorded", "Chunks of verified positions recorded for the learner, since start"),
            ("vocab_rows_swapped", "swapped", "Draft vocabulary rows given to tokens of the traffic, since start")))

    def _watch(self, prefix: str, objects: Callable[[], list], gauges: tuple[tuple[str, str, str], ...]) -> None:
        """Gauges `prefix + name`, each the sum of an attribute over `objects()` when scraped (none: 0)."""
        def read(attribute: str) -> Callable[[], float]:
            return lambda: float(sum(getattr(o, attribute) for o in objects()))

        for name, attribute, doc in gauges:
            Gauge(prefix + name, doc, registry=self.registry).set_function(read(attribute))

    def render(self) -> bytes:
        return generate_latest(self.registry)
