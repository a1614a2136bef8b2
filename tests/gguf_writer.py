"""Converts tiny HF model folders to GGUF files the way llama.cpp's converter lays them out (for tests).

Written from llama.cpp's naming and conventions, independently of the loader's tables.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from tests.test_tokenizer import write_tokenizer_metadata

GGUF_ARCH = {"llama": "llama", "llama-tied": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3": "gemma3"}
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    # DeepSeek (deepseek2): latent attention, the V3 expert-choice bias, shared experts
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
}
# Where an architecture's names differ: Gemma's four norms per layer, Phi-3's fused projections.
GEMMA_LAYER_TO_GGUF = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                       "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                       "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
ARCH_LAYER_TO_GGUF = {
    "gemma2": GEMMA_LAYER_TO_GGUF, "gemma3": GEMMA_LAYER_TO_GGUF,
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
}
# Per-expert HF tensors, which llama.cpp stacks into one blk.N.ffn_{gate,up,down}_exps tensor per layer.
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    names = {**LAYER_TO_GGUF, **ARCH_LAYER_TO_GGUF.get(GGUF_ARCH[arch], {})}
    return f"blk.{layer}.{names[rest]}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows (pairs each head's two rotary halves)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for Llama 3's rope scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def rope_settings(cfg: dict) -> dict:
    """The global layers' rope parameters of a config.json (Gemma 3 keeps them per layer type)."""
    rope = cfg["rope_parameters"]
    return rope.get("full_attention", rope)


def new_writer(out: Path, kind: str, cfg: dict, hf_dir: Path) -> gguf.GGUFWriter:
    """A GGUF writer for llama.cpp architecture ``kind`` holding the keys every architecture has, and the
    tokenizer of ``hf_dir``."""
    w = gguf.GGUFWriter(str(out), kind)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope_settings(cfg)["rope_theta"])
    write_tokenizer_metadata(w, hf_dir)
    return w


def _write_arch_metadata(w: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    """The keys llama.cpp's converter adds for windows, soft caps, rope scaling and experts."""
    kind = GGUF_ARCH[arch]
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if kind.startswith("gemma"):
        if cfg["query_pre_attn_scalar"] != cfg["head_dim"]:  # llama.cpp derives it; a file may state it
            w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    rope = rope_settings(cfg)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg["head_dim"], rope))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if kind == "phi3":
        w.add_rope_dimension_count(int(cfg["hidden_size"] // cfg["num_attention_heads"]
                                       * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def write_gguf(hf_dir: Path, out: Path, arch: str, qtype: Q = Q.F32, overrides: dict | None = None) -> Path:
    """Converts a tiny HF folder to GGUF the way llama.cpp lays it out; 2-D weights stored as ``qtype``."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    kind = GGUF_ARCH[arch]
    w = new_writer(out, kind, cfg, hf_dir)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    _write_arch_metadata(w, cfg, arch)

    def add(name: str, array: np.ndarray, hf_name: str = "") -> None:
        dtype = (overrides or {}).get(hf_name, qtype if array.ndim >= 2 else Q.F32)
        if dtype == Q.F32:
            w.add_tensor(name, array)
        elif dtype == Q.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, dtype), raw_dtype=dtype)

    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.numpy()
        if m := EXPERT.fullmatch(name):
            stacked[m[1], EXPERT_PROJ[m[3]]][int(m[2])] = array
            continue
        if kind == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg["num_attention_heads"])
        elif kind == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg["num_key_value_heads"])
        elif name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)  # llama.cpp keeps the shared expert's (1, H) gate as (H,)
        elif kind.startswith("gemma") and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp bakes Gemma's (1 + weight) into the file
        add(gguf_name(name, arch), array, name)
    for (layer, proj), per_expert in stacked.items():
        add(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([per_expert[e] for e in sorted(per_expert)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def expected_weight(array: np.ndarray, qtype: Q) -> torch.Tensor:
    if qtype == Q.F32 or array.ndim == 1:
        return torch.from_numpy(array)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype))
