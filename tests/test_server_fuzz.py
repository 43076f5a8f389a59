"""Property-based fuzzing of the whole HTTP surface from the server's own OpenAPI schema (schemathesis): requests
that follow the schema and requests that break it (wrong types, missing fields, out-of-range values), on every
route. Whatever comes in: no 5xx, no traceback, exception name or file path in any body, and /health answers after
each case. The number of cases is bounded (FUZZ_EXAMPLES per route and mode: about a minute on two cores; more with
$SPECDECODE_FUZZ_EXAMPLES)."""

from __future__ import annotations

import os
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

import specdecode
from specdecode.policy.batch_cost import BatchCost
from specdecode.server.app import ServerConfig, create_app

from .helpers import make_tokenizer, write_checkpoint
from .test_server_isolation import live
from .test_server_methods import cheap_guesses

FUZZ_EXAMPLES = int(os.environ.get("SPECDECODE_FUZZ_EXAMPLES", "25"))  # per route
LEAKS = re.compile(r"Traceback|File \"|/home/|/root/|site-packages|\.py\b|Error:|Exception")


def make_app(root):
    checkpoint = write_checkpoint(root / "ckpt", make_tokenizer())
    llm = specdecode.load(checkpoint, dtype="float64")
    llm.assets._cost = cheap_guesses()
    config = ServerConfig("tiny", method="none", max_batch=4, max_queue=8, methods=("prompt-lookup", "lookahead"),
                          trust_request_chat_template=True)
    return create_app(llm, config, BatchCost([1, 2, 4], [cheap_guesses() for _ in range(3)]))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The app behind a real uvicorn on loopback: every case is a real HTTP request."""
    with live(make_app(tmp_path_factory.mktemp("fuzz"))) as url:
        yield url


def operations(url: str) -> list:
    """Every route of the server's OpenAPI schema."""
    loaded = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in loaded.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_request_breaks_the_server(url, mode):
    """Cases inside the schema (valid) and outside it (invalid), drawn by schemathesis's strategies and run by
    hypothesis directly (schemathesis's pytest plugin depends on pytest internals that change between releases)."""
    found = operations(url)
    assert {op.path for op in found} >= {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}
    for operation in found:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # a route without parameters or a body has nothing to break
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy(generation_mode=mode))
        def one_case(case) -> None:
            check_case(case, url)

        one_case()


def check_case(case, url: str) -> None:
    if case.path in ("/v1/chat/completions", "/v1/completions") and isinstance(case.body, dict) \
            and case.body.get("model") is not None:
        case.body = {**case.body, "model": "tiny"}  # a case for the served model, not only 404s
    response = case.call(base_url=url, timeout=120)  # a slow answer is not what this test is about (a busy machine)
    assert response.status_code < 500, (case.path, case.body, response.text[:2000])
    assert not LEAKS.search(response.text), response.text[:2000]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
