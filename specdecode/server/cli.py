"""`specdecode serve`: its arguments and its command (heavy imports only when it runs)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..cli_args import int_in, port, positive
from ..cli_precision import add_precision_args, quantization


def add_parser(sub) -> None:
    from ..api import DEFAULT_METHOD, METHODS

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and speculation")
    s.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf file")
    s.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    s.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help="default speculation method (a request may pick another, or `speculation: false`)")
    s.add_argument("--draft", help="draft model for --method draft/hybrid (registry name, HF dir or .gguf)")
    s.add_argument("--k", default="auto", help="tokens guessed per step, or 'auto' (cost model; backs off as the "
                   "batch grows)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)")
    s.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    s.add_argument("--max-batch", type=positive, default=16, help="requests decoded together")
    s.add_argument("--max-queue", type=int_in(0, what="a queue length"), default=64,
                   help="requests waiting for a batch slot before 503")
    s.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECDECODE_API_KEY, else none)")
    add_precision_args(s)
    s.add_argument("--threads", type=positive, help="CPU threads for the forwards (default: torch's choice)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log verbosity")


def cmd_serve(args: argparse.Namespace) -> int:
    from ..api import LLM
    from ..batch import BatchCost
    from .app import ServerConfig, serve

    if args.max_batch < 1 or args.max_queue < 0:
        raise ValueError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.k != "auto" and not str(args.k).isdigit():
        raise ValueError(f"--k must be 'auto' or an integer >= 0, got {args.k!r}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s", stream=sys.stderr)
    log = logging.getLogger("specdecode.server")
    log.info("loading %s", args.model)
    llm = LLM.load(args.model, dtype=args.dtype, quantization=quantization(args))
    llm.proposer(args.method, args.draft)  # load and check the draft (model, head, layer search) now, not later
    log.info("batched forward cost (measured once per model, machine and --max-batch, then cached)")
    cost = BatchCost.for_model(llm.model, args.max_batch)
    config = ServerConfig(model_name=args.served_model_name or args.model, method=args.method,
                          k=args.k if args.k == "auto" else int(args.k), draft=args.draft, max_batch=args.max_batch,
                          max_queue=args.max_queue, api_key=args.api_key)
    serve(llm, config, host=args.host, port=args.port, cost=cost, shutdown_timeout=args.shutdown_timeout,
          log_level=args.log_level)
    return 0
