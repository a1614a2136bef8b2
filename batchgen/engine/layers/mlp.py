"""The gated MLP: fused gate|up projection, activation-and-mul (SwiGLU, or GeGLU), down projection."""
from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from batchgen.engine.parallel.group import SINGLE, CommGroup


class GateUpActivation:
    """How a gated MLP gets ``act(x W_gate^T) * (x W_up^T)``: its gate|up projection, then the kernel set's
    act-and-mul. A kernel set may give an MLP one that does both in one op
    (:func:`batchgen.engine.backends.cpu.prepack.prepack_gated_mlps`)."""

    def __call__(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        return mlp.act_and_mul(mlp.gate_up_proj(x))


PROJECT_THEN_ACTIVATE = GateUpActivation()


class GatedMLP(nn.Module):
    """Column-parallel gate|up, row-parallel down: one all-reduce under tensor parallelism.

    ``activation``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, GELU's tanh approximation).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: KernelSet, tp: CommGroup = SINGLE,
                 activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)
        self.activation = activation
        self.act_and_mul = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}[activation]
        self.gate_up_activation = PROJECT_THEN_ACTIVATE

    def activation_values_per_token(self) -> int:
        return self.gate_up_proj.local_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_activation(self, x))
