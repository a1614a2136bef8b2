"""Expert-parallel load balancing in the engine: outputs equal one process while placements change mid-run."""
from __future__ import annotations

import pytest

from batchgen.engine.config import EngineConfig
from tests.test_parallel import assert_gone, assert_same_outputs, make_llm, workload

# Rebalanced every 3 steps on a 2-step window: the loads of so few tokens change from window to window,
# so the placement changes (and weights move) several times in one run. Each evaluation writes its log line.
EPLB = {"num_redundant_experts": 2, "window_size": 2, "step_interval": 3, "skip_unprofitable": False,
        "log_balancedness": True}


def run_with_eplb(path, workload_of=workload, eplb=EPLB, **parallel):
    single = make_llm(path)
    prompts, params = workload_of(single)
    expected = single.generate(prompts, params)
    with make_llm(path, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb, **parallel) as llm:
        pids = llm.engine.executor.pids
        got = llm.generate(prompts, params)
        report = llm.metrics()["eplb"]
    assert_gone(pids)
    assert_same_outputs(expected, got)
    return report


def check_report(report: dict, layers: int, experts: int, ranks: int = 2) -> None:
    assert report["rebalances"] >= 2 and report["moved_bytes"] > 0 and report["rebalance_time_s"] > 0
    assert len(report["layers"]) == layers and all(len(row) == experts for row in report["layers"])
    assert report["totals"] == [sum(col) for col in zip(*report["layers"])]
    assert 0 < report["balancedness_before"] <= 1 and 0 < report["balancedness_after"] <= 1
    # Tokens per rank per layer: every routed pair computed on one rank; the contiguous placement's are the
    # sums of each rank's run of experts; balancedness is their mean over max, summed over layers.
    per_rank = experts // ranks
    assert report["rank_loads_before"] == [[float(sum(row[r * per_rank:(r + 1) * per_rank])) for r in range(ranks)]
                                           for row in report["layers"]]
    after = report["rank_loads_after"]
    assert len(after) == layers and all(len(row) == ranks for row in after)
    assert [sum(row) for row in after] == pytest.approx([sum(row) for row in report["layers"]], abs=0.01 * ranks)
    for key in ("before", "after"):
        loads = report[f"rank_loads_{key}"]
        mean_over_max = sum(sum(row) / ranks for row in loads) / sum(max(row) for row in loads)
        assert report[f"balancedness_{key}"] == pytest.approx(mean_over_max, abs=1e-3)


@pytest.mark.timeout(300)
def test_data_and_expert_parallel_with_rebalancing_equals_one_process(tiny_model_factory):
    """DeepSeek-V3 (grouped router, shared expert) over two replicas: the all-to-all exchange routes to
    replicas of the hot experts, and the weights move between the replicas mid-run."""
    report = run_with_eplb(tiny_model_factory("deepseek-v3"), data_parallel_size=2)
    check_report(report, layers=2, experts=8)


@pytest.mark.timeout(300)
def test_tensor_and_expert_parallel_with_rebalancing_equals_one_process(tiny_model_factory, capfd):
    """Qwen3-MoE over two tensor-parallel ranks holding whole experts (their outputs all-reduced); the first
    rank logs each evaluation (``log_balancedness``), the worst layer's busiest rank included."""
    report = run_with_eplb(tiny_model_factory("qwen3-moe"), tensor_parallel_size=2)
    check_report(report, layers=2, experts=8)
    lines = [line for line in capfd.readouterr().err.splitlines() if "EPLB step" in line]
    assert lines and all(line.startswith("rank 0 INFO") for line in lines)
    ratios = [max(row) * len(row) / sum(row) for row in report["rank_loads_after"]]
    assert f"busiest rank {max(ratios):.2f}x the mean at worst (MoE layer {ratios.index(max(ratios))})" in lines[-1]


@pytest.mark.timeout(300)
def test_redundant_slots_that_even_out_the_experts_over_the_ranks_are_taken(tiny_model_factory):
    """8 experts over 3 ranks do not divide; with 1 redundant slot the 9 slots do, and outputs are one process's."""
    report = run_with_eplb(tiny_model_factory("deepseek-v3"), eplb={**EPLB, "num_redundant_experts": 1},
                           data_parallel_size=3)
    assert report["rebalances"] >= 1


def test_eplb_settings_are_checked(tiny_model):
    with pytest.raises(ValueError, match="unknown eplb_config key.*'window'"):
        EngineConfig(model=str(tiny_model), enable_expert_parallel=True, eplb_config={"window": 3})
    with pytest.raises(ValueError, match="'step_interval' must be int"):
        EngineConfig(model=str(tiny_model), eplb_config={"step_interval": "10"})
    with pytest.raises(ValueError, match="'window_size' must be at most 4096 steps, got 100000"):
        EngineConfig(model=str(tiny_model), enable_expert_parallel=True, eplb_config={"window_size": 100000})
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        EngineConfig(model=str(tiny_model), enable_eplb=True)


@pytest.mark.timeout(300)
def test_calibrate_once_rebalances_once_and_keeps_the_placement(tiny_model_factory):
    """Calibrated on the first 3 steps, then reported every 4 steps without moving anything again."""
    path = tiny_model_factory("deepseek-v3")
    single = make_llm(path)
    prompts, params = workload(single)
    expected = single.generate(prompts, params)
    config = {"num_redundant_experts": 2, "window_size": 3, "step_interval": 4, "calibrate_once": True}
    with make_llm(path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                  eplb_config=config) as llm:
        reports = []
        llm.engine.step_listeners.append(lambda r: r.eplb is not None and reports.append(r.eplb))
        assert_same_outputs(expected, llm.generate(prompts, params))
    assert len(reports) >= 3 and reports[0]["steps"] == 3
    assert [r["rebalances"] for r in reports] == [1] * len(reports)
    assert all(r["moved_bytes"] == reports[0]["moved_bytes"] > 0 for r in reports)
    assert [r["steps"] for r in reports[1:]] == [4 * (i + 1) for i in range(len(reports) - 1)]
