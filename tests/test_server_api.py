"""The OpenAI-compatible server as a client meets it: a real `specdecode serve` process on loopback, a tiny
checkpoint with a real BPE tokenizer, the official `openai` client (streaming and not), output equal to the
library's, concurrency with no cross-talk between batch rows, disconnects, logprobs, structured output, n choices
and metrics. What it refuses: test_server_requests.py; how it stops: test_server_shutdown.py."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from specdecode.engine.prefix_cache import common_prefix

from .server_files import CONTEXT
from .server_process import (
    CHAT,
    COMPLETION,
    KEY,
    MODEL,
    PROMPTS,
    chat,
    post,
    rss_mb,
    started,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with started(tmp_path_factory.mktemp("server"), ("--max-batch", "16", "--max-queue", "16")) as (procs, llm):
        yield procs[0], llm


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


@pytest.fixture(scope="module")
def llm(setup):
    return setup[1]


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


BLOCK = 16  # the server's default --block-size


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
        # does not come back whole); sent again, turn 2 finds all of its prompt but the last token; shared a whole
        # KV block at a time (the server's paged cache)
        prompt = llm.encode(messages, chat=True)
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == (len(prompt) - 1 if stream else common_prefix(turn1[:-1], prompt[:-1])) // BLOCK * BLOCK
        assert cached >= usage1.prompt_tokens // BLOCK * BLOCK
        assert llm.prefix_cache is None
        assert text == llm.generate(messages, method="none", chat=True, max_new_tokens=30).text
    assert server.metric("vllm:prefix_cache_hits_total") >= \
        hits + usage1.prompt_tokens // BLOCK * BLOCK + (len(prompt) - 1) // BLOCK * BLOCK
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
