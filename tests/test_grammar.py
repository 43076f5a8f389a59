"""Structured output (grammar.py): the output follows a JSON schema, a regex or a choice, and speculation under a
grammar commits exactly what structured plain decoding commits (greedy: token for token, every method)."""

from __future__ import annotations

import json
import re

import pytest

import specdecode
from specdecode.core.grammar import StructuredOutput

from .helpers import make_tokenizer, write_checkpoint

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPTS = ["the quick brown fox jumps over the lazy dog", "def add(a, b): return a + b", "Hello! Hello! Hello!"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> specdecode.LLM:
    """A tiny random model with a real BPE tokenizer: left alone it writes noise, so every structure is the
    grammar's doing."""
    return specdecode.load(write_checkpoint(tmp_path_factory.mktemp("grammar") / "ckpt", make_tokenizer()),
                           dtype="float64")


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150 and isinstance(value["ok"], bool)


@pytest.mark.parametrize("method,options", [("prompt-lookup", {"k": 4}), ("prompt-lookup", {"k": 3, "branches": 3}),
                                            ("lookahead", {"k": 3})])
def test_greedy_structured_speculation_equals_structured_plain_decoding(llm, method, options) -> None:
    specs = [{"json": SCHEMA}, {"json": True}, {"regex": r"(ab|cd)[0-9]{2,6}x"}, {"choice": ["yes", "no", "maybe"]}]
    accepted = 0
    for prompt in PROMPTS:
        for spec in specs:
            plain = llm.generate(prompt, method="none", max_new_tokens=80, structured=spec)
            spec_out = llm.generate(prompt, method=method, max_new_tokens=80, structured=spec, **options)
            assert spec_out.token_ids == plain.token_ids, (prompt, spec)
            accepted += spec_out.stats.accepted
            if plain.finish_reason == "stop":  # complete: it matches
                if "regex" in spec:
                    assert re.fullmatch(spec["regex"], plain.text)
                elif "choice" in spec:
                    assert plain.text in spec["choice"]
                elif spec["json"] is True:
                    assert isinstance(json.loads(plain.text), dict)
                else:
                    check_schema(plain.text)
    assert accepted > 0  # guesses were accepted under the grammar


def test_sampled_structured_outputs_are_valid(llm) -> None:
    finished = 0
    for seed in range(12):
        out = llm.generate(PROMPTS[seed % 3], method="prompt-lookup", k=3, max_new_tokens=120, temperature=1.0,
                           seed=seed, structured={"json": SCHEMA})
        if out.finish_reason == "stop":
            check_schema(out.text)
            finished += 1
        else:  # cut by max_new_tokens: still a valid beginning of such an object
            assert out.text.startswith("{")
    assert finished >= 6


def test_bad_structured_specs_say_what_is_wrong(llm) -> None:
    with pytest.raises(ValueError, match="exactly one of json, regex, choice"):
        llm.generate("hi", structured={"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="exactly one of json, regex, choice"):
        llm.generate("hi", structured={"grammar": "start: 'a'"})
    with pytest.raises(ValueError, match="structured output: .*bogus"):
        llm.generate("hi", structured={"json": {"type": "bogus"}})
    with pytest.raises(ValueError, match="non-empty strings"):
        llm.generate("hi", structured={"choice": []})
    assert StructuredOutput.of({"choice": ["a", "b"]}).choice == ("a", "b")


def test_mask_forbids_exactly_the_tokens_whose_bits_are_clear(llm) -> None:
    """Bit t % 32 of word t // 32 allows token t (llguidance's layout, read bit by bit here); logits past the
    model's vocabulary are forbidden."""
    import torch

    constraint = llm.grammar().constraint({"choice": ["yes", "no"]})
    vocab = llm.model.config.vocab_size
    masked = constraint.mask(torch.zeros(vocab + 40))
    words = constraint.bitmask[0].tolist()
    allowed = {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}
    assert 0 < len(allowed) < vocab
    assert {t for t in range(vocab + 40) if masked[t] == 0} == allowed
