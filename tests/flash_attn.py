"""flash-attn's varlen calling convention over the Triton prefill kernel: tests call it like that library."""
from __future__ import annotations

import torch

from batchgen.engine.backends.triton.prefill_attention import prefill_attention, prefill_work


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None,
                           causal: bool = True, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0) -> torch.Tensor:
    """Contiguous varlen attention with flash-attn's calling convention (causal is bottom-right;
    ``window_size=(left, 0)``: each query also sees its ``left`` preceding keys, -1 for all)."""
    del max_seqlen_q, max_seqlen_k  # the tile list below holds the exact lengths
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q_lens = cu_seqlens_q.diff().tolist()
    work = prefill_work(q_lens, cu_seqlens_k.diff().tolist()).to(q.device)
    left = window_size[0]
    return prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, work, scale, causal=causal,
                             sliding_window=left + 1 if left >= 0 else None, softcap=softcap or None)
