"""The model's blocks run by the native kernel (kernels/block.c): one call a step for all layers instead of ~30
PyTorch operators per layer, for one sequence or a batch's rows (spans) on the CPU in float32, with int4, int8,
float16, bfloat16 or float32 weights; Llama's block or Gemma 3's (QK-norm, sandwich norms, GeGLU, sliding and full
layers each with their own View).

`applies` and `NativeBlocks.build` say no where the kernel does not apply (another device or dtype, gradients,
a cache it cannot read, layers it does not know, or no native library: see kernels.native), and the PyTorch
blocks run.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import kernels
from .cache import KV_KINDS, BatchKVCache, KVCache
from .halflinear import HalfLinear
from .linear import Linear
from .paged import PagedKVCache, PagedRow
from .quant import QuantLinear, QuantStack, trim_heap


def weight_struct(layer: torch.nn.Module) -> kernels.Weight | None:
    """block.c's view of a linear layer, or None for a layer it cannot run."""
    bias = getattr(layer, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(layer, QuantStack):  # block.c's W_STACK: the parts' Weights, ended by an empty one
        parts = [weight_struct(p) for p in layer.parts]
        if any(p is None for p in parts):
            return None
        array = (kernels.Weight * (len(parts) + 1))(*parts, kernels.Weight())
        stacked = kernels.Weight(9, layer.out_features, layer.in_features, ctypes.addressof(array), None, None,
                                 bias_ptr)
        stacked._parts = array  # alive as long as the struct pointing to it
        return stacked
    if isinstance(layer, HalfLinear):  # block.c's W_F16 / W_BF16: the 16-bit words as the file stores them
        return kernels.Weight(4 if layer.bf16 else 3, layer.out_features, layer.in_features, layer.bits.data_ptr(),
                              None, None, bias_ptr)
    if isinstance(layer, QuantLinear) and layer.act8:  # block.c passes these to the int8-activation kernel
        a8_kind, qs, d, m = layer.a8_operands()
        return kernels.Weight(10 + a8_kind, layer.out_features, layer.in_features, qs.data_ptr(), d.data_ptr(),
                              None if m is None else m.data_ptr(), bias_ptr)
    if isinstance(layer, QuantLinear) and layer.exact_scales:
        return None  # float32 scales (K-quants) with float activations: no kernel, the layer dequantizes
    if isinstance(layer, QuantLinear):
        m = None if layer.m is None else layer.m.data_ptr()
        return kernels.Weight(1 if layer.kind == "int4" else 2, layer.out_features, layer.in_features,
                              layer.qs.data_ptr(), layer.d.data_ptr(), m, bias_ptr)
    if isinstance(layer, Linear) and layer.weight.dtype == torch.float32 and layer.weight.is_contiguous():
        w = layer.weight
        return kernels.Weight(0, w.shape[0], w.shape[1], w.data_ptr(), None, None, bias_ptr)
    return None


# one attention type's RoPE table for the call's tokens: (cos [n, hd], sin [n, hd]), float32, contiguous
View = tuple[torch.Tensor, torch.Tensor]
# one attention type's masks for a span: (tree mask [n, n] or None: a chain, mask over all keys [n, start + n] or
# None: every cached key visible), uint8, contiguous
Masks = tuple[torch.Tensor | None, torch.Tensor | None]


@dataclass
class RowSpan:
    """One sequence's tokens in a call: x[first:first + n], cached after `start` in the cache's row `row`."""

    first: int
    n: int
    start: int
    row: int
    masks: list[Masks]  # per View (full layers', then sliding layers' where the model has both)
    table: torch.Tensor | None = None  # a paged cache's block table for the row (int32), None: a contiguous row


class NativeBlocks:
    """Layers described for the kernel once (their norms, epsilon and weights), run in one call a step; with the
    final norm and output layer where the kernel runs them too (`head`: the logits in the same call)."""

    def __init__(self, layers: Sequence[torch.nn.Module], described: ctypes.Array, weights: list,
                 head: tuple[int, float, kernels.Weight] | None = None) -> None:
        self.layers, self.described, self.head = layers, described, head
        self.types = sorted({bool(layer.sliding) for layer in layers})  # the Views the layers read: full, sliding
        self._weights = weights  # the structs the descriptions point to: alive as long as they are

    @classmethod
    def build(cls, layers: Sequence[torch.nn.Module], norm: torch.nn.RMSNorm | None = None,
              output: torch.nn.Module | None = None) -> NativeBlocks | None:
        """None where some layer has no kernel; `head` None where the norm or the output layer has none."""
        described, weights = (kernels.Layer * len(layers))(), []
        for i, block in enumerate(layers):
            ws = [weight_struct(m) for m in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2)]
            extra = (block.attn.q_norm, block.attn.k_norm, block.post_attn_norm, block.post_mlp_norm)
            norms = [norm for norm in (block.attn_norm, block.mlp_norm, *extra) if norm is not None]
            if any(w is None for w in ws) or any(norm.weight.dtype != torch.float32 or norm.eps != norms[0].eps
                                                 or not norm.weight.is_contiguous() for norm in norms):
                return None  # the kernel takes one epsilon a layer
            weights += ws
            eps = norms[0].eps if norms[0].eps is not None else torch.finfo(torch.float32).eps
            wide = block.attn_norm is None  # q/k/v read the call's `wide` rows (EAGLE-3's layer)
            described[i] = kernels.Layer(None if wide else block.attn_norm.weight.data_ptr(),
                                         block.mlp_norm.weight.data_ptr(), float(eps), *(ctypes.pointer(w) for w in ws),
                                         *(None if norm is None else norm.weight.data_ptr() for norm in extra),
                                         int(block.mlp.gelu), int(block.sliding), int(wide))
        head = None
        out = None if output is None else weight_struct(output)
        if out is not None and norm is not None and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous():
            eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
            head = (norm.weight.data_ptr(), float(eps), out)
        trim_heap()  # the weights were just tiled anew (QuantLinear.tile): their old copies' pages go back
        return cls(layers, described, weights, head)

    def run(self, lib, x: torch.Tensor, kv: torch.Tensor, spans: Sequence[RowSpan], views: Sequence[View], cfg,
            states: dict[int, torch.Tensor] | None = None, logits_of: slice | None = None,
            argmax: torch.Tensor | None = None, wide: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every block on x [n, H] (updated in place): the tokens of each span, a sequence or a batch's row, layer
        i's keys and values written into kv's layer i, the span's row ([layers, 2, rows, kv_heads, max_len,
        head_dim]); views[0] for the full-attention layers, views[1] for the sliding ones (where the model has
        them); states[i] ([n, H], contiguous), where given, receives x after layer i. A token's numbers are the
        same in any company: a batch's rows compute what each computes alone.
        logits_of: rows of x (a slice of step 1) whose logits [rows, V] the call returns, through `head` (which must
        be set): x itself stays the last block's output. argmax ([rows] int32, contiguous), where given, receives each
        of those rows' first maximum, as NumPy's argmax gives it. wide ([n, q/k/v's inputs], contiguous float32): what
        the q/k/v of layers without an attention norm read (EAGLE-3's normed token embedding | feature)."""
        widths = {layer.attn.wqkv.in_features for layer in self.layers if layer.attn_norm is None}
        if widths and (wide is None or wide.dtype != torch.float32 or not wide.is_contiguous()
                       or (wide.shape[0], {wide.shape[1]}) != (x.shape[0], widths)):
            raise ValueError("a layer whose q/k/v read their own inputs needs them: wide, [n, inputs] float32, "
                             "contiguous")
        n, hidden = x.shape
        described = (kernels.View * 2)(*(kernels.View(cos.data_ptr(), sin.data_ptr()) for cos, sin in
                                         (views[0], views[-1])))
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        rows = (kernels.Span * len(spans))(*(kernels.Span(
            span.first, span.n, span.start, 0 if span.table is not None else span.row * kv.stride(2),
            (ptr(span.masks[0][0]), ptr(span.masks[-1][0])), (ptr(span.masks[0][1]), ptr(span.masks[-1][1])),
            ptr(span.table)) for span in spans))
        scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
        outputs = None
        if states:
            outputs = (ctypes.c_void_p * len(self.layers))()
            for i, out in states.items():
                outputs[i] = out.data_ptr()
        output, logits = None, None
        if logits_of is not None:
            first, stop, step = logits_of.indices(n)
            if step != 1:
                raise ValueError(f"the kernel computes the logits of consecutive rows, not {logits_of}")
            norm, eps, weight = self.head
            logits = torch.empty(max(stop - first, 0), weight.n_out, dtype=torch.float32)
            if argmax is not None and (argmax.dtype != torch.int32 or argmax.numel() != len(logits)
                                       or not argmax.is_contiguous()):
                raise ValueError(f"argmax must be a contiguous int32 tensor of {len(logits)} rows")
            output = kernels.Output(norm, eps, ctypes.pointer(weight), first, len(logits), logits.data_ptr(),
                                    None if argmax is None else argmax.data_ptr())
        failed = lib.specdecode_blocks(
            x.data_ptr(), n, hidden, self.described, len(self.layers), kv.data_ptr(), kv.stride(0), kv.stride(1),
            kv.shape[4], KV_KINDS[kv.dtype], described, rows, len(spans), cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, scale, outputs, None if output is None else ctypes.byref(output),
            kv.stride(2), None if wide is None else wide.data_ptr())
        if failed:
            raise MemoryError("the native block could not allocate its scratch memory")
        return logits


def _storage(m: torch.nn.Module) -> int:
    if isinstance(m, QuantStack):
        return _storage(m.parts[0])
    for name in ("qs", "bits"):
        if name in m._buffers:
            return m._buffers[name].data_ptr()
    return m._parameters["weight"].data_ptr()


def blocks_of(owner: torch.nn.Module, layers: Sequence[torch.nn.Module], norm: torch.nn.RMSNorm | None = None,
              output: torch.nn.Module | None = None) -> NativeBlocks | None:
    """`layers` (and the final `norm` and `output` layer, where given) described for the kernel, kept on `owner`
    until their weights move or are replaced (None: some layer the kernel cannot run)."""
    first, last = layers[0], layers[-1]
    key = (tuple(layers), _storage(first.attn.wqkv), _storage(last.mlp.w2),
           None if output is None else _storage(output), None if norm is None else norm.weight.data_ptr())
    cached = owner.__dict__.get("_native")
    if cached is None or cached[0] != key:
        cached = (key, NativeBlocks.build(layers, norm, output))
        owner.__dict__["_native"] = cached
    return cached[1]


def runner(owner: torch.nn.Module, layers: Sequence[torch.nn.Module], norm: torch.nn.RMSNorm | None = None,
           output: torch.nn.Module | None = None) -> tuple[ctypes.CDLL, NativeBlocks] | None:
    """(the native library, `layers` described for it), or None where the library or some layer's kernel is
    missing (the PyTorch blocks then run)."""
    lib = kernels.native()
    blocks = None if lib is None else blocks_of(owner, layers, norm, output)
    return None if blocks is None else (lib, blocks)


def table_of(cache, row: int) -> torch.Tensor | None:
    """Row `row`'s block table where the cache is paged (the kernel reads keys through it), else None."""
    return cache.block_table(row) if isinstance(cache, PagedKVCache | PagedRow) else None


def cache_fits(cache) -> bool:
    """The kernel reads each layer's keys (and values) of a sequence (a row of a batch's cache) as one [kv_heads,
    max_len, row] block, or through its block table (a paged cache: blocks of [kv_heads, block_size, row]), of
    float32, float16 or int8 elements (cache.row_width)."""
    if not isinstance(cache, KVCache | BatchKVCache | PagedKVCache | PagedRow) or cache.kv.dtype not in KV_KINDS:
        return False
    # kv[0, 0, 0].is_contiguous() read off the strides: no view made each forward
    (*_, heads, length, dim), stride = cache.kv.shape, cache.kv.stride()
    return ((dim == 1 or stride[5] == 1) and (length == 1 or stride[4] == dim)
            and (heads == 1 or stride[3] == length * dim))


def applies(model: torch.nn.Module, tokens: torch.Tensor, cache) -> bool:
    """Whether this forward can take the native path (before looking at the layers)."""
    return (tokens.device.type == "cpu" and (tokens.shape[0] == 1 or isinstance(cache, BatchKVCache | PagedKVCache))
            and model.dtype == torch.float32 and not torch.is_grad_enabled() and cache_fits(cache))
