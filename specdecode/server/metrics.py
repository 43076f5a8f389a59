"""Prometheus metrics of one server (its own registry, so several servers in one process do not clash)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported for the route
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "specdecode_"
        self.requests = Counter(p + "requests", "Requests by outcome: stop, length, cancelled (client gone), "
                                "error, rejected (queue full or shutting down)", ["outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter(p + "drafted_tokens", "Guessed tokens sent to the target for verification", registry=r)
        self.accepted = Counter(p + "accepted_tokens", "Guessed tokens the target accepted", registry=r)
        self.acceptance_rate = Gauge(p + "acceptance_rate", "accepted / drafted since start", registry=r)
        self.mean_accepted = Gauge(p + "mean_accepted_length",
                                   "Mean tokens committed per row per verification step (tau) since start", registry=r)
        self.accepted_per_step = Histogram(p + "accepted_per_step", "Guesses accepted per row per step",
                                           buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Between successive pieces of output of one request (a piece may hold several tokens)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "request_duration_seconds", "From arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a batch slot", registry=r)
        self.batch_size = Gauge(p + "batch_size", "Requests in the running batch", registry=r)
        self.step_rows = Histogram(p + "step_batch_size", "Rows per batched verification forward",
                                   buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Seconds per batched step (propose, forward, verify)",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.estimated_speedup = Histogram(
            p + "estimated_speedup", "Per finished request, the policy's estimate of its speedup: plain-step seconds "
            "its tokens would have cost (at the load of each step) over the seconds its steps took",
            buckets=(0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2, 3), registry=r)
        self._steps = self._committed = self._drafted = self._accepted = 0

    def observe_row_step(self, drafted: int, accepted: int, committed: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.generated_tokens.inc(committed)
        self.accepted_per_step.observe(accepted)
        self._steps += 1
        self._committed += committed
        self._drafted += drafted
        self._accepted += accepted
        if self._drafted:
            self.acceptance_rate.set(self._accepted / self._drafted)
        self.mean_accepted.set(self._committed / self._steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
