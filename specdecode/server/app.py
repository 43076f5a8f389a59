"""The FastAPI app: OpenAI routes (plus vLLM's /tokenize, /detokenize, /version), API-key check, SSE streaming,
errors in OpenAI's shape.

Everything that takes CPU time per request (JSON parsing, validation, tokenization and the chat template) runs
in a worker thread, never on the event loop: a large body must not stall /health or other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..api import LLM
from ..core import chat_template as chat_templates
from ..core.acceptance import AcceptanceStats
from ..core.grammar import Constraint
from ..core.sampling import SamplingParams
from ..engine import request as engine_request
from ..engine.assets import ASYNC_DRAFTS
from ..engine.blocks import default_memory
from ..engine.loop import Engine
from ..policy.batch_cost import BatchCost
from ..policy.speculation import Pricing
from . import schemas
from .body import BODY_TIMEOUT, MAX_REQUEST_BYTES, parse_json, read_body
from .errors import APIError, bad_request, internal_error
from .hosts import TrustedHosts
from .metrics import CONTENT_TYPE, Metrics
from .scheduler import Done, Failed, Job, LockedTokenizer, Piece, Scheduler
from .template_sandbox import TemplateSandbox
from .tokenizers import TokenizerPool, max_token_bytes
from .warmup import DEFAULT_METHODS, warm_up

log = logging.getLogger("specdecode.server")
FLUSH_SECONDS = 5  # after the scheduler's shutdown deadline, for the cut requests' last events to go out


@dataclass
class ServerConfig:
    model_name: str
    method: str = "prompt-lookup"
    k: int | str = "auto"
    draft: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    api_key: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS  # what requests may ask for: set up before the first request
    max_request_bytes: int = MAX_REQUEST_BYTES
    replica: str | None = None  # a name /health reports (one replica of several behind Ray Serve)
    trust_request_chat_template: bool = False  # a request may bring its own chat template (Jinja, sandboxed)
    prefill_share: float = 0.5  # while requests run, the most of a turn's time a new prompt's prefill may take
    online_draft: bool = False  # eagle and hybrid: the EAGLE head learns from what the target verifies
    async_draft: bool = False  # draft, quantized, layer-skip: the draft drafts ahead while the target verifies
    allowed_hosts: tuple[str, ...] | None = None  # Host headers answered (None: any; see hosts.py)
    protect: tuple[str, ...] = ()  # of hosts.PROTECTABLE: routes that need the API key too
    body_timeout: float = BODY_TIMEOUT  # seconds a request body may take to arrive
    kv_cache_memory: int | None = None  # bytes of the paged KV cache (None: blocks.default_memory)
    block_size: int = 16  # tokens per KV block

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(["none", self.method, *self.methods]))


@dataclass
class Prepared:
    req: schemas.Common
    rows: list[engine_request.Request]  # one per choice (n)
    method: str


class Server:
    """Everything a route needs: the model, the scheduler, the metrics and the defaults."""

    def __init__(self, llm: LLM, config: ServerConfig, cost: BatchCost) -> None:
        self.llm, self.config = llm, config
        self.context = llm.model.config.max_position_embeddings
        warm_up(llm, config.allowed, config.draft)
        # structured output's view of the tokenizer (half a second) and its first constraint (it imports llguidance's
        # torch side: 4-13 s here): at start, never in a request (the first one waited that long)
        llm.grammar().constraint({"choice": ["warm-up"]}).mask(torch.zeros(llm.model.config.vocab_size))
        self.metrics = Metrics(config.model_name, self.context)
        self.metrics.watch_suffix(lambda: llm.assets._suffix)  # the cache every 'suffix' request of this model shares
        self.metrics.watch_online(lambda: list(llm.assets._online.values()))  # --online-draft's learners
        if llm.prefix_cache is not None:
            llm.prefix_cache.clear()  # the warm-up's texts
        memory = config.kv_cache_memory or default_memory(llm.model, config.max_batch, config.block_size)
        self.engine = Engine(llm.model, cost, llm.prefix_cache, kv_memory=memory, block_size=config.block_size)
        if self.engine.paging is not None and self.engine.paging.share:  # prefixes shared as the pool's kept blocks
            self.metrics.watch_prefix(self.engine.paging)
        self.scheduler = Scheduler(self.engine, max_batch=config.max_batch, max_queue=config.max_queue,
                                   metrics=self.metrics, prefill_share=config.prefill_share)
        # a fast tokenizer must not run in two threads at once: the routes take copies of their own (a long
        # prompt's encoding holds one copy, not every request), the scheduler detokenizes with another
        self.tokenizers = TokenizerPool(llm.tokenizer)
        self.tokenizer = LockedTokenizer(copy.deepcopy(llm.tokenizer), threading.Lock())
        # a text of more bytes than the context's tokens can stand for is refused before it is tokenized
        self.max_prompt_bytes = self.context * max_token_bytes(llm.tokenizer) * text_shrink(llm.tokenizer)
        # a request's own chat template renders in a process of its own, bounded in time, memory and output
        self.sandbox = TemplateSandbox() if config.trust_request_chat_template else None
        self.acceptance: dict[str, AcceptanceStats] = {}  # long-run acceptance per method, across requests

    # -------------------------------------------------------------------------------- requests
    def speculation(self, req: schemas.Common) -> tuple[str, int | str, dict[str, Any]]:
        """The request's method, k and the method options it sets (schemas.SpeculationBase)."""
        spec, cfg = req.speculation, self.config
        if spec is False:
            return "none", 0, {}
        if spec is None or spec is True:
            return cfg.method, cfg.k, {}
        method = spec.method or cfg.method
        if method not in cfg.allowed:
            raise bad_request(f"speculation.method {method!r} is not enabled on this server; it runs "
                              f"{', '.join(cfg.allowed)} (the server's --methods option chooses which, and sets "
                              "them up at start)", param="speculation", code="method_not_enabled")
        return method, cfg.k if spec.k is None else spec.k, spec.options()

    def prepare(self, raw: bytes, cls: schemas.RequestType) -> Prepared:
        """Body -> validated request -> prompt tokens -> Request (a worker thread: all of it may take a while)."""
        req = schemas.parse(cls, parse_json(raw))
        self.check_model(req.model)
        prompt = self.encode(req)
        rows = [self.build_row(req, prompt, choice) for choice in range(req.n or 1)]
        return Prepared(req, [row for _, row in rows], rows[0][0])

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise model_not_found(model, self.config.model_name)

    def build_row(self, req: schemas.GenerationRequest, prompt: list[int],
                  choice: int = 0) -> tuple[str, engine_request.Request]:
        """Validate against the model and build the Request of one choice (with a seed: seed + choice, so the n
        choices of a sampled request differ)."""
        limit = req.limit
        room = self.context - len(prompt)
        where = "messages" if isinstance(req, schemas.ChatRequest) else "prompt"
        if limit is None:
            limit = room
        if len(prompt) + limit > self.context:
            raise bad_request(
                f"this model's context is {self.context} tokens; the prompt has {len(prompt)} and max_tokens asks "
                f"for {limit} more: shorten the prompt or lower max_tokens", param=where,
                code="context_length_exceeded")
        if limit < 1:
            raise bad_request(f"the prompt ({len(prompt)} tokens) fills the model's context of {self.context}",
                              param=where, code="context_length_exceeded")
        if req.min_tokens is not None and req.min_tokens > limit:
            raise bad_request(f"min_tokens ({req.min_tokens}) is more than max_tokens ({limit}): lower it",
                              param="min_tokens")
        method, k, options = self.speculation(req)
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            bias, stop_ids = req.token_ids(self.llm.model.config.vocab_size)
            params = SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                                    top_k=req.top_k or 0, min_p=req.min_p or 0.0, logit_bias=tuple(bias.items()),
                                    presence_penalty=req.presence_penalty or 0.0,
                                    frequency_penalty=req.frequency_penalty or 0.0,
                                    repetition_penalty=req.repetition_penalty or 1.0,
                                    min_tokens=req.min_tokens or 0)
            online = self.config.online_draft and method in ("eagle", "hybrid")
            ahead = self.config.async_draft and method in ASYNC_DRAFTS
            proposer = self.llm.proposer(method, self.config.draft, k=k, online_draft=online,  # set up at start
                                         async_draft=ahead, **options)
            acceptance = lambda part: self.acceptance.setdefault(f"{method}|{part}" if part else method,  # noqa: E731
                                                                 AcceptanceStats())
            row = engine_request.Request(
                self.context, proposer, prompt, max_new_tokens=limit, params=params,
                k=k, pricing=Pricing(self.engine.view, acceptance),
                stop_token_ids={*stop_ids, *(() if req.ignore_eos else self.llm.stop_token_ids)},
                seed=choice_seed(req.seed, choice), logprobs=req.logprob_count, constraint=self.constraint(req))
        except ValueError as e:
            raise bad_request(str(e), param=schemas.named_field(str(e), type(req).model_fields)) from None
        except FileNotFoundError as e:  # what the method needs is missing here (e.g. layer-skip's calibration text)
            raise bad_request(f"speculation method {method!r} is not available on this server: {e}",
                              param="speculation") from None
        if self.engine.paging is not None:  # a prompt the whole KV budget cannot hold would wait forever
            try:
                self.engine.paging.check(row)
            except ValueError as e:
                raise bad_request(str(e), param=where, code="kv_cache_exceeded") from None
        return method, row

    def constraint(self, req: schemas.GenerationRequest) -> Constraint | None:
        asked = req.structured()
        if asked is None:
            return None
        field, spec = asked
        try:
            return self.llm.grammar().constraint(spec)
        except ValueError as e:
            raise bad_request(str(e), param=field) from None

    def encode(self, req: schemas.GenerationRequest | schemas.TokenizeChat | schemas.TokenizeCompletion) -> list[int]:
        """The request's prompt as token ids: its text bounded in bytes before a tokenizer copy of its own encodes
        it (a chat's text: rendered by the server's template, or by the request's own in the sandbox)."""
        if isinstance(req, schemas.TokenizeCompletion | schemas.CompletionRequest):
            prompt = req.prompt if isinstance(req, schemas.TokenizeCompletion) else req.single_prompt()
            if isinstance(prompt, str):
                self.check_bytes(prompt, "prompt")
        else:
            self.check_bytes("".join(m["content"] for m in req.chat()), "messages")  # before the template's text
        try:
            with self.tokenizers.take() as tokenizer:
                if isinstance(req, schemas.ChatRequest | schemas.TokenizeChat):
                    text = self.render(req, tokenizer)
                    self.check_bytes(text, "messages")
                    return chat_templates.tokenize(tokenizer, text)
                if isinstance(req, schemas.TokenizeCompletion):
                    return list(tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
                return self.llm.encode(prompt, tokenizer=tokenizer)
        except ValueError as e:
            message = str(e)
            param = "chat_template_kwargs" if "chat_template_kwargs" in message else \
                "chat_template" if "chat template" in message else \
                "continue_final_message" if "exclude each other" in message else "prompt"
            raise bad_request(message, param=param) from None

    def render(self, req: schemas.ChatRequest | schemas.TokenizeChat, tokenizer) -> str:
        """A chat's prompt text, by the server's chat template or (where the server trusts them) the request's."""
        if isinstance(req, schemas.TokenizeChat):
            return chat_templates.render(tokenizer, req.chat())
        if req.chat_template is None:
            return chat_templates.render(tokenizer, req.chat(), add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         variables=req.chat_template_kwargs)
        if self.sandbox is None:
            raise bad_request("a request's own chat_template is refused unless the server runs with "
                              "--trust-request-chat-template (its --chat-template sets the default)",
                              param="chat_template")
        return self.sandbox.render(req.chat_template, req.chat(), add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   variables=chat_templates.check_variables(req.chat_template_kwargs),
                                   special_tokens=dict(tokenizer.special_tokens_map),
                                   max_chars=self.max_prompt_bytes)

    def check_bytes(self, text: str, param: str) -> None:
        size = len(text.encode())
        if size > self.max_prompt_bytes:
            raise bad_request(f"the prompt's text ({size} bytes) is longer than this model's context of "
                              f"{self.context} tokens can hold: shorten it", param=param,
                              code="context_length_exceeded")

    def tokenize(self, raw: bytes) -> dict:
        req = schemas.parse_tokenize(parse_json(raw))
        self.check_model(req.model)
        tokens = self.encode(req)
        out = {"count": len(tokens), "max_model_len": self.context, "tokens": tokens}
        if req.return_token_strs:
            with self.tokenizers.take() as tokenizer:
                out["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return out

    def detokenize(self, raw: bytes) -> dict:
        req = schemas.validate(schemas.Detokenize, parse_json(raw))
        self.check_model(req.model)
        vocab = self.llm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
        with self.tokenizers.take() as tokenizer:
            return {"prompt": tokenizer.decode(req.tokens)}

    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specdecode",
                "root": self.llm.name, "max_model_len": self.context}


def text_shrink(tokenizer) -> int:
    """How many times fewer UTF-8 bytes a text may have than the tokens it becomes: 1 without a normalizer, else 3
    (NFKC makes a fullwidth 'Ａ' of three bytes the 'A' of one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return 1 if backend is not None and backend.normalizer is None else 3


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request (seed + choice: the choices differ, and choice 0 is the request's
    own seed)."""
    return seed if seed is None or choice == 0 else (seed + choice) % 2**64


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist here; this server serves {served!r} (see /v1/models)",
                    param="model", code="model_not_found")


class GuardedRoute(APIRoute):
    """A route whose unexpected exception is answered as an OpenAI-shaped 500 (logged once, under an error id) in
    the route itself. Past the route, Starlette's outermost handler answers and then raises again: uvicorn logged
    the traceback a second time and closed the keep-alive connection without `Connection: close`, so a client's
    next request on it failed."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception as e:  # noqa: BLE001 - a bug: the client gets an id to quote, the log the details
                raise internal_error("internal server error", e) from None

        return guarded


def create_app(llm: LLM, config: ServerConfig, cost: BatchCost, *, scheduler_thread: bool = True) -> FastAPI:
    """Sets up every method of `config.methods` before it returns (see warmup.py).
    scheduler_thread=False: the caller runs `app.state.server.scheduler.run()` itself (see `serve`)."""
    server = Server(llm, config, cost)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if scheduler_thread:
            server.scheduler.start()
        yield
        await run_in_threadpool(server.scheduler.stop)  # in-flight requests had the graceful-shutdown window
        if server.sandbox is not None:
            server.sandbox.close()

    docs = "docs" not in config.protect  # protected: served by the routes below, behind the key
    app = FastAPI(title="specdecode", version=__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.router.route_class = GuardedRoute
    app.state.server = server

    def answer(e: APIError) -> JSONResponse:
        server.metrics.error(e.status, e.code)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return answer(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return answer(APIError(e.status_code, str(e.detail), type=kind, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def unhandled(request: Request, e: Exception) -> JSONResponse:  # outside any route (GuardedRoute)
        return answer(internal_error("internal server error", e))

    if config.allowed_hosts is not None:  # a plain ASGI layer: streams and disconnects pass through untouched
        app.add_middleware(TrustedHosts, allowed=config.allowed_hosts, refuse=lambda: answer(APIError(
            421, "this server does not answer for that Host header (--allowed-hosts)", param="host",
            code="host_not_allowed")))

    def authorize(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>'", type="authentication_error",
                           code="invalid_api_key")

    async def body(request: Request) -> bytes:
        authorize(request)
        return await read_body(request, config.max_request_bytes, config.body_timeout)

    @app.get("/health")
    async def health() -> dict:
        out = {"status": "ok", "model": config.model_name, **server.scheduler.load}
        if config.replica:
            out["replica"] = config.replica
        return out

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if "metrics" in config.protect:
            authorize(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    if not docs:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> JSONResponse:
            authorize(request)
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def swagger(request: Request) -> HTMLResponse:
            authorize(request)
            return get_swagger_ui_html(openapi_url="/openapi.json", title="specdecode")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict:
        authorize(request)
        server.check_model(model)
        return server.model_card()

    @app.post("/tokenize", openapi_extra=schemas.request_body(schemas.TokenizeCompletion, schemas.TokenizeChat))
    async def tokenize(request: Request) -> dict:
        return await run_in_threadpool(server.tokenize, await body(request))

    @app.post("/detokenize", openapi_extra=schemas.request_body(schemas.Detokenize))
    async def detokenize(request: Request) -> dict:
        return await run_in_threadpool(server.detokenize, await body(request))

    @app.post("/v1/chat/completions", openapi_extra=schemas.request_body(schemas.ChatRequest))
    async def chat(request: Request) -> Response:
        return await complete(request, schemas.ChatRequest, "chat")

    @app.post("/v1/completions", openapi_extra=schemas.request_body(schemas.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await complete(request, schemas.CompletionRequest, "completion")

    async def complete(request: Request, cls: schemas.RequestType, kind: str) -> Response:
        prepared = await run_in_threadpool(server.prepare, await body(request), cls)
        req = prepared.req
        events: asyncio.Queue = asyncio.Queue()  # the n choices' jobs answer into one queue, each with its index
        jobs: list[Job] = []
        for i, row in enumerate(prepared.rows):
            jobs.append(Job(row, server.tokenizer, req.stops, asyncio.get_running_loop(), method=prepared.method,
                            index=i, events=events, sibling=jobs[0] if jobs else None))
        server.scheduler.submit_all(jobs)
        rid, created = schemas.new_id(kind), schemas.now()
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(jobs, events, kind, rid, created, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(request, jobs, events, kind, rid, created)

    def cancel_all(jobs: list[Job]) -> None:
        for job in jobs:
            server.scheduler.cancel(job)  # no-op for a job that finished

    async def whole(request: Request, jobs: list[Job], events: asyncio.Queue, kind: str, rid: str,
                    created: int) -> Response:
        """Collect each choice's text; if the client goes away meanwhile, the jobs are cancelled at once (their rows
        leave the batch before the next step), whatever they are doing."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            cancel_all(jobs)
            events.put_nowait(None)  # wakes the loop below: nobody is left to answer

        watcher = asyncio.create_task(watch())
        texts: list[list[str]] = [[] for _ in jobs]
        logprobs: list[list[dict] | None] = [None if job.row.logprobs is None else [] for job in jobs]
        done: dict[int, Done] = {}
        try:
            while len(done) < len(jobs):
                event = await events.get()
                if event is None:
                    return Response(status_code=499)  # nginx's "client closed request", for the access log
                if isinstance(event, Piece):
                    texts[event.index].append(event.text)
                    if (entries := logprobs[event.index]) is not None:
                        entries += event.logprobs or []
                elif isinstance(event, Failed):
                    raise event.error
                else:
                    done[event.index] = event
            choices = [schemas.choice(kind, "".join(texts[i]), done[i].finish_reason, stream=False,
                                      logprobs=logprobs[i], index=i) for i in range(len(jobs))]
            return JSONResponse(schemas.envelope(kind, rid, created, config.model_name, choices, stream=False,
                                                 usage=schemas.merge_usage([done[i].usage for i in range(len(jobs))])))
        finally:
            watcher.cancel()
            cancel_all(jobs)

    async def stream(jobs: list[Job], events: asyncio.Queue, kind: str, rid: str, created: int,
                     with_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = schemas.envelope(kind, rid, created, config.model_name, choices, stream=True, usage=usage,
                                    with_usage=with_usage)
            return f"data: {json.dumps(body)}\n\n"

        sent = [0] * len(jobs)  # characters of text so far, per choice (completions' text_offset)
        usages: dict[int, dict] = {}
        try:
            if kind == "chat":  # OpenAI opens a chat stream with the role, for each choice
                for i in range(len(jobs)):
                    yield chunk([schemas.choice(kind, "", None, stream=True, first=True, index=i)])
            while len(usages) < len(jobs):
                event = await events.get()
                if isinstance(event, Piece):
                    yield chunk([schemas.choice(kind, event.text, None, stream=True, logprobs=event.logprobs,
                                                offset=sent[event.index], index=event.index)])
                    sent[event.index] += len(event.text)
                elif isinstance(event, Failed):
                    server.metrics.error(event.error.status, event.error.code)
                    yield f"data: {json.dumps(event.error.body())}\n\n"
                    break
                else:
                    yield chunk([schemas.choice(kind, None, event.finish_reason, stream=True, index=event.index)])
                    usages[event.index] = event.usage
            else:
                if with_usage:
                    yield chunk([], usage=schemas.merge_usage([usages[i] for i in range(len(jobs))]))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled here) or the stream ended
            cancel_all(jobs)

    return app


def serve(llm: LLM, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, cost: BatchCost | None = None,
          shutdown_timeout: float = 30.0, log_level: str = "info") -> int:
    """Run the server until SIGINT/SIGTERM; then stop accepting, give in-flight requests `shutdown_timeout`
    seconds to finish and end what is left with an error event (a stream: then `[DONE]`). Returns the requests
    cut so (a second signal exits at once and counts what was running)."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """As uvicorn's, minus re-raising the signal afterwards: a graceful stop exits with status 0."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    cost = cost or BatchCost.for_model(llm.model, config.max_batch, llm.assets.cost_model())
    app = create_app(llm, config, cost, scheduler_thread=False)
    scheduler = app.state.server.scheduler
    # uvicorn's own deadline comes after ours, so that what the scheduler cuts at ours reaches its client
    web = Uvicorn(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                 timeout_graceful_shutdown=int(shutdown_timeout) + FLUSH_SECONDS))

    def on_signal(sig, frame) -> None:  # as uvicorn's own handler: stop gracefully, a second signal at once
        if web.should_exit and sig == signal.SIGINT:
            web.force_exit = True
        web.should_exit = True
        if scheduler.deadline is None:
            scheduler.drain(shutdown_timeout)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=web.run, name="uvicorn", daemon=True)
    thread.start()
    # the decode loop runs here, in the main thread (faster torch); it ends when the app's lifespan stops it,
    # after uvicorn's graceful shutdown, or when uvicorn's thread ends (e.g. the port was taken)
    running = lambda: thread.is_alive() and not web.force_exit  # noqa: E731
    scheduler.run(alive=running)
    thread.join()
    if not web.started:
        raise SystemExit(f"the server did not start on {host}:{port} (see the log above)")
    if scheduler.cut:
        log.warning("%d request(s) were still running at the end of the shutdown and were cut", scheduler.cut)
    return scheduler.cut
