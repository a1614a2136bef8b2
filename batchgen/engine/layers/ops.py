"""Elementwise layer ops (RMSNorm, rotary, SiLU-and-mul) in torch, and the kernel set a model uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from batchgen.engine.layers.attention import AttentionBackend


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm computed in fp32. With ``residual``: adds it first and returns (normed, new residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(x.dtype) * weight), residual


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q (T, Hq, D) and k (T, Hkv, D); cache rows are [cos | sin], D/2 each."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for a fused [gate | up] projection output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class KernelSet:
    """The implementations a model calls; torch everywhere, or Triton kernels on the GPU path."""

    attention: AttentionBackend
    rms_norm: Callable = rms_norm
    apply_rotary: Callable = apply_rotary
    silu_and_mul: Callable = silu_and_mul


def make_kernel_set(backend: str) -> KernelSet:
    """Build the kernel set for ``backend``: "torch" or "triton"."""
    if backend == "torch":
        from batchgen.engine.layers.torch_attention import TorchAttentionBackend
        return KernelSet(attention=TorchAttentionBackend())
    if backend == "triton":
        from batchgen.engine.kernels.backend import triton_kernel_set
        return triton_kernel_set()
    raise ValueError(f"unknown attention_backend {backend!r}; expected 'torch' or 'triton'")


def default_backend(device: torch.device) -> str:
    """Triton on CUDA when it is installed, torch otherwise."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
            return "triton"
        except ImportError:
            return "torch"
    return "torch"
