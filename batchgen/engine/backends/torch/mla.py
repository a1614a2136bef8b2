"""Latent attention in plain torch: the CPU path of MLA (the fused CPU backend keeps its prefill), and the
reference for the Triton MLA kernels."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchgen.engine.backends.torch.attention import causal_attention, store_rows

if TYPE_CHECKING:
    from batchgen.engine.backends.interface import LatentPrefill


class TorchMLABackend:
    name = "torch"

    def store_latent(self, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_rows(latent, cache, slot_mapping)

    def decode(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, max_context: int, value_dim: int, scale: float) -> torch.Tensor:
        """Every sequence's cached rows gathered into a padded batch; the heads act as one KV head's queries."""
        batch, width = q.shape[0], cache.shape[-1]
        block_size = cache.shape[1]
        num_blocks = -(-max_context // block_size)
        blocks = block_tables[:, :num_blocks].long().clamp(min=0).flatten()
        rows = cache.index_select(0, blocks).view(batch, 1, num_blocks * block_size, width)[:, :, :max_context]
        rows = rows.to(q.dtype)
        visible = torch.arange(max_context, device=q.device)[None, :] < context_lens[:, None].to(torch.int64)
        out = F.scaled_dot_product_attention(q[:, None], rows, rows[..., :value_dim],
                                             attn_mask=visible[:, None, None, :], scale=scale)
        return out[:, 0]

    def prefill(self, q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, k_pe: torch.Tensor,
                plan: "LatentPrefill", scale: float) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        q_start = k_start = 0
        for q_len, ctx_len in zip(plan.query_lens, plan.context_lens):
            keys = slice(k_start, k_start + ctx_len)
            k = torch.cat((k_nope[keys], k_pe[keys, None, :].expand(-1, q.shape[1], -1)), dim=-1)
            out[q_start:q_start + q_len] = causal_attention(q[q_start:q_start + q_len], k, v[keys], scale)
            q_start, k_start = q_start + q_len, k_start + ctx_len
        return out
