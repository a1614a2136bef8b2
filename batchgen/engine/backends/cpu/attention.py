"""The CPU attention backend: prefill and mixed steps in the fused C++ op, decode-only steps in the paged decode op."""
from __future__ import annotations

import torch

from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.torch.attention import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    """One fused call per layer for a whole step, keys and values read in place from the paged cache:
    decode-only steps (sliding windows and soft caps included) in the paged decode op, the others in the
    varlen prefill op. In prefill, dtypes or head sizes the op does not take, sliding windows (whose freed
    blocks the op would read) and soft-capped scores go through the torch backend."""

    name = "cpu"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if not ops.store_kv(k, v, k_cache, v_cache, slot_mapping):
            super().store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if meta.decode_only and q.dtype == k_cache.dtype and ops.supports_decode(q.dtype, q.shape[-1]):
            return ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                              sliding_window, softcap)
        if (meta.decode_only or sliding_window is not None or softcap is not None
                or not ops.supports_attention(q.dtype, q.shape[-1])):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
        return ops.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                           meta.block_tables, scale)
