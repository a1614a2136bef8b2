"""DeepSeek-V3's multi-token-prediction (MTP) layer: one decoder layer that predicts the token after next.

The checkpoint keeps it at layer index ``num_hidden_layers`` (config ``num_nextn_predict_layers`` >= 1): ``enorm``
and ``hnorm`` (RMSNorms of the next token's embedding and of the main model's last hidden state before its final
norm), ``eh_proj`` (2H -> H over ``[enorm(emb(t[i+1])), hnorm(h[i])]``, embedding first), a full decoder layer
(``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) and ``shared_head.norm``; its own
``embed_tokens`` and ``shared_head.head`` are optional (the main model's embedding and LM head otherwise). Row i's
output predicts token i + 2; its hidden state (before ``shared_head.norm``) is the next row's h when the layer
drafts further tokens (as vLLM and SGLang chain it).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.backends.interface import AttentionMetadata, KernelSet
from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.linear import ReplicatedLinear
from batchgen.engine.layers.norm import RMSNorm
from batchgen.engine.loading.model_source import Weight, as_tensor
from batchgen.engine.models.base import DecoderLayer

OPTIONAL_WEIGHTS = ("embed_tokens.weight", "shared_head.head.weight")  # the main model's, when absent


def mtp_layer_count(cfg: ModelConfig) -> int:
    """The checkpoint's multi-token-prediction layers (config.json's ``num_nextn_predict_layers``)."""
    return int(cfg.hf.get("num_nextn_predict_layers") or 0)


class SharedHead(nn.Module):
    """The MTP layer's output norm; its vocabulary projection is a buffer set only by a checkpoint that has one."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.register_buffer("head", None, persistent=False)


class MultiTokenPredictor(DecoderLayer):
    """The decoder layer with the MTP input projection before it and the shared head after it (names as in the
    checkpoint below ``model.layers.{num_hidden_layers}.``)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, cfg: ModelConfig, kernels: KernelSet,
                 chunk_tokens: int):
        super().__init__(self_attn, mlp, cfg, kernels, chunk_tokens)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps, kernels)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps, kernels)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(cfg, kernels)
        self.register_buffer("embed_tokens", None, persistent=False)

    def load_optional(self, name: str, loaded: Weight) -> None:
        """Its own embedding or LM head (``OPTIONAL_WEIGHTS``), in the model's dtype and device."""
        like = self.enorm.weight
        tensor = as_tensor(loaded).to(device=like.device, dtype=like.dtype)
        if name == "embed_tokens.weight":
            self.embed_tokens = tensor
        else:
            self.shared_head.head = tensor

    def hidden_states(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, meta: AttentionMetadata,
                      embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's output (before ``shared_head.norm``) for rows of (token i + 1, hidden state i)."""
        e = F.embedding(input_ids, self.embed_tokens) if self.embed_tokens is not None else embed(input_ids)
        x = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(previous)), dim=-1))
        x, residual = self(x, None, positions, cos_sin, meta)
        return x + residual

    def logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        h = self.shared_head.norm(hidden)
        return F.linear(h, self.shared_head.head) if self.shared_head.head is not None else lm_head(h)
