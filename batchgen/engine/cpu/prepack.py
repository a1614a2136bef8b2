"""bf16 linear layers with their weights prepacked once into oneDNN's blocked layout.

torch's CPU linear reorders the weight on every call; packing it once measured 1.0-1.3x in prefill-sized
matmuls and 1.3-2.7x in decode-sized ones with AMX (fp32 gained nothing, so it keeps plain linears).
"""
from __future__ import annotations

import logging
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class PrepackedLinear(nn.Module):
    """``nn.Linear`` over a prepacked copy of its weight (the plain weight is dropped unless shared)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


@lru_cache(maxsize=1)
def prepacking_works() -> bool:
    """Whether this torch build packs and runs bf16 linears, checked once on a small one."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        return torch.allclose(PrepackedLinear(linear)(x).float(), F.linear(x, linear.weight, linear.bias).float(),
                              atol=1e-2, rtol=1e-2)
    except RuntimeError as e:
        log.info("bf16 weight prepacking unavailable: %s", str(e).splitlines()[0])
        return False


def prepack_linears(model: nn.Module) -> int:
    """Replaces the bf16 CPU ``nn.Linear`` modules of ``model`` by prepacked ones; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
               and child.weight.device.type == "cpu"]
    if not targets or not prepacking_works():
        return 0
    with torch.inference_mode():
        for parent, name, child in targets:
            setattr(parent, name, PrepackedLinear(child))
    return len(targets)
