"""RMSNorm through the kernel set, optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.layers.linear import copy_weight
from batchgen.engine.loading.model_source import Weight, as_tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps, self.kernels = eps, kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual_out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual_out)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, which scales by (1 + weight): the 1 is added once, when the checkpoint loads."""

    def __init__(self, dim: int, eps: float, kernels: KernelSet):
        super().__init__(dim, eps, kernels)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: Weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter has no shard {shard_id!r}")
        copy_weight(param.data, as_tensor(loaded).float() + 1.0)
