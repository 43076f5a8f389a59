"""An EAGLE-3-style draft head: one decoder layer that drafts from the target's own features.

Input per position t: the fusion of the target's hidden states at a low, a middle and a high layer
(EAGLE-3) -- or, deeper in a draft, the head's own output at the previous position -- together with the
embedding of token t+1; output: the distribution of token t+2 over a reduced draft vocabulary (the most
frequent target tokens; `d2t` maps back), since on a small model with a 49k vocabulary the output layer
would be most of the draft's cost. The target's embedding is shared, never copied.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from . import native
from .cache import KVCache
from .config import ModelConfig
from .linear import Linear
from .llama import Block, RopeTable, Transformer, rope_table
from .quant import quantize_linears_

CONFIG = "eagle_config.json"
WEIGHTS = "eagle.safetensors"
ARCH_OURS, ARCH_EAGLE3 = "specdecode", "eagle3"  # this module's head; EAGLE-3's own (eagle3.py)
INT8_BLOCK = 32  # weights stored as int8 per block of 32 with a float16 scale (GGUF's Q8_0, as quantize_ rounds)
SCALE = ".int8_scale"  # the key suffix of a stored int8 weight's scales


@dataclass
class EagleConfig:
    target_layers: list[int]  # target layers whose outputs are fused (low, mid, high)
    draft_vocab_size: int
    block: ModelConfig  # the decoder layer's shape (num_layers = 1); the target's hidden size
    arch: str = ARCH_OURS  # which head computes it: EagleHead (ARCH_OURS) or eagle3.Eagle3Head (ARCH_EAGLE3)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, target_layers: list[int] | None = None,
                   arch: str = ARCH_OURS):
        n = target.num_layers
        layers = target_layers or sorted({min(2, n - 1), n // 2, max(n - 3, 0)})
        # a Llama block whatever the target's (Gemma's options and window are its own model's, not the head's): it
        # attends to all its entries, as training computes it
        block = dataclasses.replace(target.plain(), num_layers=1, sliding_window=None)
        if arch not in (ARCH_OURS, ARCH_EAGLE3):
            raise ValueError(f"unknown EAGLE head architecture {arch!r}: {ARCH_OURS} or {ARCH_EAGLE3}")
        return cls(layers, min(draft_vocab_size, target.vocab_size), block, arch)

    def to_json(self) -> str:
        extra = {} if self.arch == ARCH_OURS else {"arch": self.arch}  # older readers' files stay as they were
        return json.dumps({"target_layers": self.target_layers, "draft_vocab_size": self.draft_vocab_size,
                           "block": dataclasses.asdict(self.block), **extra}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> EagleConfig:
        d = json.loads(text)
        return cls(d["target_layers"], d["draft_vocab_size"], ModelConfig(**d["block"]), d.get("arch", ARCH_OURS))


@torch.no_grad()
def copy_weights_(dst: nn.Module, src: nn.Module) -> None:
    """Each parameter of `dst` from `src`'s same-named weight where it has one of that shape, read through the
    attribute (`.weight`): a quantized layer's comes dequantized, cast to the parameter's dtype and device."""
    for name, param in dst.named_parameters():
        owner, attr = name.rsplit(".", 1)
        try:
            source = getattr(src.get_submodule(owner), attr, None)
        except AttributeError:  # src has no such submodule
            continue
        if source is not None and source.shape == param.shape:
            param.copy_(source)


def read_config(path: Path) -> EagleConfig:
    """A head directory's config, its files checked and its architecture one this version knows."""
    if not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        raise FileNotFoundError(
            f"{path} is not an EAGLE head: expected {CONFIG} and {WEIGHTS} "
            "(train one with `specdecode train eagle --out DIR`)")
    cfg = EagleConfig.from_json((path / CONFIG).read_text())
    if cfg.arch not in (ARCH_OURS, ARCH_EAGLE3):
        raise ValueError(f"{path / CONFIG}: unknown head architecture {cfg.arch!r} (a newer specdecode's?)")
    return cfg


class EagleHead(nn.Module):
    ARCH = ARCH_OURS  # the `arch` its config names
    d2t: torch.Tensor  # a buffer: draft id -> target id

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.block.hidden_size
        self.fuse = Linear(len(cfg.target_layers) * h, h, bias=False)
        self.embed_norm = nn.RMSNorm(h, eps=cfg.block.rms_norm_eps)
        self.feature_norm = nn.RMSNorm(h, eps=cfg.block.rms_norm_eps)
        self.input = Linear(2 * h, h, bias=False)
        self.block = Block(cfg.block)
        self.norm = nn.RMSNorm(h, eps=cfg.block.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)  # draft id -> target id
        self._rope: RopeTable | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms stay float when the linear layers are quantized)."""
        return self.norm.weight.dtype

    def quantize_(self, kind: str) -> EagleHead:
        """Its linear layers in `kind` (e.g. "int8-a8" beside an int4 target: a draft step then reads a quarter of
        the bytes). Lossless either way: a draft's precision changes how often it guesses right, never the output."""
        quantize_linears_(self, kind)
        return self

    def init_from_target(self, target: Transformer, vocab: torch.Tensor) -> None:
        """Start from the target: its last layer's weights for the block (those a Llama block has), its output rows
        for `vocab`, its norms' gains where they are a Llama's. A Gemma's (1 + w: mean 27, up to 301, fitted to its
        own residual stream) made a new head's logits span ~100, from which it learned next to nothing (held-out
        depth-1 acceptance 0.19 after 200 steps of 8; from unit gains 0.35 after 80): its head starts at unit gain."""
        copy_weights_(self.block, target.layers[-1])
        with torch.no_grad():
            self.norm.weight.copy_(target.norm.weight)
            if target.config.norm_offset:
                for norm in (self.block.attn_norm, self.block.mlp_norm, self.norm):
                    norm.weight.fill_(1.0)
            self.lm_head.weight.copy_(target.lm_head.weight[vocab.to(target.lm_head.weight.device)])
            self.d2t.copy_(vocab)

    def draft_ids(self) -> torch.Tensor:
        """[target vocabulary]: each target token's draft id, -1 outside the draft vocabulary (the inverse of d2t)."""
        t2d = torch.full((self.config.block.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        t2d[self.d2t] = torch.arange(len(self.d2t), device=self.d2t.device)
        return t2d

    def float_copy(self) -> EagleHead:
        """A float32 copy on the CPU, quantized layers dequantized."""
        out = EagleHead(self.config)
        copy_weights_(out, self)
        out.d2t.copy_(self.d2t.cpu())
        return out

    @torch.no_grad()
    def swap_vocab(self, mass: torch.Tensor, output: torch.Tensor, most: int, min_mass: float) -> list[int]:
        """The draft vocabulary towards a text's: up to `most` target tokens with the largest `mass` (how much a
        text uses each target token) outside the vocabulary, at least `min_mass` and twice the row's, take the rows
        of the draft tokens with the least (ties: the highest id first, as BPE ids rise where merges get rarer). A
        new row starts from the target's output row (`output`, [V, H]) scaled to the rows' mean norm (unscaled, the
        larger norms of rarer tokens overrule the trained rows: tau 1.44 -> 1.31 on tool-call traffic). A head can
        neither guess nor learn a token outside its vocabulary. Returns the rows swapped."""
        d2t, weight, ids = self.d2t, self.lm_head.weight, self.d2t.cpu()
        mass = mass.to(torch.float64).cpu()
        outside = mass.clone()
        outside[ids] = 0.0
        top = outside.topk(min(most, len(outside)))
        row_mass = mass[ids]
        victims = (row_mass * (len(mass) + 1) - ids.double()).argsort()  # least mass, then highest id
        norm = float(weight.float().norm(dim=1).mean())
        rows = []
        for m, token, row in zip(top.values.tolist(), top.indices.tolist(), victims.tolist(), strict=False):
            if m < max(min_mass, 2 * float(row_mass[row])):
                break
            d2t[row] = token
            new = output[token].float()
            weight[row] = (new * (norm / new.norm().clamp_min(1e-6))).to(weight.device, weight.dtype)
            rows.append(row)
        return rows

    def new_cache(self, max_len: int) -> KVCache:
        b = self.config.block
        return KVCache(1, b.num_kv_heads, b.head_dim, max_len, dtype=self.dtype, device=self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._rope = rope_table(self.config.block, int(positions.max()) + 1, self.device, self.dtype, table=self._rope)
        return self._rope[0][positions], self._rope[1][positions]

    def fuse_features(self, hidden: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Target hidden states ([..., H] per layer, or stacked [..., L, H]) -> the head's feature [..., H]."""
        x = torch.cat(list(hidden), dim=-1) if isinstance(hidden, list) else hidden.flatten(-2)
        return self.fuse(x.to(self.dtype))

    def embed_input(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return self.input(torch.cat((self.embed_norm(token_embeds), self.feature_norm(features)), dim=-1))

    # the decoder layer's parts as training's unrolled steps use them (training/eagle.py ttt_states; Eagle3Head's
    # differ): the attention, (what q/k/v read, the residual stream), the MLP's residual step, the output's norm
    def attention(self):
        return self.block.attn

    def attn_input(self, features: torch.Tensor, token_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_input(features, token_embeds)
        return self.block.attn_norm(x), x

    def mlp_step(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block.mlp(self.block.mlp_norm(x))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def step_inputs(self, start: int, n: int, positions: torch.Tensor, mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """RoPE for `positions` and the mask of n entries after `start` cached ones (None given: a causal chain;
        one entry needs none), on the head's device: what every head architecture's forward starts with."""
        cos, sin = self.rope(positions)
        if mask is None and n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        return cos, sin, None if mask is None else mask.to(self.device)

    @torch.inference_mode()
    def forward(
        self,
        features: torch.Tensor,
        token_embeds: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        logits_at: slice = slice(None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [1, n] after the cache's `length` ones; mask [n, length + n] bool (True = attend; None: a
        causal chain). Returns (draft-vocab logits [1, len(logits_at), Vd], the head's output [1, n, H]: the
        next depth's feature). logits_at: the entries that need logits (a catch-up over skipped positions needs
        the last one's only: the output layer is most of the head's work)."""
        start, n = cache.length, features.shape[1]
        cos, sin, mask = self.step_inputs(start, n, positions, mask)
        x = self.embed_input(features, token_embeds)
        blocks = self._native_block(cache)
        if blocks is not None:  # one native call instead of a dozen PyTorch operators' dispatch
            logits, x = self.run_native(blocks, x, cos, sin, cache, mask, logits_at)
        else:
            x, logits = self.block(x, cos, sin, cache, 0, start, mask), None
        cache.length = start + n
        return (self.lm_head(self.norm(x[:, logits_at])) if logits is None else logits[None]), x

    def run_native(self, blocks, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   mask: torch.Tensor | None, logits_at: slice | None, wide: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits of `logits_at` where the kernel computes them, else None; the layer's output [1, n, H]) for x
        [1, n, H], which the kernel updates in place, after the cache's length entries (`wide`: NativeBlocks.run's)."""
        lib, block = blocks
        start, n = cache.length, x.shape[1]
        x = x.reshape(n, -1).contiguous()
        full = None if mask is None else mask.to(torch.uint8).contiguous()  # [n, start + n]
        logits = block.run(lib, x, cache.kv, [native.RowSpan(0, n, start, 0, [(None, full)])], [(cos, sin)],
                           self.config.block, None, None if block.head is None else logits_at, wide=wide)
        return logits, x.view(1, n, -1)

    def warm_up(self) -> None:
        """One forward of a position: a head's first forward builds its native description and RoPE table (many
        times a later run's cost), which a request's first run would pay otherwise, and be judged by."""
        h = self.config.block.hidden_size
        x = torch.zeros(1, 1, h, dtype=self.dtype, device=self.device)
        self(x, x, self.new_cache(1), torch.zeros(1, dtype=torch.long, device=self.device), None, slice(-1, None))

    def _native_block(self, cache: KVCache):
        """(library, NativeBlocks) where the block can run in the native kernel (float32 on the CPU), else None."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not native.cache_fits(cache):
            return None
        return native.runner(self, [self.block], self.norm, self.lm_head)

    # ---------------------------------------------------------------------------------- persistence
    def save(self, out_dir: Path | str, dtype: torch.dtype = torch.float32, int8: bool = False) -> None:
        """Weights as safetensors (`dtype`: bfloat16 halves a shipped head; `int8`: the matrices as int8 blocks of
        32 with float16 scales, a quarter, and beside an int4 target exactly what quantize_("int8-a8") runs anyway;
        a draft's precision only affects how often it guesses right, never the output) and the config as JSON."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state: dict[str, torch.Tensor] = {}
        for k, v in self.float_copy().state_dict().items() if int8 else self.state_dict().items():
            v = v.detach().cpu()
            if int8 and v.dim() == 2 and v.is_floating_point() and v.shape[1] % INT8_BLOCK == 0:
                state[k], state[k + SCALE] = int8_blocks(v)
            else:
                state[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
        save_file(state, str(out / WEIGHTS))
        (out / CONFIG).write_text(self.config.to_json())

    @classmethod
    def load(cls, path: Path | str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """The head in `path`, which must be this class's architecture (head_files.load_head picks the class)."""
        path = Path(path)
        cfg = read_config(path)
        if cfg.arch != cls.ARCH:
            raise ValueError(f"{path} holds an {cfg.arch!r} head, not {cls.ARCH!r}: load it with "
                             "specdecode.models.head_files.load_head, which picks the class its config names")
        head = cls(cfg)
        stored = load_file(str(path / WEIGHTS))
        state = {k: int8_weight(v, stored[k + SCALE]) if k + SCALE in stored else v.float() if v.is_floating_point()
                 else v for k, v in stored.items() if not k.endswith(SCALE)}
        head.load_state_dict(state)
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def check_target(self, target: Transformer) -> None:
        b, t = self.config.block, target.config
        if (b.hidden_size, b.vocab_size) != (t.hidden_size, t.vocab_size) or max(self.config.target_layers) >= \
                t.num_layers or int(self.d2t.max()) >= t.vocab_size:
            raise ValueError(
                f"this EAGLE head was trained for a target with hidden size {b.hidden_size}, vocabulary "
                f"{b.vocab_size} and layers {self.config.target_layers}; the target has {t.hidden_size}, "
                f"{t.vocab_size} and {t.num_layers} layers: train a head for this target")


def int8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [out, in] as int8 [out, in] and float16 scales [out, in / 32]: each block's absmax is 127,
    the rounding quant.QuantLinear's int8 uses, so a head stored so and quantized again at load is unchanged."""
    out, inp = w.shape
    blocks = w.float().reshape(out, inp // INT8_BLOCK, INT8_BLOCK)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1.0 / d.float())
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(out, inp).contiguous(), d.contiguous()


def int8_weight(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8_blocks' inverse: float32 [out, in]."""
    if q.dtype != torch.int8 or q.dim() != 2 or d.shape != (q.shape[0], q.shape[1] // INT8_BLOCK):
        raise ValueError(f"an int8 weight {list(q.shape)} {q.dtype} with scales {list(d.shape)}: expected int8 "
                         f"[out, in] and scales [out, in / {INT8_BLOCK}]")
    return (q.float().reshape(q.shape[0], -1, INT8_BLOCK) * d.float()[..., None]).reshape(q.shape)
