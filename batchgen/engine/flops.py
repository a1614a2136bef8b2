"""What the engine's work is worth: FLOP accounting, the matmul-rate probe, GPU peaks, and the figures (rates,
budget use, MFU) derived from the engine's counters, under one key name each."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.engine.core.metrics import EngineMetrics

if TYPE_CHECKING:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.models.base import ModelProfile

# Dense tensor-core peaks (no sparsity), FLOP/s, from the vendors' datasheets (SXM parts): bf16/fp16,
# and FP8 e4m3 for the GPUs that have it (Ada, Hopper, Blackwell). A name matches its longest key.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
                 "B200": 2250e12, "B300": 2250e12, "GH200": 989e12}
GPU_PEAK_FP8 = {"H200": 1979e12, "H100": 1979e12, "H800": 1979e12, "L40S": 733e12, "L4": 242.5e12,
                "B200": 4500e12, "B300": 4500e12, "GH200": 1979e12}


def causal_keys(start: int, end: int, window: int | None = None) -> int:
    """Keys the tokens at positions start..end-1 attend to: p + 1 each, at most ``window``."""
    full_end = end if window is None else max(start, min(end, window))
    keys = (full_end * (full_end + 1) - start * (start + 1)) // 2
    return keys + (0 if window is None else window * (end - full_end))


def attention_flops(profile: ModelProfile, start: int, end: int) -> int:
    """Causal attention matmul FLOPs (QK^T and PV) for the tokens at positions start..end-1.

    The token at position p attends to p + 1 keys (at most a sliding window's), each costing the layers'
    FLOPs per key.
    """
    windowed = sum(flops * causal_keys(start, end, window) for window, flops in profile.windowed_attention_flops)
    return profile.attention_flops_per_key * causal_keys(start, end) + windowed


def linear_flops(profile: ModelProfile, tokens_computed: int, tokens_generated: int) -> tuple[int, int]:
    """(FLOPs of the linear layers and the logits, the part of them multiplied in FP8)."""
    return (2 * profile.active_params * tokens_computed + 2 * profile.lm_head_params * tokens_generated,
            2 * profile.fp8_active_params * tokens_computed)


def datasheet_peak(name: str, table: dict[str, float]) -> float | None:
    keys = [key for key in table if key in name]
    return table[max(keys, key=len)] if keys else None


def gpu_peak_flops(device: torch.device, fp8: bool = False) -> float | None:
    """The datasheet bf16 (or FP8) peak of a known GPU; None on CPU and unknown GPUs."""
    if device.type != "cuda":
        return None
    return datasheet_peak(torch.cuda.get_device_name(device), GPU_PEAK_FP8 if fp8 else GPU_PEAK_BF16)


@dataclass(frozen=True)
class PeakFlops:
    """The datasheet peaks of the GPUs that run one engine, all ranks together; ``fp8`` None where unknown."""

    bf16: float
    fp8: float | None = None

    def times(self, n: int) -> "PeakFlops":
        return PeakFlops(self.bf16 * n, self.fp8 * n if self.fp8 else None)

    def seconds(self, flops: float, fp8_flops: float = 0) -> float | None:
        """Seconds at peak for ``flops``, ``fp8_flops`` of them at the FP8 peak and the rest at the bf16 peak
        (MFU = this / the time taken); None when FP8 work meets an unknown FP8 peak."""
        fp8_peak = self.fp8 if fp8_flops else self.bf16
        if not fp8_peak:
            return None
        return (flops - fp8_flops) / self.bf16 + fp8_flops / fp8_peak


def device_peak(device: torch.device, devices: int = 1) -> PeakFlops | None:
    """``devices`` GPUs of ``device``'s kind at their datasheet peaks; None on CPU and unknown GPUs."""
    peak = gpu_peak_flops(device)
    if not peak:
        return None
    return PeakFlops(peak, gpu_peak_flops(device, fp8=True)).times(devices)


def engine_peak_flops(config: EngineConfig) -> PeakFlops | None:
    """The peaks of every GPU one engine runs on (one per rank); None on CPU or an unknown GPU."""
    return device_peak(config.torch_device(), config.world_size)


def _ratio(a: float, b: float, digits: int = 4) -> float | None:
    return round(a / b, digits) if b else None


def engine_figures(m: EngineMetrics, wall_s: float, token_budget: int, profile: ModelProfile | None = None,
                   peak: PeakFlops | None = None, engines: int = 1) -> dict[str, Any]:
    """The engine's counters and what follows from them, one key per figure: rates, budget use, padding and
    idle shares, time per step, achieved FLOP/s over ``wall_s`` (linear layers and logits) and ``mfu`` against
    the GPUs' datasheet peak (the FP8 peak for FP8 matmuls; None on CPU or an unknown GPU). ``engines`` ran
    side by side over ``wall_s`` (Ray replicas, each of ``token_budget``): their busy time is shared out."""
    steps = m.prefill_steps + m.decode_steps
    busy = m.prefill_time_s + m.decode_time_s
    out: dict[str, Any] = {k: round(v, 4) if isinstance(v, float) else v for k, v in m.as_dict().items()}
    out.update(
        steps=steps, busy_s=round(busy, 4), token_budget=token_budget,
        prefill_tokens_per_s=_ratio(m.prompt_tokens_computed, m.prefill_time_s, 1),
        decode_tokens_per_s=_ratio(m.decode_tokens, m.decode_time_s, 1),
        token_budget_utilization=_ratio(m.tokens_computed, steps * token_budget),
        padding_share=_ratio(m.padded_tokens, m.tokens_computed + m.padded_tokens),
        idle_share=round(max(0.0, 1 - busy / (engines * wall_s)), 4) if wall_s > 0 else None,
        achieved_tflops=None, peak_tflops=None, mfu=None, prefill_mfu=None,
        **_step_times(m), **_decode_host_times(m))
    if profile is not None and wall_s > 0:
        flops, fp8_flops = linear_flops(profile, m.tokens_computed, m.tokens_generated)
        out["achieved_tflops"] = round(flops / wall_s / 1e12, 6)
        engines_peak = peak.times(engines) if peak else None
        ideal = engines_peak.seconds(flops, fp8_flops) if engines_peak and flops else None
        if ideal:
            out["peak_tflops"] = round(flops / ideal / 1e12, 1)
            out["mfu"] = mfu(ideal, wall_s)
        prefill = engines_peak.seconds(*linear_flops(profile, m.prompt_tokens_computed, 0)) if engines_peak else None
        if prefill and m.prefill_time_s:  # the linear layers over the prompt tokens, in the steps that ran them
            out["prefill_mfu"] = mfu(prefill, m.prefill_time_s / engines)
    return out


def mfu(seconds_at_peak: float, seconds_taken: float) -> float:
    """Model FLOP utilization: the time the work takes at the peak over the time it took."""
    return round(seconds_at_peak / seconds_taken, 6)


def _step_times(m: EngineMetrics) -> dict[str, float]:
    """Milliseconds per step in collectives between devices and in everything else."""
    steps = m.prefill_steps + m.decode_steps
    if not steps:
        return {"comm_ms_per_step": None, "compute_ms_per_step": None}
    busy = m.prefill_time_s + m.decode_time_s
    return {"comm_ms_per_step": round(1e3 * m.comm_time_s / steps, 3),
            "compute_ms_per_step": round(1e3 * (busy - m.comm_time_s) / steps, 3)}


def _decode_host_times(m: EngineMetrics) -> dict[str, float | None]:
    """The host's work per decode step outside the model (scheduling, writing the step down and building
    its tensors, applying its tokens), and its share of a step in which nothing overlaps it."""
    if not m.decode_steps:
        return {"decode_host_ms_per_step": None, "decode_step_ms": None, "decode_host_share_of_step": None}
    host = m.decode_host_time_s + m.decode_prepare_time_s
    step = m.decode_host_time_s + m.decode_time_s
    return {"decode_host_ms_per_step": round(1e3 * host / m.decode_steps, 3),
            "decode_step_ms": round(1e3 * step / m.decode_steps, 3),
            "decode_host_share_of_step": round(host / step, 4) if step else None}
