"""Scale out on Ray Serve: N replicas of the server (each its own model, batch and scheduler) behind Ray Serve's
router, one OpenAI endpoint. Needs `pip install "specdecode[ray]"`.

    specdecode serve --replicas 2 ...                   # `specdecode serve`'s options, on Ray Serve
    serve run specdecode.server.ray_app:build_app model=smollm2-135m-instruct replicas=2

or from Python: `serve.run(specdecode.server.ray_app.build_app({"model": ..., "replicas": 2}))`.
On a multi-machine cluster (`ray start --head` on one machine, `ray start --address HEAD:6379` on the others),
set RAY_ADDRESS=HEAD:6379 (or run on the head): Ray places the replicas wherever there are free CPUs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from ray import serve
from ray.serve import Application

from .body import MAX_REQUEST_BYTES
from .warmup import parse_methods

log = logging.getLogger("specdecode.server")


@serve.deployment
@serve.ingress()
class Replica:
    """One server: loads the model and sets up its methods when Ray starts it, then answers as `specdecode
    serve` does (its scheduler runs in a thread of the replica)."""

    def __init__(self, options: dict[str, Any]) -> None:
        from .replica import build

        logging.getLogger("specdecode").setLevel(options.get("log_level", "INFO").upper())
        replica = serve.get_replica_context().replica_id.unique_id
        self.llm, self.config, self.cost = build(options, replica=replica)

    def __serve_build_asgi_app__(self):
        from .app import create_app

        return create_app(self.llm, self.config, self.cost)


def deployment(options: dict[str, Any], replicas: int, replica_cpus: float = 1.0) -> Application:
    """The application for `serve.run`: `replicas` replicas, each reserving `replica_cpus` CPUs (and running
    that many torch threads unless options['threads'] says otherwise)."""
    options = {**options, "threads": options.get("threads") or max(1, int(replica_cpus))}
    # Ray's router sends a replica at most this many requests at once: enough to fill its batch and queue
    # (Ray's default, 5, would keep batches small); beyond it requests wait at the router
    ongoing = options["max_batch"] + options["max_queue"]
    return Replica.options(  # type: ignore[attr-defined]  # serve.deployment made the class a Deployment
        num_replicas=replicas, max_ongoing_requests=ongoing, ray_actor_options={"num_cpus": replica_cpus}).bind(options)


def build_app(args: dict[str, str]) -> Application:
    """`serve run specdecode.server.ray_app:build_app key=value ...`: keys as `specdecode serve`'s options
    (model, served_model_name, method, methods, k, draft, max_batch, max_queue, api_key, max_request_bytes,
    dtype, quantization, threads) plus replicas and replica_cpus."""
    model = args.get("model", "smollm2-135m-instruct")
    method = args.get("method", "prompt-lookup")
    k = args.get("k", "auto")
    options = {
        "model": model, "served_model_name": args.get("served_model_name", model), "method": method,
        "methods": parse_methods(str(args.get("methods", "")), method),
        "k": k if k == "auto" else int(k), "draft": args.get("draft"),
        "max_batch": int(args.get("max_batch", 16)), "max_queue": int(args.get("max_queue", 64)),
        "api_key": args.get("api_key", os.environ.get("SPECDECODE_API_KEY")),
        "max_request_bytes": int(args.get("max_request_bytes", MAX_REQUEST_BYTES)),
        "dtype": args.get("dtype", "float32"), "quantization": args.get("quantization", "auto"),
        "kv_cache_dtype": args.get("kv_cache_dtype", "float16"),
        "threads": int(args["threads"]) if args.get("threads") else None,
    }
    return deployment(options, int(args.get("replicas", 1)), float(args.get("replica_cpus", 1.0)))


def run_replicas(options: dict[str, Any], *, replicas: int, replica_cpus: float, host: str, port: int) -> None:
    """`specdecode serve --replicas N`: join the Ray cluster at $RAY_ADDRESS (else start a local one), serve
    until SIGINT/SIGTERM, then take the application down."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    log.info("%s", f"joining the Ray cluster at {address}" if address else "starting a local Ray cluster")
    ray.init(address=address, include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        log.info("starting %d replicas of %s (each loads the model and sets up its methods: see the replica logs "
                 "under /tmp/ray/session_latest/logs/serve)", replicas, options["model"])
        serve.run(deployment(options, replicas, replica_cpus), name="specdecode", route_prefix="/")
        log.info("serving on http://%s:%d with %d replicas", host, port, replicas)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("shutting down")
    finally:
        serve.shutdown()
        ray.shutdown()
