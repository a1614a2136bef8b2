"""Writes a DeepSeek-V3-architecture model folder with random bf16 weights, for benchmarks on big shapes.

    python benchmarks/random_deepseek.py --size v3-small --out /tmp/deepseek-v3-small [--device cuda] [--fp8]

``v3-small`` keeps DeepSeek-V3's attention and routing (multi-head latent attention with a
512 + 64 latent, heads of nope 128 + rope 64 and v 128, q LoRA 1536, YaRN; sigmoid routing with
expert bias over 8 groups, top-4 groups) with fewer layers, heads and experts: 64 routed experts +
1 shared, top-6, about 2.9B parameters (5.8 GB), 0.3B active per token. ``tiny`` is the same shape
in miniature, to check scripts on CPU. ``--fp8`` writes DeepSeek-V3's FP8 checkpoint format
(projections in e4m3 with ``weight_scale_inv`` per 128x128 block; routers, norms, embeddings as they are).
"""
from __future__ import annotations

from pathlib import Path

from random_llama import parse_args, write_random_model

SIZES = {
    "v3-small": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                     q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, moe_intermediate_size=768, n_routed_experts=64, num_experts_per_tok=6,
                     vocab_size=129280),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                 q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=6, vocab_size=1024),
}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF checkpoint names and shapes (per-expert tensors, as save_pretrained writes them)."""
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    q_rank, rank, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim, experts = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["n_routed_experts"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}

    def mlp(prefix: str, size: int) -> None:
        out.update({prefix + "gate_proj.weight": (size, h), prefix + "up_proj.weight": (size, h),
                    prefix + "down_proj.weight": (h, size)})

    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_a_proj.weight": (q_rank, h), p + "self_attn.q_a_layernorm.weight": (q_rank,),
                    p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
                    p + "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h),
                    p + "self_attn.kv_a_layernorm.weight": (rank,),
                    p + "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), rank),
                    p + "self_attn.o_proj.weight": (h, heads * v_dim)})
        if n < cfg["first_k_dense_replace"]:
            mlp(p + "mlp.", cfg["intermediate_size"])
            continue
        out.update({p + "mlp.gate.weight": (experts, h), p + "mlp.gate.e_score_correction_bias": (experts,)})
        for e in range(experts):
            mlp(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
        mlp(p + "mlp.shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    return out


def config(size: str) -> dict:
    """The HF config of a size of SIZES."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
            "tie_word_embeddings": False, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 8,
            "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
            "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "rope_theta": 10000.0, **SIZES[size]}


def main() -> None:
    args = parse_args(__doc__, SIZES)
    cfg = config(args.size)
    write_random_model(Path(args.out), cfg, shapes(cfg), args.device, args.fp8)


if __name__ == "__main__":
    main()
