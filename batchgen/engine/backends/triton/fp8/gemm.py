"""W8A8 FP8 GEMM: activations scaled per (row, 128 columns), weights per 128x128 block, row or tensor."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import INTERPRET, gemm_tile, grouped_tile_order
from batchgen.engine.backends.triton.fp8.format import FP8_BLOCK, FP8_DTYPE, weight_scale_group
from batchgen.engine.backends.triton.fp8.quant import quantize_fp8_activation


@dataclass(frozen=True)
class WeightScaleArgs:
    """A weight scale as the kernels index it: GROUP_N rows share a scale; zero strides repeat one."""

    scale: torch.Tensor  # contiguous float32
    group_n: int
    stride_e: int
    stride_n: int
    stride_k: int


def weight_scale_args(weight: torch.Tensor, scale: torch.Tensor) -> WeightScaleArgs:
    """Kernel arguments for the scale of an FP8 weight (N, K) or experts (E, N, K)."""
    group_n, group_k = weight_scale_group(weight, scale)
    n, k = weight.shape[-2:]
    rows, cols = triton.cdiv(n, group_n), triton.cdiv(k, group_k)
    assert group_k in (FP8_BLOCK, k), "a K tile must sit inside one scale group"
    scale = scale.contiguous()
    return WeightScaleArgs(scale, group_n if rows > 1 else 1, rows * cols,
                           cols if rows > 1 else 0, 1 if cols > 1 else 0)


def _check_operands(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor) -> None:
    if a.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 GEMM operands must be {FP8_DTYPE}, got {a.dtype} and {weight.dtype}")
    if a.shape[-1] != weight.shape[-1]:
        raise ValueError(f"K differs: activations {tuple(a.shape)}, weight {tuple(weight.shape)}")
    if a_scale.shape != (*a.shape[:-1], triton.cdiv(a.shape[-1], FP8_BLOCK)) or a_scale.dtype != torch.float32:
        raise ValueError(f"activation scales must be float32 {(*a.shape[:-1], triton.cdiv(a.shape[-1], FP8_BLOCK))}"
                         f", got {a_scale.dtype} {tuple(a_scale.shape)}")


@triton.jit
def _w8a8_gemm_kernel(
    A, B, C, AScale, BScale, Bias, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn, stride_bsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUP_N: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
):
    """C (M, N) = A (M, K) @ B (N, K)^T (+ Bias (N,)), all row-major; A scaled per (row, BLOCK_K
    columns) by AScale (M, ceil(K/BLOCK_K)), B by BScale[(n // GROUP_N) * stride_bsn + t * stride_bsk]."""
    pid_m, pid_n = grouped_tile_order(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    # Columns past N wrap around (their results are not stored), so B loads need no column mask.
    acc = gemm_tile(A, B, AScale, BScale, rows.to(tl.int64), row_mask, cols % N, K, stride_am, stride_bn,
                    stride_asm, 1, stride_bsn, stride_bsk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N,
                    True, "tf32", UPCAST)
    col_mask = cols < N
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages): small row tiles for few rows; all fit 99 KB of shared memory.

    No 128-row tile: with it (8 warps) ptxas spills about 1 KB of registers on sm_100 (see
    tests/triton_aot.py --spills); 64 rows spill nothing on sm_90 and sm_100.
    """
    if m <= 16:
        return 16, 4, 4
    if m <= 32:
        return 32, 4, 4
    return 64, 4, 3


def w8a8_matmul(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) fp8 @ weight (N, K)^T fp8 -> (M, N) ``out_dtype``, accumulated in fp32.

    a_scale: float32 (M, ceil(K/128)), one per row and 128 columns (from quantize_fp8_activation).
    weight_scale: float32 (ceil(N/128), ceil(K/128)) per 128x128 block (``weight_scale_inv``),
    (N, 1) or (N,) per row, or one element per tensor. K need not be a multiple of 128.
    """
    _check_operands(a, a_scale, weight)
    if weight.dim() != 2 or a.dim() != 2:
        raise ValueError(f"w8a8_matmul takes a (M, K) and weight (N, K), got {tuple(a.shape)}, {tuple(weight.shape)}")
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    a, weight, a_scale = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, weight, a_scale))
    scales = weight_scale_args(weight, weight_scale)
    block_m, num_warps, num_stages = _tiles(m)
    block_n = FP8_BLOCK
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_gemm_kernel[grid](
        a, weight, out, a_scale, scales.scale, bias if bias is not None else out, m, n, k,
        a.stride(0), weight.stride(0), out.stride(0), a_scale.stride(0), scales.stride_n, scales.stride_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, GROUP_M=8, GROUP_N=scales.group_n,
        HAS_BIAS=bias is not None, UPCAST=INTERPRET, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(weight)^T + bias for x (..., K) float and an FP8 weight (N, K): x is quantized
    per (row, 128 columns) on the fly; y has x's dtype."""
    q, q_scale = quantize_fp8_activation(x.reshape(-1, x.shape[-1]))
    out = w8a8_matmul(q, q_scale, weight, weight_scale, x.dtype, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
