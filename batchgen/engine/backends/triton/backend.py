"""The Triton attention backend and the Triton kernels of the GPU path's kernel set."""
from __future__ import annotations

import torch

from batchgen.engine.backends.triton.accept import accept_drafts
from batchgen.engine.backends.triton.rejection import reject_drafts
from batchgen.engine.backends.triton.activation import gelu_tanh_and_mul, silu_and_mul
from batchgen.engine.backends.triton.decode_attention import decode_attention, decode_rows
from batchgen.engine.backends.triton.fp8.gemm import fp8_linear
from batchgen.engine.backends.triton.fused_moe import fused_moe
from batchgen.engine.backends.triton.kv_store import store_kv
from batchgen.engine.backends.triton.mla import mla_decode, mla_prefill, store_latent
from batchgen.engine.backends.triton.norm import rms_norm
from batchgen.engine.backends.triton.prefill_attention import prefill_attention, prefill_work
from batchgen.engine.backends.triton.rotary import apply_rotary
from batchgen.engine.backends.interface import AttentionMetadata, LatentPrefill
from batchgen.engine.dtype import as_stored
from batchgen.engine.transfer import to_device


class TritonAttentionBackend:
    """The paged decode kernel for the rows of one new token (decode-only steps, and the decodes of a
    mixed step); the varlen prefill kernel for the longer queries."""

    name = "triton"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor,
                  cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return as_stored(k, cache_dtype), as_stored(v, cache_dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        options = dict(sliding_window=sliding_window, softcap=softcap)
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables,
                                    meta.max_seqlen_k, scale, **options)
        if meta.prefill_work is None:  # once per step: every layer shares the metadata
            plan_mixed_step(meta, q.device)
        if not meta.has_cached_prefix:
            out = prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.prefill_work, scale,
                                    **options)
        else:  # new keys come from k/v directly; only the prefix before them is read from the cache
            out = prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.prefill_work, scale,
                                    k_cache=k_cache, v_cache=v_cache, context_lens=meta.context_lens,
                                    block_tables=meta.block_tables, **options)
        if meta.decode_rows is not None:
            decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, meta.max_seqlen_k, scale,
                             out=out, rows=meta.decode_rows, **options)
        return out


class TritonMLABackend:
    """Latent attention: the absorbed decode kernel over the latent cache, the expanded prefill kernel."""

    name = "triton"

    def store_latent(self, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_latent(latent, cache, slot_mapping)

    def decode(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, max_context: int, value_dim: int, scale: float) -> torch.Tensor:
        return mla_decode(q, cache, context_lens, block_tables, max_context, value_dim, scale)

    def prefill(self, q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, k_pe: torch.Tensor,
                plan: LatentPrefill, scale: float) -> torch.Tensor:
        if "work" not in plan.memo:  # once per step: every layer shares the plan
            plan.memo["work"] = to_device(prefill_work(plan.query_lens, plan.context_lens), q.device)
        return mla_prefill(q, k_nope, v, k_pe, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.memo["work"], scale)


def plan_mixed_step(meta: AttentionMetadata, device: torch.device) -> None:
    """Sets the step's query tiles and, when it has rows of one new token next to longer queries, its
    decode slots (those rows then leave the tile list)."""
    split = 1 in meta.query_lens and meta.max_seqlen_q > 1
    meta.prefill_work = to_device(prefill_work(meta.query_lens, meta.context_lens_list, skip_decodes=split), device)
    meta.decode_rows = to_device(decode_rows(meta.query_lens), device) if split else None


def triton_kernels() -> dict[str, object]:
    """The Triton implementations of the kernel set's fields (the torch ones fill the rest)."""
    return dict(attention=TritonAttentionBackend(), rms_norm=rms_norm, apply_rotary=apply_rotary,
                silu_and_mul=silu_and_mul, gelu_tanh_and_mul=gelu_tanh_and_mul, fused_moe=fused_moe,
                fp8_linear=fp8_linear, mla=TritonMLABackend(), accept_drafts=accept_drafts,
                reject_drafts=reject_drafts)
