"""The model boundary: the architecture registry, config parsing, checkpoint loading errors, KV layout, rotary."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.models.base import CausalLM
from batchgen.engine.models.errors import UnsupportedModelError
from batchgen.engine.models.registry import ARCHITECTURES, build_model, gguf_architecture, model_config, supported_names

TINY = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def build(cfg: dict, max_positions: int = 64):
    return build_model(model_config(cfg), make_kernel_set("torch"), max_positions, torch.float32, "cpu")


def test_registry_classes_and_the_unsupported_architecture_error():
    for arch in ARCHITECTURES:
        cls = arch.model_class()
        assert issubclass(cls, CausalLM) and cls.__name__ == arch.name
    with pytest.raises(UnsupportedModelError) as err:
        model_config({"architectures": ["GPT2LMHeadModel"], **TINY})
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(name in str(err.value) for name in supported_names())


def test_gguf_architectures_come_from_the_registry():
    assert gguf_architecture("llama", has_experts=False).name == "LlamaForCausalLM"
    assert gguf_architecture("llama", has_experts=True).name == "MixtralForCausalLM"
    assert gguf_architecture("qwen3moe", has_experts=True).name == "Qwen3MoeForCausalLM"
    assert gguf_architecture("deepseek2", has_experts=True).name == "DeepseekV2ForCausalLM"  # V3 by its gating
    known = "deepseek2, gemma2, gemma3, llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe"
    with pytest.raises(UnsupportedModelError, match=rf"'phi2'.*supported: {known}"):
        gguf_architecture("phi2", has_experts=False)
    with pytest.raises(UnsupportedModelError, match="'qwen2' with experts"):
        gguf_architecture("qwen2", has_experts=True)


def test_config_fields_for_moe_and_partial_rotary():
    cfg = model_config({"architectures": ["Qwen2MoeForCausalLM"], **TINY, "num_experts": 8,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 64, "mlp_only_layers": [0],
                               "partial_rotary_factor": 0.5})
    assert cfg.rotary_dim == 8 and cfg.head_dim == 16 and cfg.mla is None
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (8, 2, 32, 64)
    assert moe.num_shared_experts == 1 and moe.mlp_only_layers == (0,) and moe.norm_topk_prob is False
    mixtral = model_config({"architectures": ["MixtralForCausalLM"], **TINY, "num_local_experts": 4,
                                   "num_experts_per_tok": 2})
    assert mixtral.moe.intermediate_size == 96 and mixtral.moe.num_shared_experts == 0
    assert model_config({"architectures": ["LlamaForCausalLM"], **TINY}).moe is None


def test_kv_layout_is_declared_by_the_attention_layers():
    model = build({"architectures": ["LlamaForCausalLM"], **TINY})
    layout = model.kv_layout()
    assert layout.layers == (((2, 16), (2, 16)),) * 2
    assert layout.bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert layout.describe() == "2 layers x [(2, 16), (2, 16)]"
    caches = layout.allocate(3, 16, torch.float32, torch.device("cpu"))
    model.bind_kv_cache(caches)
    attn = model.layers[1].self_attn.attn
    assert attn.k_cache is caches[1][0] and attn.k_cache.shape == (3, 16, 2, 16)


def test_loading_names_missing_unexpected_and_misshapen_weights(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    weights = load_file(str(tiny_model / "model.safetensors"))
    dropped = ("model.layers.1.self_attn.k_proj.weight", "model.norm.weight")
    gone = {k: v for k, v in weights.items() if k not in dropped}
    with pytest.raises(ValueError, match=r"missing weights: layers\.1\.self_attn\.qkv_proj\.weight\[k\], norm\.weight$"):
        build(cfg).load_weights(gone.items())
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mlp\.extra\.weight'"):
        build(cfg).load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    bad = dict(weights, **{"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match=r"weight 'model\.layers\.0\.self_attn\.q_proj\.weight': shape \(3, 64\)"):
        build(cfg).load_weights(bad.items())


def test_partial_rotary_rotates_the_leading_dims_like_transformers():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    cfg = {"architectures": ["LlamaForCausalLM"], **TINY, "partial_rotary_factor": 0.5, "rope_theta": 500.0}
    model = build(cfg)
    attn = model.layers[0].self_attn
    torch.manual_seed(0)
    attn.qkv_proj.weight.normal_()
    h, positions = torch.randn(5, 64), torch.tensor([0, 1, 2, 7, 30])
    q, k, _ = attn.split_heads(attn.project(h, positions, model.cos_sin))

    ref_q, ref_k, _ = attn.split_heads(h @ attn.qkv_proj.weight.T)
    rope = Phi3RotaryEmbedding(Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5,
                                          rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    cos, sin = rope(h, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(ref_q.transpose(0, 1)[None], ref_k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(k, ref_k[0].transpose(0, 1))


@pytest.mark.parametrize("context", [32, 200])  # within the original 64 positions: short factors; beyond: long
def test_longrope_tables_match_transformers(context):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [1.2, 3.0, 5.0, 9.0]}
    hf_cfg = {"architectures": ["Phi3ForCausalLM"], **TINY, "max_position_embeddings": 256,
              "original_max_position_embeddings": 64, "rope_scaling": {**rope, "type": "su"},
              "partial_rotary_factor": 0.5}
    model = build(hf_cfg, max_positions=context)
    ref = Phi3RotaryEmbedding(Phi3Config(**{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    cos, sin = ref(torch.zeros(1), torch.arange(context)[None])
    half = model.cfg.rotary_dim // 2
    torch.testing.assert_close(model.cos_sin[:, :half], cos[0, :, :half])
    torch.testing.assert_close(model.cos_sin[:, half:], sin[0, :, :half])
    assert ref.attention_scaling > 1  # sqrt(1 + ln(256 / 64) / ln 64)


def test_gemma3_config_layouts_parse_alike():
    """A transformers 4 Gemma 3 config (flat rope keys, a pattern) and a transformers 5 one (rope per layer
    type, layer_types), and a vision checkpoint's text_config, give the same model."""
    flat = {"architectures": ["Gemma3ForCausalLM"], **TINY, "num_hidden_layers": 7, "head_dim": 16,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 8, "sliding_window_pattern": 6}
    nested = {**{k: v for k, v in flat.items() if not k.startswith(("rope", "sliding_window_pattern"))},
              "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    vision = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {**flat, "architectures": None},
              "vision_config": {"hidden_size": 32}}
    models = [build(cfg) for cfg in (flat, nested, vision)]
    for model in models[1:]:
        assert [m.sliding_window for m in model.cache_layers()] == [8] * 5 + [None, 8]
        torch.testing.assert_close(model.cos_sin, models[0].cos_sin)
        torch.testing.assert_close(model.cos_sin_local, models[0].cos_sin_local)
    assert not torch.equal(models[0].cos_sin, models[0].cos_sin_local)
    assert models[2].checkpoint_target("model.vision_tower.encoder.layers.0.fc1.weight") is None
    assert models[2].checkpoint_target("language_model.model.layers.0.mlp.up_proj.weight") == \
        ("layers.0.mlp.gate_up_proj.weight", 1)
    assert models[2].checkpoint_target("model.language_model.norm.weight") == ("norm.weight", None)


def test_unsupported_activation_and_bidirectional_gemma_are_named():
    with pytest.raises(UnsupportedModelError, match="'gelu'.*LlamaForCausalLM.*silu"):
        model_config({"architectures": ["LlamaForCausalLM"], **TINY, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        model_config({"architectures": ["Gemma3ForCausalLM"], **TINY, "use_bidirectional_attention": True})
