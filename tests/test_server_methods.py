"""Every method through the server's own path (`policy_for`, `RowCost`, the engine), at k="auto" and at
a fixed k, streamed and not: greedy output equals plain decoding. The library path hands a proposer a
`CostModel`, the server a `RowCost`; a method one of them lacked once failed every eagle and medusa request in
the server (HTTP 500) while every library test passed. And a 500 carries no exception text to the client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import specdecode
from specdecode.models.eagle import EagleConfig, EagleHead
from specdecode.models.medusa import MedusaHeads
from specdecode.policy.batch_cost import BatchCost
from specdecode.policy.cost import CostModel
from specdecode.proposers.layer_skip import SkipSearchResult, SkipStep, save_skip_layers
from specdecode.proposers.online_learning import OnlineConfig
from specdecode.server.app import ServerConfig, create_app

from .helpers import FrozenCost, make_tokenizer, write_checkpoint

MAX_TOKENS = 24
SKIP = SkipSearchResult(skipped=[1], agreement=0.5, speedup=1.2, k=3, num_layers=2,
                        trajectory=[SkipStep(skipped=[], agreement=1.0, speedup=1.0, k=3),
                                    SkipStep(skipped=[1], agreement=0.5, speedup=1.2, k=3)])
PROMPTS = ["the cat sat on the mat and the cat sat on the", "one two three one two three one two"]


def cheap_guesses(sizes=(1, 2, 4, 8, 16, 32, 64)) -> CostModel:
    """A cost under which guessing nearly always pays, so every method speculates."""
    return CostModel(list(sizes), [64, 512], [[1e-3 * (1 + 0.002 * n) for n in sizes]] * 2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    tokenizer = make_tokenizer()
    target_dir = write_checkpoint(root / "target", tokenizer)
    draft_dir = write_checkpoint(root / "draft", tokenizer, layers=1)
    llm = specdecode.load(target_dir, dtype="float64")
    llm.assets._cost = cheap_guesses()  # what the library path would measure: not what these tests are about
    model = llm.model
    vocab = torch.arange(model.config.vocab_size)
    head = EagleHead(EagleConfig.for_target(model.config, model.config.vocab_size)).double()
    head.init_from_target(model, vocab)
    head.save(root / "eagle")
    MedusaHeads.from_target(model, 2, vocab).save(root / "medusa")
    save_skip_layers(model, SKIP, root / "cache")
    return llm, {"eagle": root / "eagle", "medusa": root / "medusa"}, draft_dir, root / "cache"


def plain(llm, prompt: str) -> str:
    return llm.generate(prompt, method="none", max_new_tokens=MAX_TOKENS, temperature=0.0).text


def client_for(llm, draft: Path | None, methods: tuple[str, ...] = ()) -> TestClient:
    batch_cost = BatchCost([1, 2, 4], [cheap_guesses() for _ in range(3)])
    return TestClient(create_app(llm, ServerConfig("tiny", method="none", draft=str(draft) if draft else None,
                                                   max_batch=4, methods=methods), batch_cost))


def ask(client: TestClient, prompt: str, method: str, k, stream: bool) -> tuple[str, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "speculation": {"method": method, "k": k}}
    if stream:
        body["stream_options"] = {"include_usage": True}
        text, usage = [], {}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text += [c["text"] for c in chunk["choices"] if c.get("text")]
        return "".join(text), usage
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]


METHODS = ["none", "prompt-lookup", "draft", "lookahead", "layer-skip", "hybrid", "eagle", "medusa", "quantized",
           "suffix"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_through_the_server_equals_plain(world, method, monkeypatch) -> None:
    llm, heads, draft_dir, cache = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    expected = {p: plain(llm, p) for p in PROMPTS}
    with client_for(llm, heads.get(method, draft_dir), (method,)) as client:
        drafted = 0
        for k in ("auto", 3):
            for stream in (False, True):
                for prompt in PROMPTS:
                    text, usage = ask(client, prompt, method, k, stream)
                    assert text == expected[prompt], (method, k, stream, prompt)
                    drafted += usage.get("drafted", 0)
        if method != "none":
            assert drafted > 0, f"{method} never speculated: the test would not see its server path"


def test_online_draft_through_the_server_learns_and_equals_plain(world, monkeypatch) -> None:
    """--online-draft: eagle requests record what the target verified for the shared head's learner; output is
    plain decoding's."""
    llm, heads, _, cache = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    expected = {p: plain(llm, p) for p in PROMPTS}
    online = llm.assets.online_head(heads["eagle"], OnlineConfig(chunk=8))  # short requests: short chunks
    batch_cost = BatchCost([1, 2, 4], [cheap_guesses() for _ in range(3)])
    config = ServerConfig("tiny", method="eagle", draft=str(heads["eagle"]), max_batch=4, online_draft=True)
    with TestClient(create_app(llm, config, batch_cost)) as client:
        assert f"specdecode_online_draft_chunks_recorded {float(online.recorded)}" in client.get("/metrics").text
        for _ in range(3):
            for prompt in PROMPTS:
                assert ask(client, prompt, "eagle", "auto", False)[0] == expected[prompt]
        online.close()
        metrics = client.get("/metrics").text
    assert online.recorded > 0  # the server's requests fed the learner (the one head of the model)
    assert f"specdecode_online_draft_chunks_recorded {float(online.recorded)}" in metrics
    assert f"specdecode_online_draft_learner_steps {float(online.steps)}" in metrics


def test_async_draft_through_the_server_equals_plain(world, monkeypatch) -> None:
    """--async-draft: model drafts draft ahead in the model's one drafter thread while the batch verifies; requests
    side by side (one batch) and one by one all get plain decoding's text."""
    llm, _, draft_dir, cache = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    expected = {p: plain(llm, p) for p in PROMPTS}
    batch_cost = BatchCost([1, 2, 4], [cheap_guesses() for _ in range(3)])
    config = ServerConfig("tiny", method="draft", draft=str(draft_dir), max_batch=4, async_draft=True,
                          methods=("draft", "layer-skip", "prompt-lookup"))
    with TestClient(create_app(llm, config, batch_cost)) as client:
        asks = [(prompt, method) for prompt in PROMPTS for method in ("draft", "layer-skip", "prompt-lookup")]
        with ThreadPoolExecutor(len(asks)) as pool:
            texts = list(pool.map(lambda a: ask(client, a[0], a[1], 3, False)[0], asks))
        assert texts == [expected[prompt] for prompt, _ in asks]
        for prompt, method in asks:
            assert ask(client, prompt, method, "auto", True)[0] == expected[prompt]
    drafter = llm.assets._drafter
    assert drafter is not None and drafter._holders == 0  # used, and every request let its cores go


def test_a_500_names_an_error_id_not_the_exception(world, monkeypatch, caplog) -> None:
    llm, _, draft_dir, cache = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    with client_for(llm, draft_dir) as client:
        server = client.app.state.server

        def broken(*args, **kwargs):
            raise RuntimeError("secret internals /home/user/weights.bin")

        original = server.engine.step
        monkeypatch.setattr(server.engine, "step", broken)
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": stream}
            r = client.post("/v1/completions", json=body)
            text = r.text
            assert "secret internals" not in text and "RuntimeError" not in text
            assert "error id" in text
            assert r.status_code == (200 if stream else 500)
        assert "secret internals" in caplog.text  # the log keeps what the client is not told
        monkeypatch.setattr(server.engine, "step", original)
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200  # and the server goes on serving


def test_the_library_and_the_server_give_identical_tokens_and_stats(world, monkeypatch) -> None:
    """One request through `LLM.generate` and through the server runs the same engine code (a batch of one):
    the same tokens, and the same speculation (guessed, accepted, target forwards), whatever the method."""
    llm, heads, draft_dir, cache = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    sizes = (1, 2, 4, 8, 16, 32, 64)

    def slow() -> CostModel:  # forwards far dearer than proposing; learns nothing, so no decision depends on timing
        return FrozenCost(list(sizes), [64, 512], [[1.0 + 0.002 * n for n in sizes]] * 2)

    saved, llm.assets._cost = llm.assets._cost, slow()
    try:
        llm._acceptance.clear()
        config = ServerConfig("tiny", method="none", draft=str(draft_dir), max_batch=4,
                              methods=("prompt-lookup", "lookahead", "draft"))
        app = create_app(llm, config, BatchCost([1, 2, 4], [slow() for _ in range(3)]))
        with TestClient(app) as client:
            for method, k in (("prompt-lookup", "auto"), ("lookahead", "auto"), ("prompt-lookup", 3), ("draft", 2)):
                draft = draft_dir if method == "draft" else None
                ours = llm.generate(PROMPTS[0], method=method, k=k, draft=draft, max_new_tokens=MAX_TOKENS)
                text, usage = ask(client, PROMPTS[0], method, k, stream=False)
                assert text == ours.text, method
                s = ours.stats
                assert (usage["drafted"], usage["accepted"], usage["target_forwards"], usage["completion_tokens"]) \
                    == (s.drafted, s.accepted, s.target_forwards, s.new_tokens), (method, k)
                assert s.drafted > 0, method
    finally:
        llm.assets._cost = saved


def test_layer_skip_on_a_fresh_machine_searches_on_the_shipped_text(world, tmp_path, monkeypatch) -> None:
    """No cached search, no data folder: the request runs the search on the calibration text the package ships."""
    llm, _, draft_dir, _ = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDECODE_DATA", str(tmp_path / "no-data"))
    expected = plain(llm, PROMPTS[0])
    with client_for(llm, draft_dir, methods=("layer-skip",)) as client:  # the search runs at start
        assert ask(client, PROMPTS[0], "layer-skip", 2, stream=False)[0] == expected
    assert list((tmp_path / "cache" / "layer_skip").glob("*.json"))  # searched once, cached for the next


def test_a_method_whose_files_are_missing_stops_the_start_saying_so(world, tmp_path, monkeypatch) -> None:
    """Set-up runs at start (--methods): a method that cannot run there is a start-up error naming what is missing,
    never a 500 inside a request."""
    llm, _, draft_dir, _ = world
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specdecode.proposers.layer_skip.DEFAULT_CALIBRATION", tmp_path / "gone.jsonl")
    monkeypatch.setattr("specdecode.server.warmup._ready", {})  # as in a new process: nothing set up yet
    with pytest.raises(ValueError, match="gone.jsonl"):
        client_for(llm, draft_dir, methods=("layer-skip",))
