"""Expert-parallel load balancing on a skewed router: balancedness and step time with EPLB off and on.

    PYTHONPATH=. python benchmarks/eplb.py [--dp 2 4] [--prompts 48] [--redundant 8]

A DeepSeek-V3-shaped tiny model (multi-head latent attention, sigmoid routing with expert bias over 8
groups keeping 4, top-8 of 32 routed experts + 1 shared, 3 layers of which the first dense) whose
expert-choice bias sends about 37 % of the routed pairs to the top 10 % of experts (3 of each token's 8
choices, the most top-8 allows). Each run is data parallel with expert parallelism on gloo (CPU). EPLB
calibrates once on the first steps' loads, then keeps the placement.
Prints balancedness (mean / max tokens per rank, contiguous placement vs EPLB's, on the same loads), the
worst layer's busiest rank over the mean rank, the share of pairs the hottest experts received, step time off
and on, and the rebalance's cost; then DeepSeek-V3's DEP8 figure on paper from the loads measured at the
largest DP (``benchmarks/eplb_dep8.py``), and with ``--save-loads`` writes those loads as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen.engine import LLM, SamplingParams  # noqa: E402
from benchmarks.eplb_dep8 import dep8_figure  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

EXPERTS, TOP_K, HOT = 32, 8, 3  # the top 10 % of 32 experts


def build_skewed_model(out: Path, hot_bias: float) -> Path:
    build_tiny_model(out, "deepseek-v3", num_hidden_layers=3, hidden=256, heads=4, kv_heads=4,
                     n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=8, topk_group=4, moe_intermediate_size=256,
                     q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     head_dim=16)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name in weights:
        if name.endswith("e_score_correction_bias"):  # the hot experts: one in each of 3 groups
            bias = torch.zeros(EXPERTS)
            hot = torch.randperm(8, generator=gen)[:HOT] * (EXPERTS // 8) + torch.randint(0, 4, (HOT,), generator=gen)
            bias[hot] = hot_bias
            weights[name] = bias
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run(path: Path, dp: int, prompts: list[list[int]], eplb: dict | None) -> dict:
    options = dict(enable_eplb=True, eplb_config=eplb) if eplb else {}
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=512, kv_cache_memory=64 << 20,
             data_parallel_size=dp, enable_expert_parallel=True, distributed_timeout_s=300, **options) as llm:
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        llm.generate(prompts[:dp * 2], params)  # warm-up (and, with EPLB, the calibration window)
        llm.engine.reset_metrics()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        m = llm.metrics()
    steps = m["prefill_steps"] + m["decode_steps"]
    return {"wall_s": wall, "step_ms": 1e3 * (m["prefill_time_s"] + m["decode_time_s"]) / steps,
            "tokens": [o.token_ids for o in outs], "eplb": m["eplb"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--hot-bias", type=float, default=1.5)
    ap.add_argument("--save-loads", type=Path, help="write the largest DP's EPLB report (its loads) as JSON here")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_skewed_model(Path(tmp) / "model", args.hot_bias)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 400, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
        results = []
        for dp in args.dp:
            # Calibrated on the warm-up's first 8 steps; reported every 8 steps on the latest 8.
            eplb = {"num_redundant_experts": args.redundant, "window_size": 8, "step_interval": 8,
                    "calibrate_once": True}
            off, on = run(path, dp, prompts, None), run(path, dp, prompts, eplb)
            report = on["eplb"]
            shares = [sum(sorted(layer, reverse=True)[:HOT]) / sum(layer) for layer in report["layers"]]
            row = {"dp": dp, "slots": EXPERTS + args.redundant,
                   "hot_share": round(sum(shares) / len(shares), 3),  # of the pairs, per layer
                   "balancedness_before": round(report["balancedness_before"], 3),
                   "balancedness_after": round(report["balancedness_after"], 3),
                   "worst_layer_busiest_over_mean_before": worst_layer(report["rank_loads_before"]),
                   "worst_layer_busiest_over_mean_after": worst_layer(report["rank_loads_after"]),
                   "step_ms_off": round(off["step_ms"], 2), "step_ms_on": round(on["step_ms"], 2),
                   "rebalances": report["rebalances"], "moved_bytes": report["moved_bytes"],
                   "rebalance_ms": round(1e3 * report["rebalance_time_s"], 2),
                   "same_tokens": off["tokens"] == on["tokens"]}
            results.append(row)
            print(json.dumps(row), flush=True)
        if args.save_loads:
            args.save_loads.write_text(json.dumps(report))
        print(json.dumps({"deepseek_v3_dep8_on_paper": dep8_figure(report["layers"], report["balancedness_after"])}))


def worst_layer(rank_loads: list[list[float]]) -> float:
    """The largest busiest-rank / mean-rank ratio over the MoE layers."""
    return round(max(max(row) / (sum(row) / len(row)) for row in rank_loads if sum(row)), 3)


if __name__ == "__main__":
    main()
