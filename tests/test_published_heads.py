"""Published draft heads (models/published_heads.py): checkpoints written here in each published layout -- the key
names and config fields of EAGLE-3 (SafeAILab/EAGLE cnets.py, SpecForge), EAGLE-1/2 (cnets1.py) and Medusa
(FasterDecoding/Medusa) -- load, compute what the published forward computes (a reference written from those
formulas, over the whole sequence without a cache), draft losslessly, round-trip, and are refused with a message
when they do not fit the target or when a pickle holds more than tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdecode.cli.commands import main as cli_main
from specdecode.engine.assets import SHIPPED_EAGLE, Assets
from specdecode.engine.loop import generate_ids
from specdecode.models import Transformer
from specdecode.models.eagle import EagleConfig, EagleHead
from specdecode.models.medusa import MedusaHeads
from specdecode.models.published_heads import (
    Eagle1Head,
    Eagle3Head,
    Mismatch,
    export_head,
    load_eagle_head,
    load_medusa_heads,
    save_eagle3,
    save_medusa,
)
from specdecode.models.published_io import EAGLE1, EAGLE3, MEDUSA, OURS_EAGLE, OURS_MEDUSA, detect_layout
from specdecode.proposers import EagleProposer, MedusaProposer

from .helpers import make_tokenizer, own_cache_dir, tiny_model, write_checkpoint
from .test_lossless import PROMPTS, VOCAB

H, INTER, HEADS, KV, DIM, LAYERS, NEW = 64, 128, 4, 2, 16, 8, 24
_own_cache_dir = own_cache_dir()  # the cost table that draft= through the library calibrates, this module's own
CASES = PROMPTS[1:8]  # one-token, random and repeating prompts


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0, vocab_size=VOCAB, num_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(target: Transformer) -> list[list[int]]:
    return [generate_ids(target, p, max_new_tokens=NEW)[0] for p in CASES]


def rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[-1] ** 0.5


def gains(gen: torch.Generator, n: int = H) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


def llama_config(vocab: int, hidden: int = H, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": DIM,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
            "vocab_size": vocab, "tie_word_embeddings": False, "hidden_act": "silu", **extra}


def attention_weights(gen, prefix: str, width: int, hidden: int = H) -> dict[str, torch.Tensor]:
    return {prefix + "self_attn.q_proj.weight": rand(gen, HEADS * DIM, width),
            prefix + "self_attn.k_proj.weight": rand(gen, KV * DIM, width),
            prefix + "self_attn.v_proj.weight": rand(gen, KV * DIM, width),
            prefix + "self_attn.o_proj.weight": rand(gen, hidden, HEADS * DIM),
            prefix + "post_attention_layernorm.weight": gains(gen, hidden),
            prefix + "mlp.gate_proj.weight": rand(gen, INTER, hidden),
            prefix + "mlp.up_proj.weight": rand(gen, INTER, hidden),
            prefix + "mlp.down_proj.weight": rand(gen, hidden, INTER)}


def write(path: Path, state: dict[str, torch.Tensor], config: dict, pickle: bool = False) -> Path:
    """float32 weights (a published head's bf16/fp16 values are float32 values too) and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in state.items()}
    if pickle:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_eagle3(path: Path, target: Transformer, seed: int = 1, *, draft_vocab: int = 40, hidden: int = H,
                 vocab: int = VOCAB, fc_norm: bool = False, layer_ids: list[int] | None = None,
                 top_level_ids: list[int] | None = None, d2t_shift: int = 0, fc_states: int = 3,
                 pickle: bool = False) -> Path:
    """An EAGLE-3 checkpoint as SpecForge's save_pretrained writes one: its lm_head starts from the target's rows
    of the draft vocabulary (as trained heads do), so some guesses are right."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    lm = target.lm_head.weight[ids % target.config.vocab_size] if hidden == H else rand(gen, draft_vocab, hidden)
    state = {"fc.weight": rand(gen, hidden, fc_states * hidden),
             "midlayer.input_layernorm.weight": gains(gen, hidden), "midlayer.hidden_norm.weight": gains(gen, hidden),
             **attention_weights(gen, "midlayer.", 2 * hidden, hidden),
             "norm.weight": gains(gen, hidden), "lm_head.weight": lm.clone(),
             "d2t": ids - torch.arange(draft_vocab) + d2t_shift, "t2d": t2d}
    if fc_norm:
        state.update({f"fc_norm.{i}.weight": gains(gen, hidden) for i in range(3)})
    extra: dict = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
    if fc_norm:
        extra["fc_norm"] = True
    if layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    if top_level_ids is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = top_level_ids
    return write(path, state, llama_config(vocab, hidden, **extra), pickle)


def write_eagle1(path: Path, seed: int = 2, *, hidden: int = H, layers: int = 1, bias: bool = True) -> Path:
    """An EAGLE-1/2 checkpoint (cnets1.py's Model): fc 2h -> h, layers.{i}.*, the first without input_layernorm."""
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": rand(gen, hidden, 2 * hidden)}
    if bias:
        state["fc.bias"] = 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64)
    for i in range(layers):
        state.update(attention_weights(gen, f"layers.{i}.", hidden, hidden))
        if i:
            state[f"layers.{i}.input_layernorm.weight"] = gains(gen, hidden)
    return write(path, state, llama_config(VOCAB, hidden, num_hidden_layers=layers, bias=bias))


def write_medusa(path: Path, target: Transformer, seed: int = 3, *, heads: int = 3, layers: int = 1,
                 hidden: int = H, vocab: int = VOCAB) -> Path:
    """Medusa's medusa_lm_head.safetensors: ModuleList of Sequential(ResBlock * layers, Linear) as it saves it."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = 0.5 * rand(gen, hidden, hidden)
            state[f"{i}.{j}.linear.bias"] = 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64)
        out = target.lm_head.weight if (hidden, vocab) == (H, VOCAB) else rand(gen, vocab, hidden)
        state[f"{i}.{layers}.weight"] = out + 0.05 * rand(gen, vocab, hidden)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                  "base_model_name_or_path": "tiny", "hidden_size": hidden,
                                                  "vocab_size": vocab}))
    return path


# ------------------------------------------------------------------- the published forwards, from their formulas


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [heads, n, d] at positions 0..n-1 (HF's rotate_half convention)."""
    n, d = x.shape[1], x.shape[2]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat((-x2, x1), -1) * emb.sin()


def layer(s: dict[str, torch.Tensor], p: str, attn_in: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + attention(attn_in) (causal, GQA), then + MLP(post_attention_layernorm(.))."""
    n = attn_in.shape[0]
    q = (attn_in @ s[p + "self_attn.q_proj.weight"].T).view(n, HEADS, DIM).transpose(0, 1)
    k = (attn_in @ s[p + "self_attn.k_proj.weight"].T).view(n, KV, DIM).transpose(0, 1)
    v = (attn_in @ s[p + "self_attn.v_proj.weight"].T).view(n, KV, DIM).transpose(0, 1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(DIM)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ s[p + "self_attn.o_proj.weight"].T
    x = residual + out
    y = rms(x, s[p + "post_attention_layernorm.weight"])
    return x + (F.silu(y @ s[p + "mlp.gate_proj.weight"].T) * (y @ s[p + "mlp.up_proj.weight"].T)) \
        @ s[p + "mlp.down_proj.weight"].T


def read(path: Path) -> dict[str, torch.Tensor]:
    file = path / "model.safetensors"
    return {k: v.double() if v.is_floating_point() else v for k, v in load_file(str(file)).items()}


def eagle3_reference(s, aux: torch.Tensor, emb: torch.Tensor, fc_norm: bool,
                     norm_output: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    if fc_norm:
        aux = torch.cat([rms(part, s[f"fc_norm.{i}.weight"]) for i, part in enumerate(aux.chunk(3, -1))], -1)
    f = aux @ s["fc.weight"].T
    wide = torch.cat((rms(emb, s["midlayer.input_layernorm.weight"]), rms(f, s["midlayer.hidden_norm.weight"])), -1)
    out = layer(s, "midlayer.", wide, f)
    return (rms(out, s["norm.weight"]) if norm_output else out) @ s["lm_head.weight"].T, out


def run_in_two(head: EagleHead, features: torch.Tensor, emb: torch.Tensor, split: int):
    """The head over positions 0..split-1, then the rest through its cache (as the proposer runs it)."""
    cache = head.new_cache(64)
    n = features.shape[0]
    a = head(features[None, :split], emb[None, :split], cache, torch.arange(split))
    b = head(features[None, split:], emb[None, split:], cache, torch.arange(split, n))
    return torch.cat((a[0][0], b[0][0])), torch.cat((a[1][0], b[1][0]))


def hidden_states(target: Transformer, tokens: list[int], layers: list[int]) -> list[torch.Tensor]:
    out = target(torch.tensor([tokens]), target.new_cache(64), hidden_layers=layers)
    return [h[0] for h in out.hidden]


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("fc_norm,norm_output", [(False, True), (True, False)])
def test_eagle3_computes_the_published_forward(tmp_path, target, fc_norm, norm_output) -> None:
    path = write_eagle3(tmp_path / "e3", target, fc_norm=fc_norm)
    if not norm_output:  # SpecForge's option: logits from the layer's output without the final norm
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "norm_output": False}))
    head = load_eagle_head(path, target)
    assert isinstance(head, Eagle3Head) and detect_layout(path) == EAGLE3
    assert head.config.target_layers == [1, 3, 4]  # entering layers 2, n // 2, n - 3 of 8: outputs of 1, 3, 4
    tokens = PROMPTS[3][:9]
    aux = torch.cat(hidden_states(target, tokens, [1, 3, 4]), -1)[:-1]
    emb = target.embed(torch.tensor(tokens[1:]))  # position t reads its feature and token t + 1
    logits, out = run_in_two(head, head.fuse(aux), emb, 5)
    s = read(path)
    ref_logits, ref_out = eagle3_reference(s, aux, emb, fc_norm, norm_output)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-9, atol=1e-9)
    # the next depth reads the layer's output as its feature, without fc: same formula with f = out
    assert torch.equal(head.d2t, torch.arange(40) + s["d2t"])


def test_eagle1_computes_the_published_forward(tmp_path, target) -> None:
    path = write_eagle1(tmp_path / "e1", layers=2)
    head = load_eagle_head(path, target)
    assert isinstance(head, Eagle1Head) and detect_layout(path) == EAGLE1
    tokens = PROMPTS[4][:8]
    last = hidden_states(target, tokens, [LAYERS - 1])[0][:-1]
    emb = target.embed(torch.tensor(tokens[1:]))
    logits, out = run_in_two(head, head.fuse(last), emb, 3)
    s = read(path)
    x = torch.cat((emb, rms(last, target.norm.weight)), -1) @ s["fc.weight"].T + s["fc.bias"]
    x = layer(s, "layers.0.", x, x)  # the first layer: no input norm
    x = layer(s, "layers.1.", rms(x, s["layers.1.input_layernorm.weight"]), x)
    torch.testing.assert_close(out, x, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logits, x @ target.lm_head.weight.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layers", [1, 2])
def test_medusa_computes_the_published_forward(tmp_path, target, layers) -> None:
    path = write_medusa(tmp_path / "m", target, layers=layers)
    heads = load_medusa_heads(path, target)
    assert detect_layout(path) == MEDUSA
    last = hidden_states(target, PROMPTS[3][:6], [LAYERS - 1])[0]
    s = {k: v.double() for k, v in load_file(str(path / "medusa_lm_head.safetensors")).items()}
    normed = rms(last, target.norm.weight)
    for i in range(3):
        y = normed
        for j in range(layers):
            y = y + F.silu(y @ s[f"{i}.{j}.linear.weight"].T + s[f"{i}.{j}.linear.bias"])
        torch.testing.assert_close(heads(last)[:, i], y @ s[f"{i}.{layers}.weight"].T, rtol=1e-9, atol=1e-9)


class TreeSpy:
    """Records every tree a proposer sends (tokens and parents)."""

    def __init__(self, proposer) -> None:
        self.trees: list[tuple[list[int], list[int]]] = []
        inner = proposer.propose

        def propose(context):
            tree = inner(context)
            self.trees.append((list(tree.tokens), list(tree.parents)))
            return tree

        proposer.propose = propose


def speculate(target, reference, proposer, k: int) -> tuple[list, int, int]:
    spy = TreeSpy(proposer)
    drafted = accepted = 0
    for prompt, expected in zip(CASES, reference, strict=True):
        out, stats = generate_ids(target, prompt, proposer=proposer, k=k, max_new_tokens=NEW)
        assert out == expected, f"prompt {prompt}"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return spy.trees, drafted, accepted


@pytest.mark.parametrize("layout", ["eagle3", "eagle3-pickle", "eagle1", "medusa", "medusa-2-layers"])
def test_published_heads_draft_losslessly(tmp_path, target, reference, layout) -> None:
    if layout.startswith("eagle3"):
        path = write_eagle3(tmp_path / layout, target, pickle=layout.endswith("pickle"))
    elif layout == "eagle1":
        path = write_eagle1(tmp_path / layout)
    else:
        path = write_medusa(tmp_path / layout, target, layers=2 if layout.endswith("layers") else 1)
    if layout.startswith("medusa"):
        proposer = MedusaProposer(load_medusa_heads(path, target), VOCAB, max_nodes=12)
    else:
        proposer = EagleProposer(load_eagle_head(path, target), target, topk=3, nodes=10)
    trees, drafted, accepted = speculate(target, reference, proposer, k=4)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert any(len(set(parents)) < len(parents) - 1 for _, parents in trees)  # real trees, not chains only


def test_beside_an_int8_activation_target_published_heads_run_in_int8_and_stay_lossless(tmp_path) -> None:
    from specdecode.models.quant import quantize_linears_

    target = quantize_linears_(tiny_model(0, vocab_size=VOCAB, num_layers=LAYERS, dtype=torch.float32), "int8-a8")
    drafting = Assets(target, None, "tiny")
    for path in (write_eagle3(tmp_path / "e3", target), write_eagle1(tmp_path / "e1")):
        head = drafting.eagle_head(path)
        assert head.attn.wqkv.quantization == "int8-a8" if isinstance(head, Eagle3Head) else \
            head.input.quantization == "int8-a8"
        proposer = EagleProposer(head, target, topk=3, nodes=8)
        drafted = 0
        for prompt in CASES[2:5]:
            out, stats = generate_ids(target, prompt, proposer=proposer, k=4, max_new_tokens=NEW)
            assert out == generate_ids(target, prompt, max_new_tokens=NEW)[0], prompt
            drafted += stats.drafted
        assert drafted > 0


def test_pickled_head_equals_its_safetensors_and_an_object_in_a_pickle_is_refused(tmp_path, target) -> None:
    safe = load_eagle_head(write_eagle3(tmp_path / "safe", target), target)
    pickled = load_eagle_head(write_eagle3(tmp_path / "pickled", target, pickle=True), target)
    for (name, a), (_, b) in zip(safe.state_dict().items(), pickled.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    state = dict(load_file(str(tmp_path / "safe" / "model.safetensors")))
    state["payload"] = Payload(marker)  # type: ignore[assignment]
    torch.save(state, evil / "pytorch_model.bin")
    (evil / "config.json").write_text((tmp_path / "safe" / "config.json").read_text())
    with pytest.raises(ValueError, match="refused to read .*pickle that holds more than tensors"):
        load_eagle_head(evil, target)
    assert not marker.exists()  # its code never ran


class Payload:
    """Unpickled unrestricted, it would create `marker` (any code could run there)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_round_trips_propose_the_same_trees(tmp_path, target, reference) -> None:
    # EAGLE-3: published -> loaded -> written back -> loaded
    first = load_eagle_head(write_eagle3(tmp_path / "e3", target, fc_norm=True), target)
    again_path = save_eagle3(first, tmp_path / "e3-again")
    original, again = read(tmp_path / "e3"), read(again_path)
    assert original.keys() == again.keys()
    for key in original:
        assert torch.equal(original[key], again[key]), key
    assert json.loads((again_path / "config.json").read_text()) == json.loads((tmp_path / "e3/config.json").read_text())
    second = load_eagle_head(again_path, target)
    trees = [speculate(target, reference, EagleProposer(h, target, topk=3, nodes=10), 4)[0] for h in (first, second)]
    assert trees[0] == trees[1] and len(trees[0]) > 10
    # Medusa: ours -> Medusa's layout -> ours, accuracies kept
    ours = MedusaHeads.from_target(target, 3, torch.arange(VOCAB), name="tiny")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        ours.res_weight.copy_(0.3 * torch.randn(ours.res_weight.shape, generator=gen, dtype=torch.float64) / 8)
        ours.res_bias.copy_(0.1 * torch.randn(ours.res_bias.shape, generator=gen, dtype=torch.float64))
    ours.config.accuracy = [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.02]]
    ours = ours.float().double()  # float32 values: what a float32 file holds
    exported = save_medusa(ours, tmp_path / "medusa-published")
    assert detect_layout(exported) == MEDUSA
    back = load_medusa_heads(exported, target)
    assert back.config.accuracy == ours.config.accuracy and type(back) is MedusaHeads
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    trees = [speculate(target, reference, MedusaProposer(h, VOCAB, max_nodes=12), 4)[0] for h in (ours, back)]
    assert trees[0] == trees[1] and len(trees[0]) > 10
    ours.save(tmp_path / "medusa-ours")
    assert export_head(tmp_path / "medusa-ours", tmp_path / "exported") == MEDUSA


def test_our_eagle_head_cannot_be_written_as_eagle3_and_says_why(tmp_path, target) -> None:
    head = EagleHead(EagleConfig.for_target(target.config, 32)).double()
    head.save(tmp_path / "ours")
    assert detect_layout(tmp_path / "ours") == OURS_EAGLE
    with pytest.raises(ValueError, match="cannot be written in the EAGLE-3 layout: its residual stream"):
        save_eagle3(head, tmp_path / "out")
    with pytest.raises(ValueError, match="cannot be written in the EAGLE-3 layout"):
        export_head(tmp_path / "ours", tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_drafting_detects_each_layout(tmp_path, target) -> None:
    drafting = Assets(target, None, "tiny")
    ours = EagleHead(EagleConfig.for_target(target.config, 32)).double()
    ours.save(tmp_path / "ours")
    MedusaHeads.from_target(target, 2, torch.arange(VOCAB)).save(tmp_path / "ours-medusa")
    assert detect_layout(tmp_path / "ours-medusa") == OURS_MEDUSA
    assert type(drafting.eagle_head(tmp_path / "ours")) is EagleHead
    assert isinstance(drafting.eagle_head(write_eagle3(tmp_path / "e3", target)), Eagle3Head)
    assert isinstance(drafting.eagle_head(write_eagle1(tmp_path / "e1")), Eagle1Head)
    assert drafting.medusa_heads(write_medusa(tmp_path / "m", target)).config.heads == 3
    assert type(drafting.medusa_heads(tmp_path / "ours-medusa")) is MedusaHeads
    with pytest.raises(ValueError, match="published Medusa heads: use it with method 'medusa'"):
        drafting.eagle_head(tmp_path / "m")
    with pytest.raises(ValueError, match="an EAGLE-3 head: use it with method 'eagle'"):
        drafting.medusa_heads(tmp_path / "e3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no head weights"):
        drafting.eagle_head(tmp_path / "empty")
    with pytest.raises(ValueError, match="online learning .* published"):
        drafting.eagle_head(tmp_path / "e3").float_copy()


MISMATCHES = {
    "eagle3 hidden": (lambda p, t: write_eagle3(p, t, hidden=32), r"hidden size 32, the target's 64"),
    "eagle3 vocabulary": (lambda p, t: write_eagle3(p, t, vocab=VOCAB + 8),
                          rf"vocabulary {VOCAB + 8}, the target's {VOCAB}"),
    "eagle3 layers past the target": (lambda p, t: write_eagle3(p, t, layer_ids=[1, 4, 9]),
                                      r"reads target layers \[1, 4, 9\] .*layer outputs are 0..7"),
    "eagle3 the embedding layer": (lambda p, t: write_eagle3(p, t, top_level_ids=[0, 4, 6]),
                                   r"layer id 0 is the embedding"),
    "eagle3 fc over other layers": (lambda p, t: write_eagle3(p, t, fc_states=4),
                                    r"its fc reads 256 values, 3 layers \(\[1, 3, 4\], the default"),
    "eagle3 d2t": (lambda p, t: write_eagle3(p, t, d2t_shift=20), r"d2t maps draft tokens to target ids"),
    "eagle1 hidden": (lambda p, t: write_eagle1(p, hidden=32), r"an EAGLE-1/2 head .*hidden size 32"),
    "medusa hidden": (lambda p, t: write_medusa(p, t, hidden=32), r"published Medusa heads .*hidden size 32"),
    "medusa vocabulary": (lambda p, t: write_medusa(p, t, vocab=VOCAB + 4), rf"vocabulary {VOCAB + 4}"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_heads_are_refused_before_any_forward(tmp_path, target, case, monkeypatch) -> None:
    make, message = MISMATCHES[case]
    path = make(tmp_path / "head", target)
    for cls in (Eagle3Head, Eagle1Head):
        monkeypatch.setattr(cls, "forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(Mismatch, match=message) as err:  # through what draft= runs, and directly
        Assets(target, None, "tiny").medusa_heads(path) if case.startswith("medusa") else \
            Assets(target, None, "tiny").eagle_head(path)
    text = str(err.value)
    assert "does not fit this target (hidden size 64" in text and "published for this target" in text
    with pytest.raises(Mismatch, match=message):
        load_medusa_heads(path, target) if case.startswith("medusa") else load_eagle_head(path, target)


def test_explicit_layer_ids_name_outputs_in_eagle_config_and_layers_entered_at_top_level(tmp_path, target) -> None:
    assert load_eagle_head(write_eagle3(tmp_path / "a", target, layer_ids=[5, 1, 3]), target).config.target_layers \
        == [1, 3, 5]  # SpecForge / SGLang: outputs, captured in layer order
    assert load_eagle_head(write_eagle3(tmp_path / "b", target, top_level_ids=[2, 4, 6]), target).config \
        .target_layers == [1, 3, 5]  # vLLM: the layers entered


def test_cli_export_head(tmp_path, capsys) -> None:
    assert cli_main(["export-head", str(SHIPPED_EAGLE["smollm2-135m-instruct"]), "--out", str(tmp_path / "s")]) == 0
    assert "EAGLE-3" in capsys.readouterr().out and (tmp_path / "s/model.safetensors").is_file()
    assert cli_main(["export-head", str(SHIPPED_EAGLE["gemma3-270m"]), "--out", str(tmp_path / "e3")]) == 2
    assert "cannot be written in the EAGLE-3 layout" in capsys.readouterr().err
    target = tiny_model(0, vocab_size=VOCAB, num_layers=2)
    MedusaHeads.from_target(target, 2, torch.arange(VOCAB)).save(tmp_path / "ours")
    assert cli_main(["export-head", str(tmp_path / "ours"), "--out", str(tmp_path / "m"), "--dtype", "bfloat16"]) == 0
    assert "Medusa heads to" in capsys.readouterr().out
    written = load_file(str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    assert sorted(written) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.weight", "1.0.linear.bias",
                               "1.0.linear.weight", "1.1.weight"]
    assert written["0.1.weight"].dtype == torch.bfloat16


def test_draft_dir_through_the_library_and_the_cli(tmp_path, capsys) -> None:
    import specdecode

    ckpt = write_checkpoint(tmp_path / "target", make_tokenizer(), layers=LAYERS)
    llm = specdecode.load(ckpt, dtype="float64")
    vocab = llm.model.config.vocab_size
    eagle3 = write_eagle3(tmp_path / "e3", llm.model, vocab=vocab, draft_vocab=64)
    medusa = write_medusa(tmp_path / "m", llm.model, vocab=vocab)
    prompt = "the quick brown fox"
    plain = llm.generate(prompt, method="none", max_new_tokens=16)
    for method, head in (("eagle", eagle3), ("medusa", medusa)):
        out = llm.generate(prompt, method=method, draft=str(head), k=3, max_new_tokens=16)
        assert out.token_ids == plain.token_ids and out.stats.drafted > 0, method
    base = ["generate", prompt, "--model", str(ckpt), "--dtype", "float64", "--k", "3", "--max-new-tokens", "16"]
    assert cli_main([*base, "--method", "eagle", "--draft", str(eagle3)]) == 0
    assert capsys.readouterr().out.strip() == plain.text.strip()
    other = write_eagle3(tmp_path / "other", llm.model, vocab=vocab + 8)  # made for another vocabulary
    assert cli_main([*base, "--method", "eagle", "--draft", str(other)]) == 2
    assert f"vocabulary {vocab + 8}, the target's {vocab}" in capsys.readouterr().err


def test_full_vocabulary_head_without_maps_and_a_shipped_embedding(tmp_path, target) -> None:
    path = write_eagle3(tmp_path / "full", target, draft_vocab=VOCAB)
    state = load_file(str(path / "model.safetensors"))
    del state["d2t"], state["t2d"]  # EAGLE drops them when the draft vocabulary is the whole vocabulary
    state["embed_tokens.weight"] = target.embed.weight.to(torch.bfloat16).float()  # the target's, as a bf16 copy
    save_file(state, str(path / "model.safetensors"))
    assert torch.equal(load_eagle_head(path, target).d2t, torch.arange(VOCAB))
    state["embed_tokens.weight"] = torch.randn(VOCAB, H)  # another model's
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(Mismatch, match="its embedding differs from the target's"):
        load_eagle_head(path, target)
