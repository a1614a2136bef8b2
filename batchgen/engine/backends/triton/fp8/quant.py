"""Dynamic per-token-group FP8 quantization of activations (one scale per row and 128 columns)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import INTERPRET
from batchgen.engine.backends.triton.fp8.format import ACTIVATION_GROUP, FP8_DTYPE, FP8_MAX, MIN_AMAX

_GROUPS_PER_PROGRAM = 8


@triton.jit
def round_to_e4m3(y):
    """y (fp32, within +-448) rounded to the nearest e4m3 value, ties to even, still in fp32.

    The interpreter's fp32 -> fp8 cast truncates subnormals and drops the carry when rounding up
    to the next power of two (126 becomes 64), so under it values are made exact before the cast.
    (Its fp8 -> fp32 cast and fp8 dots are exact, except that the NaN codes decode as +-480.)
    """
    bits = y.to(tl.int32, bitcast=True)
    magnitude = tl.abs(y)
    exponent = tl.maximum((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    # Three mantissa bits: the spacing is 2^(e-3), and 2^-9 below the smallest normal (2^-6).
    spacing = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    rounded = ((magnitude / spacing + 12582912.0) - 12582912.0) * spacing  # 1.5 * 2^23: round to even
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def _quantize_groups_kernel(X, Q, Scale, width, num_groups, stride_x, stride_q, stride_s,
                            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, FP8_MAX: tl.constexpr,
                            MIN_AMAX: tl.constexpr, EXACT_ROUNDING: tl.constexpr):
    """Row r, groups g..g+BLOCK_G of X (rows, width): Q (rows, width) e4m3, Scale (rows, num_groups) fp32."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < width
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), 1), MIN_AMAX), FP8_MAX)
    # Exact division, as torch does: the quantized values match format.quantize_fp8 bit for bit.
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    if EXACT_ROUNDING:
        y = round_to_e4m3(y)
    tl.store(Q + row * stride_q + cols, y.to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row * stride_s + groups, scale, mask=groups < num_groups)


def quantize_fp8_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> (float8_e4m3fn (..., K), float32 scales (..., ceil(K/128))), both contiguous.

    scale = amax / 448 per row and 128 columns (the last group may be shorter); x ~= q * scale.
    """
    group = ACTIVATION_GROUP[1]
    width = x.shape[-1]
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, num_groups = x2.shape[0], triton.cdiv(width, group)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(*x.shape[:-1], num_groups, dtype=torch.float32, device=x.device)
    if rows == 0 or width == 0:
        return q, scale
    q2, scale2 = q.view(rows, width), scale.view(rows, num_groups)
    _quantize_groups_kernel[(rows, triton.cdiv(num_groups, _GROUPS_PER_PROGRAM))](
        x2, q2, scale2, width, num_groups, x2.stride(0), q2.stride(0), scale2.stride(0),
        GROUP=group, BLOCK_G=_GROUPS_PER_PROGRAM, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
        EXACT_ROUNDING=INTERPRET, num_warps=4,
    )
    return q, scale
