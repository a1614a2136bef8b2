"""Plain-torch references and error bounds for the fused-MoE and FP8 kernel tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.backends.triton.common import INTERPRET
from batchgen.engine.backends.triton.fp8.format import (
    ACTIVATION_GROUP, FP8_BLOCK, FP8_DTYPE, FP8_MAX, MIN_AMAX, dequantize_fp8, dequantize_fp8_weight,
    expand_scale, quantize_fp8,
)
from batchgen.engine.backends.torch import ops

# |x - dequant(quant(x))| <= E4M3_REL * |x| + E4M3_SUBNORMAL * scale: half the spacing of three
# mantissa bits, and half the subnormal spacing 2^-9 for values below 2^-6 (in units of the scale).
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL = 2.0 ** -10
# Relative error of one fp32 accumulation step. Hopper's FP8 tensor cores keep about 14 bits in
# their accumulator (DeepSeek-V3 report, 3.3.2), far fewer than fp32's 24.
ACCUM_EPS = 2.0 ** -24 if INTERPRET else 2.0 ** -13
SILU_LIPSCHITZ = 1.1  # max |silu'(x)| = 1.0998


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch path: pairs grouped by expert, one GEMM per used expert, weighted scatter-add.

    Intermediates in x's dtype as the model's torch path has them; the sum over experts in fp32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        hidden = ops.silu_and_mul(x[token] @ w13[expert].T)
        out.index_add_(0, token, (hidden @ w2[expert].T).float() * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def e4m3_error(x: torch.Tensor, scale: torch.Tensor, group: tuple[int, int] = ACTIVATION_GROUP) -> torch.Tensor:
    """Elementwise bound on the FP8 quantization error of x (..., N, K) with those group scales."""
    return E4M3_REL * x.abs() + E4M3_SUBNORMAL * expand_scale(scale.double(), group, x.shape)


def matvec(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (w @ v.unsqueeze(-1)).squeeze(-1)


def group_amax(t: torch.Tensor) -> torch.Tensor:
    """Max over each group of 128 in the last dim, repeated back to t's shape."""
    width = t.shape[-1]
    padded = F.pad(t, (0, -width % FP8_BLOCK)).unflatten(-1, (-1, FP8_BLOCK))
    return padded.amax(-1).repeat_interleave(FP8_BLOCK, -1)[..., :width]


def fp32_outward(t: torch.Tensor, direction: float) -> torch.Tensor:
    """The nearest fp32 value at or beyond t (fp64) in ``direction`` (-inf or inf)."""
    t32 = t.float()
    beyond = t32.double() > t if direction < 0 else t32.double() < t
    return torch.where(beyond, torch.nextafter(t32, torch.full_like(t32, direction)), t32)


def fake_quant_range(h: torch.Tensor, h_err: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] holding q * scale for every value within h_err of h, quantized as the activation kernel
    does: scale = fp32(group amax / 448), q = e4m3(fp32(value / scale)), rounding monotone throughout."""
    widen = 2.0 ** -23
    amax_lo = group_amax((h.abs() - h_err).clamp(min=0)).clamp(min=MIN_AMAX) / FP8_MAX * (1 - widen)
    amax_hi = group_amax(h.abs() + h_err).clamp(min=MIN_AMAX) / FP8_MAX * (1 + widen)
    low, high = h - h_err, h + h_err
    ratios_lo = torch.minimum(low / amax_lo, low / amax_hi)
    ratios_hi = torch.maximum(high / amax_lo, high / amax_hi)
    q_lo, q_hi = (fp32_outward(r, d).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).double()
                  for r, d in ((ratios_lo, float("-inf")), (ratios_hi, float("inf"))))
    return torch.minimum(q_lo * amax_lo, q_lo * amax_hi), torch.maximum(q_hi * amax_lo, q_hi * amax_hi)


def fp8_moe_reference_and_bound(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                                w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                                topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize-then-matmul reference of the FP8 fused MoE in fp64, and a bound on the kernel's
    distance from it.

    The reference quantizes x and the SiLU-and-mul output per (row, 128 columns) with the torch
    helper and multiplies the dequantized values with the dequantized experts. The kernel path
    quantizes x identically; after that it differs by fp32 accumulation (ACCUM_EPS per step), by
    rounding gate/up, SiLU, the product and the expert outputs to x's dtype (one eps each; SiLU's
    slope is at most 1.1), and so by where its intermediate lands among the e4m3 values: the bound
    takes the whole range of quantized values that intermediate can round to (fake_quant_range).
    """
    eps = torch.finfo(x.dtype).eps + 2.0 ** -22  # rounding to x's dtype plus fp32 op rounding
    x_hat = dequantize_fp8(*quantize_fp8(x, ACTIVATION_GROUP), ACTIVATION_GROUP, torch.float64)[:, None, :]
    w13d = dequantize_fp8_weight(w13, w13_scale, torch.float64)[topk_ids]  # (T, k, 2I, H), exact
    w2d = dequantize_fp8_weight(w2, w2_scale, torch.float64)[topk_ids]  # (T, k, H, I)
    hidden_size, inter = x.shape[1], w2.shape[2]
    gate_up = matvec(w13d, x_hat)
    gu_err = (hidden_size + 3) * ACCUM_EPS * matvec(w13d.abs(), x_hat.abs())
    gu_err = gu_err + eps * (gate_up.abs() + gu_err)
    (gate, up), (gate_err, up_err) = gate_up.chunk(2, -1), gu_err.chunk(2, -1)
    act = F.silu(gate)
    act_err = SILU_LIPSCHITZ * gate_err + eps * (act.abs() + SILU_LIPSCHITZ * gate_err)
    h = act * up
    h_err = act_err * up.abs() + (act.abs() + act_err) * up_err
    h_err = h_err + eps * (h.abs() + h_err)
    h_ref = dequantize_fp8(*quantize_fp8(h.float(), ACTIVATION_GROUP), ACTIVATION_GROUP, torch.float64)
    h_lo, h_hi = fake_quant_range(h, h_err)
    assert ((h_lo <= h_ref) & (h_ref <= h_hi)).all()
    y = matvec(w2d, h_ref)
    y_err = (matvec(w2d.abs(), torch.maximum(h_hi - h_ref, h_ref - h_lo))
             + (inter + 3) * ACCUM_EPS * matvec(w2d.abs(), torch.maximum(h_lo.abs(), h_hi.abs())))
    weights = topk_weights.double()[..., None]
    y_err = weights * (y_err + eps * (y.abs() + y_err))  # routed-weight product, rounding to dtype
    out = (weights * y).sum(1)
    out_err = y_err.sum(1) + topk_ids.shape[1] * 2.0 ** -24 * (weights * (y.abs() + y_err)).sum(1)
    return out, out_err + eps * (out.abs() + out_err)
