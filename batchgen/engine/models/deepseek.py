"""DeepSeek-V2 and V3: multi-head latent attention, dense MLPs in the first ``first_k_dense_replace``
layers, then routed experts plus un-gated shared experts (one MLP of ``n_shared_experts`` experts' width).

Routing, as transformers computes it (float32 router):
- V2: softmax scores; ``greedy`` top-k, or ``group_limited_greedy`` (top-k among the experts of the
  ``topk_group`` groups with the highest best expert); weights times ``routed_scaling_factor``.
- V3: sigmoid scores; experts chosen on scores + ``e_score_correction_bias`` within the ``topk_group``
  groups with the highest sum of their top two; weights are the unbiased scores, divided by their sum
  (+1e-20) with ``norm_topk_prob``, times ``routed_scaling_factor``.
Rope rotates adjacent pairs (V3 unless ``rope_interleave`` is false), with YaRN scaling and its
mscale on the softmax scale.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from batchgen.engine.backends.interface import AttentionMetadata, KernelSet
from batchgen.engine.config import MoEConfig, ModelConfig
from batchgen.engine.core.kv_cache import KVLayout
from batchgen.engine.layers.linear import default_weight_loader, new_parameter
from batchgen.engine.layers.mla import MLAAttention, MLAMetadata
from batchgen.engine.layers.mlp import GatedMLP
from batchgen.engine.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
from batchgen.engine.layers.rotary import cos_sin_cache
from batchgen.engine.loading.model_source import Weight
from batchgen.engine.models.base import CausalLM, CheckpointNames, WeightRule, expert_rules
from batchgen.engine.models.deepseek_mtp import OPTIONAL_WEIGHTS, MultiTokenPredictor, mtp_layer_count
from batchgen.engine.models.errors import UnsupportedModelError
from batchgen.engine.parallel.context import SINGLE_PROCESS, ParallelContext

# transformers' defaults for keys a config.json may leave out.
_MLA_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                 "v_head_dim": 128}


def top_groups_mask(group_scores: torch.Tensor, topk_group: int, experts_per_group: int) -> torch.Tensor:
    """(T, E) bool: the experts of each token's ``topk_group`` best groups."""
    keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.repeat_interleave(experts_per_group, dim=1)


class GroupedRouter(TopKRouter):
    """A float32 router over ``n_group`` equal groups of experts."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__(hidden_size, moe.num_experts, moe.top_k, renormalize=moe.norm_topk_prob,
                         params_dtype=torch.float32)
        if moe.num_experts % moe.n_group or not 1 <= moe.topk_group <= moe.n_group:
            raise UnsupportedModelError(f"{moe.num_experts} experts cannot form {moe.n_group} groups "
                                        f"of which {moe.topk_group} are kept")
        self.n_group, self.topk_group, self.scaling = moe.n_group, moe.topk_group, moe.routed_scaling_factor
        self.experts_per_group = moe.num_experts // moe.n_group

    def group_view(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.view(-1, self.n_group, self.experts_per_group)


class DeepseekV2Router(GroupedRouter):
    """Softmax scores; top-k over all experts or over those of the best groups (by their best expert)."""

    TOPK_METHODS = ("greedy", "group_limited_greedy")

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__(hidden_size, moe)
        if moe.topk_method not in self.TOPK_METHODS:
            raise UnsupportedModelError(f"unsupported topk_method {moe.topk_method!r}; "
                                        f"supported: {', '.join(self.TOPK_METHODS)}")
        self.grouped = moe.topk_method == "group_limited_greedy"

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float().softmax(dim=-1)
        if self.grouped:
            keep = top_groups_mask(self.group_view(scores).amax(dim=-1), self.topk_group, self.experts_per_group)
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, ids


class DeepseekV3Router(GroupedRouter):
    """Adds ``e_score_correction_bias`` (float32), which steers the choice but not the weights."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__(hidden_size, moe)
        if self.experts_per_group < 2:
            raise UnsupportedModelError("DeepSeek-V3 routing scores groups by their top two experts; "
                                        f"{self.num_experts} experts in {self.n_group} groups leave fewer")
        self.e_score_correction_bias = new_parameter((self.num_experts,), default_weight_loader, torch.float32)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float().sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = self.group_view(choice).topk(2, dim=-1).values.sum(dim=-1)
        keep = top_groups_mask(group_scores, self.topk_group, self.experts_per_group)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekV2ForCausalLM(CausalLM):
    """Latent attention with pairwise rope; softmax routing (greedy or group-limited)."""

    config_defaults = {**_MLA_DEFAULTS, "n_shared_experts": 2, "topk_method": "greedy"}
    router_class: type[GroupedRouter] = DeepseekV2Router
    checkpoint_names = CheckpointNames(shared_expert="shared_experts")
    weight_rules = (
        *expert_rules(),
        WeightRule(rf"\.{checkpoint_names.shared_expert}\.gate_proj\.", ".shared_expert.gate_up_proj.", 0),
        WeightRule(rf"\.{checkpoint_names.shared_expert}\.up_proj\.", ".shared_expert.gate_up_proj.", 1),
        WeightRule(rf"\.{checkpoint_names.shared_expert}\.", ".shared_expert."),
        WeightRule(r"\.gate_proj\.", ".gate_up_proj.", 0),
        WeightRule(r"\.up_proj\.", ".gate_up_proj.", 1),
    )
    # The prefill plan (which context rows to expand) is sized on the host each step: decode steps only.
    graph_step_kinds = ("decode",)

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int, chunk_tokens: int = 1024,
                 parallel: ParallelContext = SINGLE_PROCESS, mtp: bool = False):
        """``mtp``: also build (and load) the checkpoint's first multi-token-prediction layer, ``self.mtp``, and
        keep every step's last hidden states for it (``keep_hidden_states``)."""
        if cfg.mla is None or cfg.moe is None:
            raise UnsupportedModelError(f"{cfg.architecture} needs kv_lora_rank and routed experts in its config")
        if cfg.hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias is not supported")
        super().__init__(cfg, kernels, max_positions, chunk_tokens, parallel)
        self.mtp: MultiTokenPredictor | None = None
        if mtp:
            if mtp_layer_count(cfg) < 1:
                raise ValueError("speculative method 'mtp' needs a checkpoint with multi-token-prediction layers: "
                                 f"this config.json has num_nextn_predict_layers = "
                                 f"{cfg.hf.get('num_nextn_predict_layers')!r}, not >= 1")
            n = cfg.num_layers  # the MTP layer's index: the usual dense / MoE rule applies to it
            self.mtp = MultiTokenPredictor(self.make_attention(n), self.make_mlp(n), cfg, kernels, chunk_tokens)
            self.keep_hidden_states = True

    def pairwise_rope(self) -> bool:
        return True

    def make_attention(self, layer: int) -> nn.Module:
        return MLAAttention(self.cfg, self.kernels, pairwise_rope=self.pairwise_rope(), tp=self.parallel.tp)

    def make_mlp(self, layer: int) -> nn.Module:
        c, moe, tp = self.cfg, self.cfg.moe, self.parallel.tp
        if layer < moe.first_k_dense_replace:
            return GatedMLP(c.hidden_size, c.intermediate_size, self.kernels, tp=tp)
        experts = FusedMoE(moe.num_experts, c.hidden_size, moe.intermediate_size, self.kernels, self.parallel)
        shared = GatedMLP(c.hidden_size, moe.shared_intermediate_size, self.kernels, tp=tp) \
            if moe.shared_intermediate_size else None
        return SparseMoeBlock(self.router_class(c.hidden_size, moe), experts, shared, exchange=self.parallel.exchange)

    def rotary_table(self, max_positions: int) -> torch.Tensor:
        c = self.cfg
        return cos_sin_cache(c.mla.qk_rope_head_dim, c.rope_theta, c.rope_scaling, max_positions)

    def checkpoint_target(self, hf_name: str) -> tuple[str, Any] | None:
        layer = hf_name.removeprefix("model.").split(".")
        if layer[0] == "layers" and int(layer[1]) >= self.cfg.num_layers:
            if self.mtp is None or int(layer[1]) > self.cfg.num_layers:
                return None  # the multi-token-prediction layers after the last one (only the first is used)
            return super().checkpoint_target(".".join(["mtp", *layer[2:]]))
        return super().checkpoint_target(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """The main model's weights and, with ``mtp``, its MTP layer's (a clear error when it has none)."""
        if self.mtp is None:
            return super().load_weights(weights)
        prefix, seen = f"model.layers.{self.cfg.num_layers}.", []

        def main_and_mtp_layer():
            for name, tensor in weights:
                rest = name.removeprefix(prefix)
                if rest != name:
                    seen.append(name)
                    if rest in OPTIONAL_WEIGHTS:
                        self.mtp.load_optional(rest, tensor)
                        continue
                yield name, tensor

        try:
            super().load_weights(main_and_mtp_layer())
        except ValueError:
            if not seen:
                raise ValueError(f"speculative method 'mtp': the checkpoint has no weights of its multi-token-"
                                 f"prediction layer ({prefix}enorm, hnorm, eh_proj, self_attn, mlp, ...)") from None
            raise

    def proposer_kv_layout(self) -> KVLayout:
        if self.mtp is None:
            return super().proposer_kv_layout()
        return KVLayout((tuple(self.mtp.self_attn.cache_token_shapes()),))

    def mtp_hidden_states(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        """The MTP layer's output rows (see ``MultiTokenPredictor.hidden_states``) over its own paged cache."""
        if not meta.decode_only:
            meta = MLAMetadata.for_step(meta, self.mtp.self_attn.cache.shape[1])
        return self.mtp.hidden_states(input_ids, previous, positions, self.cos_sin, meta, self.embed)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.logits(hidden, self.compute_logits)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        if not meta.decode_only:
            meta = MLAMetadata.for_step(meta, self.layers[0].self_attn.cache.shape[1])
        return super().forward(input_ids, positions, meta, logits_indices)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's layers with sigmoid, bias-steered group routing; rope pairwise unless ``rope_interleave`` is false."""

    config_defaults = {**_MLA_DEFAULTS, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                       "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                       "rope_interleave": True}
    router_class = DeepseekV3Router

    def pairwise_rope(self) -> bool:
        return bool(self.cfg.hf["rope_interleave"])
