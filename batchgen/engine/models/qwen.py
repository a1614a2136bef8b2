"""Qwen2 and Qwen3: Llama-shaped, with their own attention quirks (q/k/v biases, q/k norm)."""
from __future__ import annotations

from batchgen.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """q, k and v projections always carry biases; the output projection never does."""

    def attention_options(self) -> dict[str, bool]:
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Per-head RMSNorm of q and k before rotary; ``attention_bias`` on all four projections."""

    def attention_options(self) -> dict[str, bool]:
        bias = self.cfg.attention_bias
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
