"""Attention backend in plain torch: the CPU path and the reference for the Triton kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.layers.attention import AttentionMetadata


class TorchAttentionBackend:
    """Packed varlen attention with SDPA; never builds a padded batch for prefill."""

    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if meta.decode_only:
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                meta.max_seqlen_k, scale)
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
                                       meta.context_lens[rows], max_ctx, scale)
        else:
            decode_rows = []
        for i in set(range(meta.num_seqs)).difference(decode_rows):
            start, end, ctx_len = starts[i], starts[i + 1], meta.context_lens_list[i]
            if ctx_len == end - start:  # no cached prefix: attend to the fresh k/v directly
                ks, vs = k[start:end], v[start:end]
            else:
                ks = gather_context(k_cache, meta.block_tables[i], ctx_len)
                vs = gather_context(v_cache, meta.block_tables[i], ctx_len)
            out[start:end] = causal_attention(q[start:end], ks, vs, scale)
        return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, max_ctx: int, scale: float) -> torch.Tensor:
    """One query per sequence: gather each context's blocks into a padded batch and mask the padding."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_ctx // block_size)
    blocks = block_tables[:, :num_blocks].long().clamp(min=0).flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # (B, Hkv, max_ctx, D)
        ctx = cache.index_select(0, blocks).view(batch, num_blocks * block_size, num_kv_heads, head_dim)
        return ctx[:, :max_ctx].transpose(1, 2).to(q.dtype)

    positions = torch.arange(max_ctx, device=q.device)
    mask = (positions[None, :] < context_lens[:, None].to(positions.dtype))[:, None, None, :]
    # The query heads sharing a KV head act as that head's queries: no K/V expansion for GQA.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    return out.reshape(q.shape)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """The first ctx_len cached tokens of one sequence, as (ctx_len, Hkv, D)."""
    block_size = cache.shape[1]
    num_blocks = (ctx_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:ctx_len]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q (Lq, Hq, D) against k/v (Lk, Hkv, D), queries aligned to the end."""
    q_len, k_len = q.shape[0], k.shape[0]
    # 4-D (1, H, L, D) views: torch's CPU flash kernel only takes batched inputs (3-D falls back to math).
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k.to(q.dtype), v.to(q.dtype)))
    gqa = q.shape[1] != k.shape[1]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(diagonal=k_len - q_len)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
