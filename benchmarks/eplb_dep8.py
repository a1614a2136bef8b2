"""DeepSeek-V3 at DEP8 on paper: balancedness and step time with EPLB, from expert loads measured on a tiny model.

    PYTHONPATH=. python benchmarks/eplb_dep8.py LOADS.json   # an EPLB report: "layers", "balancedness_after"

``benchmarks/eplb.py`` prints this at its end from the loads it measured. The derivation:

1. Skew: each measured layer's share of the routed pairs per expert is carried over to DeepSeek-V3's 256
   routed experts, every measured expert standing for 256 / E consecutive ones (the top 10 % of experts keep
   their share; expert j of group g stays in group g when the measured model has 8 groups). Their loads
   vary around that share as much as the measured layer's cold experts (outside its top 10 %) vary among
   themselves (coefficient of variation, normal draws). The measured layers are cycled over V3's 58 MoE
   layers. A placement is judged on the loads it was computed from: the stationary limit of an offline job
   (the same data for hours), which DeepSeek's 10-minute windows of millions of tokens come close to.
2. Placement: DEP8 is 8 ranks on one node. Contiguous: rank r holds experts 32r ... 32r+31 (= router group r).
   EPLB: ``eplb.rebalance`` with 32 redundant experts (288 slots, 36 per rank; one node: the global policy).
   Two cases for where the hot experts sit: as measured (whole groups hot), and shuffled over the expert ids
   in each layer (hot experts anywhere); each the mean of 20 draws.
3. Time: a MoE layer's routed-expert time is its busiest rank's tokens (the GEMMs of large prefill batches are
   compute-bound, and the all-to-all sends and receives in proportion too); everything else (MLA attention,
   projections, the shared expert, the 3 dense layers) is balanced by data parallelism. The routed experts'
   share of a token's multiply-adds comes from V3's shapes below, with attention over a prompt of
   ``PROMPT`` tokens. Step speedup = (1 - r + r / b_before) / (1 - r + r / b_after).
4. Judged on its own loads, EPLB's placement is all but perfect at 36 slots a rank. With ``measured_after``
   (the balancedness the tiny model's calibrated placement kept on later windows) the speedup is given for
   that b_after too: the cost of placing on one window and running on the next.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen.engine.parallel.eplb import balancedness, contiguous_placement, rebalance  # noqa: E402

# DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3)
HIDDEN, LAYERS, DENSE_LAYERS, DENSE_FFN = 7168, 61, 3, 18432
EXPERTS, TOP_K, EXPERT_FFN, SHARED = 256, 8, 2048, 1
Q_LORA, KV_LORA, HEADS, NOPE, ROPE, V_DIM = 1536, 512, 128, 128, 64, 128
RANKS, REDUNDANT, PROMPT = 8, 32, 2048


def routed_share(prompt: int = PROMPT) -> float:
    """The routed experts' share of a prefill token's multiply-adds (projections, experts, causal attention)."""
    attention = (HIDDEN * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + HIDDEN * (KV_LORA + ROPE)
                 + KV_LORA * HEADS * (NOPE + V_DIM) + HEADS * V_DIM * HIDDEN)
    scores = HEADS * (NOPE + ROPE + V_DIM) * prompt / 2  # q.k and p.v over half the prompt on average
    expert = 3 * HIDDEN * EXPERT_FFN
    moe_layers = LAYERS - DENSE_LAYERS
    routed = moe_layers * TOP_K * expert
    total = (LAYERS * (attention + scores) + moe_layers * (routed / moe_layers + SHARED * expert + HIDDEN * EXPERTS)
             + DENSE_LAYERS * 3 * HIDDEN * DENSE_FFN)
    return routed / total


def cold_spread(measured: torch.Tensor) -> torch.Tensor:
    """Per measured layer, the coefficient of variation of the loads of its experts outside the top 10 %."""
    top = max(1, round(0.1 * measured.shape[1]))
    cold = measured.double().sort(1, descending=True).values[:, top:]
    return cold.std(1) / cold.mean(1)


def v3_loads(measured: torch.Tensor, gen: torch.Generator, shuffle: bool) -> torch.Tensor:
    """(58, 256) expert loads drawn around each measured layer's shares, cycled over the layers; ``shuffle``
    spreads each layer's experts over random ids."""
    per = EXPERTS // measured.shape[1]
    cycle = torch.arange(LAYERS - DENSE_LAYERS) % len(measured)
    shares = measured.double() / measured.double().sum(1, keepdim=True)
    rows = (shares.repeat_interleave(per, dim=1) / per)[cycle]
    noise = torch.randn(rows.shape, generator=gen, dtype=torch.float64) * cold_spread(measured)[cycle, None]
    rows = rows * (1 + noise).clamp(min=0.05)
    if shuffle:
        rows = torch.stack([row[torch.randperm(EXPERTS, generator=gen)] for row in rows])
    return rows


def balancedness_pair(loads: torch.Tensor) -> tuple[float, float]:
    contiguous = balancedness(contiguous_placement(len(loads), EXPERTS, RANKS).rank_loads(loads))
    balanced = balancedness(rebalance(loads, EXPERTS + REDUNDANT, RANKS).rank_loads(loads))
    return contiguous, balanced


def dep8_figure(measured_layers: list[list[int]], measured_after: float | None = None, draws: int = 20) -> dict:
    measured = torch.tensor(measured_layers)
    if EXPERTS % measured.shape[1]:
        raise ValueError(f"{measured.shape[1]} measured experts do not divide DeepSeek-V3's {EXPERTS}")
    top = max(1, round(0.1 * measured.shape[1]))
    hot_share = float((measured.sort(1, descending=True).values[:, :top].sum(1) / measured.sum(1)).mean())
    share = routed_share()

    def speedup(before: float, after: float) -> float:
        return round((1 - share + share / before) / (1 - share + share / after), 3)

    def case(before: float, after: float) -> dict:
        out = {"balancedness_before": round(before, 3), "balancedness_after": round(after, 4),
               "busiest_over_mean_before": round(1 / before, 3), "busiest_over_mean_after": round(1 / after, 3),
               "moe_layer_speedup": round(after / before, 3), "prefill_step_speedup": speedup(before, after)}
        if measured_after is not None:
            out["prefill_step_speedup_at_measured_after"] = speedup(before, measured_after)
        return out

    gen = torch.Generator().manual_seed(0)

    def mean_case(shuffle: bool) -> dict:
        pairs = [balancedness_pair(v3_loads(measured, gen, shuffle)) for _ in range(draws)]
        return case(*(sum(x) / draws for x in zip(*pairs)))

    return {"measured_layers": len(measured), "measured_experts": measured.shape[1], "measured_after": measured_after,
            "top10pct_share": round(hot_share, 3), "cold_spread": round(float(cold_spread(measured).mean()), 3),
            "routed_share_of_prefill_macs": round(share, 3),
            "hot_groups_as_measured": mean_case(False), "hot_experts_shuffled": mean_case(True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("loads", type=Path, help='JSON with "layers": tokens per expert per MoE layer (an EPLB report)')
    args = ap.parse_args()
    report = json.loads(args.loads.read_text())
    print(json.dumps(dep8_figure(report["layers"], report.get("balancedness_after"))))


if __name__ == "__main__":
    main()
