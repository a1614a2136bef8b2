"""How llama.cpp lays out each GGUF architecture where it differs from Llama: tensor names, weight
transforms and the metadata (or tensors) that become Hugging Face config keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from batchgen.engine.loading.gguf.metadata import as_int

Getter = Callable[..., Any]  # get(key, default=None): the metadata value "{arch}.{key}"

# llama.cpp's Gemma: layer counts of the 27B models, whose attention scale it takes from hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's fixed base for Gemma 3's local layers


@dataclass(frozen=True)
class GGUFArch:
    """One architecture's deviations from the Llama layout."""

    layer_names: Mapping[str, str] = field(default_factory=dict)  # blk.N.<name> -> HF name under the layer
    permute_qk: bool = False  # llama.cpp interleaves Q/K rows for its rotary (Llama files only)
    norm_offset: float = 0.0  # llama.cpp stores every RMSNorm weight with this added (Gemma: its 1 +)
    config: Callable[[Getter, Mapping[str, Any], dict], dict] | None = None  # extra HF config keys
    config_tensors: frozenset[str] = frozenset()  # tensors read into the config, not loaded as weights


def tensor_values(tensor: Any) -> list[float]:
    """A small float tensor of the file (e.g. rope factors) as a list."""
    return np.asarray(tensor.data, dtype=np.float32).reshape(-1).tolist()


def _sliding_window(get: Getter) -> dict:
    window = as_int(get("attention.sliding_window"), "attention.sliding_window")
    return {"sliding_window": window} if window else {}


def _window_pattern(get: Getter) -> dict:
    """A pattern the file states: every n-th layer global, or a flag per layer (True: local)."""
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return {"layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}
    return {"sliding_window_pattern": int(pattern)} if pattern else {}


def _llama_config(get: Getter, tensors: Mapping[str, Any], config: dict) -> dict:
    """Mistral's window, where the converter wrote it; Llama 3's rope scaling, which llama.cpp stores
    as one divisor per rotary frequency (the rope_freqs tensor)."""
    out = _sliding_window(get)
    if "rope_freqs.weight" in tensors:
        out["rope_scaling"] = {"rope_type": "frequency_factors",
                               "factors": tensor_values(tensors["rope_freqs.weight"])}
    return out


def _gemma_config(arch: str) -> Callable[[Getter, Mapping[str, Any], dict], dict]:
    def extra(get: Getter, tensors: Mapping[str, Any], config: dict) -> dict:
        out: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                               **_sliding_window(get), **_window_pattern(get)}
        scale = get("attention.scale")
        if scale:
            out["query_pre_attn_scalar"] = float(scale) ** -2
        elif config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
            out["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
        else:
            out["query_pre_attn_scalar"] = config["head_dim"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                out[key] = float(get(key))
        if arch == "gemma3":
            out["rope_local_base_freq"] = float(get("rope.freq_base_swa", _GEMMA_LOCAL_ROPE_BASE))
        return out

    return extra


def _phi3_config(get: Getter, tensors: Mapping[str, Any], config: dict) -> dict:
    """The window (0: none, as in Phi-4) and LongRoPE, whose factors the file keeps as two tensors."""
    out = _sliding_window(get)
    original = as_int(get("rope.scaling.original_context_length"), "rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = original
    if "rope_factors_long.weight" in tensors:
        out["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                               "long_factor": tensor_values(tensors["rope_factors_long.weight"]),
                               "short_factor": tensor_values(tensors["rope_factors_short.weight"])}
        if get("rope.scaling.attn_factor") is not None:
            out["rope_scaling"]["attention_factor"] = float(get("rope.scaling.attn_factor"))
    return out


def _deepseek2_config(get: Getter, tensors: Mapping[str, Any], config: dict) -> dict:
    """DeepSeek-V2/V3 keys: latent attention sizes, routing (sigmoid gating is V3's), YaRN.

    Newer files describe the absorbed form (one KV head of key_length = kv_lora_rank + rope) and put
    the per-head sizes in key_length_mla / value_length_mla; older ones have only the latter's values.
    """
    def integer(key: str, default: int | None = None) -> int | None:
        return as_int(get(key, default), key)

    rope = integer("rope.dimension_count")
    qk_dim = integer("attention.key_length_mla") or integer("attention.key_length")
    v3 = integer("expert_gating_func") == 2
    n_group = integer("expert_group_count") or 1
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "num_key_value_heads": config["num_attention_heads"], "head_dim": rope,
        "partial_rotary_factor": 1.0,  # key_length is not a rotary head's width here
        "q_lora_rank": integer("attention.q_lora_rank"),
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensors,
        "kv_lora_rank": integer("attention.kv_lora_rank"), "qk_nope_head_dim": qk_dim - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": integer("attention.value_length_mla") or integer("attention.value_length"),
        "n_routed_experts": integer("expert_count"), "n_shared_experts": integer("expert_shared_count", 0),
        "first_k_dense_replace": integer("leading_dense_block_count", 0), "mlp_only_layers": [],  # not a list
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)), "n_group": n_group,
        "topk_group": integer("expert_group_used_count") or 1, "rope_interleave": True,
    }
    if not v3:  # V3 always routes by groups
        out["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    log_multiplier = get("rope.scaling.yarn_log_multiplier")
    if get("rope.scaling.type") == "yarn" and log_multiplier is not None:
        # llama.cpp keeps cos/sin unscaled and scales the softmax by (1 + log_mul * ln factor)^2: in HF
        # terms mscale = mscale_all_dim = log_mul / 0.1.
        mscale = float(log_multiplier) / 0.1
        original = integer("rope.scaling.original_context_length")
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                               "original_max_position_embeddings": original,
                               "mscale": mscale, "mscale_all_dim": mscale}
    return out


_GEMMA = dict(layer_names={"post_attention_norm.weight": "post_attention_layernorm.weight",
                           "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                           "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
              norm_offset=1.0)
GGUF_ARCHS = {
    "llama": GGUFArch(permute_qk=True, config=_llama_config, config_tensors=frozenset({"rope_freqs.weight"})),
    "gemma2": GGUFArch(**_GEMMA, config=_gemma_config("gemma2")),
    "gemma3": GGUFArch(**_GEMMA, config=_gemma_config("gemma3")),
    # Fused q|k|v and gate|up projections, stored as they are in Phi-3 checkpoints.
    "phi3": GGUFArch(layer_names={"attn_qkv.weight": "self_attn.qkv_proj.weight",
                                  "ffn_up.weight": "mlp.gate_up_proj.weight"},
                     config=_phi3_config,
                     config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})),
    # DeepSeek's latent attention (split attn_k_b / attn_v_b are merged by the loader)
    "deepseek2": GGUFArch(layer_names={
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a.bias": "self_attn.q_a_proj.bias",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_mqa.bias": "self_attn.kv_a_proj_with_mqa.bias",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    }, config=_deepseek2_config),
}


def gguf_arch(name: str) -> GGUFArch:
    return GGUF_ARCHS.get(name, GGUFArch())
