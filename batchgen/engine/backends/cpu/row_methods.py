"""Linear methods that keep a layer's own weight and multiply decode-sized steps in the CPU row ops: fp32 layers
in ``batchgen_cpu.small_linear`` (an fp32 latent layer's absorbed products in ``small_bmm``), bf16 ones on CPUs with
AMX in ``amx_linear``; larger steps (prefill) in ``F.linear``.

A bf16 weight prepacked once gains on most CPUs (``prepack``); an fp32 one gained nothing. But a step of a few
rows is bound by streaming the weight, and ``F.linear`` streams it at well under the memory's rate there (on AVX2
with 2 threads: one row on one thread; 2 rows take twice one row's time). ``small_linear`` streams it once per 64
rows, on every thread (1.4-3.3x ``F.linear`` at 1-64 rows, benchmarks/small_linear_cpu.py), for steps of up to
``SMALL_ROWS`` (decode at the default 256 sequences). Past that, a wide layer (the vocabulary head) multiplies in
slices of 1024 output columns: ``F.linear`` over all 49K of SmolLM2's ran at half the rate of its slices
(1.4-1.9x at 65-1024 rows), whose weight and output stay in the caches.
"""
from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.layers.linear import LinearMethod
from batchgen.engine.layers.mla import AbsorbedProducts


def unit_stride(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (M, K) with each row's inputs contiguous, as the row ops take them: copied only where they are not
    (a few rows' copy is cheap beside streaming W). Latent attention's values come out of their per-head product
    as a view with the tokens innermost; given to ``F.linear`` instead, DeepSeek-V3-shaped o_proj ran at half the
    small-row op's rate (AVX2, fp32, 64 rows)."""
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Rows up to which fp32 layers run the small-row op: 1.4-3.3x F.linear at 1-64 rows, 1.05-1.3x at 96-256 (64
# rows at a time), 1.4-1.8x the vocabulary head's slices at 96-256 (AVX2, 2 threads); past that F.linear (prefill).
SMALL_ROWS = 256
AMX_ROWS = 64  # rows up to which bf16 layers on AMX CPUs run amx_linear
# Rows up to which fp32 absorbed products run small_bmm: DeepSeek-V3's heads (32 of them, 128 x 512), 8 layers
# cold, against bmm (and o_proj's copy of its permuted values): 1.1x at 1 row, 1.8x at 8-16, 1.4x at 32, even at
# 64, 0.90x at 256 (AVX2, 2 threads).
LATENT_ROWS = 64
WIDE_OUTPUTS, COLUMN_SLICE = 8192, 1024  # output columns from which larger steps multiply slice by slice


class SmallRowsMethod(LinearMethod):
    """An fp32 layer's multiply on CPU (x cast to fp32, as ``F.linear``'s method does): steps of at most
    ``SMALL_ROWS`` rows run ``batchgen_cpu.small_linear``, larger ones ``F.linear``, slice by slice of
    ``COLUMN_SLICE`` outputs in layers of ``WIDE_OUTPUTS`` or more. The layer keeps its weight, its type and its
    attributes; only its method changes."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight
        rows = x.reshape(-1, weight.shape[1]).to(torch.float32)  # a float32 router in a bf16 model gets bf16 x
        if rows.shape[0] <= SMALL_ROWS:
            out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
            torch.ops.batchgen_cpu.small_linear(unit_stride(rows), weight, bias, out)
        elif weight.shape[0] >= WIDE_OUTPUTS:
            out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
            for first in range(0, weight.shape[0], COLUMN_SLICE):
                cols = slice(first, first + COLUMN_SLICE)
                if bias is None:
                    torch.mm(rows, weight[cols].t(), out=out[:, cols])
                else:
                    torch.addmm(bias[cols], rows, weight[cols].t(), out=out[:, cols])
        else:
            return super().apply(layer, x, bias)
        return out.view(*x.shape[:-1], weight.shape[0])


SMALL_ROWS_METHOD = SmallRowsMethod()


class AmxRowsMethod(LinearMethod):
    """A bf16 layer's multiply on a CPU with AMX: steps of at most ``AMX_ROWS`` rows run ``batchgen_cpu.amx_linear``
    (the weight's own rows as AMX tiles, streamed once: 1.1-1.9x oneDNN's prepacked linear at 1-8 rows on
    SmolLM2's shapes, 0.95-1.2x at 64), larger ones ``F.linear``, which on these CPUs runs prefill-sized steps as
    fast as a prepacked copy (0.8-1.0x its time at 2,048 and 7,000 rows), so the layer keeps only its own weight."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight
        rows = x if x.dim() == 2 else x.reshape(-1, weight.shape[1])
        if x.dtype != torch.bfloat16 or rows.shape[0] > AMX_ROWS:
            return super().apply(layer, x, bias)
        out = rows.new_empty((rows.shape[0], weight.shape[0]))
        torch.ops.batchgen_cpu.amx_linear(unit_stride(rows), weight, bias, out)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


AMX_ROWS_METHOD = AmxRowsMethod()


def amx_rows_fit(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``amx_linear`` takes this layer: outputs in blocks of 16, inputs in steps of 32, bf16 throughout."""
    return (weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and
            (bias is None or bias.dtype == torch.bfloat16))


class SmallRowsProducts(AbsorbedProducts):
    """A latent attention layer's fp32 absorbed products in ``batchgen_cpu.small_bmm`` for steps of up to
    ``LATENT_ROWS`` rows (each head's product the small-row linear's: a row's result does not depend on the step's
    other rows), larger ones bmm. W_UK is kept as a copy of its transpose (H, R, nope), W_UV read where it lies in
    kv_b_proj's weight; the values come out (B, H, v), rows o_proj takes as they are."""

    def __init__(self, w_uk: torch.Tensor):
        super().__init__()
        self.register_buffer("uk", w_uk.transpose(1, 2).contiguous(), persistent=False)

    @staticmethod
    def per_head(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """(B, H, N) = rows (B, H, K) times each head's weight (H, N, K), or None past the op's steps."""
        if rows.dtype != torch.float32 or rows.shape[0] > LATENT_ROWS or rows.stride(2) != 1:
            return None
        out = rows.new_empty(rows.shape[0], rows.shape[1], weight.shape[1])
        torch.ops.batchgen_cpu.small_bmm(rows, weight, out)
        return out

    def query(self, layer: nn.Module, q_nope: torch.Tensor) -> torch.Tensor:
        out = self.per_head(q_nope, self.uk)
        return out if out is not None else super().query(layer, q_nope)

    def values(self, layer: nn.Module, out: torch.Tensor) -> torch.Tensor:
        values = self.per_head(out, layer.w_uv)
        return values if values is not None else super().values(layer, out)
