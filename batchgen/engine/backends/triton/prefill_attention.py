"""Varlen causal flash attention for packed prefill, with an optional prefix read from the paged cache."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import (
    INTERPRET, LOG2E, NO_WINDOW, attend_paged_range, dot_precision, needs_long_offsets, row_offsets, softmax_step,
)


@triton.jit
def query_tile(work, cu_q, cu_k, seq):
    """This program's tile of ``work`` (of sequence seq): its first query row, and where the
    sequence's queries and keys start in the packed step and how many there are."""
    m_start = tl.load(work + 2 * tl.program_id(1) + 1)
    q_start = tl.load(cu_q + seq)
    k_start = tl.load(cu_k + seq)
    return m_start, q_start, tl.load(cu_q + seq + 1) - q_start, k_start, tl.load(cu_k + seq + 1) - k_start


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, KCache, VCache, cu_q, cu_k, ctx_lens, block_tables, work, qk_scale, window, softcap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PREFIX: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, LONG: tl.constexpr,
):
    # One program per (head, query tile); `work` lists the tiles as (sequence, first row), the ones
    # with the most keys to visit first, padded with sequence -1 (so a fixed grid can be captured).
    # Heads vary fastest so a GQA group's programs run together and share K/V in L2.
    head = tl.program_id(0)
    seq = tl.load(work + 2 * tl.program_id(1))
    if seq < 0:
        return
    m_start, q_start, q_len, k_start, kc_len = query_tile(work, cu_q, cu_k, seq)
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_m = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    # Finite start value: a row whose first tile is fully masked must not produce inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Query row j sits at contiguous key diag + j (queries at the end of the keys) and, when causal,
    # sees keys diag + j - window < t <= diag + j (window: NO_WINDOW for full attention).
    diag = kc_len - q_len
    if HAS_PREFIX:
        # The cached prefix precedes every new token: only the window bounds which of it a row sees.
        prefix_len = tl.load(ctx_lens + seq) - kc_len
        first_key = prefix_len + diag + offs_m - window + 1
        table_row = block_tables + seq.to(tl.int64) * stride_bt
        acc, m_i, l_i = attend_paged_range(acc, m_i, l_i, q, KCache, VCache, table_row,
                                           tl.maximum(prefix_len + diag + m_start - window + 1, 0), prefix_len,
                                           kv_head, offs_n, offs_d, mask_d, qk_scale, stride_cb, stride_cs,
                                           stride_ch, BLOCK_SIZE, BLOCK_N, PREC, UPCAST, first_key, softcap,
                                           True, SOFTCAP)

    # Key tiles [start, lo_full) and [full_end, end) need the mask; every row sees all of [lo_full, full_end).
    if CAUSAL:
        start = tl.maximum(diag + m_start - window + 1, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(kc_len, diag + m_start + BLOCK_M)
        full_end = tl.maximum(tl.minimum(kc_len, diag + m_start + 1), 0) // BLOCK_N * BLOCK_N
        lo_full = tl.minimum(tl.cdiv(tl.maximum(diag + m_start + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N,
                             full_end)
    else:
        start = 0
        end = kc_len
        full_end = kc_len // BLOCK_N * BLOCK_N
        lo_full = 0
    k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    # Tiles that slide out of the window for some rows of this block (none without a window).
    for n0 in range(start, lo_full, BLOCK_N):
        pos = row_offsets(n0 + offs_n, LONG)
        k_t = tl.load(k_base + pos[None, :] * stride_kt + offs_d[:, None], mask=mask_d[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        mask = pos[None, :] > diag + offs_m[:, None] - window
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, q, k_t, v, mask, qk_scale, True, PREC, UPCAST,
                                     softcap, SOFTCAP)
    # Tiles every row of this query block sees in full: no mask. Offsets within one sequence fit
    # int32 unless LONG; 64-bit offset tiles made ptxas spill registers at head dim 128.
    for n0 in range(lo_full, full_end, BLOCK_N):
        pos = row_offsets(n0 + offs_n, LONG)
        k_t = tl.load(k_base + pos[None, :] * stride_kt + offs_d[:, None], mask=mask_d[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, q, k_t, v, mask_m[:, None], qk_scale,
                                     False, PREC, UPCAST, softcap, SOFTCAP)
    # Tiles on the diagonal or at the ragged end.
    for n0 in range(full_end, end, BLOCK_N):
        pos = row_offsets(n0 + offs_n, LONG)
        valid = pos < kc_len
        k_t = tl.load(k_base + pos[None, :] * stride_kt + offs_d[:, None],
                      mask=valid[None, :] & mask_d[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)
        mask = valid[None, :]
        if CAUSAL:
            mask = mask & (pos[None, :] <= diag + offs_m[:, None]) & (pos[None, :] > diag + offs_m[:, None] - window)
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, q, k_t, v, mask, qk_scale, True, PREC, UPCAST,
                                     softcap, SOFTCAP)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


_BLOCK_M = 128  # query rows per program; the host-side tile list depends on it


def _tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a head dim.

    Eight warps: with four, ptxas spills registers at head dim 64 (sm_90, see tests/triton_aot.py).
    fp32 tiles are smaller so they fit 99 KB of shared memory (Ada, Ampere consumer GPUs).
    """
    if dtype == torch.float32:
        return 32, 4 if head_dim <= 64 else 8, 1
    return 64, 8, 3 if head_dim <= 64 else 2


def prefill_tile_capacity(num_tokens: int, num_seqs: int) -> int:
    """The most query tiles a step of that many tokens and sequences can have."""
    return triton.cdiv(num_tokens, _BLOCK_M) + num_seqs


def prefill_work(query_lens: Sequence[int], context_lens: Sequence[int],
                 capacity: int | None = None, skip_decodes: bool = False) -> torch.Tensor:
    """The query tiles of a step as int32 (N, 2) rows (sequence, first query row), built on the host.

    Tiles with the most keys to visit come first; with ``capacity`` the list is padded to that
    many rows with sequence -1, which the kernel skips. ``skip_decodes`` leaves out the sequences of
    one new token (the decode kernel computes those: a tile of 128 query rows would hold one).
    """
    tiles = sorted(((ctx - q_len + m + _BLOCK_M, seq, m)
                    for seq, (q_len, ctx) in enumerate(zip(query_lens, context_lens))
                    if not (skip_decodes and q_len == 1)
                    for m in range(0, q_len, _BLOCK_M)), reverse=True)
    rows = [(seq, m) for _, seq, m in tiles]
    if capacity is not None:
        if len(rows) > capacity:
            raise ValueError(f"{len(rows)} query tiles do not fit a capacity of {capacity}")
        rows += [(-1, 0)] * (capacity - len(rows))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, work: torch.Tensor, scale: float, causal: bool = True,
                      k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      context_lens: torch.Tensor | None = None,
                      block_tables: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, sliding_window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Attention of packed q (T, Hq, D) over packed k/v (Tk, Hkv, D), queries aligned to the end.

    ``work`` is the step's tile list from :func:`prefill_work`, on q's device. With a paged cache:
    sequence i first attends to its ``context_lens[i] - klen_i`` cached tokens (read through
    ``block_tables[i]``; an fp8 cache's rows are widened to q's dtype), which sit before its contiguous
    keys. A causal ``sliding_window`` limits each query to its last ``sliding_window`` keys (cached blocks
    before them are never read); ``softcap`` caps the scaled scores at ``softcap * tanh(s / softcap)``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or work.shape[0] == 0:
        return out
    has_prefix = k_cache is not None
    if has_prefix:
        assert v_cache is not None and context_lens is not None and block_tables is not None
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        cache_strides = k_cache.stride()[:3]
        block_size, table_stride = k_cache.shape[1], block_tables.stride(0)
    else:
        k_cache = v_cache = context_lens = block_tables = k  # placeholders, never read
        cache_strides, block_size, table_stride = (0, 0, 0), 1, 0
    block_n, num_warps, num_stages = _tiles(head_dim, q.dtype)
    _prefill_kernel[(num_heads, work.shape[0])](
        q, k, v, out, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, context_lens, block_tables, work,
        scale if softcap else scale * LOG2E, sliding_window or NO_WINDOW, float(softcap or 0.0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), *cache_strides, table_stride,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_SIZE=block_size, CAUSAL=causal,
        HAS_PREFIX=has_prefix, PREC=dot_precision(q.dtype), UPCAST=INTERPRET, SOFTCAP=bool(softcap),
        LONG=needs_long_offsets(k, v), num_warps=num_warps, num_stages=num_stages,
    )
    return out
