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

from batchgen.engine.layers.linear import UNQUANTIZED, LinearBase, ParallelLMHead, RowParallelLinear

log = logging.getLogger(__name__)


class PrepackedLinear(nn.Module):
    """``y = x W^T (+ b)`` over a prepacked copy of a layer's weight; it replaces the layer once loaded
    (the plain weight is freed unless another module shares it, as a tied embedding does)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


@lru_cache(maxsize=1)
def prepacking_works() -> bool:
    """Whether this torch build packs and runs bf16 linears, checked once on a small one."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, bias = torch.randn(48, 64).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        return torch.allclose(PrepackedLinear(weight, bias)(x).float(), F.linear(x, weight, bias).float(),
                              atol=1e-2, rtol=1e-2)
    except RuntimeError as e:
        log.info("bf16 weight prepacking unavailable: %s", str(e).splitlines()[0])
        return False


# Projections whose forward is y = x W^T (+ b) and nothing else once unsplit (a router also selects experts).
_PLAIN_FORWARDS = (LinearBase.forward, RowParallelLinear.forward, ParallelLMHead.forward)


def packable(module: nn.Module) -> bool:
    """A whole (not tensor-parallel) bf16 projection or LM head on CPU that multiplies with ``F.linear``
    (FP8 layers kept quantized own their weight and scales; dequantized ones are plain by now)."""
    if type(module).forward not in _PLAIN_FORWARDS or getattr(module, "tp_size", 1) != 1:
        return False
    if getattr(module, "quant_method", UNQUANTIZED) is not UNQUANTIZED:
        return False
    weight = module.weight
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def prepack_linears(model: nn.Module) -> int:
    """Replaces the packable layers of a loaded ``model`` by prepacked ones; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if packable(child)]
    if not targets or not prepacking_works():
        return 0
    with torch.inference_mode():
        for parent, name, child in targets:
            setattr(parent, name, PrepackedLinear(child.weight, getattr(child, "bias", None)))
    return len(targets)
