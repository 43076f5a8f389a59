"""The FastAPI app: OpenAI routes, API-key check, SSE streaming, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import api
from ..api import LLM
from ..batch import BatchCost, BatchDecoder, Row
from ..policy import AcceptanceStats, AdaptiveK, FixedK, Policy
from ..proposers import HybridProposer, NoProposer, Proposer
from ..sampling import SamplingParams
from . import schemas
from .errors import APIError, bad_request, internal_error
from .metrics import CONTENT_TYPE, Metrics
from .scheduler import Failed, Job, LockedTokenizer, Piece, Scheduler


@dataclass
class ServerConfig:
    model_name: str
    method: str = "prompt-lookup"
    k: int | str = "auto"
    draft: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    api_key: str | None = None


class Server:
    """Everything a route needs: the model, the scheduler, the metrics and the defaults."""

    def __init__(self, llm: LLM, config: ServerConfig, cost: BatchCost) -> None:
        self.llm, self.config = llm, config
        self.metrics = Metrics()
        self.decoder = BatchDecoder(llm.model, cost)
        self.scheduler = Scheduler(self.decoder, max_batch=config.max_batch, max_queue=config.max_queue,
                                   metrics=self.metrics)
        self.tokenizer_lock = threading.Lock()
        self.tokenizer = LockedTokenizer(llm.tokenizer, self.tokenizer_lock)
        self.acceptance: dict[str, AcceptanceStats] = {}  # long-run acceptance per method, across requests
        self.context = llm.model.config.max_position_embeddings

    # -------------------------------------------------------------------------------- requests
    def speculation(self, req: schemas.Common) -> tuple[str, int | str]:
        spec, cfg = req.speculation, self.config
        if spec is False:
            return "none", 0
        if spec is None or spec is True:
            return cfg.method, cfg.k
        method = spec.method or cfg.method
        if method not in api.METHODS:
            raise bad_request(f"speculation.method {method!r} is unknown; choose one of {', '.join(api.METHODS)}",
                              param="speculation")
        if method in ("draft",) and cfg.draft is None:
            raise bad_request("speculation.method 'draft' needs a draft model: start the server with --draft",
                              param="speculation")
        return method, cfg.k if spec.k is None else spec.k

    def policy(self, k: int | str, proposer: Proposer, method: str) -> Policy:
        if k != "auto":
            return FixedK(int(k))
        if isinstance(proposer, NoProposer) or not proposer.expected_to_pay:
            return FixedK(0)
        view = self.decoder.view  # forward cost at the batch's current size
        if proposer.sizes_itself:
            proposer.cost = view
            return FixedK(proposer.max_depth)
        if isinstance(proposer, HybridProposer):
            proposer.draft_policy = AdaptiveK(view, self.acceptance.setdefault(method + "|draft", AcceptanceStats()),
                                              cheap=False) if proposer.draft.expected_to_pay else FixedK(0)
        return AdaptiveK(view, self.acceptance.setdefault(method, AcceptanceStats()), cheap=proposer.cheap,
                         tree_size=getattr(proposer, "tree_size", None))

    def build_row(self, req: schemas.Common, prompt: list[int]) -> Row:
        """Validate against the model and build the request's Row (runs in a worker thread: a draft may load)."""
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
        method, k = self.speculation(req)
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            params = SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                                    top_k=req.top_k or 0)
            proposer = self.llm.proposer(method, self.config.draft, k=k)
            return Row(self.llm.model, proposer, prompt, max_new_tokens=limit, params=params,
                       k=self.policy(k, proposer, method),
                       stop_token_ids=() if req.ignore_eos else self.llm.stop_token_ids, seed=req.seed)
        except ValueError as e:
            raise bad_request(str(e)) from None
        except FileNotFoundError as e:  # what the method needs is missing here (e.g. layer-skip's calibration text)
            raise bad_request(f"speculation method {method!r} is not available on this server: {e}",
                              param="speculation") from None

    def encode(self, req: schemas.Common) -> list[int]:
        try:
            with self.tokenizer_lock:
                if isinstance(req, schemas.ChatRequest):
                    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                    return self.llm.encode(messages, chat=True)
                return self.llm.encode(req.single_prompt())
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from None


def create_app(llm: LLM, config: ServerConfig, cost: BatchCost, *, scheduler_thread: bool = True) -> FastAPI:
    """scheduler_thread=False: the caller runs `app.state.server.scheduler.run()` itself (see `serve`)."""
    server = Server(llm, config, cost)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if scheduler_thread:
            server.scheduler.start()
        yield
        await run_in_threadpool(server.scheduler.stop)  # in-flight requests had the graceful-shutdown window

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unhandled(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(internal_error("internal server error", e).body(), status_code=500)

    def authorize(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>'", type="authentication_error",
                           code="invalid_api_key")

    async def read(request: Request, cls: type[schemas.Common]) -> schemas.Common:
        authorize(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the body is not valid JSON: {e}") from None
        req = schemas.parse(cls, body)
        if req.model != config.model_name:
            raise APIError(400, f"the model {req.model!r} is not served here; this server serves "
                                f"{config.model_name!r} (see /v1/models)", param="model", code="model_not_found")
        return req

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model_name, **server.scheduler.load}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdecode", "max_model_len": server.context}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, await read(request, schemas.ChatRequest), "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, await read(request, schemas.CompletionRequest), "completion")

    async def complete(request: Request, req: schemas.Common, kind: str) -> Response:
        prompt = server.encode(req)
        row = await run_in_threadpool(server.build_row, req, prompt)
        job = Job(row, server.tokenizer, req.stops, asyncio.get_running_loop())
        server.scheduler.submit(job)
        rid, created = schemas.new_id(kind), schemas.now()
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(job, kind, rid, created, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(request, job, kind, rid, created)

    async def whole(request: Request, job: Job, kind: str, rid: str, created: int) -> Response:
        text = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        server.scheduler.cancel(job)
                        return Response(status_code=499)
                    continue
                if isinstance(event, Piece):
                    text.append(event.text)
                elif isinstance(event, Failed):
                    raise event.error
                else:
                    choice = schemas.choice(kind, "".join(text), event.finish_reason, stream=False)
                    return JSONResponse(schemas.envelope(kind, rid, created, config.model_name, [choice],
                                                         stream=False, usage=event.usage))
        finally:
            server.scheduler.cancel(job)  # no-op when it finished

    async def stream(job: Job, kind: str, rid: str, created: int, with_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = schemas.envelope(kind, rid, created, config.model_name, choices, stream=True, usage=usage,
                                    with_usage=with_usage)
            return f"data: {json.dumps(body)}\n\n"

        try:
            if kind == "chat":  # OpenAI opens a chat stream with the role
                yield chunk([schemas.choice(kind, "", None, stream=True, first=True)])
            while True:
                event = await job.events.get()
                if isinstance(event, Piece):
                    yield chunk([schemas.choice(kind, event.text, None, stream=True)])
                elif isinstance(event, Failed):
                    yield f"data: {json.dumps(event.error.body())}\n\n"
                    break
                else:
                    yield chunk([schemas.choice(kind, None, event.finish_reason, stream=True)])
                    if with_usage:
                        yield chunk([], usage=event.usage)
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled here) or the stream ended
            server.scheduler.cancel(job)

    return app


def serve(llm: LLM, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, cost: BatchCost | None = None,
          shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM; then stop accepting, give in-flight requests `shutdown_timeout`
    seconds to finish and cancel what is left."""
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

    cost = cost or BatchCost.for_model(llm.model, config.max_batch)
    app = create_app(llm, config, cost, scheduler_thread=False)
    web = Uvicorn(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                 timeout_graceful_shutdown=shutdown_timeout))

    def on_signal(sig, frame) -> None:  # as uvicorn's own handler: stop gracefully, a second signal at once
        if web.should_exit and sig == signal.SIGINT:
            web.force_exit = True
        web.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=web.run, name="uvicorn", daemon=True)
    thread.start()
    # the decode loop runs here, in the main thread (faster torch); it ends when the app's lifespan stops it,
    # after uvicorn's graceful shutdown, or when uvicorn's thread ends (e.g. the port was taken)
    app.state.server.scheduler.run(alive=thread.is_alive)
    thread.join()
    if not web.started:
        raise SystemExit(f"the server did not start on {host}:{port} (see the log above)")
