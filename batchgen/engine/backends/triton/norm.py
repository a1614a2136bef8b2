"""Fused RMSNorm with an optional residual add, computed in fp32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import program_rows, rows_per_program


@triton.jit
def _rms_norm_kernel(
    X, Residual, Weight, Out, ResidualOut, eps, rows, hidden,
    stride_x, stride_r, stride_o, stride_ro,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = program_rows(ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (offs < hidden)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the residual dtype first: that is the residual stream's value.
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 1) / hidden + eps)[:, None]
    normed = (xf * inv_rms).to(ResidualOut.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim. With ``residual``: adds it first and returns (normed, new residual)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_residual = torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
        nr2 = new_residual.view(-1, hidden)
        r_strides = (r2.stride(0), nr2.stride(0))
    else:
        # Without a residual the kernel never reads r2 or writes nr2; nr2 only lends its dtype.
        r2 = nr2 = x2
        new_residual, r_strides = None, (0, 0)
    out_dtype = torch.promote_types(nr2.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    per_program = rows_per_program(block)
    _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x2, r2, weight, out2, nr2, eps, rows, hidden, x2.stride(0), r_strides[0], out2.stride(0),
        r_strides[1], BLOCK=block, ROWS=per_program, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block * per_program // 256, 1), 8),
    )
    return out, new_residual
