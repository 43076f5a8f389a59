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
import torch

import specdecode
from specdecode.batch import BatchCost
from specdecode.policy import CostModel

from .helpers import make_tokenizer, write_checkpoint

KEY = "test-key"
MODEL = "tiny"
CONTEXT = 1024


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

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint (context raised to 1024, so long requests exist), flat made-up costs saved where
    the server looks for it (measuring is not what these tests are about) and two servers started together:
    the main one and a one-slot one without a queue."""
    root = tmp_path_factory.mktemp("server")
    checkpoint = write_checkpoint(root / "ckpt", make_tokenizer())
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (checkpoint / "config.json").write_text(json.dumps(config))
    cache = root / "cache"
    llm = specdecode.load(checkpoint, dtype="float64")
    sizes = [1, 2, 4, 8, 16]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cost file's name carries the thread count: the servers run one thread
    try:  # the one-request cost too (prompt lookup's tree width under k=auto): startup then measures nothing
        CostModel.save(llm.model, CostModel(sizes, [64, 512], [[1e-3 * (1 + 0.01 * n) for n in sizes]] * 2), cache)
        for max_batch in (16, 1):
            batch_sizes = BatchCost.sizes_up_to(max_batch)
            tables = [CostModel(sizes, [64, 512], [[1e-3 * (1 + 0.01 * b * n) for n in sizes]] * 2)
                      for b in batch_sizes]
            BatchCost(batch_sizes, tables).save(BatchCost.path(llm.model, max_batch, cache))
    finally:
        torch.set_num_threads(threads)
    main = ServerProcess(checkpoint, cache, "--max-batch", "16", "--max-queue", "8")
    small = ServerProcess(checkpoint, cache, "--max-batch", "1", "--max-queue", "0", "--shutdown-timeout", "20")
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
    assert {"specdecode_requests_total", "specdecode_generation_tokens_total", "specdecode_drafted_tokens_total",
            "specdecode_accepted_tokens_total", "specdecode_acceptance_rate", "specdecode_mean_accepted_length",
            "specdecode_time_to_first_token_seconds", "specdecode_inter_token_latency_seconds",
            "specdecode_queue_depth", "specdecode_batch_size"} <= names
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
        assert {"drafted", "accepted", "tau"} <= set(u.model_extra) and u.model_extra["tau"] >= 1.0
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
    ({"model": "gpt-4", "prompt": "hi"}, "model"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, "n"),
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
