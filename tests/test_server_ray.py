"""`specdecode serve` scaled out on Ray Serve: two CPU replicas on a local Ray cluster behind one OpenAI
endpoint. Concurrent requests (streamed and not, through the official client) equal the library's greedy
output, both replicas answer, and a bad request is still a 400 in OpenAI's shape."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .server_files import server_files

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray's own, not ours

MODEL = "tiny"
PROMPTS = ["the quick brown fox jumps over the lazy dog", "def add(a, b):\n    return a + b\n",
           "Hello, world! How are you today?", "speculative decoding guesses tokens"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray import serve

    from specdecode.server.ray_app import build_app

    checkpoint, cache, llm = server_files(tmp_path_factory.mktemp("ray"), max_batches=(4,))
    port = free_port()
    # the replicas are processes of their own: they inherit the made-up costs' folder from the environment
    saved = os.environ.get("SPECDECODE_CACHE")
    os.environ["SPECDECODE_CACHE"] = str(cache)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # as `serve run specdecode.server.ray_app:build_app key=value ...` would pass them
        args = {"model": str(checkpoint), "served_model_name": MODEL, "dtype": "float64", "threads": "1",
                "max_batch": "4", "max_queue": "8", "replicas": "2", "replica_cpus": "1"}
        serve.run(build_app(args), name="specdecode", route_prefix="/")
        yield f"http://127.0.0.1:{port}", llm
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("SPECDECODE_CACHE")
        else:
            os.environ["SPECDECODE_CACHE"] = saved


def test_two_replicas_behind_one_endpoint(cluster) -> None:
    url, llm = cluster
    replicas = {httpx.get(url + "/health", timeout=30).json()["replica"] for _ in range(24)}
    assert len(replicas) == 2  # Ray's router spreads requests over both (all 24 on one: p = 2^-23)

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    llm.stop_token_ids = frozenset()  # as the server with ignore_eos
    expected = [llm.generate(p, method="none", max_new_tokens=16).text for p in PROMPTS]

    def ask(i: int) -> str:
        prompt = PROMPTS[i % len(PROMPTS)]
        args = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
        return client.completions.create(**args).choices[0].text

    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == [expected[i % len(PROMPTS)] for i in range(8)], f"in {time.perf_counter() - started:.1f} s"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"max_tokenz": 3})
    assert "max_tokens" in e.value.body["message"]
