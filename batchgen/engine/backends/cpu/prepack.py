"""The CPU kernel set's preparation of a loaded model: bf16 weights prepacked once (for ``batchgen_cpu.dot_linear``
on CPUs with AVX512-BF16 and no AMX, else into oneDNN's blocked layout); fp32 layers, and bf16 ones on CPUs with
AMX, given a row method that keeps their weight (``row_methods``).

torch's CPU linear reorders a bf16 weight on every call; packing it once measured 1.0-1.3x in prefill-sized
matmuls and 1.3-2.7x in decode-sized ones with AMX. Without AMX, ``dot_linear``'s blocks stream from memory as
fast as its products need them, where oneDNN's prepacked linear waits for its weights (against it, SmolLM2's
layers with weights streamed from memory, benchmarks/dot_linear_cpu.py: 1.5-1.6x at 1-8 rows, 1.19x at 64,
0.93-1.09x at 512-8,192).

Where ``dot_linear`` runs, bf16 experts are packed in its blocks too, slot by slot: the expert op's few-row tiles
sum their lanes and its GEMMs pack W every call (benchmarks/moe_cpu.py, 64 experts of 2048 x 768: 1.2x at 1-8
tokens, 1.3-1.4x at 64-256, 1.03-1.14x at 1,024-4,096), and so are the latent attention's absorbed W_UK and W_UV, a
head at a time (``dot_bmm`` in place of bmm's GEMMs). A SwiGLU MLP's gate|up is packed gate block and up block in
turn, and ``dot_gated_linear`` applies silu(gate) * up to each tile's products while they are in L1: the same
values as the projection and then the ``silu_and_mul`` op (SmolLM2's decode steps 1.02x at batch 1, 1.01x at 8,
even at 64: benchmarks/packed_ab.py --what gated).
"""
from __future__ import annotations

import logging
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.ops import amx_tiles
from batchgen.engine.backends.cpu.row_methods import (
    AMX_ROWS_METHOD, SMALL_ROWS_METHOD, SmallRowsProducts, amx_rows_fit, unit_stride,
)
from batchgen.engine.layers.linear import UNQUANTIZED, LinearBase, ParallelLMHead, RowParallelLinear
from batchgen.engine.layers.mla import AbsorbedProducts, MLAAttention
from batchgen.engine.layers.mlp import GatedMLP, GateUpActivation
from batchgen.engine.layers.moe import UNQUANTIZED_MOE, FusedMoE, MoEMethod, TopKRouter

log = logging.getLogger(__name__)


DOT_BLOCK = 48  # output columns a block of dot_linear's packed weight holds


@lru_cache(maxsize=1)
def dot_linear_runs() -> bool:
    """Whether bf16 layers multiply with ``batchgen_cpu.dot_linear``: kernels built with AVX512-BF16, on a CPU
    without AMX (where AMX tiles run the small steps and oneDNN's AMX kernels the large ones)."""
    return load_kernels() and bool(torch.ops.batchgen_cpu.dot_linear_built()) and not amx_tiles()


def pack_dot_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight (N, K), K even, in ``dot_linear``'s layout: blocks of 48 outputs (zero rows past N), each
    block's inputs in pairs, (N/48, K/2, 48, 2)."""
    return pack_dot_experts(weight.unsqueeze(0)).squeeze(0)


def pack_dot_experts(weights: torch.Tensor) -> torch.Tensor:
    """Stacked bf16 weights (E, N, K), K even, each in ``dot_linear``'s layout: (E, N/48, K/2, 48, 2)."""
    e, n, k = weights.shape
    blocks = -(-n // DOT_BLOCK)
    padded = weights.new_zeros(e, blocks * DOT_BLOCK, k)
    padded[:, :n] = weights
    return padded.view(e, blocks, DOT_BLOCK, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


class PrepackedLinear(nn.Module):
    """``y = x W^T (+ b)`` over a prepacked copy of a layer's bf16 weight: ``dot_linear``'s blocks where it runs
    (the bias kept in fp32 beside them), else oneDNN's blocked layout. It replaces the layer once loaded (the plain
    weight is freed unless another module shares it, as a tied embedding does)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dot = dot_linear_runs() and self.in_features % 2 == 0
        if self.dot:
            packed = pack_dot_weight(weight.detach().to(torch.bfloat16))
            if bias is not None:
                padded = torch.zeros(packed.shape[0] * DOT_BLOCK)
                padded[: self.out_features] = bias.detach().float()
                bias = padded
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        # Buffers, not plain attributes: the model's own tensors, which the CPU runner moves onto huge pages.
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows as the multiply takes them: 2-D, bf16, each row's inputs contiguous."""
        return unit_stride(x.reshape(-1, self.in_features).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        if not self.dot:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        else:
            out = rows.new_empty((rows.shape[0], self.out_features))
            torch.ops.batchgen_cpu.dot_linear(rows, self.packed, self.bias, out)
        return out.view(*x.shape[:-1], self.out_features)


def pack_dot_gated(weight: torch.Tensor, intermediate: int) -> torch.Tensor:
    """A gated MLP's bf16 gate|up weight (2I, K), or stacked experts' (E, 2I, K), in ``dot_gated_linear``'s layout:
    gate block b, then up block b, (2 ceil(I/48), K/2, 48, 2) (each expert's so, (E, 2 ceil(I/48), K/2, 48, 2))."""
    stacked = weight if weight.dim() == 3 else weight.unsqueeze(0)
    e, _, k = stacked.shape
    halves = pack_dot_experts(stacked.reshape(2 * e, intermediate, k))  # (2E, I/48, K/2, 48, 2)
    gated = halves.view(e, 2, *halves.shape[1:]).transpose(1, 2).reshape(e, -1, *halves.shape[2:])
    return gated if weight.dim() == 3 else gated.squeeze(0)


def pack_dot_moe(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked bf16 experts, gate|up (E, 2I, H) and down (E, H, I), as ``fused_moe_packed`` takes them: gate|up in
    gate and up blocks in turn, down in ``dot_linear``'s blocks."""
    return pack_dot_gated(w13, w2.shape[2]), pack_dot_experts(w2)


class PrepackedGateUp(PrepackedLinear):
    """A gated MLP's gate|up projection packed for ``batchgen_cpu.dot_gated_linear`` (gate and up blocks in
    turn): :meth:`activated` gives silu(gate) * up in one op; ``forward`` gives the projection itself, gate|up,
    as the layer it replaces did."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.intermediate, self.dot = self.out_features // 2, True
        self.register_buffer("packed", pack_dot_gated(weight.detach().to(torch.bfloat16), self.intermediate),
                             persistent=False)
        self.register_buffer("bias", None, persistent=False)
        if bias is not None:
            padded = torch.zeros(2, self.packed.shape[0] // 2 * DOT_BLOCK)
            padded[:, : self.intermediate] = bias.detach().float().view(2, self.intermediate)
            self.bias = padded.view(2, -1, DOT_BLOCK).transpose(0, 1).reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        blocks = rows.new_empty(rows.shape[0], self.packed.shape[0] * DOT_BLOCK)
        torch.ops.batchgen_cpu.dot_linear(rows, self.packed, self.bias, blocks)
        gate, up = blocks.view(rows.shape[0], -1, 2, DOT_BLOCK).unbind(2)
        out = torch.cat([gate.flatten(1)[:, : self.intermediate], up.flatten(1)[:, : self.intermediate]], 1)
        return out.view(*x.shape[:-1], self.out_features)

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        out = rows.new_empty(rows.shape[0], self.intermediate)
        torch.ops.batchgen_cpu.dot_gated_linear(rows, self.packed, self.bias, out)
        return out.view(*x.shape[:-1], self.intermediate)


class DotGateUpActivation(GateUpActivation):
    """silu(x W_gate^T) * (x W_up^T) in one op over the MLP's :class:`PrepackedGateUp`: the 2I-wide gate|up rows
    are never written (the activation reads each tile's products from L1)."""

    def __call__(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        return mlp.gate_up_proj.activated(x)


DOT_GATE_UP = DotGateUpActivation()


def prepack_gated_mlps(model: nn.Module) -> int:
    """Where ``dot_linear`` runs, gives ``model``'s SwiGLU MLPs with a whole bf16 gate|up projection (even inputs)
    a :class:`PrepackedGateUp` and :data:`DOT_GATE_UP`; returns how many."""
    if not dot_linear_runs():
        return 0
    count = 0
    with torch.inference_mode():
        for mlp in model.modules():
            if not isinstance(mlp, GatedMLP) or mlp.activation != "silu" or not plain_projection(mlp.gate_up_proj):
                continue
            weight = mlp.gate_up_proj.weight
            if weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
                continue
            mlp.gate_up_proj = PrepackedGateUp(weight, getattr(mlp.gate_up_proj, "bias", None))
            mlp.gate_up_activation = DOT_GATE_UP
            count += 1
    return count


class DotExpertsMethod(MoEMethod):
    """bf16 experts whose stacked weights ``prepack_experts`` packed in ``dot_linear``'s blocks: every expert's
    projection runs in one parallel loop of ``dot_linear``'s tiles (``batchgen_cpu.fused_moe_packed``), where the
    expert op's few-row tiles sum lanes and its GEMMs pack W each call."""

    def apply(self, moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              skip_negative: bool = False) -> torch.Tensor:
        return ops.fused_moe_packed(x, moe.gate_up_proj, moe.down_proj, moe.local_size, topk_weights, topk_ids,
                                    skip_negative)


DOT_EXPERTS_METHOD = DotExpertsMethod()


def prepack_experts(model: nn.Module) -> int:
    """Packs the stacked weights of ``model``'s unquantized bf16 experts where ``dot_linear`` runs
    (:func:`pack_dot_moe`), the slots staying the first dim (expert load balancing moves whole slots); returns how
    many layers."""
    if not dot_linear_runs():
        return 0
    count = 0
    with torch.inference_mode():
        for moe in model.modules():
            if not isinstance(moe, FusedMoE) or moe.quant_method is not UNQUANTIZED_MOE:
                continue
            w13, w2 = moe.gate_up_proj, moe.down_proj
            if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 or w13.device.type != "cpu" or \
                    moe.hidden_size % 2 or moe.local_size % 2:
                continue
            packed13, packed2 = pack_dot_moe(w13.data, w2.data)
            moe.gate_up_proj = nn.Parameter(packed13, requires_grad=False)
            moe.down_proj = nn.Parameter(packed2, requires_grad=False)
            moe.quant_method = DOT_EXPERTS_METHOD
            count += 1
    return count


class DotAbsorbedProducts(AbsorbedProducts):
    """A latent attention layer's W_UK (as W_UK^T) and W_UV packed a head at a time in ``dot_linear``'s blocks:
    the absorbed decode's products in ``batchgen_cpu.dot_bmm`` (bf16 rows), in place of bmm's GEMMs."""

    def __init__(self, w_uk: torch.Tensor, w_uv: torch.Tensor):
        super().__init__()
        # (H, R, nope): q_nope W_UK[h] = q_nope (W_UK[h]^T)^T
        self.register_buffer("uk", pack_dot_experts(w_uk.transpose(1, 2)), persistent=False)
        self.register_buffer("uv", pack_dot_experts(w_uv), persistent=False)  # (H, v, R)
        self.rank, self.v_dim = w_uk.shape[2], w_uv.shape[1]

    def query(self, layer: nn.Module, q_nope: torch.Tensor) -> torch.Tensor:
        if q_nope.dtype != torch.bfloat16:
            return super().query(layer, q_nope)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], self.rank)
        torch.ops.batchgen_cpu.dot_bmm(q_nope, self.uk, out)
        return out

    def values(self, layer: nn.Module, out: torch.Tensor) -> torch.Tensor:
        if out.dtype != torch.bfloat16 or out.stride(2) != 1:
            return super().values(layer, out)
        values = out.new_empty(out.shape[0], out.shape[1], self.v_dim)
        torch.ops.batchgen_cpu.dot_bmm(out, self.uv, values)
        return values


def prepack_absorbed(model: nn.Module) -> int:
    """Gives ``model``'s latent attention layers their own absorbed products: :class:`SmallRowsProducts` for fp32
    W_UK and W_UV, :class:`DotAbsorbedProducts` for bf16 ones (even dims) where ``dot_linear`` runs; returns how
    many."""
    count = 0
    with torch.inference_mode():
        for layer in model.modules():
            if not isinstance(layer, MLAAttention) or layer.w_uk.device.type != "cpu":
                continue
            if layer.w_uk.dtype == torch.float32:
                layer.absorbed = SmallRowsProducts(layer.w_uk)
            elif layer.w_uk.dtype == torch.bfloat16 and dot_linear_runs() and layer.nope_dim % 2 == 0 and \
                    layer.kv_lora_rank % 2 == 0:
                layer.absorbed = DotAbsorbedProducts(layer.w_uk, layer.w_uv)
            else:
                continue
            count += 1
    return count


def prepack_weights(model: nn.Module) -> None:
    """The CPU kernel set's ``prepare_model``: :func:`prepack_gated_mlps` (before the other linears, whose pass
    would pack gate|up as a plain projection), :func:`prepack_linears`, :func:`prepack_experts` and
    :func:`prepack_absorbed`."""
    gated = prepack_gated_mlps(model)
    linears, experts, latent = prepack_linears(model), prepack_experts(model), prepack_absorbed(model)
    log.debug("prepacked %d gated MLPs, %d other linear layers, %d layers of experts, %d latent attention layers",
              gated, linears, experts, latent)


@lru_cache(maxsize=1)
def prepacking_works() -> bool:
    """Whether this torch build packs and runs bf16 linears, checked once on a small one."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, bias = torch.randn(48, 64).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        return torch.allclose(PrepackedLinear(weight, bias)(x).float(), F.linear(x, weight, bias).float(),
                              atol=1e-2, rtol=1e-2)
    except RuntimeError as e:
        log.info("bf16 weight prepacking unavailable: %s", str(e).splitlines()[0])
        return False


# Projections whose forward is y = x W^T (+ b) and nothing else once unsplit (a router also selects experts).
_PLAIN_FORWARDS = (LinearBase.forward, RowParallelLinear.forward, ParallelLMHead.forward)


def whole_unquantized(module: nn.Module) -> bool:
    """A layer on one rank (not tensor-parallel) whose 2-D CPU weight ``F.linear`` multiplies (FP8 layers kept
    quantized own their weight and scales; dequantized ones are plain by now)."""
    if getattr(module, "tp_size", 1) != 1 or getattr(module, "quant_method", UNQUANTIZED) is not UNQUANTIZED:
        return False
    weight = module.weight
    return weight.dim() == 2 and weight.device.type == "cpu" and weight.is_contiguous()


def plain_projection(module: nn.Module) -> bool:
    """A whole projection or LM head on CPU that multiplies with ``F.linear`` and does nothing else."""
    return type(module).forward in _PLAIN_FORWARDS and whole_unquantized(module)


def whole_router(module: nn.Module) -> bool:
    """A mixture's router on CPU: its logits are its method's multiply (then it selects experts), so it takes a
    new method but is not replaced by a prepacked layer."""
    return isinstance(module, TopKRouter) and whole_unquantized(module)


def prepack_linears(model: nn.Module) -> int:
    """Readies the plain projections and routers of a loaded ``model``: fp32 ones multiply with the small-row
    method (so a token's router logits, like its other products, do not depend on the step's other rows); bf16
    ones with the AMX small-row method on CPUs with AMX, else plain projections become prepacked layers (where
    this torch build packs them); returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if (plain_projection(child) or whole_router(child))
               and child.weight.dtype in (torch.bfloat16, torch.float32)]
    packing = prepacking_works() if any(c.weight.dtype == torch.bfloat16 for _, _, c in targets) else False
    count = 0
    with torch.inference_mode():
        for parent, name, child in targets:
            if child.weight.dtype == torch.float32:
                child.quant_method = SMALL_ROWS_METHOD
            elif amx_tiles() and amx_rows_fit(child.weight, getattr(child, "bias", None)):
                child.quant_method = AMX_ROWS_METHOD
            elif packing and plain_projection(child):
                setattr(parent, name, PrepackedLinear(child.weight, getattr(child, "bias", None)))
            else:
                continue
            count += 1
    return count
