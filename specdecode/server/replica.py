"""One server's set-up from plain options: load the model, measure the batch's forward cost, make the config.
`specdecode serve` runs it in its own process; each Ray Serve replica runs it in its actor (ray_app.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..api import LLM
from ..engine.prefix_cache import DEFAULT_MB
from ..policy.batch_cost import BatchCost
from .app import ServerConfig
from .body import BODY_TIMEOUT
from .warmup import warm_up

log = logging.getLogger("specdecode.server")


def build(options: dict[str, Any], replica: str | None = None) -> tuple[LLM, ServerConfig, BatchCost]:
    """options: the keys cmd_serve fills (model, served_model_name, method, methods, k, draft, max_batch,
    max_queue, api_key, max_request_bytes, dtype, quantization, kv_cache_dtype, threads, suffix_cache_tokens,
    prefix_cache_mb, chat_template, trust_request_chat_template, prefill_share)."""
    if options.get("threads"):
        import torch

        torch.set_num_threads(int(options["threads"]))
    log.info("loading %s", options["model"])
    llm = LLM.load(options["model"], dtype=options.get("dtype", "float32"),
                   quantization=options.get("quantization", "auto"),
                   kv_cache_dtype=options.get("kv_cache_dtype", "float16"),
                   prefix_cache_mb=options.get("prefix_cache_mb", DEFAULT_MB))
    llm.assets.suffix_cache(options.get("suffix_cache_tokens"))
    if options.get("chat_template"):
        llm.tokenizer.chat_template = read_template(options["chat_template"])
    warm_up(llm, options["methods"], options.get("draft"))  # before the batch's timing: fail fast
    log.info("batched forward cost (measured once per model, machine and --max-batch, then cached)")
    cost = BatchCost.for_model(llm.model, options["max_batch"], llm.assets.cost_model())
    config = ServerConfig(model_name=options["served_model_name"], method=options["method"], k=options["k"],
                          draft=options.get("draft"), max_batch=options["max_batch"], max_queue=options["max_queue"],
                          api_key=options.get("api_key"), methods=tuple(options["methods"]),
                          max_request_bytes=options["max_request_bytes"], replica=replica,
                          trust_request_chat_template=bool(options.get("trust_request_chat_template")),
                          prefill_share=options.get("prefill_share", 0.5),
                          online_draft=options.get("online_draft", False),
                          async_draft=options.get("async_draft", False),
                          allowed_hosts=options.get("allowed_hosts"), protect=tuple(options.get("protect", ())),
                          body_timeout=options.get("body_timeout", BODY_TIMEOUT),
                          kv_cache_memory=options.get("kv_cache_memory"), block_size=options.get("block_size", 16))
    return llm, config, cost


def read_template(template: str) -> str:
    """--chat-template: a file's text, or the template itself (anything with Jinja's braces in it)."""
    path = Path(template).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in template:
        return template
    raise FileNotFoundError(f"--chat-template {template!r} is neither a file nor a Jinja template")
