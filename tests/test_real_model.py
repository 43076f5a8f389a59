"""The default model, for real: conversion, logits vs transformers, greedy equality on Spec-Bench prompts, at
both precisions we offer for it: its own int4 (Q4_1) weights as published, and float32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import specdecode
from specdecode.models import KVCache, load_transformer, resolve
from specdecode.models.loading import REGISTRY, registry_file

from .real_model import require_smollm2, spec_bench_prompts

pytestmark = pytest.mark.real_model
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module", params=["auto", "int4", "float32"])
def llm(request) -> specdecode.LLM:
    """auto: the file's Q4_1 weights with int8 activations (llama.cpp's arithmetic); int4: the same weights with
    float32 activations; float32: dequantized."""
    require_smollm2()
    return specdecode.load(NAME, quantization=None if request.param == "float32" else request.param)


@pytest.fixture(scope="module")
def shallow_draft(llm, tmp_path_factory) -> str:
    """A real draft with the target's tokenizer: the target's first 6 of 30 layers (guesses are often wrong)."""
    src = resolve(NAME)
    out = tmp_path_factory.mktemp("draft")
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 6}
    save_file(keep, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return str(out)


def test_logits_match_transformers(llm):
    """Against transformers on the same weights dequantized: float32 to rounding; the int4 weights, multiplied in
    the native kernels without ever being dequantized in memory, to float32 rounding over 30 layers; with int8
    activations (a model of its own, as llama.cpp's), close: the same top token at 90%+ of positions."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(resolve(NAME)), dtype=torch.float32).eval()
    ids = llm.encode(spec_bench_prompts(1)[0], chat=True)
    cfg = llm.model.config  # the architecture against transformers' float32 in a float32 cache (test_kv_cache.py)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids))
    ours = llm.model.forward(torch.tensor([ids]), cache).logits
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits
    kind = llm.model.weights_kind()
    if "a8" in kind:
        agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        assert agree >= 0.9 and (ours - theirs).abs().max() < 0.15 * theirs.abs().max(), (agree, kind)
        return
    tolerance = 2e-3 if kind.startswith("int4") else 3e-4
    torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=tolerance)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_gguf_conversion_matches_transformers_gguf_loader():
    """Our dequantize + q/k un-permute gives the same weights as transformers' own GGUF reader."""
    require_smollm2()
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    gguf_path = registry_file(NAME)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    ours = load_file(str(resolve(NAME) / "model.safetensors"))
    theirs = reference.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.q_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0, msg=name)


def test_converted_dir_loads_fast_from_cache():
    require_smollm2()
    first = resolve(NAME)
    assert resolve(NAME) == first and (first / "model.safetensors").is_file()
    model = load_transformer(first)
    assert model.config.num_layers == 30 and model.config.tie_word_embeddings


@pytest.fixture(scope="module")
def plain_runs(llm) -> dict[str, specdecode.GenerationOutput]:
    return {prompt: llm.generate(prompt, method="none", chat=True, max_new_tokens=40)
            for prompt in spec_bench_prompts(5)}


@pytest.mark.parametrize("method,options", [
    ("prompt-lookup", {"k": 4}),
    ("prompt-lookup", {"k": 8, "branches": 3}),
    ("draft", {"k": 4}),
])
def test_greedy_speculative_equals_plain_on_spec_bench(llm, plain_runs, shallow_draft, method, options):
    drafted = accepted = 0
    for prompt, plain in plain_runs.items():
        extra = {"draft": shallow_draft} if method == "draft" else {}
        spec = llm.generate(prompt, chat=True, max_new_tokens=40, method=method, **options, **extra)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.text == plain.text
        drafted += spec.stats.drafted
        accepted += spec.stats.accepted
    assert accepted > 0 and accepted < drafted  # guesses were both kept and rejected: the test saw both paths


def test_registry_lists_default_model():
    assert NAME in REGISTRY


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 120},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer", "confidence"], "additionalProperties": False}


def test_structured_output_with_eagle_and_prompt_lookup_equals_structured_plain_decoding():
    """A JSON schema on held-out (Spec-Bench) prompts, the published model: the shipped EAGLE head's trees and
    prompt lookup commit exactly structured plain decoding's tokens, and the finished answers are valid."""
    require_smollm2()
    llm = specdecode.load(NAME)
    finished = drafted = 0
    for prompt in spec_bench_prompts(5):  # 3 of them finish within 80 tokens (the others loop inside a string)
        ask = f"{prompt}\n\nAnswer in JSON with the fields answer and confidence."
        plain = llm.generate(ask, chat=True, method="none", max_new_tokens=80, structured={"json": ANSWER})
        for method, k in (("eagle", 3), ("prompt-lookup", 4)):
            spec = llm.generate(ask, chat=True, method=method, k=k, max_new_tokens=80, structured={"json": ANSWER})
            assert spec.token_ids == plain.token_ids, (method, prompt)
            drafted += spec.stats.drafted
        if plain.finish_reason == "stop":
            value = json.loads(plain.text)
            assert set(value) == {"answer", "confidence"} and 0 <= value["confidence"] <= 100
            finished += 1
    assert finished >= 2 and drafted > 0
