"""A GGUF draft model for a GGUF target (`method="draft", draft="small.gguf"`): both on their native int paths (the
draft keeps its own quantized blocks and its own KV cache), greedy output equal to plain decoding through the library
and the CLI, and a draft whose vocabulary differs refused with a message that says so. Tiny synthetic files written by
specdecode.models.gguf_write: a Q8_0 target and a Q4_0 draft of one layer (the target's first), so guesses are taken
and refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specdecode
from specdecode.cli import main as cli_main
from specdecode.models.gguf_write import CHATML_TEMPLATE, QWEN_SPECIALS, byte_level_vocab, write_gguf

from .helpers import guessing_pays, own_cache_dir, randomize_

VOCAB = 300
PROMPTS = ["the quick brown fox", "speculative decoding drafts tokens", "one forward pass; the output"]

_cache = own_cache_dir()


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=512, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """target.gguf (3 layers, Q8_0), draft.gguf (its first layer, Q4_0) and other.gguf (the draft's weights with a
    vocabulary of Qwen's special tokens: same size, other tokens)."""
    folder = tmp_path_factory.mktemp("gguf-drafts")
    target = _llama(3)
    with torch.no_grad():
        randomize_(target, seed=3)
    state = target.state_dict()
    draft = _llama(1)
    draft.load_state_dict({k: v for k, v in state.items() if not k.startswith("model.layers.")
                           or int(k.split(".")[2]) < 1})
    other = byte_level_vocab(VOCAB, QWEN_SPECIALS, pre="qwen2", chat_template=CHATML_TEMPLATE, add_bos_token=False)
    return {"target": write_gguf(folder / "target.gguf", target.config.to_dict(), state, "Q8_0"),
            "draft": write_gguf(folder / "draft.gguf", draft.config.to_dict(), draft.state_dict(), "Q4_0"),
            "other": write_gguf(folder / "other.gguf", draft.config.to_dict(), draft.state_dict(), "Q4_0", other)}


@pytest.fixture(scope="module")
def llm(files) -> specdecode.LLM:
    return specdecode.LLM.load(files["target"])


@pytest.mark.parametrize("k,options", [(3, {}), ("auto", {}), (3, {"async_draft": True}), (3, {"cascade":
                                                                                                "prompt-lookup"})])
def test_a_gguf_draft_decodes_as_plain_decoding(llm, files, k, options) -> None:
    """Every token equal to plain decoding; the draft loaded at its own file's types (int4 blocks, int8 activations)
    beside the int8 target, each with a KV cache of its own; guesses both taken and refused."""
    if k == "auto":
        llm.assets._cost = guessing_pays()  # k='auto' guesses whatever this machine's timings (lossless either way)
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = llm.generate(prompt, max_new_tokens=24, method="none")
        out = llm.generate(prompt, max_new_tokens=24, method="draft", draft=files["draft"], k=k, **options)
        assert out.token_ids == plain.token_ids, (k, options, prompt)
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert 0 < accepted < drafted, (accepted, drafted)
    draft = llm.assets.draft_model(files["draft"]).model
    assert (llm.model.quantization, draft.quantization) == ("int8-a8", "int4-a8")
    assert draft.config.num_layers == 1 and draft is not llm.model


def test_the_cli_takes_a_gguf_draft(files, capsys) -> None:
    """`specdecode generate --model target.gguf --method draft --draft draft.gguf` prints plain decoding's text."""
    common = ["generate", PROMPTS[0], "--model", str(files["target"]), "--max-new-tokens", "16", "--k", "3"]
    assert cli_main([*common, "--method", "none"]) == 0
    plain = capsys.readouterr().out
    assert cli_main([*common, "--method", "draft", "--draft", str(files["draft"])]) == 0
    assert capsys.readouterr().out == plain and plain.strip()


def test_a_gguf_draft_with_another_vocabulary_is_refused(llm, files) -> None:
    """Same size, other tokens (Qwen's specials where Llama 3's were): refused by name, never drafted with."""
    with pytest.raises(ValueError, match=r"tokenizer does not match the target's: vocabularies differ \(300 vs 300 "
                                         r"tokens; e\.g\. .*Use a draft trained with the target's tokenizer"):
        llm.generate(PROMPTS[0], max_new_tokens=4, method="draft", draft=files["other"])


def test_any_thread_count_gives_the_same_tokens(llm, files, monkeypatch) -> None:
    """The kernels and the step split work over any thread count (users' machines have 4-32 cores): plain decoding
    and GGUF-draft speculation give the same tokens on 1, 2 and 4 threads (the rows' sums are their outputs' own)."""
    monkeypatch.setenv("SPECDECODE_ADAPTIVE_THREADS", "0")  # the count set here is the count used
    before = torch.get_num_threads()
    outputs = set()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            for method in ("none", "draft"):
                out = llm.generate(PROMPTS[1], max_new_tokens=12, method=method, draft=files["draft"], k=3)
                outputs.add(tuple(out.token_ids))
    finally:
        torch.set_num_threads(before)
    assert len(outputs) == 1
