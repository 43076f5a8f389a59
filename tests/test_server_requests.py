"""What the server refuses and what it accepts: bad bodies and values are 400s naming the field (and the server
keeps serving), unsupported fields are refused unless neutral, unknown fields get a guess, limits on size, depth
and stops, unknown models and routes, methods not set up; chat templates of the server and of a request."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import specdecode

from .server_files import CONTEXT
from .server_process import (
    CHAT,
    COMPLETION,
    KEY,
    MODEL,
    PROMPTS,
    REQUEST_TEMPLATE,
    SERVER_TEMPLATE,
    chat,
    post,
    started,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The main server, and one with its own chat template that also takes a request's."""
    templated = ("--max-batch", "1", "--chat-template", "TEMPLATE", "--trust-request-chat-template")
    main = ("--max-batch", "16", "--max-queue", "16")
    with started(tmp_path_factory.mktemp("server"), main, templated) as (procs, llm):
        yield procs[0], procs[1], llm


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


@pytest.fixture(scope="module")
def llm(setup):
    return setup[2]


@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "word " * 1200}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "speculation": {"method": "telepathy"}}, "speculation"),
    ({"model": MODEL, "prompt": "hi", "speculation": {"method": "draft"}}, "speculation"),
    ({"model": MODEL}, "prompt"),
    ([1, 2], None),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=data,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    assert chat(server.client(), PROMPTS[3], max_tokens=3)[1] == "length"


def test_errors_for_chat_and_unknown_routes(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1200}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("route,field,value", [
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "functions", [{"name": "f"}]),
    ("chat", "guided_grammar", "start: 'a'"),
    ("completion", "structured_outputs", {"json": {"type": "object"}}),
    ("completion", "best_of", 3),
    ("completion", "echo", True),
    ("completion", "suffix", "end"),
])
def test_unsupported_fields_are_400s_naming_them(server, route, field, value):
    """Every field the audit found silently ignored: a 400 that names it and says it is not supported."""
    path, base = ("/v1/chat/completions", CHAT) if route == "chat" else ("/v1/completions", COMPLETION)
    r = post(server, path, {**base, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    assert f"`{field}` is not supported" in error["message"]


def test_neutral_values_and_harmless_fields_are_accepted(server):
    """Clients send defaults explicitly (n=1, logprobs=false, penalties 0, tools=null) and echo assistant
    messages back with their null fields: none of that is refused."""
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=4, n=1, logprobs=False,
        presence_penalty=0, frequency_penalty=0, response_format={"type": "text"}, user="u1",
        metadata={"k": "v"}, store=False, parallel_tool_calls=True,
        extra_body={"repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True})
    echoed = first.choices[0].message.model_dump()  # role, content, refusal, annotations, audio, tool_calls...
    r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": PROMPTS[2]}, echoed, {"role": "user", "content": "go on", "name": "me"}])
    assert r.choices[0].finish_reason in ("length", "stop")
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=None, echo=False, best_of=1)
    assert c.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("route,body,param,guess", [
    ("completion", {**COMPLETION, "max_tokenz": 5}, "max_tokenz", "max_tokens"),
    ("chat", {**CHAT, "temprature": 0}, "temprature", "temperature"),
    ("chat", {**CHAT, "messages": [{"role": "user", "contnet": "hi"}]}, "messages[0].contnet", "content"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", None),
    ("completion", {**COMPLETION, "speculation": {"methd": "none"}}, "speculation.methd", None),
])
def test_unknown_fields_are_400s_with_a_guess(server, route, body, param, guess):
    r = post(server, "/v1/chat/completions" if route == "chat" else "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "unrecognized request argument" in error["message"]
    if guess:
        assert f"did you mean `{guess}`" in error["message"]


def test_limits_on_size_depth_and_stops(server):
    deep = "[" * 100_000 + "]" * 100_000  # json's recursion limit: once a 500
    r = post(server, "/v1/completions", deep)
    assert r.status_code == 400 and "nests" in r.json()["error"]["message"]
    nested: object = "x"
    for _ in range(40):
        nested = {"a": nested}
    r = post(server, "/v1/completions", {**COMPLETION, "metadata": nested})
    assert r.status_code == 400 and "nests" in r.json()["error"]["message"]
    big = json.dumps({**COMPLETION, "prompt": "x" * (3 << 20)})
    r = post(server, "/v1/completions", big)  # announced by Content-Length
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", iter([big[i:i + 65536].encode() for i in range(0, len(big), 65536)]))
    assert r.status_code == 413  # chunked: counted as it arrives
    for stop, why in ((["a", "b", "c", "d", "e"], "at most 4"), ("x" * 257, "1 to 256"), ([""], "1 to 256")):
        r = post(server, "/v1/completions", {**COMPLETION, "stop": stop})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "stop"
    assert chat(server.client(), PROMPTS[3], max_tokens=3)[1] == "length"


def test_unknown_model_is_404_and_model_routes(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(server.url + "/version").json()["version"] == specdecode.__version__


def test_a_method_not_set_up_is_refused_naming_methods(server):
    r = post(server, "/v1/completions", {**COMPLETION, "speculation": {"method": "eagle"}})
    assert r.status_code == 400 and "--methods" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "speculation"


def test_a_large_body_is_refused_by_its_size_while_the_server_keeps_answering(server):
    """~1.5 MB of prompt is more text than the context's tokens can stand for: a 400 found out from its bytes (no
    tokenizing), read and parsed in a worker thread while /health keeps answering."""
    body = {**COMPLETION, "prompt": "word " * 300_000}
    outcome = {}

    def big() -> None:
        outcome["response"] = post(server, "/v1/completions", body)

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(big)
        while not future.done():
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            time.sleep(0.05)
    r = outcome["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "bytes" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


def test_chat_templates_of_the_server_and_of_a_request(setup, server, llm):
    """--chat-template replaces the tokenizer's; a request's own template only with --trust-request-chat-template;
    continue_final_message continues the assistant's last message instead of opening a new turn."""
    small = setup[1]  # started with --chat-template and --trust-request-chat-template
    messages = [{"role": "user", "content": PROMPTS[0]}]
    tokens = httpx.post(small.url + "/tokenize", json={"model": MODEL, "messages": messages},
                        headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    assert tokens == llm.encode(messages, chat=True, chat_template=SERVER_TEMPLATE)
    own = small.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                  extra_body={"chat_template": REQUEST_TEMPLATE})
    assert own.usage.prompt_tokens == len(llm.encode(messages, chat=True, chat_template=REQUEST_TEMPLATE))
    r = post(server, "/v1/chat/completions", {**CHAT, "chat_template": REQUEST_TEMPLATE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = post(small, "/v1/chat/completions", {**CHAT, "chat_template": "{% for m in messages %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    partial = [*messages, {"role": "assistant", "content": "The fox"}]
    cont = server.client().chat.completions.create(
        model=MODEL, messages=partial, max_tokens=4, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    expected = llm.encode(partial, chat=True, add_generation_prompt=False, continue_final_message=True)
    assert cont.usage.prompt_tokens == len(expected) and llm.tokenizer.decode(expected).endswith("The fox")
    r = post(server, "/v1/chat/completions", {**CHAT, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_a_request_sets_its_methods_options(server, llm):
    """`speculation` carries the method options a request may set (common/method_options.py): they reach the
    method's proposer (a pair it refuses is a 400 saying why), and the output stays the target's."""
    body = {**COMPLETION, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/completions", {**body, "speculation": {"method": "prompt-lookup", "k": 4, "max_ngram": 2,
                                                                 "min_ngram": 2, "branches": 2}})
    assert r.status_code == 200, r.text
    llm.stop_token_ids = frozenset()  # as the server with ignore_eos
    assert r.json()["choices"][0]["text"] == llm.generate(PROMPTS[0], method="none", max_new_tokens=12).text
    r = post(server, "/v1/completions", {**body, "speculation": {"method": "prompt-lookup", "min_ngram": 3,
                                                                 "max_ngram": 2}})
    assert r.status_code == 400 and "min_ngram <= max_ngram" in r.json()["error"]["message"]
