"""`specdecode serve`: its arguments and its command (heavy imports only when it runs)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from ..common.command_line import add_precision_args, int_in, port, positive, quantization
from ..common.names import DEFAULT_METHOD, METHODS, PREFIX_CACHE_MB
from .body import BODY_TIMEOUT, MAX_REQUEST_BYTES
from .hosts import PROTECTABLE, default_allowed_hosts, parse_allowed_hosts

log = logging.getLogger("specdecode.server")


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and speculation")
    s.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF checkpoint dir or .gguf file")
    s.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    s.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help="default speculation method (a request may pick another, or `speculation: false`)")
    s.add_argument("--methods", default="",
                   help="comma list of the methods requests may pick; each is set up at start (cost "
                        "timing, heads, layer search), never inside a request (default: the --method plus "
                        "none,prompt-lookup,lookahead)")
    s.add_argument("--draft", help="draft model for --method draft/hybrid (registry name, HF dir or .gguf); the "
                   "trained heads' folder for eagle/medusa")
    s.add_argument("--k", default="auto", help="tokens guessed per step, or 'auto' (cost model; backs off as the "
                   "batch grows)")
    s.add_argument("--suffix-cache-tokens", type=int, default=1_000_000,
                   help="method suffix: tokens of earlier outputs kept for all requests to match (oldest evicted "
                        "first; about 45 bytes a token)")
    s.add_argument("--prefix-cache-mb", type=int_in(0, what="a size in MiB"), default=PREFIX_CACHE_MB,
                   help="keep up to this many MiB of finished requests' keys and values, so a prompt that begins as "
                        "an earlier request's text did (a chat's next turn, a shared system prompt) prefills only the "
                        "rest (0: off)")
    s.add_argument("--kv-cache-memory", type=memory_size,
                   help="bytes of keys and values the batch may hold (a number, or with KiB/MiB/GiB; default: what "
                        "--max-batch full contexts need, at most half the memory free at start): requests wait for "
                        "free blocks, the youngest gives its blocks back (and is recomputed) when they run out")
    s.add_argument("--block-size", type=int, choices=(8, 16, 32, 64), default=16,
                   help="tokens per KV cache block (the unit of admission, sharing and rollback)")
    s.add_argument("--online-draft", action="store_true",
                   help="eagle, hybrid: the EAGLE head keeps learning from what the target verifies (a background "
                        "thread; output unchanged, a new head taken between steps, reverted if it accepts less)")
    s.add_argument("--async-draft", action="store_true",
                   help="draft, quantized, layer-skip: the draft drafts the next step while the target verifies "
                        "this one (a worker thread on a core of its own; output unchanged)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)")
    s.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    s.add_argument("--max-batch", type=positive, default=16, help="requests decoded together")
    s.add_argument("--max-queue", type=int_in(0, what="a queue length"), default=64,
                   help="requests waiting for a batch slot before 503")
    s.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="larger request bodies get 413 (default 2 MiB)")
    s.add_argument("--replicas", type=int,
                   help="serve N replicas behind Ray Serve's router (one endpoint; `pip install specdecode[ray]`; "
                        "joins the Ray cluster at $RAY_ADDRESS, else starts a local one)")
    s.add_argument("--replica-cpus", type=float, default=1.0,
                   help="with --replicas: CPUs Ray reserves for each replica (its torch threads)")
    s.add_argument("--prefill-share", type=float, default=0.5,
                   help="while requests run, the most of the time a new prompt's prefill may take, in chunks "
                        "between steps (0.5: running streams keep half their pace; higher: new requests start "
                        "sooner)")
    s.add_argument("--chat-template", help="the chat template to use instead of the tokenizer's (a Jinja file, or the "
                   "template itself)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat_template (run in transformers' Jinja sandbox)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (visible to every user of this machine "
                   "in `ps`: prefer $SPECDECODE_API_KEY or --api-key-file)")
    s.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    s.add_argument("--allowed-hosts", help="comma list of the Host names the server answers for, '*' for any "
                   "(default: localhost,127.0.0.1,::1 when --host is a loopback address, else any); other Hosts get "
                   "421, so a web page cannot read a local server through DNS rebinding")
    s.add_argument("--protect", default="", help=f"comma list of {', '.join(PROTECTABLE)}: routes that need the API "
                   "key too (default: open, as vLLM's)")
    s.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT,
                   help="seconds a request body may take to arrive in full (then 408)")
    add_precision_args(s)
    s.add_argument("--threads", type=positive, help="CPU threads for the forwards (default: torch's choice)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log verbosity")


def cmd_serve(args: argparse.Namespace) -> int:
    from .warmup import parse_methods

    if args.max_batch < 1 or args.max_queue < 0:
        raise ValueError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.k != "auto" and not str(args.k).isdigit():
        raise ValueError(f"--k must be 'auto' or an integer >= 0, got {args.k!r}")
    if not 0 < args.prefill_share < 1:
        raise ValueError(f"--prefill-share must be in (0, 1), got {args.prefill_share}")
    if args.max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1024")
    methods = parse_methods(args.methods, args.method)
    protect = tuple(p.strip() for p in args.protect.split(",") if p.strip())
    if unknown := [p for p in protect if p not in PROTECTABLE]:
        raise ValueError(f"--protect takes {', '.join(PROTECTABLE)}, got {', '.join(unknown)}")
    if args.body_timeout <= 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    allowed_hosts = default_allowed_hosts(args.host) if args.allowed_hosts is None else \
        parse_allowed_hosts(args.allowed_hosts)
    api_key = read_api_key(args)
    if protect and api_key is None:
        raise ValueError("--protect needs an API key (--api-key-file, $SPECDECODE_API_KEY or --api-key)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s", stream=sys.stderr)
    if args.api_key is not None:
        log.warning("--api-key shows the key to every user of this machine (ps); prefer $SPECDECODE_API_KEY or "
                    "--api-key-file")
    options = dict(model=args.model, served_model_name=args.served_model_name or args.model, method=args.method,
                   methods=methods, k=args.k if args.k == "auto" else int(args.k), draft=args.draft,
                   max_batch=args.max_batch, max_queue=args.max_queue, api_key=api_key,
                   allowed_hosts=allowed_hosts, protect=protect, body_timeout=args.body_timeout,
                   max_request_bytes=args.max_request_bytes, dtype=args.dtype, quantization=quantization(args),
                   kv_cache_dtype=args.kv_cache_dtype, threads=args.threads,
                   suffix_cache_tokens=args.suffix_cache_tokens, prefix_cache_mb=args.prefix_cache_mb,
                   chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
                   prefill_share=args.prefill_share, online_draft=args.online_draft, async_draft=args.async_draft,
                   kv_cache_memory=args.kv_cache_memory, block_size=args.block_size)
    if args.replicas is not None:
        from .ray_app import run_replicas

        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        run_replicas(options, replicas=args.replicas, replica_cpus=args.replica_cpus, host=args.host,
                     port=args.port)
        return 0
    from .app import serve
    from .replica import build

    llm, config, cost = build(options)
    cut = serve(llm, config, host=args.host, port=args.port, cost=cost, shutdown_timeout=args.shutdown_timeout,
                log_level=args.log_level)
    llm.assets.save_cost_model()  # what the requests taught the single-request table, for the next start
    return 1 if cut else 0  # requests cut at shutdown: a supervisor should know the stop was not clean


UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
         "g": 1 << 30, "gib": 1 << 30, "gb": 10**9}


def memory_size(text: str) -> int:
    """A size in bytes: '2GiB', '512MiB', '1.5G', '3000000000'."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS or float(match.group(1)) * UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MiB or a number of bytes, got {text!r}")
    return int(float(match.group(1)) * UNITS[unit])


def read_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, else $SPECDECODE_API_KEY, else --api-key (None: no key)."""
    if args.api_key_file:
        path = Path(args.api_key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--api-key-file {path}: no such file")
        lines = path.read_text().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {path} is empty: write the key on its first line")
        return key
    return os.environ.get("SPECDECODE_API_KEY") or args.api_key
