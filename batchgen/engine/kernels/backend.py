"""The Triton attention backend and the Triton kernels of the GPU path's kernel set."""
from __future__ import annotations

import torch

from batchgen.engine.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from batchgen.engine.kernels.decode_attention import decode_attention
from batchgen.engine.kernels.fused_moe import fused_moe
from batchgen.engine.kernels.kv_store import store_kv
from batchgen.engine.kernels.norm import rms_norm
from batchgen.engine.kernels.prefill_attention import prefill_attention, prefill_work
from batchgen.engine.kernels.rotary import apply_rotary
from batchgen.engine.layers.attention import AttentionMetadata


class TritonAttentionBackend:
    """Paged decode kernel for decode-only steps; the varlen prefill kernel for everything else."""

    name = "triton"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        options = dict(sliding_window=sliding_window, softcap=softcap)
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables,
                                    meta.max_seqlen_k, scale, **options)
        if meta.prefill_work is None:  # once per step: every layer shares the metadata
            meta.prefill_work = prefill_work(meta.query_lens, meta.context_lens_list).to(q.device)
        if not meta.has_cached_prefix:
            return prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.prefill_work, scale,
                                     **options)
        # New keys come from k/v directly; only the prefix before them is read from the cache.
        return prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.prefill_work, scale,
                                 k_cache=k_cache, v_cache=v_cache, context_lens=meta.context_lens,
                                 block_tables=meta.block_tables, **options)


def triton_kernels() -> dict[str, object]:
    """The Triton implementations of the kernel set's fields (the torch ones fill the rest)."""
    return dict(attention=TritonAttentionBackend(), rms_norm=rms_norm, apply_rotary=apply_rotary,
                silu_and_mul=silu_and_mul, gelu_tanh_and_mul=gelu_tanh_and_mul, fused_moe=fused_moe)
