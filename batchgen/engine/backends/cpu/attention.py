"""The CPU attention backend: steps of a few queries per sequence in the paged decode op, the others in the
fused varlen prefill op."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

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
    torch backend. With a cache narrower than q (fp8, or bf16 under fp32) the decode op reads its rows in
    place, and a step with longer queries splits (:func:`over_narrow_cache`)."""

    name = "cpu"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if not ops.store_kv(k, v, k_cache, v_cache, slot_mapping):
            super().store_kv(k, v, k_cache, v_cache, slot_mapping)

    def as_stored(self, k, v, cache_dtype):
        rounded = ops.round_through_fp8(k, cache_dtype), ops.round_through_fp8(v, cache_dtype)
        return rounded if None not in rounded else super().as_stored(k, v, cache_dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if meta.max_seqlen_q <= MAX_DECODE_QUERIES and ops.supports_decode(q.dtype, q.shape[-1], k_cache.dtype):
            tables, lens = query_rows(meta)
            return ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, sliding_window, softcap)
        if (meta.decode_only or sliding_window is not None or softcap is not None
                or not ops.supports_attention(q.dtype, q.shape[-1])):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
        if k_cache.dtype != q.dtype:
            return over_narrow_cache(q, k, v, k_cache, v_cache, meta, scale)
        return ops.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                           meta.block_tables, scale)


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


@dataclass
class NarrowCacheStep:
    """A step over a cache narrower than q, split: the sequences of one new token (decode op) and the others
    (prefill op, over their prefixes' blocks widened)."""

    decode_rows: torch.Tensor  # int64: q's rows of the one-token sequences
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefill_rows: torch.Tensor | None  # int64: q's rows of the others, in order; None: every row
    cu_seqlens_q: torch.Tensor  # int32, theirs
    context_lens: torch.Tensor  # int32, theirs
    prefix_blocks: torch.Tensor  # int64: the cache blocks of their prefixes, in order
    prefix_tables: torch.Tensor  # int32: their tables numbering prefix_blocks (-1 past each prefix)

    @classmethod
    def of(cls, meta: AttentionMetadata, block_size: int) -> "NarrowCacheStep":
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        single = [i for i, n in enumerate(meta.query_lens) if n == 1]
        longer = [i for i, n in enumerate(meta.query_lens) if n != 1]
        counts = [-(-(meta.context_lens_list[i] - meta.query_lens[i]) // block_size) for i in longer]
        tables = torch.full((len(longer), max(1, *counts)), -1, dtype=torch.int32)
        first = 0
        for row, n in enumerate(counts):
            tables[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
            first += n
        lens = [meta.query_lens[i] for i in longer]
        return cls(decode_rows=torch.tensor([starts[i] for i in single], dtype=torch.int64),
                   decode_tables=meta.block_tables[single], decode_lens=meta.context_lens[single],
                   prefill_rows=torch.cat([torch.arange(starts[i], starts[i + 1]) for i in longer]) if single else None,
                   cu_seqlens_q=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
                   context_lens=meta.context_lens[longer],
                   prefix_blocks=torch.cat([meta.block_tables[i, :n].long() for i, n in zip(longer, counts)]),
                   prefix_tables=tables)


def over_narrow_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """A step of some longer queries over a cache narrower than q (fp8, or bf16 under fp32): the decodes read
    their rows in place; the prefill op takes a copy of the others' prefixes in q's dtype (only theirs: decodes'
    contexts are not widened)."""
    if "narrow_step" not in meta.memo:  # once per step: every layer shares it
        meta.memo["narrow_step"] = NarrowCacheStep.of(meta, k_cache.shape[1])
    step: NarrowCacheStep = meta.memo["narrow_step"]
    rows = step.prefill_rows
    k_prefix, v_prefix = k_cache[step.prefix_blocks].to(q.dtype), v_cache[step.prefix_blocks].to(q.dtype)
    if rows is None:  # no decodes: the rows as they are
        return ops.varlen_causal_attention(q, k, v, k_prefix, v_prefix, step.cu_seqlens_q, step.context_lens,
                                           step.prefix_tables, scale)
    out = torch.empty_like(q)
    out[step.decode_rows] = ops.paged_decode_attention(q[step.decode_rows], k_cache, v_cache, step.decode_tables,
                                                       step.decode_lens, scale)
    out[rows] = ops.varlen_causal_attention(q[rows], k[rows], v[rows], k_prefix, v_prefix, step.cu_seqlens_q,
                                            step.context_lens, step.prefix_tables, scale)
    return out
