"""Mixtral: Mistral attention, every MLP a mixture of experts (softmax over experts, top-k, always renormalised)."""
from __future__ import annotations

from torch import nn

from batchgen.engine.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
from batchgen.engine.models.base import CheckpointNames, WeightRule, expert_rules
from batchgen.engine.models.llama import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    # Checkpoints name the block block_sparse_moe and the experts' gate/up/down w1/w3/w2.
    checkpoint_names = CheckpointNames(moe_module="block_sparse_moe", expert_projections=("w1", "w3", "w2"))
    weight_rules = (
        *expert_rules(checkpoint_names.moe_module, checkpoint_names.expert_projections),
        WeightRule(rf"\.{checkpoint_names.moe_module}\.gate\.", ".mlp.gate."),
        *MistralForCausalLM.weight_rules,
    )

    def make_mlp(self, layer: int) -> nn.Module:
        c, moe = self.cfg, self.cfg.moe
        return SparseMoeBlock(TopKRouter(c.hidden_size, moe.num_experts, moe.top_k, renormalize=True),
                              FusedMoE(moe.num_experts, c.hidden_size, moe.intermediate_size, self.kernels,
                                       self.parallel), exchange=self.parallel.exchange)
