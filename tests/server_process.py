"""A real `specdecode serve` process on loopback for the server's tests (test_server_api.py,
test_server_requests.py, test_server_shutdown.py): started on the tiny checkpoint of server_files.py, read through
the official `openai` client, httpx and /metrics; and the prompts and bodies those tests share."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

import specdecode

from .server_files import server_files

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

    def wait_ready(self, timeout: float = 300.0) -> None:  # a first start on a loaded machine is slow
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


def post(server, path: str, body, **kwargs) -> httpx.Response:
    data = json.dumps(body) if isinstance(body, dict | list) else body  # else text, bytes or chunks
    return httpx.post(server.url + path, content=data, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, **kwargs)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


@contextmanager
def started(root: Path, *servers: tuple[str, ...]) -> Iterator[tuple[list[ServerProcess], specdecode.LLM]]:
    """Servers on one tiny checkpoint (each given its own extra arguments), started together and stopped at the end
    of the block; also the checkpoint loaded in the library, to compare with."""
    checkpoint, cache, llm = server_files(root, max_batches=(16, 1))
    (checkpoint.parent / "template.jinja").write_text(SERVER_TEMPLATE)
    procs = [ServerProcess(checkpoint, cache, *(a.replace("TEMPLATE", str(checkpoint.parent / "template.jinja"))
                                                for a in args)) for args in servers]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs, llm
    finally:
        for proc in procs:
            proc.stop()
