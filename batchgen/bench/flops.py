"""FLOP accounting: the model's profile (active parameters, attention), measured matmul rate, GPU peaks."""
from __future__ import annotations

import time

from dataclasses import dataclass

import torch

from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.models.base import ModelProfile
from batchgen.engine.models.registry import build_model

# Dense tensor-core peaks (no sparsity), FLOP/s, from the vendors' datasheets (SXM parts): bf16/fp16,
# and FP8 e4m3 for the GPUs that have it (Ada, Hopper, Blackwell). A name matches its longest key.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
                 "B200": 2250e12, "B300": 2250e12, "GH200": 989e12}
GPU_PEAK_FP8 = {"H200": 1979e12, "H100": 1979e12, "H800": 1979e12, "L40S": 733e12, "L4": 242.5e12,
                "B200": 4500e12, "B300": 4500e12, "GH200": 1979e12}


def config_profile(cfg: ModelConfig) -> ModelProfile:
    """The parameter/FLOP profile of a model of this config, built on the meta device (nothing allocated)."""
    model = build_model(cfg, make_kernel_set("torch"), max_positions=1, dtype=torch.bfloat16, device="meta")
    return model.profile()


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


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, seconds: float = 1.0,
                         shape: tuple[int, int, int] = (2048, 576, 1536)) -> float:
    """Sustained FLOP/s of one representative matmul (tokens x hidden @ hidden x ffn) on this device."""
    m, k, n = shape if device.type == "cpu" else (8192, 8192, 8192)
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    _sync(device)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
        if device.type != "cpu" and iters % 10 == 0:
            _sync(device)
    _sync(device)
    return 2 * m * k * n * iters / (time.perf_counter() - start)


def gpu_peak_flops(device: torch.device, fp8: bool = False) -> float | None:
    """The datasheet bf16 (or FP8) peak of a known GPU; None on CPU and unknown GPUs."""
    if device.type != "cuda":
        return None
    return datasheet_peak(torch.cuda.get_device_name(device), GPU_PEAK_FP8 if fp8 else GPU_PEAK_BF16)


def datasheet_peak(name: str, table: dict[str, float]) -> float | None:
    keys = [key for key in table if key in name]
    return table[max(keys, key=len)] if keys else None


def linear_flops(profile: ModelProfile, tokens_computed: int, tokens_generated: int) -> tuple[int, int]:
    """(FLOPs of the linear layers and the logits, the part of them multiplied in FP8)."""
    return (2 * profile.active_params * tokens_computed + 2 * profile.lm_head_params * tokens_generated,
            2 * profile.fp8_active_params * tokens_computed)


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
    fp8 = gpu_peak_flops(device, fp8=True)
    return PeakFlops(peak, fp8).times(devices)


def peak_seconds(flops: float, fp8_flops: float, device: torch.device, devices: int = 1) -> float | None:
    peak = device_peak(device, devices)
    return peak.seconds(flops, fp8_flops) if peak else None


def engine_peak_flops(config: EngineConfig) -> PeakFlops | None:
    """The peaks of every GPU one engine runs on (one per rank); None on CPU or an unknown GPU."""
    return device_peak(config.torch_device(), config.world_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
