"""Llama 3.x, Qwen2/2.5, Qwen3, Mistral and Phi-3: each architecture's logits equal transformers' (float32) on a tiny
random checkpoint that transformers itself writes, and the same weights written as llama.cpp's converter writes them
(specdecode.models.gguf_write) in F32, F16 and Q8_0 give the same logits through the GGUF path; Llama 3's GGUF
tokenizer and chat template come through; greedy speculation on a new architecture equals plain decoding."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.models import load_transformer
from specdecode.models.config import ModelConfig
from specdecode.models.gguf_file import config as gguf_config
from specdecode.models.gguf_file import llama3_factors, llama3_scaling
from specdecode.models.gguf_write import round_trip, write_gguf
from specdecode.models.loading import load_model

from .helpers import randomize_

VOCAB = 300  # a byte-level BPE (256 bytes, merges, Llama 3's special tokens): gguf_write.byte_level_vocab
LENGTH = 40
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# Llama 3 scaling of other parameters: wavelength thresholds 16 and 64 scale most of a tiny head's frequencies within
# the test's 40 positions (Llama 3.1's own thresholds, 2048 and 8192, move logits there by ~1e-2 only)
LLAMA3_SHORT = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16384)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**BASE, "head_dim": 16, **kw}))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**BASE, **kw}))


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32 with 4 heads: the attention is 128 wide on a 64-wide model, as Qwen3's heads are (128 x 16 on 1024)
    return Qwen3ForCausalLM(Qwen3Config(**{**BASE, "head_dim": 32, "tie_word_embeddings": True, **kw}))


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**{**BASE, "head_dim": 16, "sliding_window": 12, **kw}))


def _phi3(**kw):
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**{**BASE, "sliding_window": 12, "pad_token_id": 0, "bos_token_id": 1,
                                         "eos_token_id": 2, **kw}))


ARCHITECTURES: dict[str, Callable] = {
    "llama3.1": lambda: _llama(rope_theta=500_000.0, rope_scaling=LLAMA3),
    "llama3-tied": lambda: _llama(rope_theta=10_000.0, rope_scaling=LLAMA3_SHORT, tie_word_embeddings=True),
    "qwen2": lambda: _qwen2(rope_theta=1_000_000.0),
    "qwen3": lambda: _qwen3(rope_theta=1_000_000.0),
    "mistral": lambda: _mistral(),
    "phi3": lambda: _phi3(),
}


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """Converted GGUF tokenizers and configs go to a folder of the module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def sequences(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(seed))


def transformers_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Each row's logits from a fresh cache, keys and values kept in float32 (the float16 default rounds them: not
    the float32 model transformers runs)."""
    model.kv_cache_dtype = "float32"
    return torch.cat([model.forward(row[None], model.new_cache(ids.shape[1])).logits for row in ids])


def close(ours: torch.Tensor, theirs: torch.Tensor, tolerance: float = 1e-4) -> None:
    """Float32 agreement: two orders of summation, relative to the logits' scale."""
    assert theirs.abs().max() > 3  # peaked logits: a real comparison
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance * float(theirs.abs().max()))


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """(architecture, directory, transformers' float32 model) of a random tiny checkpoint transformers wrote."""
    torch.manual_seed(0)
    model = ARCHITECTURES[request.param]()
    with torch.no_grad():
        randomize_(model, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path))
    return request.param, path, model.float().eval()


def test_hf_checkpoint_logits_equal_transformers(checkpoint) -> None:
    arch, path, reference = checkpoint
    ours = load_transformer(path)
    ids = sequences()
    close(our_logits(ours, ids), transformers_logits(reference, ids))
    cfg = ours.config
    assert cfg.qk_norm == (arch == "qwen3") and cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == (arch in ("qwen3", "llama3-tied"))
    assert cfg.sliding_window == (12 if arch in ("mistral", "phi3") else None)


FEATURES = [("llama3.1", "rope_scaling"), ("llama3-tied", "rope_scaling"), ("mistral", "sliding_window"),
            ("phi3", "sliding_window"), ("qwen3", "qk_norm")]


@pytest.mark.parametrize("checkpoint,change", FEATURES, indirect=["checkpoint"], ids=[f"{a}-{c}" for a, c in FEATURES])
def test_each_feature_moves_the_logits(checkpoint, change: str) -> None:
    """Teeth: the comparisons above would fail without the feature (no scaling, no window, no q/k norm): the logits
    move by ten times their tolerance or more."""
    _, path, reference = checkpoint
    ours = load_transformer(path)
    if change == "qk_norm":
        for block in ours.layers:
            block.attn.q_norm = block.attn.k_norm = None
    else:
        setattr(ours.config, change, None)
        ours._rope_cache = None
        for block in ours.layers:
            block.sliding = ours.config.sliding(0)
    ids = sequences()
    changed, theirs = our_logits(ours, ids), transformers_logits(reference, ids)
    assert (changed - theirs).abs().max() > 1e-3 * theirs.abs().max()


def gguf_reference(reference, kind: str):
    """transformers' model on the weights a `kind` file holds, read back by the gguf package."""
    import copy

    model = copy.deepcopy(reference)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(round_trip(p, kind))
    return model


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0"])
def test_gguf_file_logits_equal_transformers(checkpoint, kind: str, tmp_path: Path) -> None:
    """The converter's layout (llama's q/k rows permuted, rope_freqs, Phi-3's fused tensors) read back: the dequantized
    weights give transformers' logits on the same dequantized weights (Mistral's file is llama's, with no window: as
    llama.cpp runs it); Q8_0 as stored (int8 activations, llama.cpp's arithmetic) agrees to its rounding."""
    arch, path, reference = checkpoint
    config = json.loads((path / "config.json").read_text())
    file = write_gguf(tmp_path / f"{arch}-{kind}.gguf", config, reference.state_dict(), kind)
    if arch == "mistral":
        unwindowed = _mistral(sliding_window=None)
        unwindowed.load_state_dict(reference.state_dict())
        reference = unwindowed.float().eval()
    expected = transformers_logits(gguf_reference(reference, kind), sequences())
    dequantized, _ = load_model(file, quantization=None)
    close(our_logits(dequantized, sequences()), expected)
    as_stored, _ = load_model(file)
    got = our_logits(as_stored, sequences())
    if kind == "Q8_0":
        assert as_stored.layers[0].attn.wqkv.quantization.startswith("int8")
        close(got, expected, tolerance=3e-2)  # int8 activations
        agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
        assert agree > 0.9, agree
    else:
        close(got, expected)
    cfg = as_stored.config
    assert cfg.tie_word_embeddings == (arch in ("qwen3", "llama3-tied")) and cfg.qk_norm == (arch == "qwen3")


def test_k_quant_mix_file_loads_at_its_types(tmp_path: Path) -> None:
    """A Q4_K_M-like mix (Q4_K matrices, Q6_K v and down projections and output, K-quants written by
    models/kquantize.py) of a Qwen3 whose rows hold 256-weight super-blocks: the dequantized file gives transformers'
    logits on the same dequantized weights; as stored (the K-quant kernels, int8 activations) the same greedy
    tokens nearly everywhere."""
    from specdecode.models.gguf_file import tensors

    model = _qwen3(hidden_size=256, intermediate_size=256, head_dim=64, tie_word_embeddings=False)
    with torch.no_grad():
        randomize_(model, seed=4)

    def mix(name: str) -> str:
        return "Q6_K" if name == "output.weight" or ".attn_v." in name or ".ffn_down." in name else "Q4_K"

    file = write_gguf(tmp_path / "qwen3-q4_k_m.gguf", model.config.to_dict(), model.state_dict(), mix)
    stored = {t.tensor_type.name for _, t, _, _ in tensors(file)}
    assert stored == {"Q4_K", "Q6_K", "F32"}
    six = ("v_proj", "down_proj", "lm_head")
    reference = copy_with(model, {name: round_trip(p, "Q6_K" if any(part in name for part in six) else "Q4_K")
                                  for name, p in model.named_parameters() if p.dim() == 2})
    expected = transformers_logits(reference, sequences())
    dequantized, _ = load_model(file, quantization=None)
    close(our_logits(dequantized, sequences()), expected)
    as_stored, _ = load_model(file)
    agree = (our_logits(as_stored, sequences()).argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree > 0.9, agree  # int8 activations


def copy_with(model, weights: dict[str, torch.Tensor]):
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name in weights:
                p.copy_(weights[name])
    return out


def test_rope_freqs_read_back_as_the_scaling_they_were_made_from() -> None:
    """Llama 3.1's own parameters, and others solved from the blended frequencies: the rebuilt factors are the file's;
    factors no Llama 3 scaling makes are refused."""
    for scaling, theta, head_dim in [(LLAMA3, 500_000.0, 128), (LLAMA3_SHORT, 10_000.0, 16),
                                     ({**LLAMA3, "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
                                       "original_max_position_embeddings": 1024}, 10_000.0, 64)]:
        factors = llama3_factors(scaling, theta, head_dim)
        read = llama3_scaling(factors.astype(np.float64), theta, head_dim,
                              scaling["original_max_position_embeddings"])
        np.testing.assert_allclose(llama3_factors(read, theta, head_dim), factors, rtol=1e-5)
        assert read["factor"] == scaling["factor"]
        ours = torch.tensor(factors, dtype=torch.float64)
        from specdecode.models.llama import rope_inv_freq

        cfg = ModelConfig(VOCAB, 64, 96, 1, 4, 4, head_dim, rope_theta=theta, rope_scaling=read)
        plain = ModelConfig(VOCAB, 64, 96, 1, 4, 4, head_dim, rope_theta=theta)
        torch.testing.assert_close(rope_inv_freq(cfg), rope_inv_freq(plain) / ours, rtol=1e-5, atol=0)
    bent = llama3_factors(LLAMA3_SHORT, 10_000.0, 16).astype(np.float64)
    bent[2] *= 1.5
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling(bent, 10_000.0, 16, 64)


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text model's config inside (transformers'
    defaults filled in), its weights under language_model.*, beside a vision tower left out; the linear RoPE scaling
    of the 4B's global layers. Logits equal the multimodal model's on text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from .test_gemma import LAYER_TYPES

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=6, layer_types=LAYER_TYPES,
                query_pre_attn_scalar=16, rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    with torch.no_grad():
        randomize_(model, seed=3)
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.sub_(1.0)  # Gemma's norms scale by 1 + w
            if "embed_tokens" in name:
                p.mul_(0.125)  # embeddings times sqrt(64): the residual stream stays O(1)
    model.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma3"
    ours = load_transformer(tmp_path)
    cfg = ours.config
    assert cfg.layer_types == LAYER_TYPES and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.tie_word_embeddings and cfg.query_scale == 16**-0.5
    ids = sequences()
    close(our_logits(ours, ids), transformers_logits(model.eval(), ids))


def test_rope_table_grows_as_positions_come_bit_for_bit() -> None:
    """A 128k-context model's RoPE table starts at 8192 positions (not 134 MB at head dim 128) and doubles as needed;
    a position's cos / sin are the same whatever the table's size (what a model decoding past 8192 relies on)."""
    from specdecode.models.llama import ROPE_TABLE_START, rope_table

    cfg = ModelConfig(VOCAB, 64, 96, 1, 4, 4, 16, max_position_embeddings=131072, rope_theta=500_000.0,
                      rope_scaling=LLAMA3)
    cpu = torch.device("cpu")
    first = rope_table(cfg, 10, cpu, torch.float32)
    assert first[0].shape[0] == ROPE_TABLE_START
    assert rope_table(cfg, 100, cpu, torch.float32, table=first) is first
    grown = rope_table(cfg, ROPE_TABLE_START + 1, cpu, torch.float32, table=first)
    assert grown[0].shape[0] == 2 * ROPE_TABLE_START
    whole = rope_table(cfg, 131072, cpu, torch.float32)
    for part, full in zip(grown, whole, strict=True):
        assert torch.equal(part, full[: part.shape[0]])


# ------------------------------------------------------------------------------------- tokenizer and chat
def test_llama3_gguf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """A Llama 3 GGUF's byte-level BPE (tokenizer.ggml.pre = llama-bpe) becomes a tokenizer through transformers'
    conversion: the merges apply, special tokens are one token each, text round-trips, the chat template is the
    file's."""
    from transformers import AutoTokenizer

    from specdecode.models.gguf_write import LLAMA3_CHAT_TEMPLATE, byte_level_vocab
    from specdecode.models.loading import convert_gguf

    model = _llama(rope_theta=500_000.0, rope_scaling=LLAMA3)
    file = write_gguf(tmp_path / "llama3.gguf", model.config.to_dict(), model.state_dict(), "F16")
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(file, weights=False)))
    vocab = byte_level_vocab(VOCAB)
    assert tokenizer.chat_template == LLAMA3_CHAT_TEMPLATE
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|eot_id|>"
    # transformers' conversion adds GPT-2's <|endoftext|> past the vocabulary (Llama 3's has none): dropped
    assert len(tokenizer) == VOCAB and max(tokenizer.encode("a <|endoftext|>", add_special_tokens=False)) < VOCAB
    for text in ["the quick brown fox", "Hello, World! 12345 ...\n\n  tabs\tand ünïcödé ✓", " the token"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert max(ids) < VOCAB
    # the merges apply in their order: Ġ t, Ġt h, Ġth e make " the" one token; "the" starting the text has no merge
    assert vocab.merges[:2] == ["Ġ t", "Ġt h"] and "Ġth e" in vocab.merges
    assert tokenizer.encode(" the", add_special_tokens=False) == [vocab.tokens.index("Ġthe")]
    assert tokenizer.encode("the", add_special_tokens=False) == [vocab.tokens.index(c) for c in "the"]
    assert len(tokenizer.encode(" the quick brown fox", add_special_tokens=False)) < len(" the quick brown fox")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer.encode(chat, add_special_tokens=False)
    assert ids[0] == vocab.bos_token_id and ids.count(vocab.tokens.index("<|eot_id|>")) == 1


def test_qwen_gguf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """Qwen's byte-level BPE (pre qwen2) and ChatML template from a Qwen3 file: no BOS added, <|im_start|> and
    <|im_end|> one token each, the file's template."""
    from transformers import AutoTokenizer

    from specdecode.models.gguf_write import CHATML_TEMPLATE, QWEN_SPECIALS, byte_level_vocab
    from specdecode.models.loading import convert_gguf

    model = _qwen3()
    vocab = byte_level_vocab(VOCAB, QWEN_SPECIALS, "qwen2", CHATML_TEMPLATE, add_bos_token=False)
    file = write_gguf(tmp_path / "qwen3.gguf", model.config.to_dict(), model.state_dict(), "Q8_0", vocab)
    tokenizer = AutoTokenizer.from_pretrained(str(convert_gguf(file, weights=False)))
    assert tokenizer.chat_template == CHATML_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == VOCAB
    text = "Hello, World! 12345 the 2nd line\n"
    ids = tokenizer.encode(text)  # with the tokenizer's own special tokens: none added
    assert tokenizer.decode(ids) == text and max(ids) < VOCAB
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(chat, add_special_tokens=False)
    assert ids[0] == vocab.tokens.index("<|im_start|>") and ids.count(vocab.tokens.index("<|im_end|>")) == 1


# --------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("config,message", [
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
     "'longrope' is not supported"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"model_type": "falcon"}, "'falcon' is not supported"),
    ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "'yarn' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(config: dict, message: str) -> None:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**base, **config})


def test_phi3_gguf_with_long_rope_factors_is_refused(tmp_path: Path) -> None:
    import gguf

    model = _phi3()
    file = write_gguf(tmp_path / "phi3.gguf", model.config.to_dict(), model.state_dict())
    reader = gguf.GGUFReader(str(file))
    writer = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "phi3")
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="longrope"):
        gguf_config(tmp_path / "long.gguf")


# --------------------------------------------------------------------------------- lossless speculation
def smaller(model):
    """A draft of the same vocabulary and a third of the depth: the target's embedding, first layer and output."""
    import copy
    import dataclasses

    draft = copy.deepcopy(model)
    draft.layers = torch.nn.ModuleList(list(draft.layers)[:1])
    draft.config = dataclasses.replace(draft.config, num_layers=1)
    draft._rope_cache = None
    return draft


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "llama3-tied"])
def test_greedy_speculation_equals_plain_decoding(arch: str, tmp_path: Path) -> None:
    """Prompt lookup and a smaller draft model on the new architectures (Phi-3 decoding past its window), float64
    from the HF checkpoint, and Qwen3 from its Q8_0 file as stored (the native int8 path): every token equal."""
    from specdecode.engine.loop import generate_ids
    from specdecode.proposers import DraftModelProposer, PromptLookupProposer

    from .test_lossless import PROMPTS

    torch.manual_seed(0)
    model = ARCHITECTURES[arch]() if arch != "qwen3" else _qwen3(rope_theta=1_000_000.0, num_hidden_layers=3)
    with torch.no_grad():
        randomize_(model, seed=2)
    model.save_pretrained(str(tmp_path))
    targets = [load_transformer(tmp_path, dtype=torch.float64)]
    if arch == "qwen3":
        file = write_gguf(tmp_path / "q8.gguf", model.config.to_dict(), model.state_dict(), "Q8_0")
        targets.append(load_model(file)[0])
    for target in targets:
        proposers = {"prompt-lookup": PromptLookupProposer(branches=3),
                     "draft": DraftModelProposer(smaller(target), VOCAB)}
        for method, proposer in proposers.items():
            drafted = accepted = 0
            for prompt in PROMPTS:
                expected, _ = generate_ids(target, prompt, max_new_tokens=24)
                out, stats = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=24)
                assert out == expected, (arch, target.quantization, method, prompt)
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
            assert 0 < accepted < drafted, (arch, method, accepted, drafted)  # guesses taken and refused
