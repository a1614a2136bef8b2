"""Paged decode attention (one query per sequence), split along the context with a reduce step."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import INTERPRET, LOG2E, NO_WINDOW, attend_paged_range, dot_precision

_BLOCK_N = 64
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, ctx_lens, block_tables, Out, PartOut, PartLse, qk_scale, split_len, window, softcap,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # One program per (sequence, kv head, split): the query heads of a GQA group share K/V loads.
    # Splits divide the keys the query sees: its last `window` ones (NO_WINDOW: all).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens + seq)
    start = tl.maximum(ctx - window, 0) + split * split_len
    if start >= ctx:
        return
    end = tl.minimum(ctx, start + split_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    io_mask = mask_g[:, None] & mask_d[None, :]
    q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = attend_paged_range(acc, m_i, l_i, q, KCache, VCache, table_row, start, end, kv_head,
                                       offs_n, offs_d, mask_d, qk_scale, stride_cb, stride_cs, stride_ch,
                                       BLOCK_SIZE, BLOCK_N, PREC, UPCAST, softcap=softcap, SOFTCAP=SOFTCAP)

    out = acc / l_i[:, None]  # every split that runs holds at least one key
    if DIRECT:
        tl.store(Out + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=io_mask)
    else:
        tl.store(PartOut + seq.to(tl.int64) * stride_pb + heads[:, None] * stride_ph
                 + split * stride_ps + offs_d[None, :], out, mask=io_mask)
        tl.store(PartLse + seq.to(tl.int64) * stride_lb + heads * stride_lh + split,
                 m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    PartOut, PartLse, ctx_lens, Out, split_len, num_splits, window,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_lens + seq)
    num_valid = tl.minimum(tl.cdiv(tl.minimum(ctx, window), split_len), num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_valid
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(PartLse + seq.to(tl.int64) * stride_lb + head * stride_lh + offs_s,
                  mask=mask_s, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = tl.where(mask_s, weights, 0.0)
    part = tl.load(PartOut + seq.to(tl.int64) * stride_pb + head * stride_ph
                   + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(part * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1e-30)
    tl.store(Out + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 128


def num_decode_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every SM a few programs, none shorter than _MIN_SPLIT_LEN keys."""
    wanted = triton.cdiv(2 * _sm_count(device), max(batch * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_context, _MIN_SPLIT_LEN), _MAX_SPLITS))


def split_context(max_context: int, num_splits: int) -> tuple[int, int]:
    """(keys per split, a multiple of the key tile, and the splits that leaves) for about num_splits splits."""
    split_len = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), _BLOCK_N) * _BLOCK_N
    return split_len, triton.cdiv(max(max_context, 1), split_len)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, max_context: int,
                     scale: float, num_splits: int | None = None, out: torch.Tensor | None = None,
                     sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, D), one token per sequence, over each sequence's paged context (its last
    ``sliding_window`` keys when given; ``softcap`` caps the scaled scores at softcap * tanh(s / softcap))."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    window = sliding_window or NO_WINDOW
    keys = max(min(max_context, window), 1)  # the most keys one query sees
    if num_splits is None:
        num_splits = num_decode_splits(batch, num_kv_heads, keys, q.device)
    split_len, num_splits = split_context(keys, num_splits)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    direct = num_splits == 1
    part_out, part_lse, part_strides, lse_strides = split_buffers(out, num_splits)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, context_lens, block_tables, out, part_out, part_lse,
        scale if softcap else scale * LOG2E, split_len, window, float(softcap or 0.0), q.stride(0), q.stride(1),
        *k_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), *part_strides, *lse_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=_BLOCK_N, BLOCK_SIZE=block_size, DIRECT=direct,
        PREC=dot_precision(q.dtype), UPCAST=INTERPRET, SOFTCAP=bool(softcap),
        num_warps=4 if head_dim <= 64 else 8, num_stages=2,
    )
    if not direct:
        merge_splits(part_out, part_lse, context_lens, out, split_len, window)
    return out


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """fp32 per-split outputs (B, H, S, D) and log2-sum-exps (B, H, S) for out (B, H, D), and their
    strides; with one split the kernel writes out directly and these are placeholders."""
    if num_splits == 1:
        return out, out, (0, 0, 0), (0, 0)
    batch, num_heads, dim = out.shape
    part_out = torch.empty(batch, num_heads, num_splits, dim, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse, part_out.stride()[:3], part_lse.stride()[:2]


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                 split_len: int, window: int = NO_WINDOW) -> None:
    """Combines per-split outputs (B, H, S, D) and log2-sum-exps (B, H, S) of a split decode into out (B, H, D);
    the splits cover each sequence's last ``window`` keys."""
    batch, num_heads, num_splits, head_dim = part_out.shape
    _decode_reduce_kernel[(batch, num_heads)](
        part_out, part_lse, context_lens, out, split_len, num_splits, window, *part_out.stride()[:3],
        *part_lse.stride()[:2], out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
