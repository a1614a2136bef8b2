"""The FP8 weight and activation formats in plain torch (no Triton): quantize, dequantize, scale layouts.

Values are float8_e4m3fn; a float32 scale per group of elements multiplies them back. Weights
(N, K), optionally stacked as experts (E, N, K), come with one scale per 128x128 block (DeepSeek-V3's
``weight_scale_inv``, shape (ceil(N/128), ceil(K/128))), per output row (``weight_scale`` (N, 1) or
(N,)) or per tensor (one element). Activations (M, K) use one scale per row and 128 columns.
"""
from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_BLOCK = 128  # weight block edge and activation group size
# An all-zero group gets this amax instead, so its scale is never 0 (as in vLLM and DeepGEMM).
MIN_AMAX = 1e-10
ACTIVATION_GROUP = (1, FP8_BLOCK)
WEIGHT_BLOCK = (FP8_BLOCK, FP8_BLOCK)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grouped(x: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """x (..., N, K) zero-padded to whole groups, viewed as (..., N/gn, gn, K/gk, gk)."""
    n, k = x.shape[-2:]
    gn, gk = group
    padded = torch.nn.functional.pad(x, (0, _cdiv(k, gk) * gk - k, 0, _cdiv(n, gn) * gn - n))
    return padded.unflatten(-1, (-1, gk)).unflatten(-3, (-1, gn))


def expand_scale(scale: torch.Tensor, group: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """The scale of every element of a (..., N, K) tensor quantized in (gn x gk) groups."""
    n, k = shape[-2:]
    scale = scale.reshape(*shape[:-2], _cdiv(n, group[0]), _cdiv(k, group[1]))
    return scale.repeat_interleave(group[0], -2)[..., :n, :].repeat_interleave(group[1], -1)[..., :k]


def quantize_fp8(x: torch.Tensor, group: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., N, K) -> (float8_e4m3fn like x, float32 scales (..., ceil(N/gn), ceil(K/gk))).

    scale = amax / 448 per (gn x gk) group and q = x / scale, rounded to nearest (the activation
    kernel computes the same, so both round identically). (128, 128): DeepSeek's weight blocks;
    (1, K): one scale per row; (1, 128): activation groups.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8 needs a (..., N, K) tensor, got shape {tuple(x.shape)}")
    xf = x.float()
    amax = _grouped(xf.abs(), group).amax(dim=(-3, -1))
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / expand_scale(scale, group, x.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float values of q (..., N, K) with one scale per (gn x gk) group, rounded once to ``dtype``
    (float64 holds them exactly)."""
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(calc) * expand_scale(scale.to(calc), group, q.shape)).to(dtype)


def weight_scale_group(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The group (gn, gk) one scale covers for a weight (N, K) or (E, N, K); a clear error otherwise."""
    if weight.dim() not in (2, 3):
        raise ValueError(f"an FP8 weight must be (N, K) or (E, N, K), got shape {tuple(weight.shape)}")
    n, k = weight.shape[-2:]
    trailing = tuple(scale.shape)
    if weight.dim() == 3:
        if scale.dim() == 0 or scale.shape[0] != weight.shape[0]:
            raise ValueError(f"expert weight scale of shape {trailing} has no row per expert "
                             f"for a weight of shape {tuple(weight.shape)}")
        trailing = trailing[1:]
    if math.prod(trailing) == 1:
        return n, k
    if trailing in ((n,), (n, 1)):
        return 1, k
    if trailing == (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK)):
        return WEIGHT_BLOCK
    raise ValueError(
        f"FP8 weight scale of shape {tuple(scale.shape)} fits no known layout for a weight of shape "
        f"{tuple(weight.shape)}: expected one per tensor, one per row ({n}, 1) or one per "
        f"{FP8_BLOCK}x{FP8_BLOCK} block {(_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))}")


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint's FP8 weight as ``dtype`` (for CPUs and GPUs without FP8 tensor cores)."""
    return dequantize_fp8(weight, scale, weight_scale_group(weight, scale), dtype)
