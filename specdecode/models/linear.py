"""The float linear layer of the models: nn.Linear with row-invariant CPU paths for decoding's few-token matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

# forwards of up to this many rows (decoding steps, verification, a batch of them) multiply in the native kernel
NATIVE_MAX_ROWS = 256


class Linear(nn.Linear):
    """nn.Linear with CPU paths for the few-token matmuls of decoding and verification.

    A verified token's numbers must be those of the one-token step that plain decoding runs (else a near tie
    decides differently and greedy speculation is not lossless). oneDNN does not promise that: on an AVX-512
    machine its float32 matmul with K = 2048 (Gemma 3 270M's down projection) rounds a row differently beside
    other rows. So up to NATIVE_MAX_ROWS rows run in the native kernel, whose rows never depend on each other
    (as fast as oneDNN for one row, slower for many); longer forwards (a prompt's prefill, the same call
    whatever the method) use oneDNN with its weight layout prepacked once, which reads the weights faster than
    MKL's `x @ W.T`. Gradients, other devices and dtypes keep F.linear.
    """

    _packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or (
                torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        few = x.dtype == w.dtype == torch.float32 and rows.shape[0] <= NATIVE_MAX_ROWS
        lib = kernels.native() if few else None
        if lib is not None:
            rows, weight = rows.contiguous(), w.detach().contiguous()
            out = torch.empty(rows.shape[0], w.shape[0], dtype=torch.float32)
            lib.specdecode_f32_matmul(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(),
                                      out.data_ptr(), w.shape[0])
            if self.bias is not None:
                out += self.bias
        elif ONEDNN and x.dtype == w.dtype:
            key = (w.data_ptr(), w._version)
            if self._packed is None or self._packed[0] != key:
                self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
            out = torch.ops.mkldnn._linear_pointwise(rows, self._packed[1], self.bias, "none", [], "")
        else:
            return F.linear(x, w, self.bias)
        return out.reshape(*x.shape[:-1], w.shape[0])


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
