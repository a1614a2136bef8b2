"""Writes a Llama-architecture model folder with random bf16 weights, for benchmarks on big shapes.

    python benchmarks/random_llama.py --size 1b --out /tmp/llama-1b [--device cuda] [--fp8]

``--fp8`` writes the projection weights as FP8 (e4m3) with one scale per 128x128 block, in DeepSeek-V3's
checkpoint format (``weight_scale_inv`` tensors, ``quantization_config.weight_block_size``).

Sizes follow Llama 3.2 1B and Llama 3.1 8B shapes (GQA 4:1, 128K vocabulary); ``moe`` is a
Qwen3-MoE model of 16 layers with 64 experts (8 per token, 768 features each), ~5B parameters of
which ~0.8B are active. The tokenizer is a tiny byte-level one: benchmarks feed token ids, so only
the loader needs it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchgen.engine.quantization.checkpoint import quantization_config, quantize_tensor

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                intermediate_size=6144, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8,
                moe_intermediate_size=768, norm_topk_prob=True),
}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if "num_experts" not in cfg:
            out.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i)})
            continue
        e = cfg["moe_intermediate_size"]
        out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate.weight": (cfg["num_experts"], h)})
        for x in range(cfg["num_experts"]):
            out.update({f"{p}mlp.experts.{x}.gate_proj.weight": (e, h), f"{p}mlp.experts.{x}.up_proj.weight": (e, h),
                        f"{p}mlp.experts.{x}.down_proj.weight": (h, e)})
    return out


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))


def write_random_model(out: Path, cfg: dict, shapes: dict[str, tuple[int, ...]], device: str,
                       fp8: bool = False) -> None:
    """config.json, random bf16 weights (std 0.02, norms 1) in safetensors shards of about 4 GiB with an
    index, and a byte-level tokenizer; generated on ``device``, which is much faster on a GPU. ``fp8``:
    the projection weights in FP8 with 128x128 block scales."""
    out.mkdir(parents=True, exist_ok=True)
    if fp8:
        cfg = {**cfg, "quantization_config": quantization_config("block")}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator(device=device).manual_seed(0)
    shard, shard_bytes, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file({k: t.cpu() for k, t in shard.items()}, str(out / name))
            index.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        tensors = {name: t.fill_(1.0)} if name.endswith("norm.weight") else {name: t}
        if fp8:
            tensors = quantize_tensor(name, t, "block")
        shard.update(tensors)
        shard_bytes += sum(v.numel() * v.element_size() for v in tensors.values())
        if shard_bytes > 4 << 30:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    write_tokenizer(out)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"wrote {out}: {params / 1e9:.2f}B parameters" + (" (FP8, 128x128 block scales)" if fp8 else ""))


def parse_args(doc: str, sizes: dict) -> argparse.Namespace:
    """--size (a key of sizes), --out, --device (the GPU when there is one), --fp8."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(sizes), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights with 128x128 block scales")
    return ap.parse_args()


BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 16384,
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1}


def main() -> None:
    args = parse_args(__doc__, SIZES)
    cfg = {**BASE, **SIZES[args.size]}
    write_random_model(Path(args.out), cfg, shapes(cfg), args.device, args.fp8)


if __name__ == "__main__":
    main()
