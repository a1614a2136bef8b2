"""RMSNorm through the kernel set, optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.layers.ops import KernelSet


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps, self.kernels = eps, kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual_out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual_out)
