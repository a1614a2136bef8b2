"""Mixture-of-experts layers: the router (top-k selection in float32, in torch), stacked experts, the block.

The expert compute goes through ``kernels.fused_moe`` (torch: sorted per-expert GEMMs; a fused
Triton kernel on the GPU path); routing stays here, where each model's router rules are readable.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen.engine.layers.linear import (
    ReplicatedLinear, check_shape, copy_weight, current_weight_methods, divide, matmul_params, new_parameter,
    param_shape, param_span, shard_span,
)
from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.loading.model_source import Weight
from batchgen.engine.parallel.context import SINGLE_PROCESS, ParallelContext
from batchgen.engine.parallel.expert import TokenExchange
from batchgen.engine.parallel.expert_map import ExpertMap

EXPERT_SHARDS = ("gate", "up", "down")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, the top-k of them, optionally renormalised to sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TopKRouter(ReplicatedLinear):
    """The gate: expert logits ``x @ weight.T``, then each token's top-k experts and float32 weights.

    Subclasses change ``select`` for other routing rules (grouped, sigmoid-scored, biased).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 params_dtype: torch.dtype | None = None):
        super().__init__(hidden_size, num_experts, params_dtype=params_dtype)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.select(super().forward(x))


def expert_parameter(moe: "FusedMoE", shape: tuple[int, ...], projection: str, dtype: torch.dtype) -> nn.Parameter:
    """A stacked (local experts, ...) parameter of the experts' ``projection`` ("gate_up" or "down"), or of
    its scales."""
    shards = tuple((e, s) for e in moe.experts for s in (("gate", "up") if projection == "gate_up" else ("down",)))
    param = new_parameter(shape, moe.weight_loader, dtype, shard_ids=shards)
    param.projection = projection
    return param


class MoEMethod:
    """Unquantized experts: ``gate_up_proj`` and ``down_proj`` in the model dtype, through ``kernels.fused_moe``."""

    computes_in_fp8 = False

    def create_weights(self, moe: "FusedMoE") -> None:
        e, size, hidden = len(moe.slots), moe.local_size, moe.hidden_size
        moe.gate_up_proj = expert_parameter(moe, (e, 2 * size, hidden), "gate_up", moe.params_dtype)
        moe.down_proj = expert_parameter(moe, (e, hidden, size), "down", moe.params_dtype)

    def apply(self, moe: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              skip_negative: bool = False) -> torch.Tensor:
        """``topk_ids`` index the local experts; -1 (with ``skip_negative``) marks another rank's pairs."""
        return moe.kernels.fused_moe(x, moe.gate_up_proj, moe.down_proj, topk_weights, topk_ids,
                                     skip_negative=skip_negative)

    def finish_loading(self, moe: nn.Module) -> None:
        """Runs once every checkpoint tensor is in place."""


UNQUANTIZED_MOE = MoEMethod()


class FusedMoE(nn.Module):
    """The routed experts' SwiGLU weights stacked: ``gate_up_proj`` (E, 2I, H), gate rows first, and
    ``down_proj`` (E, H, I), as transformers >= 5 holds them.

    Checkpoints store a tensor per expert and projection: the loader stacks them (shard
    ``(expert, "gate" | "up" | "down")``), or takes the stacked tensors whole (shard None). Under
    tensor parallelism each rank holds a slice of every expert's I; under expert parallelism it holds
    whole experts, ``parallel.local_experts``, and the pairs routed elsewhere are skipped. Either way
    the tensor-parallel ranks' partial outputs are summed. The ``quant_method`` decides how the weights
    are held (FP8 experts add ``*_scale`` parameters, sliced by the same loader).

    The stacked parameters' first dim is this rank's physical ``slots``; ``slot_experts`` says which logical
    expert each holds. Without load balancing slot e holds expert e. With it (``parallel.balance_experts``)
    there are ``num_slots`` = experts + redundant slots, a hot expert may fill several, the router's logical
    ids go through ``expert_map`` and the experts compute physical slot ids.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, kernels: KernelSet,
                 parallel: ParallelContext = SINGLE_PROCESS):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp, self.split = parallel.tp, parallel.expert_tp
        self.slots, self.slot_experts = parallel.expert_slots(num_experts)
        self.num_slots = num_experts + parallel.redundant_experts
        # The logical experts whose weights this rank loads, and the local slots each fills.
        self.experts = self.slots if self.num_slots == num_experts else tuple(sorted(set(self.slot_experts)))
        self._local_slots: dict[int, list[int]] = {}
        for i, e in enumerate(self.slot_experts):
            self._local_slots.setdefault(e, []).append(i)
        self.expert_map = self._initial_map(parallel) if parallel.balance_experts else None
        self.local_size = divide(intermediate_size, self.split.size, "expert intermediate size")
        self.params_dtype = torch.get_default_dtype()
        self.kernels = kernels
        methods = current_weight_methods()
        self.quant_method: MoEMethod = methods.moe if methods is not None else UNQUANTIZED_MOE
        self.quant_method.create_weights(self)

    def _initial_map(self, parallel: ParallelContext) -> ExpertMap:
        placement = parallel.expert_placement(self.num_experts)
        return ExpertMap(placement.log2phy(parallel.redundant_experts + 1)[0], torch.get_default_device())

    def expert_params(self) -> int:
        """Parameters of one whole expert (all ranks)."""
        return 3 * self.hidden_size * self.intermediate_size

    def shard_size(self, shard_id: Any) -> int:
        """Rows of one expert's checkpoint tensor for ``shard_id`` (all ranks)."""
        return self.hidden_size if shard_id[1] == "down" else self.intermediate_size

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: Any = None) -> None:
        size, hidden, local = self.intermediate_size, self.hidden_size, self.local_size
        gate_up = param.projection == "gate_up"
        if shard_id is None:  # stacked in the checkpoint: load this rank's experts one by one
            per_expert = (2 * size, hidden) if gate_up else (hidden, size)
            check_shape(loaded, (self.num_experts, *param_shape(param, per_expert)))
            for e in self.experts:
                expert = loaded.select(0, e)
                if gate_up:
                    for start, kind in ((0, "gate"), (size, "up")):
                        self.weight_loader(param, expert.narrow(0, *param_span(param, 0, start, size, 2 * size)),
                                           (e, kind))
                else:
                    self.weight_loader(param, expert, (e, "down"))
            return
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts or kind not in EXPERT_SHARDS:
            raise ValueError(f"no expert shard {shard_id!r} among {self.num_experts} experts")
        start = self.split.rank * local
        for slot in self._local_slots.get(expert, ()):  # none: another expert-parallel rank's, not even read
            target = param.data[slot]
            if kind == "down":
                check_shape(loaded, param_shape(param, (hidden, size)))
                copy_weight(target, loaded.narrow(1, *param_span(param, 1, start, local, size)))
            else:
                check_shape(loaded, param_shape(param, (size, hidden)))
                rows = target.narrow(0, *shard_span(param, 0 if kind == "gate" else local, local, 2 * local))
                copy_weight(rows, loaded.narrow(0, *param_span(param, 0, start, local, size)))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids``: slot ids (expert ids without load balancing) of every routed pair."""
        if len(self.slots) == self.num_slots:
            out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        else:  # local indices; -1 for the pairs another rank computes
            local = topk_ids - self.slots.start
            local.masked_fill_((local < 0) | (local >= len(self.slots)), -1)
            out = self.quant_method.apply(self, x, topk_weights, local, skip_negative=True)
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Routed experts plus optional shared ones: ``experts(x) + [sigmoid(shared_expert_gate(x)) *] shared_expert(x)``.

    Module names follow the checkpoints (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``).
    The router runs on this replica's tokens. With an active ``exchange`` (expert parallelism over
    data-parallel replicas) the routed experts see the tokens it brings them from every replica; the
    shared experts only this replica's.
    """

    def __init__(self, gate: TopKRouter, experts: FusedMoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, exchange: TokenExchange | None = None):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.exchange = exchange or TokenExchange()

    @property
    def step_wide(self) -> bool:
        """Whether the block must see the whole step at once: each call is one collective exchange."""
        return self.exchange.active

    def active_params(self, fp8_only: bool = False) -> int:
        """The router, a token's top-k experts and the shared experts (what each token multiplies by);
        ``fp8_only``: those multiplied in FP8."""
        shared = sum(matmul_params(m, fp8_only) for m in (self.shared_expert, self.shared_expert_gate)
                     if m is not None)
        routed = 0 if fp8_only and not self.experts.quant_method.computes_in_fp8 else self.experts.expert_params()
        return matmul_params(self.gate, fp8_only) + self.gate.top_k * routed + shared

    def activation_values_per_token(self) -> int:
        # Per routed copy of a token: its gathered row, gate|up and SiLU outputs, expert and weighted outputs;
        # under the exchange a rank may get every replica's tokens.
        k, size, hidden = self.gate.top_k, self.experts.local_size, self.experts.hidden_size
        shared = getattr(self.shared_expert, "activation_values_per_token", lambda: 0)()
        return self.exchange.dp.size * k * (3 * size + 3 * hidden) + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        experts = self.experts
        if experts.expert_map is not None:  # load balancing: logical experts -> their replicas' slots
            topk_ids = experts.expert_map.route(topk_ids, self.exchange.first_token)
        routed = self.exchange.dispatch(x, topk_weights, topk_ids, experts.num_slots)
        out = self.exchange.combine(self.experts(routed.x, routed.topk_weights, routed.topk_ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
