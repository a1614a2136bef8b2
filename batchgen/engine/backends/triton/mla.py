"""Multi-head latent attention kernels: the latent-row store, the absorbed decode over the paged
latent cache (MQA, split along the context) and the expanded varlen prefill (see layers/mla.py).

Both attention kernels take the query and key dims in two parts, the latent (or nope) part and the
rope part, so no operand is padded to a power of two of their sum (DeepSeek-V3: 512 + 64 in decode,
128 + 64 in prefill). The rope key is one row per token shared by every head, read straight from
the latent rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import (
    INTERPRET, LOG2E, dot_precision, fold_scores, mma, needs_long_offsets, program_rows, row_offsets,
    rows_per_program,
)
from batchgen.engine.backends.triton.decode_attention import merge_splits, plan_splits, sequence_split, split_buffers
from batchgen.engine.backends.triton.kv_store import as_cache_rows
# The tile list (prefill_work) is cut in query tiles of _BLOCK_M rows; this kernel walks the same list.
from batchgen.engine.backends.triton.prefill_attention import _BLOCK_M as PREFILL_BLOCK_M, query_tile


@triton.jit
def _store_latent_kernel(Latent, Cache, slot_mapping, num_tokens, stride_lt, stride_cb, stride_cs,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = program_rows(ROWS)
    slot = tl.load(slot_mapping + token, mask=token < num_tokens, other=-1).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (slot >= 0) & (offs < WIDTH)  # padding tokens have no slot
    row = tl.load(Latent + token[:, None] * stride_lt + offs, mask=mask)
    dst = Cache + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs
    tl.store(dst, row.to(Cache.dtype.element_ty), mask=mask)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes rows (T, W) into the cache (num_blocks, block_size, W); slots < 0 are skipped."""
    num_tokens, width = latent.shape
    if num_tokens == 0:
        return
    latent, cache = as_cache_rows(latent, cache)
    assert latent.stride(-1) == 1 and cache.stride(-1) == 1 and slot_mapping.numel() == num_tokens
    block = triton.next_power_of_2(width)
    per_program = rows_per_program(block)
    _store_latent_kernel[(triton.cdiv(num_tokens, per_program),)](
        latent, cache, slot_mapping, num_tokens, latent.stride(0), *cache.stride()[:2],
        WIDTH=width, BLOCK=block, ROWS=per_program, BLOCK_SIZE=cache.shape[1], num_warps=4)


@triton.jit
def _mla_decode_kernel(
    Q, Cache, ctx_lens, block_tables, Out, PartOut, PartLse, qk_scale, num_splits, min_split, num_heads,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_bt, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # One program per (sequence, block of heads, split of the context): the heads share each latent tile.
    seq = tl.program_id(0)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens + seq)
    _, split_len = sequence_split(ctx, ctx, num_splits, min_split)
    start = split * split_len
    if start >= ctx:
        return
    end = tl.minimum(ctx, start + split_len)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h, mask_r, mask_p = heads < num_heads, offs_r < RANK, offs_p < ROPE
    q_rows = Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_latent = tl.load(q_rows + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_rows + RANK + offs_p[None, :], mask=mask_h[:, None] & mask_p[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        latent = tl.load(Cache + rows[:, None] + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                         other=0.0).to(q_latent.dtype)
        k_pe_t = tl.load(Cache + rows[None, :] + RANK + offs_p[:, None], mask=valid[None, :] & mask_p[:, None],
                         other=0.0).to(q_pe.dtype)
        qk = (mma(q_latent, tl.trans(latent), PREC, UPCAST) + mma(q_pe, k_pe_t, PREC, UPCAST)) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        acc, m_i, l_i = fold_scores(acc, m_i, l_i, qk, latent, PREC, UPCAST)

    out = acc / l_i[:, None]  # every split that runs holds at least one key
    io_mask = mask_h[:, None] & mask_r[None, :]
    if DIRECT:
        tl.store(Out + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
                 out.to(Out.dtype.element_ty), mask=io_mask)
    else:
        tl.store(PartOut + seq.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                 + offs_r[None, :], out, mask=io_mask)
        tl.store(PartLse + seq.to(tl.int64) * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                 mask=mask_h)


def _decode_tiles(rank: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, num_stages): a 512-wide latent tile of 32 bf16 rows is 32 KB per stage, within 99 KB
    of shared memory (sm_86/89) at two stages."""
    if dtype == torch.float32 or rank > 512:
        return 16, 1
    return 32, 2


def mla_decode(q: torch.Tensor, cache: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
               max_context: int, rank: int, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Attention of q (B, H, rank + rope) over each sequence's latent rows (an fp8 cache's widened to q's
    dtype as they are read); values are their first ``rank`` dims. Returns (B, H, rank)."""
    batch, num_heads, width = q.shape
    assert width == cache.shape[-1] and q.stride(-1) == 1 and cache.stride(-1) == 1
    out = q.new_empty(batch, num_heads, rank)
    if batch == 0:
        return out
    block_h = 16  # tl.dot's smallest tile; a larger one would re-read each latent tile less often
    head_blocks = triton.cdiv(num_heads, block_h)
    num_splits, min_split = plan_splits(max_context, num_splits, batch, head_blocks, q.device)
    direct = num_splits == 1
    part_out, part_lse, part_strides, lse_strides = split_buffers(out, num_splits, batch)
    block_n, num_stages = _decode_tiles(rank, q.dtype)
    _mla_decode_kernel[(batch, head_blocks, num_splits)](
        q, cache, context_lens, block_tables, out, part_out, part_lse, scale * LOG2E, num_splits, min_split, num_heads,
        q.stride(0), q.stride(1), *cache.stride()[:2], block_tables.stride(0), out.stride(0), out.stride(1),
        *part_strides, *lse_strides,
        RANK=rank, ROPE=width - rank, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=max(16, triton.next_power_of_2(width - rank)), BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=cache.shape[1], DIRECT=direct, PREC=dot_precision(q.dtype), UPCAST=INTERPRET,
        num_warps=4, num_stages=num_stages,
    )
    if not direct:
        merge_splits(part_out, part_lse, context_lens, out, min_split)
    return out


@triton.jit
def _mla_prefill_tile(acc, m_i, l_i, q_nope, q_pe, k_nope_base, v_base, k_pe_base, pos, valid, mask,
                      stride_kt, stride_vt, stride_pt, offs_d, mask_d, offs_p, mask_p, offs_v, mask_v, qk_scale,
                      USE_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, LONG: tl.constexpr):
    """Folds the keys at ``pos`` (those ``valid`` exist) into (acc, max, sum); ``mask`` (M, N) when USE_MASK."""
    pos = row_offsets(pos, LONG)  # a 128-head rank's keys pass 2**31 elements at 64K keys
    k_t = tl.load(k_nope_base + pos[None, :] * stride_kt + offs_d[:, None], mask=valid[None, :] & mask_d[:, None],
                  other=0.0)
    pe_t = tl.load(k_pe_base + pos[None, :] * stride_pt + offs_p[:, None], mask=valid[None, :] & mask_p[:, None],
                   other=0.0)
    v = tl.load(v_base + pos[:, None] * stride_vt + offs_v[None, :], mask=valid[:, None] & mask_v[None, :],
                other=0.0)
    qk = (mma(q_nope, k_t, PREC, UPCAST) + mma(q_pe, pe_t, PREC, UPCAST)) * qk_scale
    if USE_MASK:
        qk = tl.where(mask, qk, float("-inf"))
    return fold_scores(acc, m_i, l_i, qk, v, PREC, UPCAST)


@triton.jit
def _mla_prefill_kernel(
    Q, KNope, V, KPe, Out, cu_q, cu_k, work, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_ot, stride_oh,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    LONG: tl.constexpr,
):
    # As the varlen prefill kernel: one program per (head, query tile of the step's tile list); a
    # sequence's keys are its whole context, contiguous, and its queries its last q_len tokens.
    head = tl.program_id(0)
    seq = tl.load(work + 2 * tl.program_id(1))
    if seq < 0:
        return
    m_start, q_start, q_len, k_start, kc_len = query_tile(work, cu_q, cu_k, seq)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d, offs_p, offs_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_V)
    mask_d, mask_p, mask_v, mask_m = offs_d < NOPE, offs_p < ROPE, offs_v < V_DIM, offs_m < q_len
    q_rows = Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q_nope = tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pe = tl.load(q_rows + NOPE + offs_p[None, :], mask=mask_m[:, None] & mask_p[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    keys = k_start.to(tl.int64)
    k_nope_base = KNope + keys * stride_kt + head * stride_kh
    v_base = V + keys * stride_vt + head * stride_vh
    k_pe_base = KPe + keys * stride_pt
    # Query row j sees key t when t <= diag + j; tiles every row sees in full need no mask.
    diag = kc_len - q_len
    end = tl.minimum(kc_len, diag + m_start + BLOCK_M)
    full_end = tl.maximum(tl.minimum(kc_len, diag + m_start + 1), 0) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        acc, m_i, l_i = _mla_prefill_tile(acc, m_i, l_i, q_nope, q_pe, k_nope_base, v_base, k_pe_base, pos,
                                          pos < kc_len, mask_m[:, None], stride_kt, stride_vt, stride_pt,
                                          offs_d, mask_d, offs_p, mask_p, offs_v, mask_v, qk_scale,
                                          False, PREC, UPCAST, LONG)
    for n0 in range(full_end, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < kc_len
        mask = valid[None, :] & (pos[None, :] <= diag + offs_m[:, None])
        acc, m_i, l_i = _mla_prefill_tile(acc, m_i, l_i, q_nope, q_pe, k_nope_base, v_base, k_pe_base, pos,
                                          valid, mask, stride_kt, stride_vt, stride_pt, offs_d, mask_d, offs_p,
                                          mask_p, offs_v, mask_v, qk_scale, True, PREC, UPCAST, LONG)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out_rows = Out + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh
    tl.store(out_rows + offs_v[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_v[None, :])


def _prefill_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). At DeepSeek-V3's dims bf16 needs 128 KB of shared memory on
    sm_90 (88 KB on sm_86); fp32 holds its queries in 96 KB, so it needs sm_80 or sm_90 and newer."""
    return (16, 8, 1) if dtype == torch.float32 else (64, 8, 2)


def mla_prefill(q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, k_pe: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, work: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Causal attention of q (T, H, nope + rope) over k = [k_nope (Tk, H, nope) | k_pe (Tk, rope) shared
    by the heads] and v (Tk, H, v_dim), queries aligned to the end of each sequence's keys; ``work``
    is :func:`prefill_work` of the query and context lengths. Returns (T, H, v_dim)."""
    num_tokens, num_heads, qk_dim = q.shape
    nope, rope, v_dim = k_nope.shape[-1], k_pe.shape[-1], v.shape[-1]
    assert qk_dim == nope + rope and all(t.stride(-1) == 1 for t in (q, k_nope, v, k_pe))
    out = q.new_empty(num_tokens, num_heads, v_dim)
    if num_tokens == 0 or work.shape[0] == 0:
        return out
    block_n, num_warps, num_stages = _prefill_tiles(q.dtype)
    _mla_prefill_kernel[(num_heads, work.shape[0])](
        q, k_nope, v, k_pe, out, cu_seqlens_q, cu_seqlens_k, work, scale * LOG2E,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), v.stride(0), v.stride(1), k_pe.stride(0),
        out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, V_DIM=v_dim, BLOCK_D=max(16, triton.next_power_of_2(nope)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_V=max(16, triton.next_power_of_2(v_dim)),
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=block_n, PREC=dot_precision(q.dtype), UPCAST=INTERPRET,
        LONG=needs_long_offsets(k_nope, v, k_pe), num_warps=num_warps, num_stages=num_stages,
    )
    return out
