"""Paged attention: the layer that stores K/V in the paged cache and calls its backend."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from batchgen.engine.backends.interface import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged multi-head attention (GQA): K and V of (kv_heads, head_dim) per token, bound by the model runner.

    ``scale`` defaults to head_dim ** -0.5; ``sliding_window`` and ``softcap`` as in :class:`AttentionBackend`.
    Queries meet K and V as the cache holds them: with an fp8 cache, the step's own keys and values are rounded
    to fp8 too, so every backend, and a prefix cached or computed, gives the same attention.
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
        if self.k_cache.dtype != k.dtype and not meta.decode_only:  # decode reads every key from the cache
            k, v = self.backend.as_stored(k, v, self.k_cache.dtype)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                    sliding_window=self.sliding_window, softcap=self.softcap)
