"""Scatter of packed new K/V into the paged cache through the slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import program_rows, rows_per_program
from batchgen.engine.dtype import FP8_DTYPES, to_cache_dtype


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, slot_mapping, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = program_rows(ROWS)
    slot = tl.load(slot_mapping + token, mask=token < num_tokens, other=-1).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (slot >= 0) & (offs < NUM_KV_HEADS * HEAD_DIM)  # padding tokens have no slot
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    src = token[:, None]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + dim
    k = tl.load(K + src * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(V + src * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes k/v (T, Hkv, D) into caches (num_blocks, block_size, Hkv, D); slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert slot_mapping.numel() == num_tokens
    k, k_cache = as_cache_rows(k, k_cache)
    v, v_cache = as_cache_rows(v, v_cache)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    width = num_kv_heads * head_dim
    block = triton.next_power_of_2(width)
    per_program = rows_per_program(block)
    _store_kv_kernel[(triton.cdiv(num_tokens, per_program),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=block, ROWS=per_program,
        BLOCK_SIZE=k_cache.shape[1], num_warps=4 if width <= 2048 else 8,
    )


def as_cache_rows(rows: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows and the cache as the store kernels take them. A narrower cache's rows are rounded here by
    :func:`to_cache_dtype` (what every backend stores; Triton's interpreter would also round fp32 -> fp8
    wrongly); fp8 rows and cache go as bytes, which the kernel copies."""
    if cache.dtype == rows.dtype:
        return rows, cache
    rows = to_cache_dtype(rows, cache.dtype)
    return (rows.view(torch.uint8), cache.view(torch.uint8)) if cache.dtype in FP8_DTYPES else (rows, cache)
