"""Qwen2 and Qwen3: Llama-shaped, with their own attention quirks (q/k/v biases, q/k norm)."""
from __future__ import annotations

from batchgen.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """q, k and v projections always carry biases; the output projection never does."""

    def attention_options(self) -> dict[str, bool]:
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)

    def is_local(self, layer: int) -> bool:
        """With ``use_sliding_window``, the layers from ``max_window_layers`` on (configs without layer_types)."""
        return layer >= int(self.cfg.hf.get("max_window_layers") or 0)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Per-head RMSNorm of q and k before rotary; ``attention_bias`` on all four projections."""

    def attention_options(self) -> dict[str, bool]:
        bias = self.cfg.attention_bias
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
