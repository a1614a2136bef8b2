"""Qwen2-MoE and Qwen3-MoE: softmax top-k routing, renormalised only with ``norm_topk_prob``.

Layer i is sparse unless it is in ``mlp_only_layers`` or (i + 1) is not a multiple of
``decoder_sparse_step``; dense layers use the plain gated MLP. Qwen2-MoE adds a shared expert
scaled by ``sigmoid(shared_expert_gate(x))``; Qwen3-MoE has q/k norm and no shared expert.
"""
from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.linear import ReplicatedLinear
from batchgen.engine.layers.mlp import GatedMLP
from batchgen.engine.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
from batchgen.engine.models.base import expert_rules
from batchgen.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from batchgen.engine.parallel.context import ParallelContext


class QwenMoeRouter(TopKRouter):
    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().select(logits)
        return weights.to(logits.dtype).float(), ids  # transformers rounds the weights to the model dtype


def is_sparse(cfg: ModelConfig, layer: int) -> bool:
    moe = cfg.moe
    return moe is not None and layer not in moe.mlp_only_layers and (layer + 1) % moe.decoder_sparse_step == 0


def qwen_moe_block(cfg: ModelConfig, kernels: KernelSet, with_shared_expert: bool,
                   parallel: ParallelContext) -> SparseMoeBlock:
    moe, hidden = cfg.moe, cfg.hidden_size
    router = QwenMoeRouter(hidden, moe.num_experts, moe.top_k, renormalize=moe.norm_topk_prob)
    experts = FusedMoE(moe.num_experts, hidden, moe.intermediate_size, kernels, parallel)
    if not (with_shared_expert and moe.shared_intermediate_size):
        return SparseMoeBlock(router, experts, exchange=parallel.exchange)
    return SparseMoeBlock(router, experts, GatedMLP(hidden, moe.shared_intermediate_size, kernels, tp=parallel.tp),
                          ReplicatedLinear(hidden, 1), exchange=parallel.exchange)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    config_defaults = {"qkv_bias": True}
    weight_rules = (*expert_rules(), *Qwen2ForCausalLM.weight_rules)

    def attention_options(self) -> dict[str, bool]:
        return dict(qkv_bias=bool(self.cfg.hf["qkv_bias"]), o_bias=False, qk_norm=False)

    def make_mlp(self, layer: int) -> nn.Module:
        if not is_sparse(self.cfg, layer):
            return super().make_mlp(layer)
        return qwen_moe_block(self.cfg, self.kernels, with_shared_expert=True, parallel=self.parallel)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    weight_rules = (*expert_rules(), *Qwen3ForCausalLM.weight_rules)

    def make_mlp(self, layer: int) -> nn.Module:
        if not is_sparse(self.cfg, layer):
            return super().make_mlp(layer)
        return qwen_moe_block(self.cfg, self.kernels, with_shared_expert=False, parallel=self.parallel)
