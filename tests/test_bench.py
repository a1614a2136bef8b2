"""`batchgen bench`: figures are consistent with the workload, prefix caching shows up in them."""
from __future__ import annotations

import json

from click.testing import CliRunner

import torch

from batchgen.bench.workload import from_documents, parse_length, synthetic
from batchgen.cli import main
from batchgen.engine.config import ModelConfig
from batchgen.engine.flops import attention_flops
from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.models.base import ModelProfile
from batchgen.engine.models.registry import build_model, model_config


def config_profile(cfg: ModelConfig) -> ModelProfile:
    """The parameter/FLOP profile of a model of this config, built on the meta device (nothing allocated)."""
    model = build_model(cfg, make_kernel_set("torch"), max_positions=1, dtype=torch.bfloat16, device="meta")
    return model.profile()


def run_bench(args: list[str], tmp_path) -> dict:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", *args, "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_bench_prefill_only_figures(tiny_model, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    r = run_bench(["--model", str(tiny_model), "--num-prompts", "6", "--input-len", "40",
                   "--dtype", "float32", "--max-num-batched-tokens", "64"], tmp_path)
    assert r["num_prompts"] == 6 and r["prompt_tokens"] == 6 * 40
    assert r["dtype"] == r["dtype_requested"] == "float32" and r["dtype_reason"] == "requested"
    assert r["output_tokens"] == 6 and r["prompt_tokens_computed"] == r["prompt_tokens"]
    # Parameter counts and FLOPs against the HF model's own parameters and config.
    hf = AutoModelForCausalLM.from_pretrained(tiny_model)
    matmul = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("proj.weight"))
    head = hf.lm_head.weight.numel()
    assert r["active_params"] == matmul and r["total_params"] == sum(p.numel() for p in hf.parameters())
    assert r["linear_flops"] == 2 * matmul * 6 * 40 + 2 * head * 6
    c = AutoConfig.from_pretrained(tiny_model)
    assert r["kv_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    keys = 6 * 40 * 41 // 2  # every position attends to itself and the positions before it
    assert r["attention_flops"] == 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * keys
    assert r["mfu_vs_measured_matmul"] > 0 and r["roofline_prompt_tokens_per_s"] > 0


def test_bench_shared_prefix_is_computed_once(tiny_model, tmp_path):
    args = ["--model", str(tiny_model), "--num-prompts", "8", "--input-len", "10", "--prefix-len", "160",
            "--dtype", "float32", "--output-len", "2"]
    cached = run_bench(args, tmp_path)
    plain = run_bench(args + ["--no-enable-prefix-caching"], tmp_path)
    assert plain["prompt_tokens_computed"] == plain["prompt_tokens"] == 8 * 170
    assert cached["prompt_tokens_computed"] <= 8 * 170 - 7 * 160
    assert cached["prefix_cache_hit_rate"] > 0.8
    assert cached["decode_tokens_per_s"] is not None


def test_bad_workload_options_are_usage_errors(tiny_model):
    base = ["bench", "--model", str(tiny_model), "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", str(16 << 20), "--num-prompts", "2", "--input-len", "8"]
    for extra, names in [(["--num-prompts", "0"], "'--num-prompts'"), (["--input-len", "abc"], "'--input-len'"),
                         (["--input-len", "9:3"], "'--input-len'"), (["--output-len", "0"], "'--output-len'"),
                         (["--prefix-len", "-1"], "'--prefix-len'"), (["--input-len", "100000"], "'--input-len'")]:
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 2 and f"Invalid value for {names}" in result.output, (extra, result.output)


def test_workloads():
    assert parse_length("7") == (7, 7) and parse_length("3:9") == (3, 9)
    w = synthetic(5, "3:9", 1000, prefix_len=4)
    assert len({tuple(p[:4]) for p in w.prompts}) == 1 and all(7 <= len(p) <= 13 for p in w.prompts)

    class CharTokenizer:
        def encode(self, text):
            return [ord(c) for c in text]

    docs = from_documents(["abc" * 50, "xyz" * 30], CharTokenizer(), 10, "5:50", seed=1)
    assert all(5 <= len(p) <= 50 for p in docs.prompts)
    whole = from_documents(["abc", "de"], CharTokenizer(), 3, None)
    assert [len(p) for p in whole.prompts] == [3, 2, 3]


def test_params_of_smollm2_shape():
    cfg = model_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                               "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                               "num_key_value_heads": 3, "tie_word_embeddings": True})
    profile = config_profile(cfg)
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536  # q, k, v, o and the gated MLP
    assert profile.active_params == 30 * per_layer  # 106M
    norms = 30 * 2 * 576 + 576
    assert profile.total_params == 30 * per_layer + 49152 * 576 + norms  # tied: the embedding counted once
    assert profile.lm_head_params == 49152 * 576


def test_attention_flops_count_keys_per_position():
    cfg = model_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2})
    profile = config_profile(cfg)
    per_key = 4 * 2 * 4 * 16  # 4 FLOPs x layers x heads x head_dim
    assert profile.attention_flops_per_key == per_key
    assert attention_flops(profile, 0, 3) == per_key * (1 + 2 + 3)
    assert attention_flops(profile, 2, 4) == per_key * (3 + 4)  # a cached prefix of 2 is not recomputed
    assert attention_flops(profile, 5, 5) == 0


def test_gpu_peaks_and_fp8_flops_share(monkeypatch):
    """Names match their longest datasheet key; FP8 FLOPs are timed at the FP8 peak, the rest at bf16."""
    from batchgen.engine.flops import GPU_PEAK_BF16, GPU_PEAK_FP8, datasheet_peak, device_peak

    def peak_seconds(flops, fp8_flops, device):
        peak = device_peak(device)
        return peak.seconds(flops, fp8_flops) if peak else None

    assert datasheet_peak("NVIDIA L40S", GPU_PEAK_BF16) == 362e12
    assert datasheet_peak("NVIDIA L4", GPU_PEAK_BF16) == 121e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", GPU_PEAK_FP8) is None  # no FP8 tensor cores
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda")
    assert peak_seconds(3e15, 0, cuda) == 3e15 / 989e12
    assert peak_seconds(3e15, 2e15, cuda) == 1e15 / 989e12 + 2e15 / 1979e12
    assert peak_seconds(3e15, 0, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_seconds(3e15, 2e15, cuda) is None and peak_seconds(3e15, 0, cuda) == 3e15 / 312e12


def test_bench_reports_the_weight_format_of_an_fp8_checkpoint(tiny_model, tmp_path):
    from batchgen.engine.quantization.checkpoint import convert_folder

    fp8 = convert_folder(tiny_model, tmp_path / "fp8", "channel")
    args = ["--num-prompts", "2", "--input-len", "16", "--dtype", "float32"]
    r = run_bench(["--model", str(fp8), *args], tmp_path)
    plain = run_bench(["--model", str(tiny_model), *args], tmp_path)
    assert r["weight_format"] == "fp8 e4m3, per-channel scales, dequantized to float32"
    assert plain["weight_format"] == "float32"
    # Dequantized on CPU: the same FLOPs as the unquantized model, none of them in FP8.
    assert r["fp8_active_params"] == 0 and r["fp8_linear_flops"] == 0
    assert r["active_params"] == plain["active_params"] and r["linear_flops"] == plain["linear_flops"]
    assert r["total_params"] == plain["total_params"]


def test_attention_flops_of_sliding_window_layers_stop_growing_at_the_window():
    cfg = model_config({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 3})
    profile = config_profile(cfg)
    per_layer = 4 * 4 * 16
    assert profile.attention_flops_per_key == per_layer  # layer 1 is global; layers 0 and 2 are local
    assert profile.windowed_attention_flops == ((3, 2 * per_layer),)
    # Positions 1..5 see 2, 3, 4, 5, 6 keys in the global layer and 2, 3, 3, 3, 3 in a local one.
    assert attention_flops(profile, 1, 6) == per_layer * (2 + 3 + 4 + 5 + 6) + 2 * per_layer * (2 + 3 + 3 + 3 + 3)
    assert attention_flops(profile, 4, 6) == per_layer * (5 + 6) + 2 * per_layer * (3 + 3)


def test_bench_latent_attention_figures(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("deepseek-v3")
    r = run_bench(["--model", str(folder), "--num-prompts", "3", "--input-len", "20", "--dtype", "float32"],
                  tmp_path)
    c = json.loads((folder / "config.json").read_text())
    layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    # One latent row per token and layer: the KV latent and the shared rope key.
    assert r["kv_bytes_per_token"] == layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    qk, v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    assert r["attention_flops"] == 2 * layers * heads * (qk + v) * 3 * 20 * 21 // 2


def test_profile_of_deepseek_v3_shape():
    """DeepSeek-V3 as published: 671B parameters, about 37B of them used per token."""
    from transformers import DeepseekV3Config

    cfg = model_config({**DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    profile = config_profile(cfg)
    hidden, heads, expert = 7168, 128, 3 * 7168 * 2048
    attention = 7168 * 1536 + 1536 * heads * 192 + 7168 * 576 + 512 * heads * (128 + 128) + heads * 128 * 7168
    dense, moe = 3 * 7168 * 18432, 256 * hidden + 8 * expert + expert  # router, top-8 routed, one shared
    assert profile.active_params == 61 * attention + 3 * dense + 58 * moe
    assert round(profile.total_params / 1e9) == 671
    assert round((profile.active_params + profile.lm_head_params) / 1e9) == 37
    assert profile.attention_flops_per_key == 61 * 2 * heads * (192 + 128)


def test_bench_reports_the_host_share_of_decode_steps(tiny_model, tmp_path):
    args = ["--model", str(tiny_model), "--num-prompts", "4", "--input-len", "12", "--output-len", "5",
            "--dtype", "float32"]
    runs = {mode: run_bench(args + ["--overlap-schedule", mode], tmp_path) for mode in ("off", "on")}
    assert runs["off"]["overlap"] is False and runs["on"]["overlap"] is True
    for r in runs.values():
        assert r["output_tokens"] == 4 * 5
        assert 0 < r["decode_host_ms_per_step"] < r["decode_step_ms"]
        assert abs(r["decode_host_share_of_step"] - r["decode_host_ms_per_step"] / r["decode_step_ms"]) < 2e-3
