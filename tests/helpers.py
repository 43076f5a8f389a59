"""Tiny random models for fast, offline tests.

Weights are scaled so next-token distributions are peaked (greedy decoding is non-trivial and free
of near-ties in float64) and greedy text has some repeats (prompt lookup gets guesses right), and a
"related" draft (the target plus a little noise) agrees with the target often but not always, so both
the accept and the reject paths get exercised.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import DraftTree
from specdecode.models import ModelConfig, Transformer
from specdecode.policy.cost import CostModel
from specdecode.policy.speculation import Guessing
from specdecode.proposers.base import ProposalContext, Proposer, StepOutput

# where the lossless and distribution suites run their tiny models: the CPU, or a GPU when one is lent
# (SPECDECODE_TEST_DEVICE=cuda); every other test stays on the CPU (native kernels, threads, timings)
TEST_DEVICE = torch.device(os.environ.get("SPECDECODE_TEST_DEVICE", "cpu"))


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=56, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    base.update(overrides)
    return ModelConfig(**base)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, gain: float = 1.25, head_gain: float = 6.0) -> None:
    """Overwrite every parameter in place with seeded random values.

    Embeddings ~ N(0, 1); block matrices ~ N(0, gain^2 / fan_in) (gain 1.25: the residual stream mixes the
    current token with its context, so greedy text is varied but has some repeats, which prompt lookup
    can guess); the output head ~ N(0, head_gain^2 / hidden) (peaked distributions, top-1 mass ~0.8);
    norm weights ~ 1 + N(0, 0.1^2); biases ~ N(0, 0.2^2).
    Works for our Transformer and for transformers' models alike (parameters are recognised by name).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        z = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        if "norm" in name:
            value = 1 + 0.1 * z
        elif name.endswith("bias"):
            value = 0.2 * z
        elif "embed" in name:
            value = z
        elif "lm_head" in name:
            value = z * head_gain / param.shape[1] ** 0.5
        else:
            value = z * gain / param.shape[1] ** 0.5
        param.copy_(value.to(param.dtype))


def tiny_model(seed: int, dtype: torch.dtype = torch.float64, *, gain: float = 1.25, head_gain: float = 6.0,
               **overrides) -> Transformer:
    """A random tiny Transformer (see randomize_); `overrides` go to tiny_config."""
    model = Transformer(tiny_config(**overrides))
    randomize_(model, seed, gain, head_gain)
    return model.to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def noisy_copy(model: Transformer, seed: int, noise: float = 0.05) -> Transformer:
    """The model with N(0, noise * std(w)) added to every weight: a draft that mostly agrees with it."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for param in draft.parameters():
        scale = noise * float(param.std()) if param.numel() > 1 else noise
        param.add_(scale * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param))
    draft._rope_cache = None
    return draft


@torch.no_grad()
def resize_vocab(model: Transformer, vocab_size: int, seed: int = 0) -> Transformer:
    """Copy of `model` with its embedding/lm_head truncated or padded (padding rows random) to `vocab_size`.

    The shared rows keep their values, so on the shared vocabulary the draft behaves like the original.
    """
    cfg = dataclasses.replace(model.config, vocab_size=vocab_size)
    out = Transformer(cfg).to(model.dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    for key in ("embed.weight", "lm_head.weight"):
        old = state[key]
        new = float(old.std()) * torch.randn(vocab_size, old.shape[1], generator=gen, dtype=torch.float64)
        new = new.to(old.dtype)
        n = min(vocab_size, old.shape[0])
        new[:n] = old[:n]
        state[key] = new
    out.load_state_dict(state)
    return out.eval().requires_grad_(False)


def prefix_layers(model: Transformer, num_layers: int) -> Transformer:
    """The model's first `num_layers` blocks with its own embedding, final norm and head (a shallow draft)."""
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    out = Transformer(cfg).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < num_layers}
    out.load_state_dict(state)
    return out.eval().requires_grad_(False)


# ------------------------------------------------------------------------------ HF checkpoints


def hf_config(model_type: str = "llama", **overrides):
    """A tiny transformers config of the given family (llama, qwen2, mistral)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    base = dict(
        vocab_size=60, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if model_type == "mistral":
        base["sliding_window"] = None  # our runtime has full attention; a window only matters past its length
    base.update(overrides)
    return cls(**base)


def save_hf_checkpoint(path: Path, model_type: str = "llama", seed: int = 0, **overrides):
    """Write a random tiny checkpoint with transformers' save_pretrained (safetensors); return the HF model."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)  # every parameter, so transformers' own (unseeded) init does not matter
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # randomize_ kept the tie
    model.save_pretrained(str(path))  # safetensors is transformers' default format
    return model.eval()


# ------------------------------------------------------------- a tiny checkpoint with a real tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding guesses tokens and the target model verifies them in one pass",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today? 12345 67890",
]


def make_tokenizer(extra_token: str | None = None, eos: str = "<|im_end|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token=eos,
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    if extra_token:
        fast.add_tokens([extra_token])
    return fast


def write_checkpoint(path: Path, tokenizer, seed: int = 0, layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)  # peaked distributions: greedy text repeats itself, so guesses get accepted
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def own_cache_dir() -> Callable:
    """An autouse fixture for a test module: $SPECDECODE_CACHE points at a folder of its own while the module runs
    (the adaptive policy's cost table and the layer-skip search are cached per model: keep modules apart)."""

    @pytest.fixture(scope="module", autouse=True)
    def _own_cache_dir(tmp_path_factory) -> Iterator[None]:
        old = os.environ.get("SPECDECODE_CACHE")
        os.environ["SPECDECODE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
        yield
        if old is None:
            del os.environ["SPECDECODE_CACHE"]
        else:
            os.environ["SPECDECODE_CACHE"] = old

    return _own_cache_dir


class Oracle(Proposer):
    """Knows the answer: guesses the target's own next tokens (right=True) or always a different token (right=False);
    free to ask, as a lookup."""

    guessing = Guessing(cheap=True)

    def __init__(self, full: list[int], right: bool, vocab: int) -> None:
        self.full, self.right, self.vocab = full, right, vocab

    def propose(self, context: ProposalContext) -> DraftTree:
        tokens, k = context.tokens, context.k
        truth = self.full[len(tokens) : len(tokens) + k]
        return DraftTree.chain(tokens[-1], truth if self.right else [(t + 1) % self.vocab for t in truth])


class FrozenCost(CostModel):
    """A made-up cost table that learns nothing from the steps the engine times: the tiny models' real timings
    would otherwise reshape it online, and tests of what a table implies would depend on this machine's speed."""

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        pass


def guessing_pays() -> FrozenCost:
    """A made-up cost (a forward takes a second, 64 tokens 1.5 s) next to which the tiny drafts' real milliseconds
    are free: k="auto" always guesses, so a test never depends on this machine's timings."""
    return FrozenCost([1, 64], [0, 1000], [[1.0, 1.5], [1.0, 1.5]])


def end_request(proposer: Proposer, tokens: list[int]) -> None:
    """A request driven by hand ends: its last step committed `tokens` (everything, prompt first)."""
    proposer.observe(None, None, StepOutput(tokens, len(tokens) - 1))
    proposer.finish()


def ask(tokens: list[int], k: int, params: SamplingParams | None = None,
        generator: torch.Generator | None = None) -> ProposalContext:
    """A proposal's question asked by hand (greedy unless `params` says otherwise)."""
    return ProposalContext(tokens, k, params or SamplingParams(), generator)


def assert_tree_matches_steps(model: Transformer, cache, prefix: list[int], tree: DraftTree) -> None:
    """Lossless verification rests on it: after the prefix (its last token the tree's root), each node of the tree,
    verified in one forward, gets the logits that one-token forwards along its path get, bit for bit."""
    model.forward(torch.tensor([prefix[:-1]]), cache, logits_at=None)
    start = cache.length
    tree_logits = model.forward(torch.tensor([tree.tokens]), cache, positions=start + tree.depths(),
                                tree_mask=tree.attention_mask()).logits[0]
    for node, path in enumerate(tree.node_paths()):
        cache.rollback(start)
        for token in [prefix[-1], *path]:  # one token per forward, as plain decoding runs
            step = model.forward(torch.tensor([[token]]), cache).logits[0, -1]
        assert torch.equal(step, tree_logits[node]), f"node {node}"
