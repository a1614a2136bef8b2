"""DeepSeek-V2/V3: routers and rope against transformers, layer structure and loading, the profile and
KV bytes, GGUF (llama.cpp's deepseek2) against the HF folder.

Parity over chunked prefill, prefix caching and preemption, and a job on a tiny DeepSeek folder, are
test_moe.py's, run for these too."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.backends.torch.ops import apply_rotary
from batchgen.engine.config import MoEConfig
from batchgen.engine.layers.mla import MLAAttention
from batchgen.engine.layers.mlp import GatedMLP
from batchgen.engine.layers.moe import SparseMoeBlock
from batchgen.engine.loading.gguf.arch import gguf_arch
from batchgen.engine.loading.gguf.loader import iter_gguf_weights
from batchgen.engine.models.errors import UnsupportedModelError
from batchgen.engine.models.registry import model_config
from batchgen.engine.layers.rotary import (
    cos_sin_cache, pairwise_to_half_order, rope_attention_factor, rope_inv_freq, yarn_softmax_scale,
)
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.deepseek import DeepseekV2Router, DeepseekV3Router
from batchgen.engine.models.registry import build_model
from tests.engine_helpers import assert_like_hf, mixed_prompts, model_runner
from tests.gguf_writer import EXPERT, EXPERT_PROJ, gguf_name, new_writer


# ---- routing ------------------------------------------------------------------------------------------
def router_cases():
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(hidden_size=32, n_routed_experts=16, moe_intermediate_size=8)
    yield DeepseekV2Config(**common, num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=1.0)
    yield DeepseekV2Config(**common, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                           topk_group=2, routed_scaling_factor=16.0)
    for norm in (True, False):
        yield DeepseekV3Config(**common, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=norm,
                               routed_scaling_factor=2.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routers_match_transformers(dtype):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    x = torch.randn(64, 32).to(dtype)
    for hf_cfg in router_cases():
        v3 = hf_cfg.model_type == "deepseek_v3"
        hf = (DeepseekV3TopkRouter if v3 else DeepseekV2TopkRouter)(hf_cfg)
        ours = (DeepseekV3Router if v3 else DeepseekV2Router)(32, MoEConfig.from_hf(hf_cfg.to_dict()))
        hf.weight.data.normal_(0, 0.5)
        ours.weight.data = hf.weight.data.clone()
        if v3:  # large enough to change which experts win
            hf.e_score_correction_bias.uniform_(-0.3, 0.3)
            ours.e_score_correction_bias.data = hf.e_score_correction_bias.clone()
        _, hf_weights, hf_ids = hf(x)
        weights, ids = ours(x)
        assert weights.dtype == torch.float32 and ids.shape == (64, hf_cfg.num_experts_per_tok)
        hf_order, order = hf_ids.argsort(dim=1), ids.argsort(dim=1)
        assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
        assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_router_settings_are_checked():
    moe = dict(num_experts=8, top_k=2, intermediate_size=4)
    with pytest.raises(UnsupportedModelError, match="topk_method 'noaux_tc'"):
        DeepseekV2Router(16, MoEConfig(**moe, topk_method="noaux_tc"))
    with pytest.raises(UnsupportedModelError, match="cannot form 3 groups"):
        DeepseekV2Router(16, MoEConfig(**moe, n_group=3, topk_group=1))
    with pytest.raises(UnsupportedModelError, match="top two experts"):
        DeepseekV3Router(16, MoEConfig(**moe, n_group=8, topk_group=2))


# ---- rope ---------------------------------------------------------------------------------------------
YARN = [
    {"factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
     "mscale_all_dim": 0.8},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
     "mscale_all_dim": 1.0},  # DeepSeek-V3's
    {"factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False},
    {"factor": 2.0, "original_max_position_embeddings": 1024, "attention_factor": 0.9, "beta_fast": 16},
]


@pytest.mark.parametrize("params", YARN)
def test_yarn_matches_transformers(params):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    hf_cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(rope))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, rope), inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(rope) == pytest.approx(attention_factor, rel=1e-12)
    table = cos_sin_cache(64, 10000.0, rope, 8)
    positions = torch.arange(8, dtype=torch.float32)[:, None] * inv_freq
    torch.testing.assert_close(table, torch.cat((positions.cos(), positions.sin()), -1) * attention_factor)


def test_softmax_scale_matches_transformers(tiny_model_factory):
    from tests.engine_helpers import hf_model

    for arch in ("deepseek-v2", "deepseek-v3"):
        path = str(tiny_model_factory(arch))
        llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=1 << 20)
        scale = model_runner(llm).model.layers[0].self_attn.scale
        assert scale == pytest.approx(hf_model(path).model.layers[0].self_attn.scaling, rel=1e-12)
    assert yarn_softmax_scale(None) == 1.0 and yarn_softmax_scale({"rope_type": "yarn", "factor": 4.0}) == 1.0


def test_pairwise_rope_is_rotate_half_on_reordered_dims():
    """HF's complex-pair (V2) and interleaved (V3) rotations equal ours on the dims reordered at load."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    dim, positions = 16, torch.tensor([0, 3, 17, 200])
    order = pairwise_to_half_order(dim)
    q, k = torch.randn(1, 2, 4, dim), torch.randn(1, 1, 4, dim)  # (batch, heads, tokens, dim) as HF holds them
    table = cos_sin_cache(dim, 10000.0, None, 256)
    ours_q, ours_k = (x[0].transpose(0, 1)[..., order].contiguous() for x in (q, k))  # (tokens, heads, dim)
    apply_rotary(ours_q, ours_k, positions, table)
    freqs = positions[:, None].float() * rope_inv_freq(dim, 10000.0, None)
    cos, sin = torch.cat((freqs.cos(), freqs.cos()), -1)[None], torch.cat((freqs.sin(), freqs.sin()), -1)[None]
    v3_q, v3_k = apply_rotary_pos_emb_interleave(q, k, cos, sin)  # comes out in rotate-half order
    torch.testing.assert_close(ours_q, v3_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_k, v3_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    v2_q, v2_k = apply_rotary_emb(q, k, torch.polar(torch.ones_like(freqs), freqs)[None])  # stays pairwise
    torch.testing.assert_close(ours_q, v2_q[0].transpose(0, 1)[..., order], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_k, v2_k[0].transpose(0, 1)[..., order], rtol=0, atol=1e-6)


# ---- structure, loading, profile ------------------------------------------------------------------------
def folder_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_layers_profile_and_latent_cache(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory(arch)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    runner, cfg = model_runner(llm), llm.engine.model_config
    mla, moe = cfg.mla, cfg.moe
    layers = runner.model.layers
    assert isinstance(layers[0].mlp, GatedMLP) and all(isinstance(m.mlp, SparseMoeBlock) for m in layers[1:])
    assert all(isinstance(m.self_attn, MLAAttention) for m in layers)
    shared = layers[1].mlp.shared_expert.gate_up_proj
    assert shared.output_size == 2 * moe.intermediate_size * moe.num_shared_experts
    # One latent row per token and layer, not per-head K and V.
    assert runner.kv_layout.layers == (((mla.latent_dim,),),) * cfg.num_layers
    assert runner.kv_layout.bytes_per_token(torch.float32) == cfg.num_layers * (32 + 8) * 4
    per_head_kv = cfg.num_layers * cfg.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    assert runner.kv_layout.values_per_token() * 3 < per_head_kv
    hf = AutoModelForCausalLM.from_pretrained(folder)
    named = dict(hf.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    matmuls = sum(p.numel() for n, p in named.items() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n)
    profile = runner.profile
    assert profile.active_params == matmuls - experts + experts * moe.top_k // moe.num_experts
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert profile.total_params == sum(p.numel() for p in hf.parameters()) + bias
    heads, qk, v = cfg.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    assert profile.attention_flops_per_key == cfg.num_layers * 2 * heads * (qk + v)


def test_checkpoint_names_loading_and_errors(tiny_model_factory):
    folder = tiny_model_factory("deepseek-v3")
    weights = load_file(str(folder / "model.safetensors"))
    cfg = model_config(folder_config(folder))

    def model():
        return build_model(cfg, make_kernel_set("torch"), 64, torch.float32, "cpu")

    # Multi-token-prediction layers past the last layer are not part of the model.
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    model().load_weights([*weights.items(), *mtp.items()])
    del weights["model.layers.2.mlp.gate.e_score_correction_bias"]
    with pytest.raises(ValueError, match=r"missing weights: layers\.2\.mlp\.gate\.e_score_correction_bias$"):
        model().load_weights(weights.items())
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        build_model(model_config({**folder_config(folder), "mlp_bias": True}), make_kernel_set("torch"), 8,
                    torch.float32, "meta")


# ---- GGUF: llama.cpp's deepseek2 ------------------------------------------------------------------------
def write_deepseek2_gguf(hf_dir: Path, out: Path, split_kv_b: bool) -> Path:
    """The tiny HF folder as llama.cpp's converter writes deepseek2: stacked experts, and kv_b_proj split
    into attn_k_b (transposed) / attn_v_b with the absorbed-MQA head sizes (newer files) or kept whole."""
    cfg = folder_config(hf_dir)
    heads, rank, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w = new_writer(out, "deepseek2", cfg, hf_dir)
    w.add_rope_dimension_count(rope)
    if cfg["q_lora_rank"]:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v_dim)
    else:
        w.add_head_count_kv(heads)
        w.add_key_length(nope + rope)
        w.add_value_length(v_dim)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    v3 = cfg["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    rope_params = cfg["rope_parameters"]
    if rope_params["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope_params["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope_params["mscale_all_dim"])
    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if m := EXPERT.fullmatch(name):
            stacked[m[1], EXPERT_PROJ[m[3]]][int(m[2])] = tensor.numpy()
        elif split_kv_b and name.endswith("kv_b_proj.weight"):
            k_b, v_b = tensor.view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
            layer = re.search(r"layers\.(\d+)\.", name)[1]
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", v_b.contiguous().numpy())
        else:
            w.add_tensor(gguf_name(name), tensor.numpy())
    for (layer, proj), per_expert in stacked.items():
        w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([per_expert[e] for e in sorted(per_expert)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("arch,split_kv_b", [("deepseek-v2", True), ("deepseek-v3", False)])
def test_gguf_round_trip_matches_the_folder(tiny_model_factory, tmp_path, arch, split_kv_b):
    folder = tiny_model_factory(arch)
    source = load_model_source(str(write_deepseek2_gguf(folder, tmp_path / "m.gguf", split_kv_b)))
    original = load_file(str(folder / "model.safetensors"))
    loaded = dict(source.weights())
    assert sorted(loaded) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name
    ours, ref = model_config(source.config), model_config(folder_config(folder))
    assert ours.architecture == ref.architecture and ours.mla == ref.mla and ours.moe == ref.moe
    assert (ours.num_heads, ours.hidden_size, ours.intermediate_size) == (ref.num_heads, ref.hidden_size,
                                                                            ref.intermediate_size)
    if ref.rope_scaling:  # GGUF keeps YaRN's factor, context and softmax mscale; cos/sin stay unscaled
        assert {k: ours.rope_scaling[k] for k in ("rope_type", "factor", "original_max_position_embeddings")} \
            == {k: ref.rope_scaling[k] for k in ("rope_type", "factor", "original_max_position_embeddings")}
        assert yarn_softmax_scale(ours.rope_scaling) == pytest.approx(yarn_softmax_scale(ref.rope_scaling))
        assert rope_attention_factor(ours.rope_scaling) == 1.0


@pytest.mark.parametrize("arch", ["deepseek-v2", "deepseek-v3"])
def test_gguf_model_runs_like_transformers(tiny_model_factory, tmp_path, arch):
    """The engine on the GGUF file against transformers built from that file's config and weights."""
    from transformers import AutoConfig

    folder = tiny_model_factory(arch)
    source = load_model_source(str(write_deepseek2_gguf(folder, tmp_path / "m.gguf", split_kv_b=True)))
    hf_dir = tmp_path / "from-gguf"
    rope = {"rope_theta": source.config["rope_theta"],
            **(source.config.get("rope_scaling") or {"rope_type": "default"})}
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in source.config.items() if k != "rope_scaling"},
                                  rope_parameters=rope)
    hf_cfg.save_pretrained(str(hf_dir))
    save_file(dict(source.weights()), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(tmp_path / "m.gguf"), dtype="float32", device="cpu", max_num_batched_tokens=64)
    prompts = mixed_prompts(llm, repeats=(1, 4))
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True))
    assert_like_hf(str(hf_dir), prompts, outs)


def test_gguf_with_half_a_split_kv_b_is_an_error(tiny_model_factory, tmp_path):
    path = write_deepseek2_gguf(tiny_model_factory("deepseek-v2"), tmp_path / "m.gguf", split_kv_b=True)
    config = load_model_source(str(path), weights=False).config
    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if t.name != "blk.1.attn_v_b.weight"]
    no_v_b = SimpleNamespace(tensors=tensors)
    with pytest.raises(ValueError, match=r"layers \['1'\] have only one of attn_k_b and attn_v_b"):
        list(iter_gguf_weights(no_v_b, config, gguf_arch("deepseek2")))
