"""GGUF's F16 and BF16 matrices at the file's 16 bits a weight (not widened to float32 at load: half the memory, and
half the bytes read each token), multiplied by the native kernel (kernels/f16matmul.c), which widens them in
registers and keeps the activations float32. Without the kernels the loader dequantizes these matrices to the
activations' dtype as before (loading.load_gguf), and a HalfLinear met elsewhere widens its weight per call.

The weights are kept as int16 bits (as QuantLinear keeps its float16 scales) so that `model.to(dtype)` leaves them
as stored; widening is exact (float16 and bfloat16 values are float32 values)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .linear import NATIVE_MAX_ROWS

HALF_TYPES = ("F16", "BF16")  # the GGUF types loaded as HalfLinear (where the kernels are)


def widen(bits: torch.Tensor, bf16: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """16-bit words (int16) as the float16 or bfloat16 values they hold, in `dtype` (exact for float32/64)."""
    if bf16:
        return (bits.to(torch.int32) << 16).view(torch.float32).to(dtype)
    return bits.view(torch.float16).to(dtype)


def gguf_bits(raw: np.ndarray, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A GGUF F16 / BF16 tensor's data (float16 [out, in], or BF16's bytes [out, 2 * in]) as int16 bits [out, in],
    its rows reordered by `rows` where given (gguf_file.tensors' permutation)."""
    bits = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16).copy())
    return (bits if rows is None else bits[rows]).contiguous()


class HalfLinear(nn.Module):
    """y = x @ W^T (+ bias), W float16 or bfloat16 kept as its bits [out, in]."""

    def __init__(self, bits: torch.Tensor, bf16: bool, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if bits.dim() != 2 or bits.dtype != torch.int16:
            raise ValueError(f"HalfLinear takes int16 bits [out, in], not {bits.dtype} {tuple(bits.shape)}")
        self.register_buffer("bits", bits.contiguous())
        self.bf16 = bf16
        self.out_features, self.in_features = bits.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: str, rows: torch.Tensor | None = None) -> HalfLinear:
        if ggml_type not in HALF_TYPES:
            raise ValueError(f"HalfLinear reads {' and '.join(HALF_TYPES)} tensors, not {ggml_type}")
        return cls(gguf_bits(raw, rows), ggml_type == "BF16")

    @staticmethod
    def cat(layers: list[HalfLinear]) -> HalfLinear:
        """Projections of one type fused along the outputs (q|k|v, gate|up)."""
        if len({layer.bf16 for layer in layers}) != 1:
            raise ValueError("cannot fuse float16 and bfloat16 projections")
        return HalfLinear(torch.cat([layer.bits for layer in layers]), layers[0].bf16)

    @property
    def quantization(self) -> str:
        return "bf16" if self.bf16 else "f16"

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return widen(self.bits, self.bf16, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        lib = None
        if x.device.type == "cpu" and x.dtype == torch.float32 and rows.shape[0] <= NATIVE_MAX_ROWS and not (
                torch.is_grad_enabled() and x.requires_grad):
            lib = kernels.native()
        if lib is None:  # long prefills, other dtypes and devices: the weight widened for this call
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantize(x.dtype).to(x.device), bias)
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        lib.specdecode_h_matmul(int(self.bf16), rows.data_ptr(), rows.shape[0], self.in_features,
                                self.bits.data_ptr(), out.data_ptr(), self.out_features)
        if self.bias is not None:
            out += self.bias.float()
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.quantization}, bias={self.bias is not None}"


class HalfEmbedding(nn.Module):
    """An embedding table stored as a HalfLinear's weight (tied to the output layer, as GGUF files do): a token's
    row widened when it is read."""

    def __init__(self, table: HalfLinear) -> None:
        super().__init__()
        self.table = table

    @property
    def quantization(self) -> str:
        return self.table.quantization

    @property
    def weight(self) -> torch.Tensor:
        return self.table.dequantize()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.table
        return widen(t.bits[tokens.reshape(-1).to(t.bits.device)], t.bf16).reshape(*tokens.shape, t.in_features)
