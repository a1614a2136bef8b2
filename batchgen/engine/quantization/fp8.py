"""FP8 weights in linear and MoE layers: e4m3 weights with float32 scales that load like any weight.

Each quantized layer holds its FP8 weight and a scale parameter beside it (``weight_scale``, or
``gate_up_proj_scale`` / ``down_proj_scale`` for experts), in one of two layouts: one value per
128x128 block (``group`` (128, 128)), or one per output row (``group`` (1, None)), which also holds
per-tensor scales (each fused shard's or expert's scalar is spread over its rows, so fused q/k/v or
gate/up shards with different scales need no requantization). The layers' own weight loaders slice
both, so tensor parallelism shards a weight and its scales alike.

After loading, the weights either stay FP8 and run through the kernel set's w8a8 GEMM and FP8
fused-MoE (``keep``), or are dequantized once into the model dtype and the layer becomes an
ordinary unquantized one.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.backends.triton.fp8.format import FP8_BLOCK, FP8_DTYPE, dequantize_fp8_weight
from batchgen.engine.layers.linear import UNQUANTIZED, LinearBase, LinearMethod, new_parameter
from batchgen.engine.layers.moe import UNQUANTIZED_MOE, FusedMoE, MoEMethod, expert_parameter
from batchgen.engine.loading.model_source import Weight, as_tensor
from batchgen.engine.quantization.config import QuantizationConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def dequantize_shards(weight: torch.Tensor, scale: nn.Parameter | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight (..., N, K) in ``dtype``; a fused weight whose shards keep their own block scales
    (``scale.shard_starts``) shard by shard."""
    starts = getattr(scale, "shard_starts", None)
    if not starts:
        return dequantize_fp8_weight(weight, scale, dtype)
    bounds = [*starts.items(), (weight.shape[-2], None)]
    return torch.cat([dequantize_fp8_weight(weight[..., w0:w1, :],
                                            scale[..., s0:s0 + _cdiv(w1 - w0, FP8_BLOCK), :], dtype)
                      for (w0, s0), (w1, _) in zip(bounds, bounds[1:])], dim=-2)


class Fp8Scales:
    """The scale layout of one checkpoint: its parameter shape and group, and how a loaded scale fits it."""

    def __init__(self, config: QuantizationConfig):
        self.block = config.block
        self.group = (FP8_BLOCK, FP8_BLOCK) if self.block else (1, None)

    def shape(self, rows: int, cols: int) -> tuple[int, int]:
        return (_cdiv(rows, FP8_BLOCK), _cdiv(cols, FP8_BLOCK)) if self.block else (rows, 1)

    def new(self, shape: tuple[int, ...], loader) -> nn.Parameter:
        param = new_parameter(shape, loader, torch.float32)
        param.group = self.group
        return param

    def shard_starts(self, shard_rows: list[int]) -> dict[int, int] | None:
        """Block scales of a fused weight whose shards (``shard_rows`` rows each) do not all start on a block:
        each shard keeps its own blocks (its last one partial), as the checkpoint stores them; shard start
        row -> its first scale row. None where the shards align (or scales are not blocked)."""
        if not self.block or all(start % FP8_BLOCK == 0 for start in _starts(shard_rows)):
            return None
        return dict(zip(_starts(shard_rows), _starts([_cdiv(n, FP8_BLOCK) for n in shard_rows])))

    def fused_shape(self, rows: int, cols: int, shard_rows: list[int]) -> tuple[tuple[int, int], dict | None]:
        """The scale shape of a (fused) weight of ``rows`` x ``cols``, and its ``shard_starts``."""
        starts = self.shard_starts(shard_rows)
        shape = self.shape(rows, cols)
        if starts:
            shape = (sum(_cdiv(n, FP8_BLOCK) for n in shard_rows), shape[1])
        return shape, starts

    def fit(self, loaded: Weight, rows: int, experts: int | None = None) -> torch.Tensor:
        """A checkpoint scale as float32 in the parameter's layout: block scales as they are; per-row ones
        as (rows, 1); a per-tensor scalar (one per expert when stacked) repeated over the ``rows``."""
        scale = as_tensor(loaded).float()
        if self.block:
            return scale
        lead = () if experts is None else (experts,)
        if scale.numel() == math.prod(lead):
            return scale.reshape(*lead, 1, 1).expand(*lead, rows, 1)
        if scale.numel() != math.prod(lead) * rows:
            raise ValueError(f"scale of shape {tuple(scale.shape)} is neither per tensor nor per row of {rows} rows")
        return scale.reshape(*lead, rows, 1)


class Fp8LinearMethod(LinearMethod):
    """An FP8 ``weight`` (local rows x columns) and its float32 ``weight_scale``."""

    def __init__(self, scales: Fp8Scales, kernels: KernelSet, keep: bool):
        self.scales, self.kernels, self.keep = scales, kernels, keep
        self.computes_in_fp8 = keep

    def create_weights(self, layer: LinearBase) -> None:
        layer.weight = new_parameter((layer.local_out, layer.local_in), layer.weight_loader, FP8_DTYPE,
                                     layer.shard_ids)
        layer.weight.tp_dim = layer.tp_dim
        shape, starts = self.scales.fused_shape(layer.local_out, layer.local_in, layer.local_shard_rows())
        layer.weight_scale = self.scales.new(shape, self._scale_loader(layer))
        layer.weight_scale.shard_starts = starts
        layer.weight_scale.tp_dim, layer.weight_scale.shard_ids = layer.tp_dim, layer.shard_ids

    def _scale_loader(self, layer: LinearBase):
        def load(param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
            layer.weight_loader(param, self.scales.fit(loaded, layer.shard_size(shard_id)), shard_id)
        return load

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        return dequantize_shards(layer.weight, layer.weight_scale, layer.params_dtype)

    def finish_loading(self, layer: LinearBase) -> None:
        # Shards with their own blocks: the FP8 GEMM reads one block layout, so such a layer is dequantized.
        if not self.keep or layer.weight_scale.shard_starts:
            layer.weight = nn.Parameter(self.dense_weight(layer), requires_grad=False)
            del layer.weight_scale
            layer.quant_method = UNQUANTIZED

    def unquantize(self, layer: LinearBase) -> None:
        """The checkpoint stores this layer unquantized (a router, an ignored module): back to the model dtype,
        with the loader its weight had (a model may have wrapped it, e.g. to reorder rows)."""
        del layer.weight_scale
        layer.quant_method = UNQUANTIZED
        loader = layer.weight.weight_loader
        with layer.weight.device:
            UNQUANTIZED.create_weights(layer)
        layer.weight.weight_loader = loader


class Fp8MoEMethod(MoEMethod):
    """FP8 ``gate_up_proj`` / ``down_proj`` with ``gate_up_proj_scale`` / ``down_proj_scale``."""

    def __init__(self, scales: Fp8Scales, keep: bool):
        self.scales, self.keep = scales, keep
        self.computes_in_fp8 = keep

    def create_weights(self, moe: FusedMoE) -> None:
        e, size, hidden = len(moe.slots), moe.local_size, moe.hidden_size
        for name, rows, cols, projection in (("gate_up_proj", 2 * size, hidden, "gate_up"),
                                             ("down_proj", hidden, size, "down")):
            setattr(moe, name, expert_parameter(moe, (e, rows, cols), projection, FP8_DTYPE))
            shape, starts = self.scales.fused_shape(rows, cols, [size, size] if projection == "gate_up" else [])
            scale = expert_parameter(moe, (e, *shape), projection, torch.float32)
            scale.group, scale.shard_starts = self.scales.group, starts
            scale.weight_loader = self._scale_loader(moe)
            setattr(moe, f"{name}_scale", scale)

    def _scale_loader(self, moe: FusedMoE):
        def load(param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
            if shard_id is None:  # stacked: (E, rows of all shards, ...)
                rows = 2 * moe.intermediate_size if param.projection == "gate_up" else moe.hidden_size
                moe.weight_loader(param, self.scales.fit(loaded, rows, moe.num_experts), None)
            else:
                moe.weight_loader(param, self.scales.fit(loaded, moe.shard_size(shard_id)), shard_id)
        return load

    def apply(self, moe: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              skip_negative: bool = False) -> torch.Tensor:
        return moe.kernels.fused_moe(x, moe.gate_up_proj, moe.down_proj, topk_weights, topk_ids,
                                     w13_scale=moe.gate_up_proj_scale, w2_scale=moe.down_proj_scale,
                                     skip_negative=skip_negative)

    def finish_loading(self, moe: FusedMoE) -> None:
        if self.keep and not moe.gate_up_proj_scale.shard_starts:  # else dequantized, as a linear layer is
            return
        for name in ("gate_up_proj", "down_proj"):
            weight = dequantize_shards(getattr(moe, name), getattr(moe, f"{name}_scale"), moe.params_dtype)
            setattr(moe, name, nn.Parameter(weight, requires_grad=False))
            delattr(moe, f"{name}_scale")
        moe.quant_method = UNQUANTIZED_MOE

    def unquantize(self, moe: FusedMoE) -> None:
        del moe.gate_up_proj_scale, moe.down_proj_scale
        moe.quant_method = UNQUANTIZED_MOE
        with moe.gate_up_proj.device:
            UNQUANTIZED_MOE.create_weights(moe)
