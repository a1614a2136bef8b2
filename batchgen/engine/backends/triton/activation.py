"""Gated activations over a fused [gate | up] projection output: SiLU-and-mul, GELU(tanh)-and-mul."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import program_rows, rows_per_program

_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(X, Out, rows, width, stride_x, stride_o,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, GELU: tl.constexpr):
    row = program_rows(ROWS)[:, None]
    offs = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < rows) & (offs < width)
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + width + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    # Round the activation to the activation dtype before the product, as the unfused ops do.
    act = act.to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up).to(Out.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or width == 0:
        return out
    out2 = out.view(-1, width)
    block = min(_BLOCK, triton.next_power_of_2(width))
    per_program = rows_per_program(block)
    _act_and_mul_kernel[(triton.cdiv(rows, per_program), triton.cdiv(width, block))](
        x2, out2, rows, width, x2.stride(0), out2.stride(0), BLOCK=block, ROWS=per_program, GELU=gelu,
        num_warps=4,
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x (..., 2N) -> (..., N)."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up (tanh approximation, GeGLU) for x (..., 2N) -> (..., N)."""
    return _act_and_mul(x, gelu=True)
