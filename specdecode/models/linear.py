"""The float linear layer of the models: nn.Linear with a faster CPU path for decoding's few-token matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear with a faster CPU path for the few-token matmuls of decoding and verification.

    MKL runs `x @ W.T` for a handful of rows at a third of the memory bandwidth or less, so a step that
    verifies 8 tokens used to cost 2x a 1-token step. oneDNN with its weight layout prepacked once streams
    W near full bandwidth whatever the row count, so verifying a few tokens costs almost the same as one
    (numbers in benchmarks/results/forward_cost.md). Other devices and dtypes keep F.linear.
    """

    _packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (ONEDNN and x.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)) or w.requires_grad:
            return F.linear(x, w, self.bias)
        key = (w.data_ptr(), w._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed[1], self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], w.shape[0])


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
