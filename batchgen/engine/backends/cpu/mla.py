"""The CPU latent attention backend: decode in the fused paged latent op, the rest in torch."""
from __future__ import annotations

import torch

from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.torch.mla import TorchMLABackend


class CpuMLABackend(TorchMLABackend):
    """Absorbed decode in one fused call per layer for all the step's decode rows, the latent rows read in
    place from the paged cache; other dtypes than the op's, storing and prefill go through torch."""

    name = "cpu"

    def decode(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, max_context: int, value_dim: int, scale: float) -> torch.Tensor:
        if q.dtype == cache.dtype and ops.supports_latent_decode(q.dtype):
            return ops.latent_decode_attention(q, cache, block_tables, context_lens, value_dim, scale)
        return super().decode(q, cache, block_tables, context_lens, max_context, value_dim, scale)
