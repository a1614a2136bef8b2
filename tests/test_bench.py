"""`batchgen bench`: figures are consistent with the workload, prefix caching shows up in them."""
from __future__ import annotations

import json

from click.testing import CliRunner

from batchgen.bench.flops import attention_flops, linear_params
from batchgen.bench.workload import from_documents, parse_length, synthetic
from batchgen.cli import main
from batchgen.engine.config import ModelConfig


def run_bench(args: list[str], tmp_path) -> dict:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", *args, "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_bench_prefill_only_figures(tiny_model, tmp_path):
    r = run_bench(["--model", str(tiny_model), "--num-prompts", "6", "--input-len", "20:60",
                   "--dtype", "float32", "--max-batch-tokens", "64"], tmp_path)
    assert r["num_prompts"] == 6 and 6 * 20 <= r["prompt_tokens"] <= 6 * 60
    assert r["dtype"] == r["dtype_requested"] == "float32" and r["dtype_reason"] == "requested"
    assert r["output_tokens"] == 6 and r["prompt_tokens_computed"] == r["prompt_tokens"]
    assert abs(r["prompt_tokens_per_s"] - r["prompt_tokens"] / r["wall_s"]) / r["prompt_tokens_per_s"] < 0.1
    assert r["mfu_vs_measured_matmul"] > 0 and r["roofline_prompt_tokens_per_s"] > 0
    assert r["mfu_with_attention_vs_measured_matmul"] > r["mfu_vs_measured_matmul"]


def test_bench_shared_prefix_is_computed_once(tiny_model, tmp_path):
    args = ["--model", str(tiny_model), "--num-prompts", "8", "--input-len", "10", "--prefix-len", "160",
            "--dtype", "float32", "--output-len", "2"]
    cached = run_bench(args, tmp_path)
    plain = run_bench(args + ["--no-prefix-caching"], tmp_path)
    assert plain["prompt_tokens_computed"] == plain["prompt_tokens"] == 8 * 170
    assert cached["prompt_tokens_computed"] <= 8 * 170 - 7 * 160
    assert cached["prefix_cache_hit_rate"] > 0.8
    assert cached["decode_tokens_per_s"] is not None


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


def test_linear_params_of_smollm2_shape():
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                               "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                               "num_key_value_heads": 3})
    assert abs(linear_params(cfg) - 106e6) < 1e6  # 30 layers x 3.54M


def test_attention_flops_count_keys_per_position():
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2})
    per_key = 4 * 2 * 4 * 16  # 4 FLOPs x layers x heads x head_dim
    assert attention_flops(cfg, 0, 3) == per_key * (1 + 2 + 3)
    assert attention_flops(cfg, 2, 4) == per_key * (3 + 4)  # a cached prefix of 2 is not recomputed
    assert attention_flops(cfg, 5, 5) == 0
