"""The OpenAI-compatible server as a client meets it: a real `specdecode serve` process on loopback, a tiny
checkpoint with a real BPE tokenizer, the official `openai` client (streaming and not), concurrency with no
cross-talk between batch rows, disconnects, bad inputs, a full queue and graceful shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specdecode
from specdecode.engine.prefix_cache import common_prefix

from .server_files import CONTEXT, server_files

KEY = "test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, checkpoint: Path, cache: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cache / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--model", str(checkpoint), "--served-model-name",
               MODEL, "--dtype", "float64", "--threads", "1", "--port", str(self.port), "--api-key", KEY,
               "--log-level", "warning", *args]
        env = {**os.environ, "SPECDECODE_CACHE": str(cache)}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log.read_text())

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (also given as 'name{a="b"}')."""
        if "{" in name:
            name, _, rest = name.partition("{")
            labels.update(re.findall(r'(\w+)="([^"]*)"', rest))
        total = 0.0
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


SERVER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
REQUEST_TEMPLATE = "{% for m in messages %}{{ m['content'] }} | {% endfor %}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two servers started together on the tiny checkpoint: the main one and a one-slot one without a queue."""
    checkpoint, cache, llm = server_files(tmp_path_factory.mktemp("server"), max_batches=(16, 1))
    main = ServerProcess(checkpoint, cache, "--max-batch", "16", "--max-queue", "16")
    template = checkpoint.parent / "template.jinja"
    template.write_text(SERVER_TEMPLATE)
    small = ServerProcess(checkpoint, cache, "--max-batch", "1", "--max-queue", "0", "--shutdown-timeout", "20",
                          "--chat-template", str(template), "--trust-request-chat-template")
    try:
        main.wait_ready()
        small.wait_ready()
        yield main, small, llm
    finally:
        main.stop()
        small.stop()


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


@pytest.fixture(scope="module")
def llm(setup):
    return setup[2]


PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today?",
    "speculative decoding guesses tokens",
]


def chat(client, prompt, max_tokens=40, stream=False, **extra):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                  temperature=0, extra_body={"ignore_eos": True, **extra})
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_models_health_and_auth(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert server.health()["status"] == "ok"
    names = {line.split()[2] for line in httpx.get(server.url + "/metrics").text.splitlines()
             if line.startswith("# TYPE")}
    assert {"specdecode_requests_total", "vllm:generation_tokens_total", "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds", "vllm:num_requests_waiting", "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc", "specdecode_estimated_speedup"} <= names
    with pytest.raises(openai.AuthenticationError) as e:
        server.client("wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_chat_stream_and_not_equal_the_library(server, llm):
    client = server.client()
    text, finish, usage = chat(client, PROMPTS[0])
    streamed, stream_finish, stream_usage = chat(client, PROMPTS[0], stream=True)
    assert finish == stream_finish == "length" and usage.completion_tokens == 40
    assert streamed == text
    assert stream_usage.completion_tokens == 40 and stream_usage.prompt_tokens == usage.prompt_tokens
    for u in (usage, stream_usage):  # per-response speculation stats (usage extension)
        assert {"drafted", "accepted", "tau", "estimated_speedup"} <= set(u.model_extra) and u.model_extra["tau"] >= 1.0
        speedup = u.model_extra["estimated_speedup"]  # the policy's own estimate (None where steps are not priced)
        assert speedup is None or speedup > 0
    llm.stop_token_ids = frozenset()  # as the server with ignore_eos
    plain = llm.generate([{"role": "user", "content": PROMPTS[0]}], method="none", chat=True, max_new_tokens=40)
    assert text == plain.text


def test_the_readme_client_snippet_prints_the_text_then_the_usage(server, capsys):
    """The README's OpenAI example, run as written against this server: text pieces, then usage on its own line."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "stream_options" in block)
    snippet = (snippet.replace("http://127.0.0.1:8000/v1", server.url + "/v1")
               .replace('api_key="KEY"', f'api_key="{KEY}"').replace('"smollm2-135m-instruct"', f'"{MODEL}"'))
    exec(compile(snippet, "README.md", "exec"), {})
    out = capsys.readouterr().out
    whole = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Explain speculative decoding."}], max_tokens=128,
        temperature=0)
    *text, usage_line, extra = out.rstrip("\n").split("\n")
    assert "\n".join(text) == whole.choices[0].message.content and "None" not in out
    assert re.fullmatch(rf"{whole.usage.completion_tokens} tokens, tau \d+\.\d\d", usage_line), usage_line
    assert extra.startswith("{") and "'tau'" in extra  # the completions example's per-response stats


def test_a_chats_next_turn_reads_its_prefix_from_the_cache_and_decodes_as_the_library(server, llm):
    """Turn 2 re-sends turn 1 and its answer: their keys and values come from the prefix cache (usage's
    prompt_tokens_details.cached_tokens, the metrics), and the answer is the library's without a cache."""
    client = server.client()
    question = "Tell me about prefix caching and why a server keeps it. " * 3
    first, _, usage1 = chat(client, question, max_tokens=30)
    hits = server.metric("vllm:prefix_cache_hits_total")
    llm.stop_token_ids = frozenset()  # as the server with ignore_eos
    turn1 = llm.encode(question, chat=True) + llm.generate(question, method="none", chat=True,
                                                           max_new_tokens=30).token_ids
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": first},
                {"role": "user", "content": "Say it again, shorter."}]
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                      extra_body={"ignore_eos": True, "speculation": {"method": "prompt-lookup", "k": 3}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kwargs))
            text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            r = client.chat.completions.create(**kwargs)
            text, usage = r.choices[0].message.content, r.usage
        # turn 1's text is kept but its last token (its entries are written by the next step); turn 2 shares the
        # part of it that the chat template and the tokenizer give back token for token (a random model's text
        # does not come back whole); sent again, turn 2 finds all of its prompt but the last token
        prompt = llm.encode(messages, chat=True)
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == (len(prompt) - 1 if stream else common_prefix(turn1[:-1], prompt[:-1]))
        assert cached >= usage1.prompt_tokens
        assert llm.prefix_cache is None
        assert text == llm.generate(messages, method="none", chat=True, max_new_tokens=30).text
    assert server.metric("vllm:prefix_cache_hits_total") >= hits + usage1.prompt_tokens + len(prompt) - 1
    assert server.metric("specdecode_prefix_cache_bytes") > 0


def test_completions_stream_and_not(server, llm):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "speculation": {"method": "prompt-lookup", "k": 3}})
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "speculation": False}) if c.choices]
    assert "".join(pieces) == r.choices[0].text
    llm.stop_token_ids = frozenset()
    assert r.choices[0].text == llm.generate(PROMPTS[1], method="none", max_new_tokens=24).text
    assert r.usage.model_extra["drafted"] >= 0


def test_stop_strings_and_seeded_sampling(server):
    client = server.client()
    text, _, _ = chat(client, PROMPTS[0], max_tokens=60)
    stop = text[10:13]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=60, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[: text.index(stop)]
    # a seed repeats a sample when the guesses are fixed (k=auto adapts to what earlier requests taught it,
    # which changes how many random numbers verification draws: the same distribution, not the same text)
    sampled = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                              max_tokens=30, temperature=0.8, top_p=0.9, seed=7,
                                              extra_body={"ignore_eos": True, "speculation": {"k": k}})
               .choices[0].message.content for k in (3, 3)]
    assert sampled[0] == sampled[1]


def test_concurrent_requests_equal_each_served_alone(server):
    """20 greedy requests at once (16 batch rows + 4 queued) with different prompts, lengths, methods and
    stream modes: each output equals the same request served alone."""
    client = server.client()
    methods = [None, {"method": "prompt-lookup", "k": 4}, False, {"method": "lookahead"}, {"k": 2}]
    jobs = [(PROMPTS[i % 4] + " " * (i // 4), 20 + 3 * i, i % 3 == 0, methods[i % 5]) for i in range(20)]

    def run(job):
        prompt, n, stream, spec = job
        extra = {} if spec is None else {"speculation": spec}
        return chat(client, prompt, max_tokens=n, stream=stream, **extra)[0]

    alone = [run(job) for job in jobs]
    steps_before = server.metric("specdecode_step_batch_size_count")
    rows_before = server.metric("specdecode_step_batch_size_sum")
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together == alone
    steps = server.metric("specdecode_step_batch_size_count") - steps_before
    rows = server.metric("specdecode_step_batch_size_sum") - rows_before
    assert rows / steps > 2  # they really shared batches
    assert server.health()["running"] == 0


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def test_32_mixed_requests_at_once_equal_their_solo_runs_and_memory_comes_back(server):
    """Long and short prompts, streamed and not, plain and speculative, JSON and choice grammars, penalties, and
    clients that go away mid-stream, 32 at once (16 rows, 16 queued): each finished output equals its solo run,
    nothing keeps running, and the server's memory returns to within 20% of what it held before."""
    client = server.client()
    long = " ".join(PROMPTS) * 6  # ~660 tokens: prefilled in chunks between the others' steps
    kinds = [{}, {"speculation": {"method": "prompt-lookup", "k": 3}}, {"speculation": False},
             {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
             {"guided_choice": ["alpha", "beta", "gamma"]}, {"presence_penalty": 0.7, "repetition_penalty": 1.2}]
    jobs = [((long if i % 5 == 0 else PROMPTS[i % 4]) + " " * (i // 8), 12 + i % 9, i % 2 == 0, kinds[i % 6],
             i % 7 == 3) for i in range(32)]  # (prompt, max_tokens, stream, extra, disconnect)

    def run(job) -> str | None:
        prompt, n, stream, extra, leave = job
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True,
                                                                                         **extra})
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        with client.completions.create(stream=True, **kwargs) as chunks:
            text = []
            for chunk in chunks:
                text += [c.text for c in chunk.choices]
                if leave and len(text) >= 2:
                    return None  # the client goes away mid-stream
            return "".join(text)

    alone = [run(job) for job in jobs]
    base = rss_mb(server.proc.pid)
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert [t for t, job in zip(together, jobs, strict=True) if not job[4]] == \
        [a for a, job in zip(alone, jobs, strict=True) if not job[4]]
    deadline = time.monotonic() + 10
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["running"] == 0 and server.health()["waiting"] == 0
    assert rss_mb(server.proc.pid) < 1.2 * base


def test_disconnect_mid_stream_frees_the_row(server):
    cancelled = server.metric('specdecode_requests_total{outcome="cancelled"}')
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.monotonic() + 10
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["running"] == 0
    assert server.metric('specdecode_requests_total{outcome="cancelled"}') == cancelled + 1
    assert chat(server.client(), PROMPTS[2], max_tokens=5)[1] == "length"  # still serving


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


def post(server, path: str, body, **kwargs) -> httpx.Response:
    data = json.dumps(body) if isinstance(body, dict | list) else body  # else text, bytes or chunks
    return httpx.post(server.url + path, content=data, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, **kwargs)


def test_bias_penalties_and_stop_token_ids_are_honoured_with_speculation(server, llm):
    """The target's logits processed by what each guess's history holds: the server's speculative output is the
    library's plain decoding under the same processing, which differs from plain decoding without it."""
    client = server.client()
    llm.stop_token_ids = frozenset()  # as the server with ignore_eos
    plain = llm.generate(PROMPTS[0], method="none", max_new_tokens=24)
    processing = dict(logit_bias={plain.token_ids[0]: -100.0}, presence_penalty=0.8, frequency_penalty=0.6,
                      repetition_penalty=1.3, min_p=0.05)
    expected = llm.generate(PROMPTS[0], method="none", max_new_tokens=24, **processing)
    assert expected.token_ids[0] != plain.token_ids[0] and expected.text != plain.text
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
        logit_bias={str(plain.token_ids[0]): -100}, presence_penalty=0.8, frequency_penalty=0.6,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05,
                    "speculation": {"method": "prompt-lookup", "k": 3}})
    assert r.choices[0].text == expected.text and r.usage.model_extra["drafted"] > 0
    stop = expected.token_ids[5]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                  logit_bias={str(plain.token_ids[0]): -100}, presence_penalty=0.8,
                                  frequency_penalty=0.6, extra_body={"ignore_eos": True, "repetition_penalty": 1.3,
                                                                     "min_p": 0.05, "stop_token_ids": [stop]})
    cut = expected.token_ids.index(stop)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut + 1
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 12, "stop_token_ids": [stop]})
    assert r.usage.completion_tokens >= 12  # the stop token was banned until then
    for body, param in [({"logit_bias": {"99999999": 5}}, "logit_bias"), ({"logit_bias": {"x": 5}}, "logit_bias"),
                        ({"logit_bias": {"3": 101}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                        ({"presence_penalty": 3}, "presence_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty")]:
        response = post(server, "/v1/completions", {**COMPLETION, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_logprobs_of_chat_and_completions_streamed_and_not(server, llm):
    """Each token's log-probability under the target and its likeliest alternatives, as OpenAI shapes them for each
    route; with speculation the library's plain decoding reports the same numbers."""
    client = server.client()
    llm.stop_token_ids = frozenset()
    plain = llm.generate(PROMPTS[0], method="none", max_new_tokens=12, logprobs=2)
    assert plain.logprobs is not None and len(plain.logprobs) == 12
    c = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True, "speculation": {"method": "prompt-lookup", "k": 3}})
    got = c.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([t.logprob for t in plain.logprobs], abs=1e-6)
    # each token's own text (a piece of a multi-byte character shows as U+FFFD, as in vLLM), offsets add up
    assert got.tokens == [llm.tokenizer.decode([t.token]) for t in plain.logprobs]
    assert got.text_offset == [sum(map(len, got.tokens[:i])) for i in range(12)]
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-9 for top, lp in zip(got.top_logprobs,
                                                                                    got.token_logprobs, strict=True))
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=10, temperature=0,
                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 10 and whole.usage.completion_tokens == 10
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-9 for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    r = post(server, "/v1/chat/completions", {**CHAT, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.text
    assert post(server, "/v1/completions", {**COMPLETION, "logprobs": 21}).status_code == 400


def test_structured_output_through_response_format_and_guided_fields(server, llm):
    """JSON schema (OpenAI's response_format and vLLM's guided_json), regex and choice: the text follows them, with
    speculation exactly as structured plain decoding in the library writes it; bad grammars are 400s."""
    client = server.client()
    llm.stop_token_ids = frozenset()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    expected = llm.generate(PROMPTS[0], method="none", max_new_tokens=60, structured={"json": schema})
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                  extra_body={"ignore_eos": True, "guided_json": schema,
                                              "speculation": {"method": "prompt-lookup", "k": 3}})
    assert r.choices[0].text == expected.text and expected.text.startswith("{")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ab", "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert set(json.loads(text)) == {"a", "b"}
    else:
        assert text.startswith("{")
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0.9, seed=3,
                                  extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    for body, param in [({"response_format": {"type": "bogus"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"guided_json": {"type": "bogus"}}, "guided_json"),
                        ({"guided_json": "{not json"}, "guided_json"),
                        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex")]:
        response = post(server, "/v1/completions", {**COMPLETION, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_n_choices_streamed_and_not(server, llm):
    """n > 1: n rows of the batch from one prefill, indexed choices, usage added up; greedy choices all equal plain
    decoding, sampled ones differ and the first repeats the same seed's single answer."""
    client = server.client()
    llm.stop_token_ids = frozenset()
    plain = llm.generate(PROMPTS[1], method="none", max_new_tokens=16)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, n=3,
                                  extra_body={"ignore_eos": True, "speculation": {"method": "prompt-lookup", "k": 3}})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text == plain.text for c in r.choices)
    assert r.usage.completion_tokens == 48 and r.usage.prompt_tokens == plain.prompt_tokens
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=20, temperature=1.0,
                  seed=11, extra_body={"ignore_eos": True, "speculation": {"k": 2}})
    two = client.chat.completions.create(n=2, **kwargs)
    one = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in sorted(two.choices, key=lambda c: c.index)]
    assert texts[0] == one.choices[0].message.content and texts[0] != texts[1]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(n=2, stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    r = post(server, "/v1/completions", {**COMPLETION, "n": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


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


def test_tokenize_and_detokenize(server, llm):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == llm.encode(PROMPTS[0]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == CONTEXT
    assert len(r["token_strs"]) == r["count"]
    assert post(server, "/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json()["prompt"].endswith("brown")
    messages = [{"role": "user", "content": PROMPTS[1]}]
    tokens = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert tokens == llm.encode(messages, chat=True)
    usage = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage
    assert usage.prompt_tokens == len(tokens)
    assert post(server, "/tokenize", {"model": "gpt-4", "prompt": "hi"}).status_code == 404
    assert post(server, "/detokenize", {"tokens": [10 ** 6]}).json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "hi", "add_special_tokenz": True}).status_code == 400


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


def test_non_streaming_client_that_disconnects_frees_its_row(server):
    cancelled = server.metric('specdecode_requests_total{outcome="cancelled"}')
    body = {**COMPLETION, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "speculation": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 10
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.health()["running"] == 0
    assert server.metric('specdecode_requests_total{outcome="cancelled"}') == cancelled + 1


def test_vllm_metrics_with_model_and_method_labels(server):
    client = server.client()
    for prompt in PROMPTS:  # greedy text of the tiny model repeats itself: prompt lookup guesses some of it right
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True, "speculation": {"method": "prompt-lookup", "k": 3}})
    labels = {"model_name": MODEL, "method": "prompt-lookup"}
    drafts = server.metric("vllm:spec_decode_num_drafts_total", **labels)
    drafted = server.metric("vllm:spec_decode_num_draft_tokens_total", **labels)
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total", **labels)
    first = server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **labels)
    per_pos = server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", **labels)
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted
    assert per_pos == accepted and 0 < first <= drafts  # each accepted guess at one position; the first at most once
    assert server.metric("vllm:generation_tokens_total", **labels) >= 160
    assert server.metric("vllm:prompt_tokens_total", **labels) > 0
    assert server.metric("vllm:request_success_total", finished_reason="length", **labels) >= 4
    assert server.metric("vllm:e2e_request_latency_seconds_count", **labels) >= 4
    assert server.metric("vllm:time_to_first_token_seconds_count", **labels) >= 4
    assert server.metric("vllm:inter_token_latency_seconds_count", **labels) > 0
    assert server.metric("vllm:num_requests_running", model_name=MODEL) == 0
    assert 0 <= server.metric("vllm:kv_cache_usage_perc", model_name=MODEL) <= 1


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


def test_full_queue_then_graceful_shutdown(setup):
    """One slot, no queue: a second request while the first streams gets 503; on SIGINT the running stream
    still ends with [DONE] and the process exits cleanly."""
    small = setup[1]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=small.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        busy = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
        small.proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    assert small.proc.wait(30) == 0
    assert "Traceback" not in small.log.read_text()


def test_streams_still_running_at_the_shutdown_deadline_end_with_an_error_and_done(tmp_path):
    """SIGTERM with --shutdown-timeout 0.5: a stream that cannot finish in time gets a final error event (code
    shutting_down) and [DONE], not a cut body; the process logs no traceback and exits 1 (a stop that cut work)."""
    checkpoint, cache, _ = server_files(tmp_path)
    proc = ServerProcess(checkpoint, cache, "--shutdown-timeout", "0.5")
    try:
        proc.wait_ready()
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": CONTEXT - 64, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == "shutting_down", rest[-2]
        assert proc.proc.wait(30) == 1
        assert "Traceback" not in proc.log.read_text()
    finally:
        proc.stop()
