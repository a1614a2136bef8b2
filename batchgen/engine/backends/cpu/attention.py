"""The CPU attention backend: steps of a few queries per sequence in the paged decode op, the others in the
fused varlen prefill op."""
from __future__ import annotations

import torch

from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.torch.attention import TorchAttentionBackend

# The most new tokens per sequence a step may have to run in the decode op, one query row at a time: each
# row reads its context again, which beats the prefill op's one pass up to about 8 rows (verification steps
# of speculative decoding have num_speculative_tokens + 1).
MAX_DECODE_QUERIES = 8


class CpuAttentionBackend(TorchAttentionBackend):
    """One fused call per layer for a whole step, keys and values read in place from the paged cache.

    Steps of at most ``MAX_DECODE_QUERIES`` new tokens per sequence (decode, and verification) run in the paged
    decode op, sliding windows and soft caps included: the keys are stored first, and query j of a sequence's
    n attends to its context less the n - 1 - j tokens after it. So a verified row computes exactly what plain
    decode computes at its position. The others run in the varlen prefill op; dtypes or head sizes it does
    not take, sliding windows (whose freed blocks the op would read) and soft-capped scores go through the
    torch backend. With an fp8 cache the decode op reads the fp8 rows in place; the prefill op reads a copy of
    the cached prefixes' blocks in the model's dtype (the new keys come from k and v)."""

    name = "cpu"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if not ops.store_kv(k, v, k_cache, v_cache, slot_mapping):
            super().store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if meta.max_seqlen_q <= MAX_DECODE_QUERIES and ops.supports_decode(q.dtype, q.shape[-1], k_cache.dtype):
            tables, lens = query_rows(meta)
            return ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, sliding_window, softcap)
        if (meta.decode_only or sliding_window is not None or softcap is not None
                or not ops.supports_attention(q.dtype, q.shape[-1])):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
        tables = meta.block_tables
        if k_cache.dtype != q.dtype:  # an fp8 cache: the prefixes' blocks widened, the op reads those
            blocks, tables = prefix_blocks(meta, k_cache.shape[1])
            k_cache, v_cache = k_cache[blocks].to(q.dtype), v_cache[blocks].to(q.dtype)
        return ops.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                           tables, scale)


def query_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and context length of each query row of the step (``meta.row_context_lens``). Built once
    per step."""
    if meta.decode_only:
        return meta.block_tables, meta.context_lens
    if "query_rows" not in meta.memo:
        lens = meta.row_context_lens(range(meta.num_seqs))
        counts = torch.tensor(meta.query_lens, device=meta.block_tables.device)
        tables = meta.block_tables.repeat_interleave(counts, dim=0)
        meta.memo["query_rows"] = tables, torch.tensor(lens, dtype=torch.int32, device=tables.device)
    return meta.memo["query_rows"]


def prefix_blocks(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache blocks holding the step's cached prefixes, in order, and block tables that number them in that
    order (-1 past each prefix). Built once per step."""
    if "prefix_blocks" not in meta.memo:
        counts = [-(-(c - n) // block_size) for c, n in zip(meta.context_lens_list, meta.query_lens)]
        tables = torch.full((meta.num_seqs, max(1, *counts)), -1, dtype=torch.int32)
        starts = [0]
        for i, n in enumerate(counts):
            tables[i, :n] = torch.arange(starts[-1], starts[-1] + n, dtype=torch.int32)
            starts.append(starts[-1] + n)
        blocks = torch.cat([meta.block_tables[i, :n].long() for i, n in enumerate(counts)])
        meta.memo["prefix_blocks"] = blocks, tables
    return meta.memo["prefix_blocks"]
