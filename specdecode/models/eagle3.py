"""EAGLE-3's own architecture (SafeAILab/EAGLE cnets.py `Model`; SpecForge's LlamaForCausalLMEagle3), trainable here.

`fc` fuses the target's hidden states at three layers into f; one decoder layer attends over
cat(input_layernorm(embedding), hidden_norm(f)) (q/k/v read 2 * hidden inputs) with f itself as the residual, then
a Llama MLP; `norm` and a draft-vocabulary `lm_head` give the logits, and the layer's output is the next depth's f.
Unlike specdecode's first head (eagle.EagleHead, whose residual starts at a linear map of both normed inputs), this
one is written to and read from the published EAGLE-3 layout with the same function, so other engines (vLLM,
SGLang, llama.cpp's draft-eagle3) can load what `specdecode train eagle --arch eagle3` trains, and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import native
from .cache import KVCache
from .config import ModelConfig
from .eagle import ARCH_EAGLE3, EagleConfig, EagleHead, copy_weights_
from .linear import Linear
from .llama import MLP, Attention, Transformer


class Fuse(nn.Module):
    """EAGLE-3's fc over the concatenated target hidden states, after SpecForge's per-state norms where set."""

    def __init__(self, states: int, hidden: int, norms: bool, eps: float) -> None:
        super().__init__()
        self.states = states
        self.fc = Linear(states * hidden, hidden, bias=False)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, eps=eps) for _ in range(states)) if norms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norms is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.norms, x.chunk(self.states, -1), strict=True)], -1)
        return self.fc(x)


def wide_attention(block: ModelConfig, width: int) -> Attention:
    """A Llama attention whose q/k/v read `width` inputs (EAGLE-3's 2 * hidden), o_proj back to hidden."""
    attn = Attention(block)
    attn.wqkv = Linear(width, sum(attn.split), bias=block.attention_bias)
    return attn


class NativeLayer(nn.Module):
    """The head's decoder layer as native.NativeBlocks reads a block: no attention norm (q/k/v read the wide input),
    a Llama MLP after its own norm, no sandwich norms, full attention. Kept outside the head's modules (its
    __dict__), so the head's state and devices stay its own."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.attn, self.mlp, self.mlp_norm = head.attn, head.mlp, head.mlp_norm
        self.attn_norm = self.post_attn_norm = self.post_mlp_norm = None
        self.sliding = False


def published_config(cfg: EagleConfig) -> dict[str, Any]:
    """The config.json EAGLE-3 readers take for a head of this shape (SpecForge's LlamaForCausalLMEagle3 fields;
    `eagle_config.eagle_aux_hidden_state_layer_ids` names layer outputs, as specdecode counts target layers)."""
    b = cfg.block
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": b.hidden_size,
            "intermediate_size": b.intermediate_size, "num_attention_heads": b.num_heads,
            "num_key_value_heads": b.num_kv_heads, "head_dim": b.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": b.rms_norm_eps, "rope_theta": b.rope_theta, "rope_scaling": b.rope_scaling,
            "max_position_embeddings": b.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": b.attention_bias, "tie_word_embeddings": False, "vocab_size": b.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": b.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.target_layers)}}


class Eagle3Head(EagleHead):
    """An EAGLE-3 head (module docstring) behind EagleHead's interface: fuse, forward, d2t, new_cache, training's
    attn_input / mlp_step / final. `source`: the config.json written back with the published layout."""

    ARCH = ARCH_EAGLE3

    def __init__(self, cfg: EagleConfig, source: dict[str, Any] | None = None, fc_norm: bool = False,
                 norm_output: bool = True) -> None:
        nn.Module.__init__(self)
        cfg.arch = ARCH_EAGLE3
        self.config, self.source = cfg, source if source is not None else published_config(cfg)
        self.published = False  # read from a published file (load_eagle3): it drafts as published, never trained
        b = cfg.block
        h, eps = b.hidden_size, b.rms_norm_eps
        self.fuse = Fuse(len(cfg.target_layers), h, fc_norm, eps)
        self.embed_norm = nn.RMSNorm(h, eps=eps)  # midlayer.input_layernorm
        self.feature_norm = nn.RMSNorm(h, eps=eps)  # midlayer.hidden_norm
        self.attn = wide_attention(b, 2 * h)
        self.mlp_norm = nn.RMSNorm(h, eps=eps)  # midlayer.post_attention_layernorm
        self.mlp = MLP(b)
        self.norm = nn.RMSNorm(h, eps=eps)
        self.norm_output = norm_output
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)
        self._rope = None

    # the decoder layer's parts as training's unrolled steps (training/eagle.py ttt_states) use them
    def attention(self) -> Attention:
        return self.attn

    def attn_input(self, features: torch.Tensor, token_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what q/k/v read, the residual stream): the two normed inputs side by side, and the feature itself."""
        wide = torch.cat((self.embed_norm(token_embeds.to(self.dtype)), self.feature_norm(features)), dim=-1)
        return wide, features

    def mlp_step(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mlp_norm(x))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.norm_output else x

    @torch.inference_mode()
    def forward(self, features, token_embeds, cache: KVCache, positions, mask=None, logits_at=slice(None)):
        start, n = cache.length, features.shape[1]
        cos, sin, mask = self.step_inputs(start, n, positions, mask)
        wide, x = self.attn_input(features.to(self.dtype), token_embeds)
        blocks = self._native_block(cache)
        if blocks is not None:  # one native call: the layer, the norm and the output layer
            # x is updated in place: a copy, not the caller's features
            logits, x = self.run_native(blocks, x.clone(), cos, sin, cache, mask,
                                        logits_at if self.norm_output else None, wide.reshape(n, -1).contiguous())
            cache.length = start + n
            return (self.lm_head(self.final(x[:, logits_at])) if logits is None else logits[None]), x
        x = x + self.attn(wide, cos, sin, cache, 0, start, mask)  # the fused feature is the residual
        x = self.mlp_step(x)
        cache.length = start + n
        return self.lm_head(self.final(x[:, logits_at])), x

    def _native_block(self, cache: KVCache):
        """(library, NativeBlocks) where the layer can run in the native kernel (float32 on the CPU), else None:
        its q/k/v read the wide input the call passes (NativeBlocks.run's `wide`)."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not native.cache_fits(cache):
            return None
        layer = self.__dict__.get("_native_layer")
        if layer is None:
            layer = self.__dict__["_native_layer"] = NativeLayer(self)
        return native.runner(self, [layer], self.norm, self.lm_head)

    def float_copy(self) -> EagleHead:
        if self.published:
            raise ValueError("online learning (online_draft) trains heads specdecode trained (its own files); a "
                             "published EAGLE-3 head drafts as published: drop online_draft, or train a head with "
                             "`specdecode train eagle --arch eagle3`")
        out = Eagle3Head(EagleConfig.from_json(self.config.to_json()), dict(self.source),
                         fc_norm=self.fuse.norms is not None, norm_output=self.norm_output)
        copy_weights_(out, self)
        out.d2t.copy_(self.d2t.cpu())
        return out

    def init_from_target(self, target: Transformer, vocab: torch.Tensor) -> None:
        """Start from the target's last layer: its MLP and norm gains (unit gains for a Gemma's, see
        EagleHead.init_from_target), its q/k/v reading each half of the wide input at half weight, its output rows
        for `vocab`."""
        last = target.layers[-1]
        copy_weights_(self.mlp, last.mlp)
        with torch.no_grad():
            w = last.attn.wqkv.weight.detach().float()
            self.attn.wqkv.weight.copy_(0.5 * torch.cat((w, w), dim=1))
            self.attn.wo.weight.copy_(last.attn.wo.weight.detach().float())
            if not target.config.norm_offset:
                for norm in (self.embed_norm, self.feature_norm):
                    norm.weight.copy_(last.attn_norm.weight)
                self.mlp_norm.weight.copy_(last.mlp_norm.weight)
                self.norm.weight.copy_(target.norm.weight)
            self.lm_head.weight.copy_(target.lm_head.weight[vocab.to(target.lm_head.weight.device)])
            self.d2t.copy_(vocab)

    def save(self, out_dir, dtype: torch.dtype | None = None, int8: bool = False) -> None:
        """specdecode's own files (eagle.safetensors, eagle_config.json with arch "eagle3"); `export_eagle3` writes
        the published layout."""
        EagleHead.save(self, out_dir, dtype or torch.float32, int8)

    def state_published(self) -> dict[str, torch.Tensor]:
        """The weights under EAGLE-3's names: q/k/v and gate/up split back out, d2t as offsets, t2d as a mask."""
        q, k, v = self.attn.wqkv.weight.split(self.attn.split, dim=0)
        gate, up = self.mlp.w13.weight.chunk(2, dim=0)
        vocab = self.config.block.vocab_size
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[self.d2t.cpu()] = True
        state = {"fc.weight": self.fuse.fc.weight, "midlayer.input_layernorm.weight": self.embed_norm.weight,
                 "midlayer.hidden_norm.weight": self.feature_norm.weight,
                 "midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
                 "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": self.attn.wo.weight,
                 "midlayer.post_attention_layernorm.weight": self.mlp_norm.weight,
                 "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
                 "midlayer.mlp.down_proj.weight": self.mlp.w2.weight, "norm.weight": self.norm.weight,
                 "lm_head.weight": self.lm_head.weight,
                 "d2t": (self.d2t.cpu() - torch.arange(len(self.d2t))).long(), "t2d": t2d}
        if self.attn.wqkv.bias is not None:
            for name, bias in zip("qkv", self.attn.wqkv.bias.split(self.attn.split), strict=True):
                state[f"midlayer.self_attn.{name}_proj.bias"] = bias
        if self.fuse.norms is not None:
            for i, norm in enumerate(self.fuse.norms):
                state[f"fc_norm.{i}.weight"] = norm.weight
        return state


@torch.no_grad()
def from_specdecode_head(head: EagleHead) -> Eagle3Head:
    """An EAGLE-3 head started from one of specdecode's first heads (a warm start for fine-tuning, not the same
    function): the same fc, norms, MLP, output layer and vocabulary; q/k/v read the two normed inputs through the
    old head's input map and attention norm (its gain folded in, its 1/rms replaced by the map's expected scale).
    What cannot carry over: the old residual stream started at that map's output, EAGLE-3's starts at f."""
    cfg = EagleConfig.from_json(head.config.to_json())
    out = Eagle3Head(cfg)
    src = head.float_copy()
    w_in, gain = src.input.weight.float(), src.block.attn_norm.weight.float()
    inputs = torch.cat((src.embed_norm.weight, src.feature_norm.weight)).float()
    scale = float(((w_in * inputs) ** 2).sum() / w_in.shape[0]).__pow__(0.5)  # rms of the map's output, unit inputs
    out.fuse.fc.weight.copy_(src.fuse.weight)
    out.embed_norm.weight.copy_(src.embed_norm.weight)
    out.feature_norm.weight.copy_(src.feature_norm.weight)
    out.attn.wqkv.weight.copy_(src.block.attn.wqkv.weight.float() @ (gain[:, None] * w_in) / max(scale, 1e-6))
    out.attn.wo.weight.copy_(src.block.attn.wo.weight)
    out.mlp_norm.weight.copy_(src.block.mlp_norm.weight)
    copy_weights_(out.mlp, src.block.mlp)
    out.norm.weight.copy_(src.norm.weight)
    out.lm_head.weight.copy_(src.lm_head.weight)
    out.d2t.copy_(src.d2t)
    return out
