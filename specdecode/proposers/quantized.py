"""Quantized self-speculation: a low-bit copy of the target drafts for it (a draft model with no training and
the target's tokenizer by construction), optionally without some layers as well.

The copy shares the target's norms and embedding and holds its own int4 / int8 linear layers (by default
int4 weights with int8 activations, the fastest the native kernels run), so it costs about a quarter of a
float32 target's memory traffic and agrees with it on most tokens. It pays where the target's precision is
high and its verification of a few tokens costs little more than one (float32 or int8 targets); over a target
that is already int4 it is the target itself, and is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from ..common.method_options import QuantizedOptions
from ..models import Transformer
from ..models.quant import QUANTIZATIONS, QuantLinear
from .draft_model import DraftModelProposer
from .layer_skip import skip_layers

if TYPE_CHECKING:
    from .assets import Assets, Draft


def _quantized(layer: nn.Module, kind: str) -> QuantLinear:
    weight = layer.dequantize() if isinstance(layer, QuantLinear) else layer.weight
    return QuantLinear.quantize(weight, kind, layer.bias)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing every submodule and tensor, whose children can be replaced without touching the original."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    return out


def low_bit_copy(target: Transformer, kind: str = "int4-a8") -> Transformer:
    """`target` with every linear layer (projections and output layer) quantized to `kind`; norms and the
    embedding table are the target's own."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r} for the quantized draft; choose one of "
                         f"{', '.join(QUANTIZATIONS)}")
    if target.quantization == kind:
        raise ValueError(f"the target already runs {kind} weights, so a {kind} copy of it is the target itself: load "
                         "the target in higher precision (quantization=None, or 'int8') to draft for it this way")
    draft = _shallow(target)
    blocks = []
    for block in target.layers:
        b, attn, mlp = _shallow(block), _shallow(block.attn), _shallow(block.mlp)
        attn.wqkv, attn.wo = _quantized(block.attn.wqkv, kind), _quantized(block.attn.wo, kind)
        mlp.w13, mlp.w2 = _quantized(block.mlp.w13, kind), _quantized(block.mlp.w2, kind)
        b.attn, b.mlp = attn, mlp
        blocks.append(b)
    draft.layers = nn.ModuleList(blocks)
    draft.lm_head = _quantized(target.lm_head, kind)
    draft.__dict__.pop("_native", None)
    return draft


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized"

    def __init__(self, target: Transformer, low_bit: Transformer | None = None, kind: str = "int4-a8",
                 skipped: Sequence[int] = ()) -> None:
        """low_bit: the target's low-bit copy, when one is built already (`low_bit_copy(target, kind)`)."""
        draft = low_bit if low_bit is not None else low_bit_copy(target, kind)
        super().__init__(skip_layers(draft, skipped) if skipped else draft, target.config.vocab_size)
        self.kind, self.skipped = kind, list(skipped)


def build(assets: Assets, options: QuantizedOptions, draft: Draft, k: int | str) -> QuantizedSelfProposer:
    return QuantizedSelfProposer(assets.model, assets.low_bit(options.low_bit), options.low_bit,
                                 options.skip_layers or ())
