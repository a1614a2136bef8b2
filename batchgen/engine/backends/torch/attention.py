"""Attention backend in plain torch: the CPU path and the reference for the Triton kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.dtype import FP8_DTYPES, as_stored, to_cache_dtype

# Score elements one soft-capped matmul may hold (64 MiB of fp32); longer prompts go in query chunks.
_MAX_SCORES = 1 << 24


class TorchAttentionBackend:
    """Packed varlen attention with SDPA; never builds a padded batch for prefill.

    A sliding window reads only the cached blocks inside it; soft-capped scores go through explicit
    matmuls (SDPA cannot cap them), in the order transformers computes them.
    """

    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_rows(k, k_cache, slot_mapping)
        store_rows(v, v_cache, slot_mapping)

    def as_stored(self, k, v, cache_dtype):
        return as_stored(k, cache_dtype), as_stored(v, cache_dtype)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None):
        window = dict(sliding_window=sliding_window, softcap=softcap)
        if meta.decode_only:
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                meta.max_seqlen_k, scale, **window)
        out = torch.empty_like(q)
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        # Single-token rows of a mixed step (decodes) go through one batched call.
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if len(decode_rows) > 1:
            rows = torch.tensor(decode_rows, device=q.device)
            tokens = torch.tensor([starts[i] for i in decode_rows], device=q.device)
            max_ctx = max(meta.context_lens_list[i] for i in decode_rows)
            out[tokens] = paged_decode(q[tokens], k_cache, v_cache, meta.block_tables[rows],
                                       meta.context_lens[rows], max_ctx, scale, **window)
        else:
            decode_rows = []
        for i in set(range(meta.num_seqs)).difference(decode_rows):
            start, end, ctx_len = starts[i], starts[i + 1], meta.context_lens_list[i]
            prefix = ctx_len - (end - start)
            # The first key any of these queries sees: the window's start for the first query.
            first = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
            if first >= prefix:  # every key it needs is new: attend to the fresh k/v directly
                ks, vs = k[start + first - prefix:end], v[start + first - prefix:end]
            else:
                ks = gather_context(k_cache, meta.block_tables[i], ctx_len, first)
                vs = gather_context(v_cache, meta.block_tables[i], ctx_len, first)
            out[start:end] = causal_attention(q[start:end], ks, vs, scale, **window)
        return out


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes rows (T, *row shape) into the cache's slots (a cache of (num_blocks, block_size, *row shape))."""
    rows, cache = to_cache_dtype(rows, cache.dtype), cache.view(-1, *rows.shape[1:])
    if cache.dtype in FP8_DTYPES:  # torch's index_copy_ takes no fp8 on CPU; the bytes are the same
        rows, cache = rows.view(torch.uint8), cache.view(torch.uint8)
    cache.index_copy_(0, slot_mapping, rows)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, max_ctx: int, scale: float, sliding_window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """One query per sequence: gather each context's blocks into a padded batch and mask the padding.

    With a sliding window only the blocks holding each sequence's last ``sliding_window`` keys are read.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_ctx // block_size)
    ctx = context_lens.long()
    if sliding_window is None:
        first_block = torch.zeros_like(ctx)
    else:
        first_block = (ctx - sliding_window).clamp(min=0) // block_size
        num_blocks = min(num_blocks, (sliding_window + block_size - 2) // block_size + 1)
    index = (first_block[:, None] + torch.arange(num_blocks, device=q.device)).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long().gather(1, index).clamp(min=0).flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # (B, Hkv, num_blocks * block_size, D)
        keys = cache.index_select(0, blocks).view(batch, num_blocks * block_size, num_kv_heads, head_dim)
        return keys.transpose(1, 2).to(q.dtype)

    positions = first_block[:, None] * block_size + torch.arange(num_blocks * block_size, device=q.device)
    mask = positions < ctx[:, None]
    if sliding_window is not None:
        mask &= positions >= ctx[:, None] - sliding_window
    mask = mask[:, None, None, :]
    # The query heads sharing a KV head act as that head's queries: no K/V expansion for GQA.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is None:
        out = F.scaled_dot_product_attention(grouped, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    else:
        out = capped_attention(grouped, gather(k_cache), gather(v_cache), mask, scale, softcap)
    return out.reshape(q.shape)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int, first: int = 0) -> torch.Tensor:
    """Cached tokens ``first..ctx_len-1`` of one sequence, as (ctx_len - first, Hkv, D)."""
    block_size = cache.shape[1]
    first_block, end_block = first // block_size, (ctx_len + block_size - 1) // block_size
    keys = cache[block_table[first_block:end_block].long()].flatten(0, 1)
    offset = first - first_block * block_size
    return keys[offset:offset + ctx_len - first]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q (Lq, Hq, D) against k/v (Lk, Hkv, D), queries aligned to the end."""
    q_len, k_len = q.shape[0], k.shape[0]
    # 4-D (1, H, L, D) views: torch's CPU flash kernel only takes batched inputs (3-D falls back to math).
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k.to(q.dtype), v.to(q.dtype)))
    gqa = q.shape[1] != k.shape[1]
    if q_len == k_len and sliding_window is None and softcap is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - q_len)
    if sliding_window is not None:
        mask &= ~torch.ones_like(mask).tril(diagonal=k_len - q_len - sliding_window)
    if softcap is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    groups = q.shape[1] // k.shape[1]
    grouped = qt[0].unflatten(0, (k.shape[1], groups))  # (Hkv, G, Lq, D): a KV head's query heads together
    out = capped_attention(grouped, kt[0, :, None], vt[0, :, None], mask, scale, softcap)
    return out.flatten(0, 1).transpose(0, 1)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float) -> torch.Tensor:
    """Soft-capped attention: q (..., M, D), k and v (..., L, D), mask broadcastable to (..., M, L).

    Scores are scaled, capped (softcap * tanh(s / softcap)), masked and softmaxed in float32 as
    transformers' eager path does; long query dims go in chunks to bound the score memory.
    """
    rows = max(1, _MAX_SCORES // max(1, q[..., :1, :1].numel() * k.shape[-2]))
    chunks = []
    for m in range(0, q.shape[-2], rows):
        part_mask = mask[..., m:m + rows, :] if mask.shape[-2] > 1 else mask
        scores = torch.matmul(q[..., m:m + rows, :], k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~part_mask, float("-inf"))
        chunks.append(torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v))
    return torch.cat(chunks, dim=-2)
