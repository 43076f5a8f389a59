"""Property-based fuzzing of the whole HTTP surface from the server's own OpenAPI schema (schemathesis): requests
that follow the schema and requests that break it (wrong types, missing fields, out-of-range values), on every
route. Whatever comes in: no 5xx, no traceback, exception name or file path in any body, and /health answers after
each case. The number of cases is bounded (FUZZ_EXAMPLES per route: about two minutes on two cores; more with
$SPECDECODE_FUZZ_EXAMPLES)."""

from __future__ import annotations

import os
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.generation import GenerationMode

import specdecode
from specdecode.batch_cost import BatchCost
from specdecode.server.app import ServerConfig, create_app

from .helpers import make_tokenizer, write_checkpoint
from .test_server_isolation import live
from .test_server_methods import cheap_guesses

FUZZ_EXAMPLES = int(os.environ.get("SPECDECODE_FUZZ_EXAMPLES", "25"))  # per route
LEAKS = re.compile(r"Traceback|File \"|/home/|/root/|site-packages|\.py\b|Error:|Exception")


def make_app(root):
    checkpoint = write_checkpoint(root / "ckpt", make_tokenizer())
    llm = specdecode.load(checkpoint, dtype="float64")
    llm._cost = cheap_guesses()
    config = ServerConfig("tiny", method="none", max_batch=4, max_queue=8, methods=("prompt-lookup", "lookahead"),
                          trust_request_chat_template=True)
    return create_app(llm, config, BatchCost([1, 2, 4], [cheap_guesses() for _ in range(3)]))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The app behind a real uvicorn on loopback: every case is a real HTTP request."""
    with live(make_app(tmp_path_factory.mktemp("fuzz"))) as url:
        yield url


schema = schemathesis.pytest.from_fixture("fuzzed_schema")


@pytest.fixture(scope="module")
def fuzzed_schema(url):
    loaded = schemathesis.openapi.from_url(url + "/openapi.json")  # cases both inside and outside the schema
    assert loaded.config.generation.modes == [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    return loaded


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_breaks_the_server(case, url):
    if case.path in ("/v1/chat/completions", "/v1/completions") and isinstance(case.body, dict):
        case.body = {**case.body, "model": "tiny"} if case.body.get("model") is not None else case.body
    response = case.call(timeout=120)  # a slow answer is not what this test is about (a busy machine)
    assert response.status_code < 500, (case.body, response.text[:2000])
    assert not LEAKS.search(response.text), response.text[:2000]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
