"""FLOP accounting: the model's profile (active parameters, attention), measured matmul rate, GPU peaks."""
from __future__ import annotations

import time

import torch

from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.ops import make_kernel_set
from batchgen.engine.models.base import ModelProfile
from batchgen.engine.models.registry import build_model

# Dense bf16/fp16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' datasheets.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12,
                 "B200": 2250e12, "B300": 2250e12, "GH200": 989e12}


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


def gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_BF16.items() if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
