"""Fused mixture-of-experts: (token, expert) pairs sorted by expert, then two grouped GEMMs.

The scheme of vLLM's fused_moe: the pairs are counting-sorted by expert and each expert's run is
padded to the row tile, so every row tile belongs to one expert; a grouped GEMM gathers a tile's
rows by pair index and multiplies them with that expert's weights. Gate/up, SiLU-and-mul, then
down with the routing weight folded in, then the sum over the top-k. Experts with no tokens get
no tiles. Bf16/fp16/fp32 weights, or FP8 weights with per-token-group FP8 activations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.activation import silu_and_mul
from batchgen.engine.backends.triton.common import INTERPRET, dot_precision, gemm_tile, grouped_tile_order
from batchgen.engine.backends.triton.fp8.format import FP8_BLOCK, FP8_DTYPE
from batchgen.engine.backends.triton.fp8.gemm import WeightScaleArgs, weight_scale_args
from batchgen.engine.backends.triton.fp8.quant import quantize_fp8_activation


@dataclass(frozen=True)
class MoEAlignment:
    """Pairs p = token * top_k + slot grouped by expert, each expert's run padded to ``block_m`` rows."""

    sorted_ids: torch.Tensor  # int32 (capacity,): pair per row; padding rows hold num_pairs
    expert_ids: torch.Tensor  # int32 (capacity // block_m,): the expert of each row tile
    num_padded: torch.Tensor  # int32 (1,): rows in use; tiles past it are skipped
    block_m: int


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         skip_negative: bool = False) -> MoEAlignment:
    """Counting-sorts the pairs of topk_ids (T, k) by expert, in torch ops without a host sync.

    The row capacity is a bound that depends only on the shapes (a CUDA graph can hold it): each
    expert with tokens adds at most ``block_m - 1`` padding rows. With ``skip_negative``, pairs of id
    -1 (computed by another expert-parallel rank) get no row.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    shift = int(skip_negative)  # bin 0 holds the skipped pairs, bin e + 1 expert e
    bins = flat + shift
    counts_all = torch.zeros(num_experts + shift, dtype=torch.long, device=flat.device)
    counts_all.scatter_add_(0, bins, torch.ones_like(bins))  # an id outside [0, E) (or -1) fails here
    counts = counts_all[shift:]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(bins, stable=True)
    bin_of_row = bins[order]
    rank_in_bin = torch.arange(num_pairs, device=flat.device) - (counts_all.cumsum(0) - counts_all)[bin_of_row]
    target = (padded_end - padded)[(bin_of_row - shift).clamp(min=0)] + rank_in_bin
    if shift:  # skipped pairs land in one slot past the capacity, dropped below
        target = torch.where(bin_of_row > 0, target, capacity)
    sorted_ids = torch.full((capacity + shift,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[target] = order.to(torch.int32)
    sorted_ids = sorted_ids[:capacity]
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return MoEAlignment(sorted_ids, expert_ids, padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _grouped_gemm_kernel(
    A, B, C, AScale, BScale, topk_weights, sorted_ids, expert_ids, num_padded, N, K, num_pairs, capacity,
    stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn, stride_bsk,
    TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUP_N: tl.constexpr, SCALED: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """C[p] = A[p // TOP_K] @ B[e]^T (x topk_weights[p]) for the pairs p of one (row tile, column tile).

    A (rows, K) and C (pairs, N) row-major; B (E, N, K) with unit K stride; sorted_ids / expert_ids /
    num_padded from moe_align_block_size. SCALED: A and B are FP8, AScale (rows, ceil(K/BLOCK_K))
    and BScale indexed as fp8.gemm.WeightScaleArgs describes, per expert at stride_bse.
    """
    pid_m, pid_n = grouped_tile_order(tl.program_id(0), capacity // BLOCK_M, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    pairs = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N wrap around (their results are not stored), so B loads need no column mask.
    acc = gemm_tile(A, B + expert * stride_be, AScale, BScale + expert * stride_bse,
                    (pairs // TOP_K).to(tl.int64), pair_mask, cols % N, K, stride_am, stride_bn,
                    stride_asm, 1, stride_bsn, stride_bsk, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N,
                    SCALED, PREC, UPCAST)
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights + pairs, mask=pair_mask, other=0.0)[:, None]
    tl.store(C + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=pair_mask[:, None] & (cols < N)[None, :])


@dataclass(frozen=True)
class _Tiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Row tile from the mean rows per expert: decode-sized batches waste less padding on small tiles."""
    rows = num_pairs / num_experts
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def _tiles(dtype: torch.dtype) -> _Tiles:
    """Tiles per operand type; every one fits 99 KB of shared memory (Ada, Ampere consumer GPUs)."""
    if dtype == FP8_DTYPE:
        return _Tiles(128, FP8_BLOCK, 4, 3)  # a K tile is one activation scale group
    if dtype == torch.float32:
        return _Tiles(64, 32, 4, 2)
    return _Tiles(128, 64, 4, 3)


def _grouped_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, align: MoEAlignment,
                  top_k: int, topk_weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                  scales: WeightScaleArgs | None = None) -> None:
    """out[p] = a[p // top_k] @ weight[expert(p)]^T (x topk_weights[p]) for every pair p."""
    n, k = weight.shape[1:]
    tiles = _tiles(weight.dtype)
    capacity = align.sorted_ids.shape[0]
    grid = (capacity // align.block_m * triton.cdiv(n, tiles.block_n),)
    a_scale_arg = a_scale if a_scale is not None else a
    scale_arg = scales if scales is not None else WeightScaleArgs(a, 1, 0, 0, 0)
    _grouped_gemm_kernel[grid](
        a, weight, out, a_scale_arg, scale_arg.scale, topk_weights if topk_weights is not None else out,
        align.sorted_ids, align.expert_ids, align.num_padded, n, k, out.shape[0], capacity,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        a_scale_arg.stride(0), scale_arg.stride_e, scale_arg.stride_n, scale_arg.stride_k,
        TOP_K=top_k, MUL_ROUTED_WEIGHT=topk_weights is not None, BLOCK_M=align.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=8, GROUP_N=scale_arg.group_n,
        SCALED=scales is not None, PREC=dot_precision(a.dtype), UPCAST=INTERPRET,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe takes x (T, H), w13 (E, 2I, H), w2 (E, H, I); got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    (tokens, hidden), (experts, two_i, w13_hidden) = x.shape, w13.shape
    if w13_hidden != hidden or two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"expert weights do not fit x (T, H) = {tuple(x.shape)}: w13 {tuple(w13.shape)} "
                         f"must be (E, 2I, H) and w2 {tuple(w2.shape)} (E, H, I)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be (T, k) with T = {tokens}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, skip_negative: bool = False) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    x (T, H) bf16/fp16/fp32; w13 (E, 2I, H), gate rows first then up rows; w2 (E, H, I); weights
    in x's dtype, or float8_e4m3fn with float32 ``w13_scale``/``w2_scale`` per 128x128 block
    ((E, ceil(2I/128), ceil(H/128)) and (E, ceil(H/128), ceil(I/128)): separate gate and up
    scales stack into that only when I is a multiple of 128), per row ((E, N, 1)) or per expert
    ((E,)). topk_weights float (T, k), topk_ids int32/int64 (T, k) in [0, E), or -1 with
    ``skip_negative`` for a pair another expert-parallel rank computes (it adds nothing; the pairs'
    outputs are then zero-filled first). Returns (T, H) in x's dtype.
    """
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    experts, intermediate, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    pairs = tokens * top_k
    align = moe_align_block_size(topk_ids, experts, _block_m(pairs, experts), skip_negative)
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(pairs, 2 * intermediate, dtype=x.dtype, device=x.device)
    down = (torch.zeros if skip_negative else torch.empty)(pairs, hidden, dtype=x.dtype, device=x.device)
    if w13.dtype == FP8_DTYPE:
        w13_scales, w2_scales = _fp8_expert_scales(w13, w2, w13_scale, w2_scale)
        x_q, x_scale = quantize_fp8_activation(x)
        _grouped_gemm(x_q, w13, gate_up, align, top_k, a_scale=x_scale, scales=w13_scales)
        act_q, act_scale = quantize_fp8_activation(silu_and_mul(gate_up))
        _grouped_gemm(act_q, w2, down, align, 1, weights, a_scale=act_scale, scales=w2_scales)
    else:
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"expert weights ({w13.dtype}, {w2.dtype}) must have x's dtype {x.dtype} or be FP8")
        _grouped_gemm(x, w13, gate_up, align, top_k)
        _grouped_gemm(silu_and_mul(gate_up), w2, down, align, 1, weights)
    return torch.sum(down.view(tokens, top_k, hidden), dim=1, out=out)


def _fp8_expert_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                       w2_scale: torch.Tensor | None) -> tuple[WeightScaleArgs, WeightScaleArgs]:
    if w2.dtype != FP8_DTYPE or w13_scale is None or w2_scale is None:
        raise ValueError("FP8 experts need both w13 and w2 in float8_e4m3fn, with w13_scale and w2_scale")
    return weight_scale_args(w13, w13_scale), weight_scale_args(w2, w2_scale)
