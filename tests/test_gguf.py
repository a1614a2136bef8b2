"""GGUF loading: config, names, Q/K un-permutation and dequantization, against transformers and round trips."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from batchgen.engine.config import ModelConfig
from batchgen.engine.gguf_loader import dequantize_tensor, load_gguf
from batchgen.engine.loader import load_model_source
from tests.test_tokenizer import write_tokenizer_metadata

GGUF_ARCH = {"llama": "llama", "llama-tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}
# Written independently of the loader's table, in llama.cpp's naming.
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
# Per-expert HF tensors, which llama.cpp stacks into one blk.N.ffn_{gate,up,down}_exps tensor per layer.
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_TO_GGUF[rest]}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows (pairs each head's two rotary halves)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, arch: str, qtype: Q = Q.F32, overrides: dict | None = None) -> Path:
    """Converts a tiny HF folder to GGUF the way llama.cpp lays it out; 2-D weights stored as ``qtype``."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), GGUF_ARCH[arch])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    write_tokenizer_metadata(w, hf_dir)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    def add(name: str, array: np.ndarray, hf_name: str = "") -> None:
        kind = (overrides or {}).get(hf_name, qtype if array.ndim >= 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(name, array)
        elif kind == Q.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.numpy()
        if m := EXPERT.fullmatch(name):
            stacked[m[1], EXPERT_PROJ[m[3]]][int(m[2])] = array
            continue
        if GGUF_ARCH[arch] == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg["num_attention_heads"])
        elif GGUF_ARCH[arch] == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg["num_key_value_heads"])
        elif name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)  # llama.cpp keeps the shared expert's (1, H) gate as (H,)
        add(gguf_name(name), array, name)
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


# ---- round trips through files we write ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "qwen3", "mixtral", "qwen2-moe", "qwen3-moe"])
def test_f32_round_trip_is_exact(tiny_model_factory, tmp_path, arch):
    folder = tiny_model_factory(arch)
    source = load_model_source(str(write_gguf(folder, tmp_path / "m.gguf", arch)))
    original = load_file(str(folder / "model.safetensors"))
    loaded = dict(source.weights())
    assert sorted(loaded) == sorted(original)  # incl. Qwen biases, Qwen3 q_norm/k_norm, lm_head iff untied
    for name, tensor in original.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor), name

    hf_cfg = json.loads((folder / "config.json").read_text())
    cfg = source.config
    assert cfg["architectures"] == hf_cfg["architectures"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert cfg[key] == hf_cfg[key], key
    assert ModelConfig.from_hf(cfg).moe == ModelConfig.from_hf(hf_cfg).moe  # experts, sizes, dense layers
    assert cfg["rms_norm_eps"] == pytest.approx(hf_cfg["rms_norm_eps"])
    assert cfg["rope_theta"] == hf_cfg["rope_parameters"]["rope_theta"]
    assert source.generation_config == {"eos_token_id": [hf_cfg["eos_token_id"]]}
    assert source.tokenizer.encode("The quick brown fox") == load_model_source(str(folder)).tokenizer.encode(
        "The quick brown fox")


def test_config_builds_the_same_hf_model(tiny_model_factory, tmp_path):
    """Our config dict and weights give transformers the same logits as the original folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tiny_model_factory("llama-tied")
    source = load_gguf(str(write_gguf(folder, tmp_path / "m.gguf", "llama-tied")))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_config(LlamaConfig(**source.config), dtype=torch.float32).eval()
    ours.load_state_dict(dict(source.weights()), strict=False)
    ours.tie_weights()
    ids = torch.tensor([source.tokenizer.encode("Batch inference reads prompts, sorts them by length")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
def test_moe_gguf_runs_like_transformers(tiny_model_factory, tmp_path, arch):
    """The engine on the GGUF file (stacked experts, llama's permuted q/k for Mixtral) against HF on the folder."""
    from batchgen.engine import LLM, SamplingParams
    from tests.engine_helpers import assert_like_hf, mixed_prompts

    folder = tiny_model_factory(arch)
    llm = LLM(str(write_gguf(folder, tmp_path / "m.gguf", arch)), dtype="float32", device="cpu",
              max_num_batched_tokens=64)
    hf_cfg = json.loads((folder / "config.json").read_text())
    assert llm.engine.model_config.architecture == hf_cfg["architectures"][0]
    prompts = mixed_prompts(llm, repeats=(1, 4))
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True))
    assert_like_hf(str(folder), prompts, outs)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_quantized_round_trip(tiny_model_factory, tmp_path, qtype):
    folder = tiny_model_factory("llama")
    loaded = dict(load_gguf(str(write_gguf(folder, tmp_path / "m.gguf", "llama", qtype))).weights())
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        torch.testing.assert_close(loaded[name], expected_weight(tensor.numpy(), qtype), rtol=0, atol=0)
        step = 0.02 if qtype in (Q.F16, Q.BF16, Q.Q8_0) else 0.15  # sanity: close to the original too
        assert (loaded[name] - tensor).abs().max() <= step * tensor.abs().max(), name


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.Q8_0], ids=lambda q: q.name)
def test_dequantize_matches_transformers_kernels(tmp_path, qtype):
    """Random blocks (gguf can't quantize K-quants) decoded by us and by transformers' own torch code."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(3, 2 * size), dtype=np.uint8)
    raw[:, 1::2] &= 0x3B  # keeps any fp16 scale finite and modest, wherever the format puts it
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ours = dequantize_tensor(gguf.GGUFReader(str(path)).tensors[0])
    assert ours.shape == (3, 2 * block) and ours.dtype == torch.float32
    ref = hf_dequantize(torch.from_numpy(raw.copy()), int(qtype)).reshape(3, 2 * block)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.I32], ids=lambda q: q.name)
def test_unsupported_tensor_type_is_a_clear_error(tmp_path, qtype):
    reader_path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(reader_path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, size * 64 // block), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=rf"blk\.0\.ffn_up\.weight.*{qtype.name}"):
        dequantize_tensor(gguf.GGUFReader(str(reader_path)).tensors[0])


def test_unknown_architecture_and_tensor(tiny_model, tmp_path):
    from batchgen.engine.gguf_loader import hf_tensor_name

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    write_tokenizer_metadata(w, tiny_model)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="phi2"):
        load_gguf(str(path))
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        hf_tensor_name("blk.0.attn_qkv.weight")
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(FileNotFoundError):
        load_gguf(str(tmp_path / "missing.gguf"))


# ---- the real SmolLM2 file ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model_source(str(smollm2_gguf))


@pytest.mark.slow
def test_smollm2_config(smollm2):
    cfg = smollm2.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (30, 576, 9, 3, 64, 1536)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert smollm2.generation_config == {"eos_token_id": [2]}


def _transformers_gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # the documented route needs accelerate; without it use the same loader transformers calls
        import accelerate  # noqa: F401
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
        return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2, smollm2_gguf):
    wanted = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight", "model.layers.17.self_attn.q_proj.weight",
              "model.layers.29.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"}
    ours = {}
    for name, tensor in smollm2.weights():
        if name in wanted:
            ours[name] = tensor
        assert "lm_head" not in name  # tied
    assert set(ours) == wanted
    ref = _transformers_gguf_state_dict(Path(smollm2_gguf))
    for name in wanted:
        assert ours[name].shape == ref[name].shape and torch.equal(ours[name], ref[name].float()), name
    # the un-permutation is real: the stored Q rows differ from HF's layout
    stored = next(t for t in gguf.GGUFReader(str(smollm2_gguf)).tensors if t.name == "blk.0.attn_q.weight")
    assert not torch.equal(dequantize_tensor(stored), ours["model.layers.0.self_attn.q_proj.weight"])
