"""Paged attention: the per-step metadata, the backend interface, and the layer that calls it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Describes one packed step: B sequences, T new tokens in total.

    Sequence i owns new tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and attends to
    ``context_lens[i]`` keys: its cached prefix followed by its new tokens, so
    ``context_lens[i] - query_len[i]`` tokens are read from the paged cache.
    """

    cu_seqlens_q: torch.Tensor  # int32 (B+1,)
    cu_seqlens_k: torch.Tensor  # int32 (B+1,), prefix sums of context_lens
    context_lens: torch.Tensor  # int32 (B,)
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor  # int64 (T,): flat cache slot (block * block_size + offset)
    block_tables: torch.Tensor  # int32 (B, max_blocks), padded with -1
    query_lens: list[int]  # host copies, to avoid device syncs in the torch backend
    context_lens_list: list[int]
    # Derived from the lengths unless given: a padded graph step fixes them for every replay.
    decode_only: bool | None = None
    has_cached_prefix: bool | None = None
    prefill_work: torch.Tensor | None = None  # Triton's query-tile list, built by the first layer
    # Triton's decode slots of a mixed step (sequence, query row), built with prefill_work, which then
    # leaves those sequences out; None: the prefill kernel computes every row.
    decode_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.decode_only is None:
            self.decode_only = self.max_seqlen_q == 1
        if self.has_cached_prefix is None:
            self.has_cached_prefix = any(c != q for c, q in zip(self.context_lens_list, self.query_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention for a packed step.

    Shapes: q (T, Hq, D); k, v (T, Hkv, D); caches (num_blocks, block_size, Hkv, D).
    Hq must be a multiple of Hkv (GQA). Returns (T, Hq, D).

    ``sliding_window``: a query at position p sees only the keys at positions p - sliding_window < j <= p
    (blocks wholly before that may have been freed: a backend must not read them). ``softcap``: the
    scaled scores s become softcap * tanh(s / softcap) before the softmax.
    """

    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor: ...


class PagedCacheLayer(Protocol):
    """A layer that keeps per-token state in the paged cache (attention of any kind).

    It declares the per-token shape of each cache tensor it needs; the model runner allocates
    them as (num_blocks, block_size, *shape) and binds them. Prefix caching, chunked prefill and
    preemption see only blocks, so any layout works with them unchanged. A layer that reads only its
    latest keys says so in a ``sliding_window`` attribute (absent or None: all of them).
    """

    def cache_token_shapes(self) -> tuple[tuple[int, ...], ...]: ...

    def bind_cache(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def flops_per_key(self) -> int:
        """Matmul FLOPs of one query attending to one key (QK^T and PV), for MFU accounting."""
        ...


class Attention(nn.Module):
    """Paged multi-head attention (GQA): K and V of (kv_heads, head_dim) per token, bound by the model runner.

    ``scale`` defaults to head_dim ** -0.5; ``sliding_window`` and ``softcap`` as in :class:`AttentionBackend`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def cache_token_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def bind_cache(self, tensors: Sequence[torch.Tensor]) -> None:
        self.k_cache, self.v_cache = tensors

    def flops_per_key(self) -> int:
        return 4 * self.num_heads * self.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                    sliding_window=self.sliding_window, softcap=self.softcap)
