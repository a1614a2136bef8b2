"""Pieces shared by the kernels: matmul wrapper, GEMM tile loop, online-softmax step, paged K/V loads."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The interpreter multiplies bf16 operands as their raw uint16 bits, so dots are upcast there.
try:
    INTERPRET: bool = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


LOG2E: float = 1.4426950408889634
_LOG2E_IN_KERNEL = tl.constexpr(LOG2E)  # jitted code reads only constexpr globals
NO_WINDOW = 1 << 30  # the window the kernels take for full attention: longer than any context
ROW_TILE = 1024  # elements a row-wise kernel's program covers at least: narrow rows share a program


def rows_per_program(block: int) -> int:
    """Rows one program of a row-wise kernel takes, for rows padded to ``block`` elements: one for rows of
    ROW_TILE or more (every real model), more for narrow ones, which would leave most of a program idle. It
    depends on the width alone, so a row's arithmetic does not depend on the batch."""
    return max(1, ROW_TILE // block)


@triton.jit
def program_rows(ROWS: tl.constexpr):
    """The rows (int64) this program of a row-wise kernel takes: ROWS from rows_per_program."""
    return tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (torch's default), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def needs_long_offsets(*tensors: torch.Tensor) -> bool:
    """Whether a row offset (row index * stride(0)) of any of these tensors can pass 2**31 elements: then
    the kernels compute key offsets in int64 (a variant compiled only for such sizes: int64 offset tiles
    cost registers)."""
    return any(t.shape[0] * t.stride(0) >= 2**31 for t in tensors)


@triton.jit
def row_offsets(rows, LONG: tl.constexpr):
    """rows as offsets that cannot overflow when LONG (int64), else as they are (int32)."""
    if LONG:
        return rows.to(tl.int64)
    else:
        return rows


@triton.jit
def mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC, out_dtype=tl.float32)


@triton.jit
def grouped_tile_order(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program pid, walking GROUP_M row tiles per column so B tiles stay in L2."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    return pid_m, pid_n


@triton.jit
def gemm_tile(A, B, AScale, BScale, a_rows, row_mask, b_cols, K, stride_am, stride_bn,
              stride_asm, stride_ask, stride_bsn, stride_bsk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_N: tl.constexpr, SCALED: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """A[a_rows, :K] @ B[b_cols, :K]^T as a (BLOCK_M, BLOCK_N) fp32 tile; rows off row_mask read as 0.

    A and B are row-major with unit K stride; a_rows are int64, b_cols in range. SCALED (FP8): A
    row r, K tile t is scaled by AScale[r * stride_asm + t * stride_ask] and B row n by
    BScale[(n // GROUP_N) * stride_bsn + t * stride_bsk], so BLOCK_K must be the scale group along K.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + b_cols[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    if SCALED:
        a_scale_ptrs = AScale + a_rows * stride_asm
        b_scale_ptrs = BScale + (b_cols // GROUP_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - t * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if SCALED:
            a_scale = tl.load(a_scale_ptrs + t * stride_ask, mask=row_mask, other=0.0)
            b_scale = tl.load(b_scale_ptrs + t * stride_bsk)
            acc += mma(a, b, PREC, UPCAST) * a_scale[:, None] * b_scale[None, :]
        else:
            acc += mma(a, b, PREC, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def softmax_step(acc, m_i, l_i, q, k_t, v, mask, qk_scale,
                 USE_MASK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                 softcap=0.0, SOFTCAP: tl.constexpr = False):
    """Folds one key tile into the running (acc, max, sum); scores are in log2 units.

    q (M, D), k_t (D, N), v (N, D), mask (M, N) or broadcastable; acc (M, D) fp32. With SOFTCAP,
    ``qk_scale`` is the plain softmax scale and the scaled scores s become softcap * tanh(s / softcap)
    (tanh(x) = 2 sigmoid(2x) - 1) before the conversion to log2 units.
    """
    qk = mma(q, k_t, PREC, UPCAST) * qk_scale
    if SOFTCAP:
        qk = (softcap * _LOG2E_IN_KERNEL) * (2.0 * tl.sigmoid(qk * (2.0 / softcap)) - 1.0)
    if USE_MASK:
        qk = tl.where(mask, qk, float("-inf"))
    return fold_scores(acc, m_i, l_i, qk, v, PREC, UPCAST)


@triton.jit
def fold_scores(acc, m_i, l_i, qk, v, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The online-softmax update for a tile of scores qk (M, N), scaled to log2 units and masked
    with -inf, and its values v (N, D)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PREC, UPCAST)
    return acc, m_new, l_i


@triton.jit
def load_paged_kv(KCache, VCache, block_table_row, offs_n, valid_n, kv_head, offs_d, mask_d,
                  stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, dtype: tl.constexpr):
    """Keys (as D x N) and values (N x D) at token positions offs_n of one sequence's paged cache, in
    ``dtype`` (an fp8 cache's rows widened as they are read)."""
    blk = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=valid_n, other=0).to(tl.int64)
    base = blk * stride_cb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head * stride_ch
    k_t = tl.load(KCache + base[None, :] + offs_d[:, None],
                  mask=valid_n[None, :] & mask_d[:, None], other=0.0)
    v = tl.load(VCache + base[:, None] + offs_d[None, :],
                mask=valid_n[:, None] & mask_d[None, :], other=0.0)
    return k_t.to(dtype), v.to(dtype)


@triton.jit
def attend_paged_range(acc, m_i, l_i, q, KCache, VCache, block_table_row, start, end, kv_head, offs_n,
                       offs_d, mask_d, qk_scale, stride_cb, stride_cs, stride_ch,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                       UPCAST: tl.constexpr, first_key=0, softcap=0.0, WINDOWED: tl.constexpr = False,
                       SOFTCAP: tl.constexpr = False):
    """Folds cached keys start..end-1 of one sequence into (acc, max, sum); all of them are visible, or
    with WINDOWED only the keys at or after each query row's ``first_key`` (an (M,) vector)."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        k_t, v = load_paged_kv(KCache, VCache, block_table_row, pos, valid, kv_head, offs_d, mask_d,
                               stride_cb, stride_cs, stride_ch, BLOCK_SIZE, q.dtype)
        mask = valid[None, :]
        if WINDOWED:
            mask = mask & (pos[None, :] >= first_key[:, None])
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, q, k_t, v, mask, qk_scale,
                                     True, PREC, UPCAST, softcap, SOFTCAP)
    return acc, m_i, l_i
