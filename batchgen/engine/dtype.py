"""Dtype names, and what ``"auto"`` resolves to here: the dtype this machine's hardware computes fast."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

import torch

from batchgen.engine.backends.cpu.features import CpuFeatures, cpu_features
from batchgen.engine.matmul_rate import measure_matmul_flops
from batchgen.io.atomic import write_atomic

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
}
DTYPE_NAMES: tuple[str, ...] = ("auto", *TORCH_DTYPES)
DtypeName = Literal[DTYPE_NAMES]  # type: ignore[valid-type]  # the spec's field type, built from the names
# The KV cache's dtype (vLLM's names): auto, the model's; bfloat16 (half an fp32 model's bytes); fp8 formats
# hold one byte a value, unscaled.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# bf16 must beat fp32 on a representative matmul by this factor to be picked where the flags allow it.
BF16_MIN_SPEEDUP = 1.0
MATMUL_SHAPE = (256, 576, 1536)  # tokens x hidden @ hidden x ffn of a small model


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in, and why."""

    name: str
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.name]


def check_dtype_name(name: str) -> None:
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")


_choices: dict[tuple[str, str], DtypeChoice] = {}


def resolve_dtype(requested: str, device: torch.device) -> DtypeChoice:
    """``requested`` as a concrete dtype on ``device``; "auto" picks, anything else is honoured.

    The choice and its reason are logged once per process; an explicit dtype this CPU computes slowly
    gets a warning.
    """
    check_dtype_name(requested)
    key = (requested, device.type)
    if key not in _choices:
        if requested == "auto":
            choice = auto_dtype(device)
            log.info("dtype auto -> %s on %s: %s", choice.name, device.type, choice.reason)
        else:
            choice = DtypeChoice(requested, "requested")
            slow = _slow_on_cpu(requested) if device.type == "cpu" else None
            if slow:
                log.warning("dtype %s is slow on this CPU (%s); dtype auto would pick float32", requested, slow)
        _choices[key] = choice
    return _choices[key]


def auto_dtype(device: torch.device) -> DtypeChoice:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", "the GPU computes bf16 natively")
        return DtypeChoice("float16", "the GPU lacks bf16")
    if device.type != "cpu":
        return DtypeChoice("float32", f"no reduced-precision rule for device {device.type!r}")
    slow = _slow_on_cpu("bfloat16")
    if slow:
        return DtypeChoice("float32", slow)
    return DtypeChoice("bfloat16", f"native bf16 ({cpu_features().describe()})")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache holds for ``kv_cache_dtype`` ``name`` with a model computing in ``model_dtype``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "bfloat16" and model_dtype == torch.float16:  # as wide as fp16, with 3 bits less precision
        raise ValueError("kv_cache_dtype bfloat16 needs a model dtype of bfloat16 or float32, this one is float16: "
                         "use kv_cache_dtype auto or fp8")
    return KV_CACHE_DTYPES[name] or model_dtype


def check_kv_cache_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Refuses a KV cache dtype the device's kernels cannot read: Triton widens e4m3 only on sm_89 and later."""
    if device.type != "cuda" or dtype != torch.float8_e4m3fn:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8 (e4m3) needs a GPU of compute capability 8.9 or later, this one is "
                         f"{major}.{minor}: use kv_cache_dtype fp8_e5m2 or auto")


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: cast, and in an fp8 cache clamped to the format's largest finite value first
    (e4m3 saturates at 448 when cast, e5m2 would overflow to inf)."""
    if dtype in FP8_DTYPES and x.dtype != dtype:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of ``dtype`` gives it back: rounded to that dtype, in x's dtype."""
    return to_cache_dtype(x, dtype).to(x.dtype)


def _slow_on_cpu(name: str) -> str | None:
    """Why ``name`` is slow on this CPU, or None when it is fast (fp32 always is)."""
    features = cpu_features()
    if name == "float16":
        return None if features.native_fp16 else f"no native fp16 ({features.describe()})"
    if name != "bfloat16":
        return None
    if not features.native_bf16:
        return f"no native bf16, torch would emulate it ({features.describe()})"
    rates = matmul_rates(features)
    if rates["bfloat16"] < BF16_MIN_SPEEDUP * rates["float32"]:
        return (f"a bf16 matmul measured {rates['bfloat16']:.0f} GFLOP/s against {rates['float32']:.0f} "
                f"in fp32 ({features.describe()})")
    return None


def _one_core_gflops(dtype: torch.dtype) -> float:
    """Best of 5 rounds of 4 small matmuls on one thread: what one core computes, which is what decides the
    dtype; one thread and the best round are what other processes on the cores skew least."""
    return measure_matmul_flops(dtype, shape=MATMUL_SHAPE, seconds=0.0, repeats=5, min_iters=4, threads=1) / 1e9


def matmul_rates(features: CpuFeatures) -> dict[str, float]:
    """GFLOP/s of a small matmul in bf16 and fp32, measured once per machine and cached on disk."""
    from batchgen.io.paths import cache_dir

    path = cache_dir() / "cpu" / f"matmul-{features.key()}-torch{torch.__version__}.json"
    try:
        rates = json.loads(path.read_text())
        if {"bfloat16", "float32"} <= set(rates):
            return rates
    except (OSError, ValueError):
        pass
    rates = {name: _one_core_gflops(TORCH_DTYPES[name]) for name in ("bfloat16", "float32")}
    try:
        write_atomic(path, json.dumps(rates).encode())
    except OSError as e:  # a read-only cache only costs the measurement next time
        log.debug("cannot cache matmul rates in %s: %s", path, e)
    return rates
