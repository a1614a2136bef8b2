"""Neox-style rotary embedding applied in place from a [cos | sin] cache (any frequency scaling baked in)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.backends.triton.common import program_rows, rows_per_program


@triton.jit
def _rotate_heads(X, tokens, token_mask, cos, sin, num_heads, stride_t, stride_h, offs_h, offs_r, mask_r,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    for h0 in range(0, num_heads, BLOCK_H):
        heads = (h0 + offs_h)[None, :, None]
        mask = token_mask[:, None, None] & (heads < num_heads) & mask_r[None, None, :]
        ptr = X + tokens[:, None, None] * stride_t + heads * stride_h + offs_r[None, None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
        tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, positions, CosSin, num_tokens, num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, TOKENS: tl.constexpr,
):
    tokens = program_rows(TOKENS)
    token_mask = tokens < num_tokens
    pos = tl.load(positions + tokens, mask=token_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    mask_r = offs_r < HALF
    row = CosSin + pos[:, None] * stride_cache + offs_r[None, :]
    cs_mask = token_mask[:, None] & mask_r[None, :]
    cos = tl.load(row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(row + HALF, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    _rotate_heads(Q, tokens, token_mask, cos, sin, num_q_heads, stride_qt, stride_qh, offs_h, offs_r, mask_r,
                  HALF, BLOCK_H)
    _rotate_heads(K, tokens, token_mask, cos, sin, num_kv_heads, stride_kt, stride_kh, offs_h, offs_r, mask_r,
                  HALF, BLOCK_H)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q (T, Hq, D) and k (T, Hkv, D) in place at ``positions`` and returns them."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), 16)
    block_r = triton.next_power_of_2(half)
    tokens = rows_per_program(block_h * block_r)
    _rotary_kernel[(triton.cdiv(num_tokens, tokens),)](
        q, k, positions, cos_sin_cache, num_tokens, num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_R=block_r, BLOCK_H=block_h, TOKENS=tokens, num_warps=4,
    )
    return q, k
