"""The gated SiLU MLP (SwiGLU): fused gate|up projection, SiLU-and-mul, down projection."""
from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from batchgen.engine.layers.ops import KernelSet
from batchgen.engine.parallel.group import SINGLE, CommGroup


class GatedMLP(nn.Module):
    """Column-parallel gate|up, row-parallel down: one all-reduce under tensor parallelism."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: KernelSet, tp: CommGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)
        self.kernels = kernels

    def activation_values_per_token(self) -> int:
        return self.gate_up_proj.local_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
