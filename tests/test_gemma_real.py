"""Gemma 3 270M for real (its Q4_K_M GGUF): logits and greedy tokens equal transformers' on the same weights, and
speculation is lossless on it. Short on purpose: one model load each way, a few prompts, tens of tokens."""

from __future__ import annotations

import pytest
import torch

import specdecode
from specdecode.models import KVCache
from specdecode.models.loading import registry_file

from .real_model import require_gemma, spec_bench_prompts

pytestmark = pytest.mark.real_model
NAME = "gemma3-270m"
NEW = 24


@pytest.fixture(scope="module")
def exact() -> specdecode.LLM:
    """The file's weights as stored (Q5_0 / Q8_0 as int8, K-quants dequantized), float32 activations: the model
    transformers builds from the file, multiplied without ever dequantizing the int8 tensors in memory."""
    require_gemma()
    return specdecode.load(NAME, quantization="int8")


@pytest.fixture(scope="module")
def reference(exact):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = registry_file(NAME)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def prompts() -> list[str]:
    return spec_bench_prompts(3)


def test_logits_and_greedy_tokens_equal_transformers(exact, reference) -> None:
    assert exact.model.config.model_type == "gemma3_text" and exact.model.config.tie_word_embeddings
    ids = exact.encode(prompts()[0], chat=True)
    assert ids[:2] == [2, 105]  # <bos><start_of_turn>: the Gemma chat template
    cfg = exact.model.config  # the architecture against transformers' float32 in a float32 cache (test_kv_cache.py)
    ours = exact.model.forward(torch.tensor([ids]), KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                            len(ids))).logits
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3)
    for prompt in prompts():
        ids = exact.encode(prompt, chat=True)
        with torch.inference_mode():
            generated = reference.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, top_k=None,
                                           top_p=None, eos_token_id=sorted(exact.stop_token_ids))
        expected = generated[0, len(ids):].tolist()
        assert exact.generate(ids, max_new_tokens=NEW).token_ids == expected, prompt


@pytest.fixture(scope="module")
def llm() -> specdecode.LLM:
    """The default load: every quantized tensor as stored (K-quants with float32 scales), int8 activations."""
    require_gemma()
    return specdecode.load(NAME)


@pytest.mark.parametrize("method,options", [
    ("prompt-lookup", {"k": 4, "branches": 3}),
    ("layer-skip", {"k": 3, "skip_layers": [4, 8, 12]}),  # a window-free full layer (5) and sliding ones kept
    ("eagle", {"k": 3}),  # the shipped head (int8 beside the int8-activation target), drafting every step
])
def test_greedy_speculative_equals_plain(llm, method, options) -> None:
    assert llm.model.weights_kind().startswith("int8-a8")
    drafted = accepted = 0
    for prompt in prompts():
        plain = llm.generate(prompt, chat=True, max_new_tokens=NEW)
        spec = llm.generate(prompt, chat=True, max_new_tokens=NEW, method=method, **options)
        assert spec.token_ids == plain.token_ids, prompt
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert 0 < accepted < drafted
