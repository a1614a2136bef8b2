"""Llama (2/3, SmolLM2), Mistral and Phi-3/4: GQA attention with rotary, gated SiLU MLP, over a paged KV cache."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen.engine.backends.interface import AttentionMetadata, KernelSet
from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.attention import Attention
from batchgen.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from batchgen.engine.layers.mlp import GatedMLP
from batchgen.engine.layers.norm import RMSNorm
from batchgen.engine.models.base import CausalLM, WeightRule
from batchgen.engine.parallel.group import SINGLE, CommGroup


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional per-head q/k RMSNorm, rotary on the first ``rotary_dim`` dims; this
    rank's heads under tensor parallelism.

    ``scale``, ``sliding_window`` and ``softcap`` go to :class:`Attention`; ``norm_class`` is the q/k norm's.
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 sliding_window: int | None = None, scale: float | None = None, softcap: float | None = None,
                 norm_class: type[RMSNorm] = RMSNorm, tp: CommGroup = SINGLE):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=qkv_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        self.q_size, self.kv_size = self.qkv_proj.local_sizes[:2]
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias, tp=tp)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, kernels)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, kernels.attention, scale=scale,
                              sliding_window=sliding_window, softcap=softcap)
        self.kernels = kernels

    @property
    def project_width(self) -> int:
        return self.q_size + 2 * self.kv_size

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], -1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """qkv rows for x, with q/k normed (when the model has q/k norm) and rotated."""
        qkv = self.qkv_proj(x)
        q, k, _ = self.split_heads(qkv)
        if self.qk_norm:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.rotary_dim < self.head_dim:  # partial rotary: the leading dims only
            q, k = q[..., : self.rotary_dim], k[..., : self.rotary_dim]
        self.kernels.apply_rotary(q, k, positions, cos_sin)
        return qkv

    def attend(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attn(*self.split_heads(qkv), meta).flatten(1)


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 (llama3 and linear rope scaling), SmolLM2; attention_bias adds q/k/v/o biases."""

    weight_rules = (
        WeightRule(r"\.q_proj\.", ".qkv_proj.", "q"),
        WeightRule(r"\.k_proj\.", ".qkv_proj.", "k"),
        WeightRule(r"\.v_proj\.", ".qkv_proj.", "v"),
        WeightRule(r"\.gate_proj\.", ".gate_up_proj.", 0),
        WeightRule(r"\.up_proj\.", ".gate_up_proj.", 1),
    )

    def attention_options(self) -> dict[str, Any]:
        """Biases and q/k norm of the attention projections (and anything else ``LlamaAttention`` takes)."""
        bias = self.cfg.attention_bias
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def make_attention(self, layer: int) -> nn.Module:
        return LlamaAttention(self.cfg, self.kernels, sliding_window=self.sliding_window(layer),
                              **self.attention_options(), tp=self.parallel.tp)

    def make_mlp(self, layer: int) -> nn.Module:
        return GatedMLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.kernels, tp=self.parallel.tp)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with no attention biases; ``sliding_window`` (when set) applies to every layer."""

    def attention_options(self) -> dict[str, Any]:
        return dict(qkv_bias=False, o_bias=False, qk_norm=False)


class Phi3ForCausalLM(MistralForCausalLM):
    """Phi-3 and Phi-4: checkpoints hold the fused ``qkv_proj`` and ``gate_up_proj`` (loaded as they are);
    LongRoPE scaling and partial rotary come from the config; the window, when set, covers every layer."""
