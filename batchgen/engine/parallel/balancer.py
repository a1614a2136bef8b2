"""Expert-parallel load balancing during a job: measure expert loads, rebalance placements between steps.

Every step each MoE layer counts its router's tokens per logical expert (``ExpertMap.loads``, on the
device); the balancer keeps the last ``window_size`` steps. Every ``step_interval`` steps all ranks sum the
window over the replicas, compute the new placement (``eplb.rebalance``), and, when the time it is expected
to save before the next evaluation exceeds the time moving the weights is expected to take, move the
weights that change rank and swap the maps. Every rank computes the same decision from the same summed
numbers, so they run the same collectives in the same order.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from batchgen.engine.parallel.context import ParallelContext
from batchgen.engine.parallel.eplb import Placement, balancedness, contiguous_placement, rebalance
from batchgen.engine.parallel.expert_moves import move_slots, plan_moves, slot_bytes, slot_params

log = logging.getLogger(__name__)

ASSUMED_BYTES_PER_S = 1e9  # weight-move bandwidth before the first move is measured


# The most steps of loads a rank keeps: DeepSeek-V3's 58 MoE layers x 256 experts take 60 KB a step, 0.25 GB here.
MAX_WINDOW_STEPS = 4096


@dataclass(frozen=True)
class EplbConfig:
    """``eplb_config``: vLLM's keys, and two of batchgen's: ``calibrate_once`` rebalances once, after the first
    ``window_size`` steps, and keeps that placement (an offline job's data stays alike for hours);
    ``skip_unprofitable`` False rebalances whenever the new placement is better, even where moving the
    weights is expected to cost more time than the better placement saves before the next evaluation."""

    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    log_balancedness: bool = False
    calibrate_once: bool = False
    skip_unprofitable: bool = True

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "EplbConfig":
        options = dict(options or {})
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown eplb_config key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(known)}")
        for key, value in options.items():
            kind = bool if known[key] in (bool, "bool") else int
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"eplb_config {key!r} must be {kind.__name__}, got {value!r}")
        config = cls(**options)
        if config.num_redundant_experts < 0 or config.window_size < 1 or config.step_interval < 1:
            raise ValueError("eplb_config needs num_redundant_experts >= 0, window_size >= 1, step_interval >= 1")
        if config.window_size > MAX_WINDOW_STEPS:
            raise ValueError(f"eplb_config 'window_size' must be at most {MAX_WINDOW_STEPS} steps, got "
                             f"{config.window_size}: every rank keeps that many steps' loads of every MoE layer's "
                             f"experts in device memory")
        return config


@dataclass
class EplbReport:
    """What the balancer measured, as ``LLM.metrics()["eplb"]`` shows it.

    ``balancedness_before``: mean / max tokens per expert-parallel rank that the contiguous placement would
    give on the latest window's loads (summed over layers; None where the experts do not split evenly);
    ``balancedness_after``: the same for the placement in use after the latest evaluation. ``layers``: the
    latest window's tokens per logical expert, one list per MoE layer; ``totals``: summed over layers.
    ``rank_loads_before`` / ``rank_loads_after``: the tokens each expert-parallel rank computes in each MoE layer
    (one list per layer) on those loads, with the contiguous placement (None where it does not exist) and with
    the placement in use; an expert's tokens split evenly over its replicas, as the routing spreads them.
    The busiest rank of a layer against the mean is why a step is slow (every rank waits for it).
    """

    balancedness_before: float | None = None
    balancedness_after: float | None = None
    rebalances: int = 0
    skipped: int = 0  # evaluations whose expected gain did not cover the move
    moved_bytes: int = 0  # sent between ranks, all ranks together
    rebalance_time_s: float = 0.0
    steps: int = 0
    layers: list[list[int]] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    rank_loads_before: list[list[float]] | None = None
    rank_loads_after: list[list[float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def with_load_balancing(parallel: ParallelContext, enable: bool, options: dict | None) -> ParallelContext:
    """The context the model is built with: balancing on where experts are split over several ranks."""
    if not enable or not parallel.expert_parallel or parallel.ep_size == 1:
        return parallel
    return replace(parallel, balance_experts=True,
                   redundant_experts=EplbConfig.from_dict(options).num_redundant_experts)


class ExpertBalancer:
    """One rank's view of every MoE layer's placement, load window and moves (see the module docstring)."""

    def __init__(self, model: nn.Module, parallel: ParallelContext, config: EplbConfig, active_params: int):
        self.parallel, self.config = parallel, config
        blocks = [m for m in model.modules() if getattr(getattr(m, "experts", None), "expert_map", None) is not None]
        self.layers = [b.experts for b in blocks]
        if not self.layers:
            raise ValueError("expert load balancing found no mixture-of-experts layer")
        first = self.layers[0]
        self.num_experts, self.num_slots, self.num_ranks = first.num_experts, first.num_slots, parallel.ep_size
        self.num_groups = getattr(blocks[0].gate, "n_group", 1) or 1
        row = parallel.expert_placement(self.num_experts).phy2log
        self.placement = Placement(row.repeat(len(self.layers), 1), self.num_experts, self.num_ranks)
        routed = sum(b.gate.top_k * b.experts.expert_params() for b in blocks)
        self.routed_share = min(1.0, routed / active_params) if active_params else 1.0
        device = first.expert_map.loads.device
        self.window = torch.zeros(config.window_size, len(self.layers), self.num_experts, dtype=torch.int32,
                                  device=device)
        self.steps, self.step_seconds, self.move_seconds, self.last_moved = 0, 0.0, 0.0, 0
        self.calibrated = False
        self.report = EplbReport()
        # Every rank decides alike: the first one logs. Asked for, so shown past a worker's WARNING level.
        self.logs = config.log_balancedness and parallel.ep.rank == 0
        if self.logs:
            log.setLevel(logging.INFO)

    def end_step(self, seconds: float) -> dict[str, Any] | None:
        """Files the step's counts; every ``step_interval`` steps (or once, calibrating) evaluates the
        placement, and returns the report then."""
        self.window[self.steps % self.config.window_size] = torch.stack([m.expert_map.take_loads()
                                                                          for m in self.layers])
        self.steps += 1
        self.step_seconds += seconds
        config = self.config
        due = self.steps == config.window_size if config.calibrate_once else self.steps % config.step_interval == 0
        if not due and not (config.calibrate_once and self.calibrated and self.steps % config.step_interval == 0):
            return None
        self.evaluate()
        return self.report.as_dict()

    def evaluate(self) -> None:
        """Sums the window over the ranks, and rebalances when it pays (or once, calibrating)."""
        loads, step_s, move_s = self._summed()
        current = self.placement.rank_loads(loads)
        report = self.report
        report.steps, report.layers = self.steps, loads.long().tolist()
        report.totals = loads.sum(0).long().tolist()
        contiguous = self._contiguous(loads)
        report.rank_loads_before = _rounded(contiguous) if contiguous is not None else None
        report.balancedness_before = balancedness(contiguous) if contiguous is not None else None
        self._report_after(current)
        if self.config.calibrate_once and self.calibrated:
            return self._log()
        new = rebalance(loads, self.num_slots, self.num_ranks, self.num_groups, current=self.placement)
        moves = [plan_moves(o, n, self.placement.slots_per_rank)
                 for o, n in zip(self.placement.phy2log.tolist(), new.phy2log.tolist())]
        cross = sum(self.placement.rank_of_slot(m.src_slot) != self.placement.rank_of_slot(m.dst_slot)
                    for layer in moves for m in layer)
        bytes_to_move = cross * slot_bytes(slot_params(self.layers[0]))
        busiest_now = float(current.max(-1).values.sum())
        busiest_new = float(new.rank_loads(loads).max(-1).values.sum())
        gain_s = (self.config.step_interval * step_s * self.routed_share
                  * (1 - busiest_new / busiest_now) if busiest_now else 0.0)
        bandwidth = self.last_moved / move_s if move_s and self.last_moved else ASSUMED_BYTES_PER_S
        pays = gain_s > bytes_to_move / bandwidth or self.config.calibrate_once or not self.config.skip_unprofitable
        if not any(moves) or not pays:
            report.skipped += any(moves)
            self.calibrated = True
            return self._log()
        self._apply(new, moves)
        self.last_moved = bytes_to_move
        report.moved_bytes += bytes_to_move
        report.rebalances += 1
        self._report_after(new.rank_loads(loads))
        self.calibrated = True
        self._log()

    def _summed(self) -> tuple[torch.Tensor, float, float]:
        """The window's loads summed over replicas (layers, experts), and the mean step and move times of
        the ranks: one all-reduce over every rank, so that all of them decide alike."""
        ep, tp = self.parallel.ep, self.parallel.tp
        stats = torch.cat([self.window.sum(0).double().flatten(),
                           torch.tensor([self.step_seconds / max(1, self.steps), self.move_seconds],
                                        dtype=torch.float64, device=self.window.device)])
        stats = ep.all_reduce(stats).cpu()
        # Every tensor-parallel rank of a replica counted the same tokens.
        loads = (stats[:-2] / tp.size).round().view(len(self.layers), self.num_experts)
        return loads, float(stats[-2]) / ep.size, float(stats[-1]) / ep.size

    def _contiguous(self, loads: torch.Tensor) -> torch.Tensor | None:
        """(layers, ranks) tokens with the contiguous placement; None where the experts do not split evenly."""
        if self.num_experts % self.num_ranks:
            return None
        return contiguous_placement(len(self.layers), self.num_experts, self.num_ranks).rank_loads(loads)

    def _report_after(self, rank_loads: torch.Tensor) -> None:
        self.report.rank_loads_after = _rounded(rank_loads)
        self.report.balancedness_after = balancedness(rank_loads)

    def _apply(self, new: Placement, moves: list) -> None:
        """Moves the weights that change place and installs the new maps (between steps)."""
        start = time.perf_counter()
        device = self.window.device
        per_rank, rank = new.slots_per_rank, self.parallel.ep.rank
        log2phy = new.log2phy(self.num_slots - self.num_experts + 1)
        for layer, (moe, layer_moves) in enumerate(zip(self.layers, moves)):
            if layer_moves:
                move_slots(moe, layer_moves, self.parallel.ep)
            moe.expert_map.update(log2phy[layer].to(device))
            moe.slot_experts = new.phy2log[layer, rank * per_rank:(rank + 1) * per_rank].tolist()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.placement = new
        self.move_seconds = time.perf_counter() - start
        self.report.rebalance_time_s += self.move_seconds

    def _log(self) -> None:
        if self.logs:
            r = self.report
            ratios = [max(row) * len(row) / sum(row) if sum(row) else 1.0 for row in r.rank_loads_after]
            worst = max(range(len(ratios)), key=ratios.__getitem__)
            log.info("EPLB step %d: balancedness %.3f (contiguous %s), busiest rank %.2fx the mean at worst "
                     "(MoE layer %d), %d rebalances, %d bytes moved in %.3f s", r.steps, r.balancedness_after,
                     f"{r.balancedness_before:.3f}" if r.balancedness_before is not None else "n/a",
                     ratios[worst], worst, r.rebalances, r.moved_bytes, r.rebalance_time_s)


def _rounded(rank_loads: torch.Tensor) -> list[list[float]]:
    """Tokens per rank per layer for the report: a replica's share of an expert may be a fraction."""
    return [[round(v, 2) for v in row] for row in rank_loads.tolist()]
