"""Gemma 2 and Gemma 3 (text): sandwich norms, GeGLU, interleaved local (sliding-window) and global layers.

Both scale embeddings by sqrt(hidden) and every RMSNorm by (1 + weight), and scale attention scores by
``query_pre_attn_scalar ** -0.5``. Gemma 2 soft-caps attention scores and the final logits; Gemma 3 norms
q and k per head and gives its local layers their own rope base (global layers keep the rope scaling).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.mlp import GatedMLP
from batchgen.engine.layers.norm import OffsetRMSNorm
from batchgen.engine.layers.rotary import cos_sin_cache
from batchgen.engine.models.base import CausalLM, DecoderLayer
from batchgen.engine.models.errors import UnsupportedModelError
from batchgen.engine.models.llama import LlamaAttention, LlamaForCausalLM
from batchgen.engine.parallel.context import SINGLE_PROCESS, ParallelContext

# transformers' config defaults: Gemma checkpoints (Gemma 3's text_config above all) leave many keys out.
_GEMMA2_DEFAULTS = dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, query_pre_attn_scalar=256,
    sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
)
_GEMMA3_DEFAULTS = dict(
    _GEMMA2_DEFAULTS, vocab_size=262208, max_position_embeddings=131072, rope_theta=1_000_000.0,
    rope_local_base_freq=10000.0, final_logit_softcapping=None, attn_logit_softcapping=None,
    sliding_window_pattern=6,
)


class GemmaDecoderLayer(DecoderLayer):
    """Norms around both blocks: the attention and MLP outputs are normed before joining the residual."""

    norm_class = OffsetRMSNorm

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, cfg: ModelConfig, kernels: KernelSet,
                 chunk_tokens: int):
        super().__init__(self_attn, mlp, cfg, kernels, chunk_tokens)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def mlp_input(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pre_feedforward_layernorm(self.post_attention_layernorm(attn_out), residual)

    def mlp_output(self, mlp_out: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(mlp_out)


class Gemma2ForCausalLM(CausalLM):
    """Layers alternate local and global, from a local one; soft caps on attention scores and logits."""

    config_defaults = _GEMMA2_DEFAULTS
    activations = ("gelu_pytorch_tanh",)
    weight_rules = LlamaForCausalLM.weight_rules
    decoder_layer = GemmaDecoderLayer
    local_pattern = 2  # without layer_types, every local_pattern-th layer (counting from 1) is global

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int, chunk_tokens: int = 1024,
                 parallel: ParallelContext = SINGLE_PROCESS):
        super().__init__(cfg, kernels, max_positions, chunk_tokens, parallel)
        # transformers rounds sqrt(hidden) to the weights' dtype before scaling the embeddings.
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=self.embed_tokens.weight.dtype,
                                              device="cpu"))
        self.final_softcap = cfg.hf.get("final_logit_softcapping")

    @classmethod
    def hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = super().hf_config(cfg)
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional Gemma models (embedding models) are not supported")
        return cfg

    def is_local(self, layer: int) -> bool:
        return (layer + 1) % int(self.cfg.hf.get("sliding_window_pattern") or self.local_pattern) != 0

    def attention_options(self) -> dict[str, Any]:
        hf, bias = self.cfg.hf, self.cfg.attention_bias
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=False, scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
                    softcap=hf.get("attn_logit_softcapping"))

    def make_attention(self, layer: int) -> nn.Module:
        return LlamaAttention(self.cfg, self.kernels, sliding_window=self.sliding_window(layer),
                              norm_class=OffsetRMSNorm, tp=self.parallel.tp, **self.attention_options())

    def make_mlp(self, layer: int) -> nn.Module:
        return GatedMLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.kernels, tp=self.parallel.tp,
                        activation="gelu_tanh")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Five local layers to one global; q/k norm; local layers rotate with ``rope_local_base_freq``,
    unscaled, global ones with ``rope_theta`` and the rope scaling. No attention soft cap."""

    config_defaults = _GEMMA3_DEFAULTS
    local_pattern = 6

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int, chunk_tokens: int = 1024,
                 parallel: ParallelContext = SINGLE_PROCESS):
        super().__init__(cfg, kernels, max_positions, chunk_tokens, parallel)
        local = cos_sin_cache(cfg.rotary_dim, float(cfg.hf["rope_local_base_freq"]), None, max_positions)
        self.register_buffer("cos_sin_local", local, persistent=False)

    @classmethod
    def hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = super().hf_config(cfg)
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers >= 5: rope settings per layer type
            local = rope.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"rope scaling {local['rope_type']!r} on Gemma 3's local layers")
            cfg = {**cfg, "rope_parameters": rope["full_attention"],
                   "rope_local_base_freq": local.get("rope_theta", cfg["rope_local_base_freq"])}
        return cfg

    def attention_options(self) -> dict[str, Any]:
        return dict(super().attention_options(), qk_norm=True, softcap=None)

    def layer_cos_sin(self, layer: int) -> torch.Tensor:
        return self.cos_sin_local if self.sliding_window(layer) else self.cos_sin


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 vision checkpoint (``text_config``); the vision tower is not loaded."""

    _VISION = ("vision_tower.", "multi_modal_projector.")
    # Where checkpoints keep the language model: transformers >= 5, then earlier releases.
    _PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                 "language_model.lm_head.": "lm_head."}

    @classmethod
    def hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        return super().hf_config({**top, **(cfg.get("text_config") or {}), "architectures": cfg["architectures"]})

    def checkpoint_target(self, hf_name: str) -> tuple[str, Any] | None:
        name = hf_name.removeprefix("model.")
        if name.startswith(self._VISION):
            return None
        prefix = next((p for p in self._PREFIXES if hf_name.startswith(p)), None)
        return super().checkpoint_target(self._PREFIXES[prefix] + hf_name[len(prefix):] if prefix else hf_name)
