"""Expert-parallel load balancing on block-FP8 MoE checkpoints: outputs equal one process while the
placement changes mid-run, with the experts dequantized at load (DP2+EP, TP2+EP) and kept in FP8, where
each expert's block scales travel with its weights (DP2+EP under the Triton interpreter). And a block-FP8
checkpoint whose fused shards are off the 128-row grid (which loads on one device, see test_fp8_models)
refused clearly under tensor parallelism, where a rank boundary would split a block."""
from __future__ import annotations

import pytest

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.executor.multiproc import WorkerError
from batchgen.engine.quantization.checkpoint import convert_folder
from tests.test_eplb import EPLB, check_report, run_with_eplb
from tests.test_fp8_models import build
from tests.test_parallel import GREEDY, SAMPLED, assert_gone, assert_same_outputs

# DeepSeek-V3 with two MoE layers of 8 routed experts (128 x 256 each), every projection in 128x128-block FP8
# (the rope rows reordered at load stay in their blocks); attention replicated per data-parallel replica.
DEEPSEEK = dict(hidden=256, heads=4, kv_heads=4, config=dict(
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, head_dim=16, v_head_dim=32,
    moe_intermediate_size=128, n_routed_experts=8, num_hidden_layers=3))
# Qwen3-MoE whose tensor-parallel shards are whole blocks: q 256 | k 128 | v 128 rows and 256 o_proj columns a
# rank, the dense layer's gate|up 256 | 256; its two MoE layers hold 8 whole experts of 128 x 256.
QWEN3_TP = dict(hidden=256, heads=4, kv_heads=2, head_dim=128,
                config=dict(moe_intermediate_size=128, num_experts=8, num_hidden_layers=3))


@pytest.fixture(scope="module")
def block_fp8(tmp_path_factory):
    """build(arch, spec[, name]) -> a block-FP8 checkpoint of a tiny model whose weights vary by block, built
    once per name (default: arch)."""
    built = {}

    def make(arch: str, spec: dict, name: str | None = None):
        if (name := name or arch) not in built:
            built[name] = convert_folder(build(tmp_path_factory, arch, spec), tmp_path_factory.mktemp(f"fp8-{name}"),
                                         "block")
        return built[name]

    return make


def short_workload(llm) -> tuple[list[list[int]], list[SamplingParams]]:
    """Four short prompts, greedy and seeded: two prefill steps and eight decodes, three evaluations."""
    tok = llm.tokenizer
    return [tok.encode(f"doc {i}: " + "the fox and the dog " * (i + 1)) for i in range(4)], [GREEDY, SAMPLED] * 2


@pytest.mark.timeout(300)
def test_block_fp8_deepseek_v3_data_and_expert_parallel_with_rebalancing_equals_one_process(block_fp8):
    """Every replica slot (a hot expert on both ranks) takes its expert's FP8 weights and block scales from the
    per-expert checkpoint tensors; the dequantized experts then move between the ranks several times."""
    report = run_with_eplb(block_fp8("deepseek-v3", DEEPSEEK), short_workload, data_parallel_size=2)
    check_report(report, layers=2, experts=8)
    assert report["moved_bytes"] % (4 * 3 * 256 * 128) == 0  # whole fp32 experts (dequantized at load)


@pytest.mark.timeout(300)
def test_block_fp8_qwen3_moe_tensor_and_expert_parallel_with_rebalancing_equals_one_process(block_fp8):
    report = run_with_eplb(block_fp8("qwen3-moe", QWEN3_TP), short_workload, tensor_parallel_size=2)
    check_report(report, layers=2, experts=8)


@pytest.mark.timeout(300)
def test_block_fp8_shards_that_tensor_parallel_ranks_would_split_mid_block_fail_clearly(block_fp8):
    """intermediate_size 320: each rank's 160 rows of gate/up (and columns of down) end or start inside a block;
    whichever rank fails first names its shard."""
    path = block_fp8("llama", dict(hidden=320, heads=4, kv_heads=2, head_dim=128,
                                   config=dict(intermediate_size=320)))
    message = (r"failed while loading the model: ValueError: weight 'model\.layers\.0\.mlp\..* "
               r"(0\.\.160|160\.\.320) of 320 does not align to the 128-element scale")
    with pytest.raises(WorkerError, match=message):
        LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=1 << 22, tensor_parallel_size=2,
            distributed_timeout_s=120)


# Two MoE layers and no dense one: the Triton interpreter takes seconds per kernel launch.
QWEN3_KEPT = dict(QWEN3_TP, config=dict(QWEN3_TP["config"], num_hidden_layers=2, mlp_only_layers=[]))
FP8_PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_experts_kept_in_fp8_move_with_their_scales_and_outputs_equal_one_process(block_fp8):
    """FP8 weights kept (w8a8 fused MoE under the Triton interpreter): a moved slot that left its scales behind
    would multiply by another expert's blocks. Each move carries whole FP8 slots: weights and scales.
    Rebalanced after every step on that step's loads; one prefill step, then decodes."""
    pytest.importorskip("triton")
    path = block_fp8("qwen3-moe", QWEN3_KEPT, "qwen3-moe-kept")
    kept = dict(dtype="float32", device="cpu", attention_backend="triton", fp8_weights="fp8",
                max_num_batched_tokens=64, kv_cache_memory=1 << 22)
    single = LLM(str(path), **kept)
    tok = single.tokenizer
    prompts = [tok.encode("Instruction: summarize carefully."), tok.encode("doc 1: a dog and a fox")]
    expected = single.generate(prompts, FP8_PARAMS)
    eplb = {**EPLB, "window_size": 1, "step_interval": 1}
    with LLM(str(path), data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb,
             distributed_timeout_s=300, **kept) as llm:
        pids = llm.engine.executor.pids
        got = llm.generate(prompts, FP8_PARAMS)
        report = llm.metrics()["eplb"]
    assert_gone(pids)
    assert_same_outputs(expected, got)
    assert report["rebalances"] >= 2
    hidden, size = 256, 128  # scales: gate|up (256 rows, 256 columns) 2 x 2 blocks, down 2 x 1
    fp8_slot = 3 * hidden * size + 4 * (2 * 2 + 2 * 1)  # e4m3 weights + float32 block scales (gate|up, down)
    assert report["moved_bytes"] > 0 and report["moved_bytes"] % fp8_slot == 0
