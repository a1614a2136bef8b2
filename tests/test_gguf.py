"""GGUF loading: config, names, Q/K un-permutation and dequantization, against transformers and round trips."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.loading.gguf.loader import dequantize_tensor, load_gguf
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.registry import build_model, model_config
from tests.gguf_writer import expected_weight, write_gguf
from tests.test_tokenizer import write_tokenizer_metadata

# ---- round trips through files we write ---------------------------------------------------------------
GGUF_ARCHS = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "mixtral", "qwen2-moe", "qwen3-moe", "phi3",
              "gemma2", "gemma3"]


def built(cfg: dict):
    return build_model(model_config(cfg), make_kernel_set("torch"), 64, torch.float32, "cpu")


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_f32_round_trip_is_exact(tiny_model_factory, tmp_path, arch):
    folder = tiny_model_factory(arch)
    source = load_model_source(str(write_gguf(folder, tmp_path / "m.gguf", arch)))
    original = load_file(str(folder / "model.safetensors"))
    loaded = dict(source.weights())
    assert sorted(loaded) == sorted(original)  # incl. Qwen biases, Qwen3 q_norm/k_norm, lm_head iff untied
    for name, tensor in original.items():
        assert loaded[name].dtype == torch.float32, name
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # stored as 1 + weight in float32
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=3e-7)
        else:
            assert torch.equal(loaded[name], tensor), name

    hf_cfg = json.loads((folder / "config.json").read_text())
    cfg = source.config
    assert cfg["architectures"] == (["LlamaForCausalLM"] if arch == "mistral" else hf_cfg["architectures"])
    ours, ref = model_config(cfg), model_config(hf_cfg)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rotary_dim", "max_position_embeddings", "tie_word_embeddings", "sliding_window", "moe"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps) and ours.rope_theta == ref.rope_theta
    # The models both configs build: the same windows, score scales and caps per layer, the same rope tables.
    ours_model, ref_model = built(cfg), built(hf_cfg)
    for a, b in zip(ours_model.cache_layers(), ref_model.cache_layers(), strict=True):
        assert (a.sliding_window, a.softcap) == (b.sliding_window, b.softcap) and a.scale == pytest.approx(b.scale)
    ref_buffers = dict(ref_model.named_buffers())
    for name, buffer in ours_model.named_buffers():
        torch.testing.assert_close(buffer, ref_buffers.pop(name), rtol=1e-6, atol=1e-6)
    assert not ref_buffers
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


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2-moe", "mistral", "phi3", "gemma2", "gemma3"])
def test_gguf_runs_like_transformers(tiny_model_factory, tmp_path, arch):
    """The engine on the GGUF file against HF on the folder: stacked experts, llama's permuted q/k and
    rope_freqs, Mistral's window in a llama file, Phi-3's fused projections and LongRoPE factors,
    Gemma's norms stored as 1 + weight, windows, soft caps and attention scale."""
    from batchgen.engine import LLM, SamplingParams
    from tests.engine_helpers import assert_like_hf, mixed_prompts

    folder = tiny_model_factory(arch)
    llm = LLM(str(write_gguf(folder, tmp_path / "m.gguf", arch)), dtype="float32", device="cpu",
              max_num_batched_tokens=64)
    hf_cfg = json.loads((folder / "config.json").read_text())
    expected_arch = "LlamaForCausalLM" if arch == "mistral" else hf_cfg["architectures"][0]
    assert llm.engine.model_config.architecture == expected_arch
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


@pytest.mark.parametrize("arch,layers,scalar", [("gemma2", 26, 256), ("gemma2", 46, 144), ("gemma3", 34, 256),
                                                ("gemma3", 62, 168)])
def test_gemma_attention_scale_follows_llama_cpp(tmp_path, arch, layers, scalar):
    """Files carry no query_pre_attn_scalar: the 27B models use hidden / heads, the others head_dim."""
    from batchgen.engine.loading.gguf.loader import gguf_config

    hidden, heads = {("gemma2", 46): (4608, 32), ("gemma3", 62): (5376, 32)}.get((arch, layers), (2304, 8))
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch)
    for add, value in ((w.add_block_count, layers), (w.add_embedding_length, hidden), (w.add_head_count, heads),
                       (w.add_head_count_kv, heads // 2), (w.add_key_length, 128 if scalar == 144 else 256),
                       (w.add_feed_forward_length, 4 * hidden), (w.add_sliding_window, 4096)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((4, hidden), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    reader = gguf.GGUFReader(str(tmp_path / "g.gguf"))
    config = gguf_config(reader.fields, {t.name: t for t in reader.tensors})
    assert config["query_pre_attn_scalar"] == scalar and config["sliding_window"] == 4096
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert ("rope_local_base_freq" in config) == (arch == "gemma3")


def test_unknown_architecture_and_tensor(tiny_model, tmp_path):
    from batchgen.engine.loading.gguf.arch import gguf_arch
    from batchgen.engine.loading.gguf.loader import hf_tensor_name

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    write_tokenizer_metadata(w, tiny_model)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="phi2"):
        load_gguf(str(path))
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        hf_tensor_name("blk.0.attn_qkv.weight")
    assert hf_tensor_name("rope_freqs.weight", arch=gguf_arch("llama")) is None
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
