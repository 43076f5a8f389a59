"""How the server stops: a full queue answers 503, SIGINT lets the running stream finish, and a stream still running
at the shutdown deadline ends with an error event and [DONE]."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from .server_files import CONTEXT, server_files
from .server_process import (
    KEY,
    MODEL,
    PROMPTS,
    ServerProcess,
    started,
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One slot and no queue."""
    small = ("--max-batch", "1", "--max-queue", "0", "--shutdown-timeout", "20")
    with started(tmp_path_factory.mktemp("server"), small) as (procs, llm):
        yield procs[0]


def test_full_queue_then_graceful_shutdown(small):
    """One slot, no queue: a second request while the first streams gets 503; on SIGINT the running stream
    still ends with [DONE] and the process exits cleanly."""
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
