"""A server one request cannot break: a request that fails at any stage (tokenizing, templating, its grammar, its
prefill, its step's proposal, forward, verification or commit, its text) fails alone while the rows beside it go on
token for token; malformed and hostile input gets a 4xx naming the field; the HTTP layer keeps connections and logs
clean; the metrics count what happened under vLLM's names."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import specdecode
from specdecode.core.detokenize import RequestText
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import DraftTree
from specdecode.engine import request as engine_request
from specdecode.engine.loop import Engine
from specdecode.policy.batch_cost import BatchCost
from specdecode.proposers import NoProposer
from specdecode.server import scheduler as scheduler_module
from specdecode.server.app import ServerConfig, create_app
from specdecode.server.cli import read_api_key
from specdecode.server.hosts import default_allowed_hosts, host_allowed, parse_allowed_hosts

from .helpers import make_tokenizer, write_checkpoint
from .test_server_methods import cheap_guesses

KEY = "isolation-key"
GOOD_TOKENS = 160  # long enough that the good rows are still running when the bad one fails
POISONED = 77  # the bad request's max_tokens: how the patches below tell its row from the others
POISON_STOP = "@@poison@@"
PROMPTS = ["the cat sat on the mat and the cat sat on the", "one two three one two three one two",
           "hello world hello world"]
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("isolation") / "ckpt", make_tokenizer())
    llm = specdecode.load(checkpoint, dtype="float64")
    llm.assets._cost = cheap_guesses()
    return llm


def app_for(llm, **options):
    config = ServerConfig("tiny", method="none", max_batch=8, methods=("prompt-lookup",), **options)
    return create_app(llm, config, BatchCost([1, 2, 4, 8], [cheap_guesses() for _ in range(4)]))


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(app_for(llm, trust_request_chat_template=True)) as client:
        yield client


def alone(llm, prompt: str, tokens: int):
    """The library's greedy output of a prompt, alone, past any end-of-text token (as the server's ignore_eos)."""
    stops, llm.stop_token_ids = llm.stop_token_ids, frozenset()
    try:
        return llm.generate(prompt, method="none", max_new_tokens=tokens, temperature=0.0)
    finally:
        llm.stop_token_ids = stops


@pytest.fixture(scope="module")
def solo(llm) -> dict[str, str]:
    return {p: alone(llm, p, GOOD_TOKENS).text for p in PROMPTS}


def metric(client, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def poisoned(row) -> bool:
    return row.max_new_tokens == POISONED


# ------------------------------------------------------------------------------------------- isolation
def stage_patches(monkeypatch, server, stage: str, rows_seen: list[int]) -> None:
    """Make the poisoned request fail at `stage`, noting how many rows the batch had then."""

    def fail(what: str):
        rows_seen.append(len(server.engine.rows))
        raise RuntimeError(f"{what} failed on purpose")

    if stage == "prefill":
        forward = server.llm.model.forward

        def prefill_forward(*args, **kwargs):
            pending = server.engine.pending
            if kwargs.get("logits_at", "") is None and pending is not None and poisoned(pending):
                fail("prefill")
            return forward(*args, **kwargs)

        monkeypatch.setattr(server.llm.model, "forward", prefill_forward)
    elif stage in ("propose", "forward"):
        plan = engine_request.Request.plan

        def bad_plan(self, context):
            tree = plan(self, context)
            if not poisoned(self):
                return tree
            if stage == "propose":
                fail("propose")
            rows_seen.append(len(server.engine.rows))  # a token outside the vocabulary: the batch's forward fails
            return DraftTree([server.llm.model.config.vocab_size + 3], [-1])

        monkeypatch.setattr(engine_request.Request, "plan", bad_plan)
    elif stage in ("verify", "commit"):
        name = "target_logits" if stage == "verify" else "commit"
        original = getattr(engine_request.Request, name)

        def bad(self, *args, **kwargs):
            if poisoned(self):
                fail(stage)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(engine_request.Request, name, bad)
    elif stage == "text":
        class PoisonedText(RequestText):
            def step(self, tokens, finish_reason):
                if POISON_STOP in self.incremental.stop:
                    fail("detokenizing")
                return super().step(tokens, finish_reason)

        monkeypatch.setattr(scheduler_module, "RequestText", PoisonedText)


BAD_BODIES = {  # stages a request fails at before it reaches the batch: (body, route, the 400's param)
    "tokenize": ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}, "chat", "chat_template_kwargs"),
    "template": ({"messages": MESSAGES, "chat_template": "{{ raise_exception('refused on purpose') }}"}, "chat",
                 "chat_template"),
    "grammar": ({"prompt": "hello", "guided_regex": "(unclosed"}, "completions", "guided_regex"),
}
ENGINE_STAGES = ["prefill", "propose", "forward", "verify", "commit", "text"]


def stream_text(client, prompt: str, started: threading.Event, out: dict) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "speculation": {"method": "prompt-lookup", "k": 3}}
    text = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out[prompt] = chunk
                return
            text += [c["text"] for c in chunk["choices"]]
            if text and not started.is_set():
                started.set()
    started.set()
    out[prompt] = "".join(text)


@pytest.mark.parametrize("stage", [*BAD_BODIES, *ENGINE_STAGES])
def test_a_request_failing_at_any_stage_fails_alone(client, solo, stage, monkeypatch):
    server = client.app.state.server
    rows_seen: list[int] = []
    stage_patches(monkeypatch, server, stage, rows_seen)
    out: dict = {}
    events = [threading.Event() for _ in PROMPTS]
    threads = [threading.Thread(target=stream_text, args=(client, p, e, out))
               for p, e in zip(PROMPTS, events, strict=True)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60)
    if stage in BAD_BODIES:
        body, route, param = BAD_BODIES[stage]
        r = client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                        json={"model": "tiny", "max_tokens": POISONED, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    else:
        body = {"model": "tiny", "prompt": "a poisoned request", "max_tokens": POISONED, "ignore_eos": True,
                "speculation": {"method": "prompt-lookup", "k": 3}}
        if stage == "text":
            body["stop"] = [POISON_STOP]
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and "error id" in r.json()["error"]["message"], r.text
        assert rows_seen and max(rows_seen) > 1, "the bad row never shared a batch: the test saw no isolation"
    for t in threads:
        t.join(120)
    assert out == solo, f"{stage}: a row beside the failing one changed or failed"
    monkeypatch.undo()
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8})
    assert r.status_code == 200


def test_a_batch_whose_shared_forward_fails_steps_each_row_alone(llm):
    """Engine level: one row's bad guess fails the batch's forward; the engine finds it by running each row alone,
    fails that row and commits the others' tokens exactly as if nothing had happened."""
    model = llm.model
    prompts = [llm.encode(p) for p in PROMPTS]
    expected = [alone(llm, p, 12).token_ids for p in PROMPTS]
    engine = Engine(model, BatchCost([1, 2, 4], [cheap_guesses() for _ in range(3)]))
    rows = [engine_request.Request(256, NoProposer(), p, max_new_tokens=12, params=SamplingParams(), k=0)
            for p in prompts]
    for row in rows:
        engine.add(row)
    bad = rows[1]
    original = bad.plan
    bad.plan = lambda context: DraftTree([model.config.vocab_size + 3], [-1])  # type: ignore[method-assign]
    results = dict((id(r), out) for r, out in engine.step())
    assert isinstance(results[id(bad)], Exception) and bad not in engine.rows
    bad.plan = original  # type: ignore[method-assign]
    while engine.rows:
        for row, _ in engine.step():
            if row.finish_reason is not None:
                engine.remove(row)
    assert [rows[0].new_tokens, rows[2].new_tokens] == [expected[0], expected[2]]


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs,names", [
    ({"tokenize": False}, "tokenize"), ({"return_tensors": "np"}, "return_tensors"),
    ({"return_tensors": "pt"}, "return_tensors"), ({"truncation": True, "max_length": 1}, "max_length, truncation"),
    ({"tokenizer_kwargs": {"add_special_tokens": True}}, "tokenizer_kwargs"), ({"chat_template": "{{ 1 }}"},
                                                                              "chat_template"),
    ({"return_dict": True}, "return_dict"), ({"messages": []}, "messages"),
])
def test_chat_template_kwargs_takes_template_variables_only(client, kwargs, names):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                  "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and f"{names} " in error["message"], error


def test_a_template_variable_reaches_the_template(client, llm):
    template = "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    bodies = [{"chat_template": template, "chat_template_kwargs": {"shout": flag}} for flag in (True, False)]
    counts = [client.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()["count"]]
    for body in bodies:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    assert counts[1] == len(llm.tokenizer("LOUD hello there", add_special_tokens=False)["input_ids"])
    assert counts[2] == len(llm.tokenizer("hello there", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\udc00"}', "prompt"),
    ("/tokenize", '{"model": "tiny", "prompt": "\\ud83d"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', "stop"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, route, body, param):
    r = client.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type,body", [
    ("text/plain", '{"model": "tiny", "prompt": "hi"}'), ("application/x-www-form-urlencoded", "model=tiny&prompt=hi"),
    ("multipart/form-data; boundary=x", "--x--"), (None, '{"model": "tiny", "prompt": "hi"}'),
])
def test_a_body_that_is_not_json_is_a_415(client, content_type, body):
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post("/v1/completions", content=body.encode(), headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
    assert client.post("/v1/completions", content=body.encode(),
                       headers={"content-type": "application/json; charset=utf-8"}).status_code != 415


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 5.0}, "max_tokens"),
    ({"n": True}, "n"), ({"seed": False}, "seed"), ({"temperature": True}, "temperature"),
    ({"stream": 1}, "stream"), ({"logprobs": True}, "logprobs"), ({"min_tokens": 10**9, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 20}, "min_tokens"), ({"top_k": "3"}, "top_k"), ({"stop_token_ids": [1, True]}, "stop_token_ids"),
    ({"speculation": {"method": "prompt-lookup", "k": True}}, "speculation"),
])
def test_strict_types_and_bounds_name_their_field(client, body, param):
    """No bool for an int, no string for a number; min_tokens at most max_tokens (16 by default for completions)."""
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_model_level_checks_name_their_field(client):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(client, monkeypatch):
    server = client.app.state.server
    monkeypatch.setattr(server.tokenizers, "take", lambda: pytest.fail("tokenized a prompt the byte bound refuses"))
    for route, body in (("/v1/completions", {"prompt": "x" * (server.max_prompt_bytes + 1)}),
                        ("/tokenize", {"prompt": "x" * (server.max_prompt_bytes + 1)})):
        r = client.post(route, json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == "prompt" and "bytes" in r.json()["error"]["message"]


def test_a_long_encoding_holds_one_tokenizer_copy_not_every_request(client):
    """Each route encodes with a copy of its own: while a long prompt's encoding holds one (held here), other
    requests go on with the others; with every copy held, a request waits for one and then goes on."""
    server = client.app.state.server
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
    with server.tokenizers.take():
        assert client.post("/v1/completions", json=body).status_code == 200
    copies = []
    held = [server.tokenizers.take() for _ in range(server.tokenizers.copies)]
    for h in held:
        copies.append(h.__enter__())
    answered = threading.Event()
    thread = threading.Thread(target=lambda: (client.post("/v1/completions", json=body), answered.set()))
    thread.start()
    assert not answered.wait(0.5)  # every copy busy: it waits
    held[0].__exit__(None, None, None)
    assert answered.wait(30)
    thread.join()
    for h in held[1:]:
        h.__exit__(None, None, None)
    assert len({id(c) for c in copies}) == server.tokenizers.copies


def test_a_request_template_is_bounded_in_time_memory_and_output(client):
    bombs = ["{% for i in range(100000) %}{% for j in range(100000) %}0123456789{% endfor %}{% endfor %}",
             "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "{{ 'x' * 4000000000 }}"]
    for template in bombs:
        started = time.monotonic()
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1,
                                                      "chat_template": template})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert time.monotonic() - started < 30
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1,
                                                  "chat_template": plain})
    assert r.status_code == 200, r.text  # and the renderer, started afresh, renders the next template


# ----------------------------------------------------------------------------------------- HTTP layer
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live(app) -> Iterator[str]:
    """The app behind a real uvicorn on loopback (keep-alive connections, slow bodies)."""
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not web.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        web.should_exit = True
        thread.join(30)


def test_a_500_in_a_route_keeps_the_connection_and_logs_once(llm, monkeypatch, caplog):
    app = app_for(llm)
    server = app.state.server

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a route")

    monkeypatch.setattr(server, "prepare", broken)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with live(app) as url, httpx.Client(base_url=url) as http, caplog.at_level(logging.ERROR):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 500 and "error id" in r.json()["error"]["message"]
        assert r.headers.get("connection") != "close"
        monkeypatch.undo()
        ports = set()
        for _ in range(3):  # the same pooled connection answers the next requests
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr")[1])
        assert len(ports) == 1
    tracebacks = [rec for rec in caplog.records if rec.exc_info and "a bug in a route" in str(rec.exc_info[1])]
    assert len(tracebacks) == 1, [rec.getMessage() for rec in caplog.records]
    assert metric_of(server, "specdecode_http_errors_total", status="500") == 1


def metric_of(server, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(server.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def test_a_body_that_never_arrives_times_out(llm):
    app = app_for(llm, body_timeout=1.0)
    with live(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\": ")
            started = time.monotonic()
            answer = s.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert time.monotonic() - started < 10


def test_hosts_outside_the_allowlist_get_421(llm):
    with TestClient(app_for(llm, allowed_hosts=("localhost", "127.0.0.1", "::1"))) as c:
        assert c.get("/health", headers={"host": "localhost:8000"}).status_code == 200
        assert c.get("/health", headers={"host": "[::1]:8000"}).status_code == 200
        for host in ("evil.example", "127.0.0.1.evil.example", "localhost.evil.example:8000"):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers={"host": host})
            assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", host


def test_host_rules():
    assert default_allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert default_allowed_hosts("::1") and default_allowed_hosts("localhost")
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("myhost") is None
    assert parse_allowed_hosts("*") is None
    allowed = parse_allowed_hosts("api.example.com, *.internal")
    assert host_allowed("API.example.com.:443", allowed) and host_allowed("a.b.internal", allowed)
    assert not host_allowed("example.com", allowed) and not host_allowed(None, allowed)
    assert not host_allowed("internal", allowed)


def test_protected_metrics_and_docs_need_the_key(llm):
    with TestClient(app_for(llm, api_key=KEY, protect=("metrics", "docs"))) as c:
        for route in ("/metrics", "/docs", "/openapi.json"):
            assert c.get(route).status_code == 401, route
            assert c.get(route, headers={"authorization": f"Bearer {KEY}"}).status_code == 200, route
        assert c.get("/health").status_code == 200
    with TestClient(app_for(llm, api_key=KEY)) as c:  # by default open, as vLLM's
        assert c.get("/metrics").status_code == 200 and c.get("/openapi.json").status_code == 200


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    args = argparse.Namespace(api_key=None, api_key_file=None)
    assert read_api_key(args) is None
    monkeypatch.setenv("SPECDECODE_API_KEY", "from-env")
    assert read_api_key(args) == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert read_api_key(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "key"))) == "from-file"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "empty")))
    with pytest.raises(FileNotFoundError):
        read_api_key(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "missing")))


# --------------------------------------------------------------------------------------------- metrics
def test_vllm_latency_histograms_prefix_cache_counters_aborts_and_errors(llm):
    with TestClient(app_for(llm)) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                                                   "ignore_eos": True}).status_code == 200
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": True}).status_code == 400
        server = c.app.state.server
        job_done = threading.Event()
        close = server.scheduler._close

        def watch(job, outcome, event):
            close(job, outcome, event)
            if outcome == "cancelled":
                job_done.set()

        server.scheduler._close = watch  # a client that goes away mid-stream: an abort
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            next(r.iter_lines())
        assert job_done.wait(30)
        for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                     "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
                     "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count"):
            assert metric(c, name) >= 2, name
        assert metric(c, "vllm:prefix_cache_queries_total") >= 2 * len(llm.encode(PROMPTS[0]))
        assert metric(c, "vllm:request_success_total", finished_reason="length") == 2
        assert metric(c, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(c, "specdecode_http_errors_total", status="400") == 1


def test_prefix_cache_hits_count_tokens_read_from_it(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", make_tokenizer())
    cached = specdecode.LLM.load(checkpoint, dtype="float64", prefix_cache_mb=16)
    cached._cost = cheap_guesses()
    with TestClient(app_for(cached)) as c:
        prompt = PROMPTS[0] * 3
        for _ in range(2):
            assert c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}).status_code \
                == 200
        # the second request shares the first one's full KV blocks (16 tokens each) of all of its prompt but the last
        assert metric(c, "vllm:prefix_cache_hits_total") >= (len(cached.encode(prompt)) - 1) // 16 * 16 > 0
