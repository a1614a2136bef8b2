"""Paged decode attention (one query per sequence), split along the context with a reduce step."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import INTERPRET, LOG2E, NO_WINDOW, attend_paged_range, dot_precision

_BLOCK_N = 64
_SPLIT_ALIGN = 64  # a split's keys are a multiple of this (of every decode kernel's key tile)
_SPLIT_ALIGN_IN_KERNEL = tl.constexpr(_SPLIT_ALIGN)  # jitted code reads only constexpr globals
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 32


@triton.jit
def decode_slot(Rows, GATHER: tl.constexpr):
    """(sequence, query row) of this program's decode slot: the slot itself, or with GATHER the slot's
    entry of ``Rows`` (int32 (N, 2); sequence -1: a padding slot)."""
    slot = tl.program_id(0)
    if GATHER:
        return tl.load(Rows + 2 * slot), tl.load(Rows + 2 * slot + 1)
    else:
        return slot, slot


@triton.jit
def sequence_split(ctx, window, num_splits, min_split):
    """(first key, keys per split) of one sequence: its own last ``window`` keys cut in num_splits
    parts of at least min_split keys, a multiple of _SPLIT_ALIGN; sized per sequence, so a short
    context in a batch planned for long ones still spreads over the splits."""
    first = tl.maximum(ctx - window, 0)
    split_len = tl.cdiv(tl.cdiv(ctx - first, num_splits), _SPLIT_ALIGN_IN_KERNEL) * _SPLIT_ALIGN_IN_KERNEL
    return first, tl.maximum(split_len, min_split)


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, ctx_lens, block_tables, Rows, Out, PartOut, PartLse, qk_scale, num_splits, min_split,
    window, softcap,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr, GATHER: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # One program per (decode slot, kv head, split): the query heads of a GQA group share K/V loads.
    # Splits divide the keys the query sees: its last `window` ones (NO_WINDOW: all).
    seq, row = decode_slot(Rows, GATHER)
    if seq < 0:
        return
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens + seq)
    first, split_len = sequence_split(ctx, window, num_splits, min_split)
    start = first + split * split_len
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
    q = tl.load(Q + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
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
        tl.store(Out + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=io_mask)
    else:
        tl.store(PartOut + slot * stride_pb + heads[:, None] * stride_ph
                 + split * stride_ps + offs_d[None, :], out, mask=io_mask)
        tl.store(PartLse + slot * stride_lb + heads * stride_lh + split,
                 m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    PartOut, PartLse, ctx_lens, Rows, Out, num_splits, min_split, window,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr,
):
    seq, row = decode_slot(Rows, GATHER)
    if seq < 0:
        return
    slot = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx = tl.load(ctx_lens + seq)
    first, split_len = sequence_split(ctx, window, num_splits, min_split)
    num_valid = tl.minimum(tl.cdiv(ctx - first, split_len), num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_valid
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(PartLse + slot * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = tl.where(mask_s, weights, 0.0)
    part = tl.load(PartOut + slot * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(part * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1e-30)
    tl.store(Out + row.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 128


def num_decode_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits to give every SM a few programs, none shorter than _MIN_SPLIT_LEN keys."""
    wanted = triton.cdiv(2 * _sm_count(device), max(batch * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_context, _MIN_SPLIT_LEN), _MAX_SPLITS))


def plan_splits(max_context: int, num_splits: int | None, batch: int, num_kv_heads: int,
                device: torch.device) -> tuple[int, int]:
    """(splits per sequence, fewest keys per split) of a decode launch. ``max_context`` only bounds the
    grid (under CUDA graphs it is the model's limit): each sequence cuts its own context in the kernel.
    Splits asked for explicitly may be as short as one key tile."""
    if num_splits is None:
        num_splits, min_split = num_decode_splits(batch, num_kv_heads, max_context, device), _MIN_SPLIT_LEN
    else:
        min_split = _SPLIT_ALIGN
    return max(1, min(num_splits, triton.cdiv(max(max_context, 1), min_split))), min_split


def decode_rows(query_lens: Sequence[int], capacity: int | None = None) -> torch.Tensor:
    """The decode slots of a mixed step as int32 (N, 2) rows (sequence, its query row in the packed
    step) for the sequences of one new token, built on the host; with ``capacity`` padded to that many
    rows with sequence -1, which the kernels skip."""
    rows, start = [], 0
    for seq, q_len in enumerate(query_lens):
        if q_len == 1:
            rows.append((seq, start))
        start += q_len
    if capacity is not None:
        rows += [(-1, 0)] * (capacity - len(rows))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, max_context: int,
                     scale: float, num_splits: int | None = None, out: torch.Tensor | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, D), one token per sequence, over each sequence's paged context (its last
    ``sliding_window`` keys when given; ``softcap`` caps the scaled scores at softcap * tanh(s / softcap)).

    With ``rows`` (int32 (N, 2) of (sequence, row of q), sequence -1 skipped): only those query rows of a
    packed step (T, Hq, D), each against its sequence's context; the other rows of ``out`` are left as
    they are (the decode rows of a mixed step, next to the prefill kernel's rows). The caches may hold fp8
    (e4m3, e5m2): their rows are widened to q's dtype as they are read."""
    num_heads, head_dim = q.shape[1:]
    batch = q.shape[0] if rows is None else rows.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    window = sliding_window or NO_WINDOW
    num_splits, min_split = plan_splits(max(min(max_context, window), 1), num_splits, batch, num_kv_heads,
                                        q.device)
    group = num_heads // num_kv_heads
    direct = num_splits == 1
    part_out, part_lse, part_strides, lse_strides = split_buffers(out, num_splits, batch)
    gather_rows = rows if rows is not None else context_lens  # a placeholder, never read
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, context_lens, block_tables, gather_rows, out, part_out, part_lse,
        scale if softcap else scale * LOG2E, num_splits, min_split, window, float(softcap or 0.0),
        q.stride(0), q.stride(1), *k_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), *part_strides, *lse_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=_BLOCK_N, BLOCK_SIZE=block_size, DIRECT=direct,
        GATHER=rows is not None, PREC=dot_precision(q.dtype), UPCAST=INTERPRET, SOFTCAP=bool(softcap),
        num_warps=4 if head_dim <= 64 else 8, num_stages=2,
    )
    if not direct:
        merge_splits(part_out, part_lse, context_lens, out, min_split, window, rows)
    return out


def split_buffers(out: torch.Tensor, num_splits: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """fp32 per-split outputs (slots, H, S, D) and log2-sum-exps (slots, H, S) for out (*, H, D), and their
    strides; with one split the kernel writes out directly and these are placeholders."""
    if num_splits == 1:
        return out, out, (0, 0, 0), (0, 0)
    num_heads, dim = out.shape[1:]
    part_out = torch.empty(slots, num_heads, num_splits, dim, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(slots, num_heads, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse, part_out.stride()[:3], part_lse.stride()[:2]


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                 min_split: int, window: int = NO_WINDOW, rows: torch.Tensor | None = None) -> None:
    """Combines per-split outputs (slots, H, S, D) and log2-sum-exps (slots, H, S) of a split decode into
    out (*, H, D), cut as :func:`sequence_split` cuts each sequence's last ``window`` keys; ``rows`` as in
    :func:`decode_attention`."""
    slots, num_heads, num_splits, head_dim = part_out.shape
    _decode_reduce_kernel[(slots, num_heads)](
        part_out, part_lse, context_lens, rows if rows is not None else context_lens, out, num_splits,
        min_split, window, *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), GATHER=rows is not None, num_warps=4,
    )
