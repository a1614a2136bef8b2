"""What this CPU computes natively: its /proc/cpuinfo flags and torch's dispatch level."""
from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})
# Environment variables that change which instructions torch and oneDNN use, hence measured speeds.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's model name and flags, and ``torch.backends.cpu.get_cpu_capability()``."""

    model_name: str
    flags: frozenset[str]
    capability: str

    @property
    def avx512(self) -> bool:
        return self.capability.startswith("AVX512") and AVX512_CORE <= self.flags

    @property
    def avx2(self) -> bool:
        return self.capability.startswith(("AVX2", "AVX512")) and {"avx2", "fma"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX), as torch dispatches them."""
        return self.avx512 and bool(self.flags & BF16_FLAGS)

    @property
    def native_fp16(self) -> bool:
        return self.avx512 and bool(self.flags & FP16_FLAGS)

    @property
    def isa(self) -> str | None:
        """The vector level the fused kernels are built for: "avx512", "avx2", or None (no fused kernels)."""
        return "avx512" if self.avx512 else ("avx2" if self.avx2 else None)

    def describe(self) -> str:
        native = sorted(self.flags & (BF16_FLAGS | FP16_FLAGS)) or ["no bf16/fp16 dot-product flags"]
        return f"{self.model_name or platform.machine()}, torch capability {self.capability}, {', '.join(native)}"

    def key(self) -> str:
        """A short id of everything here that changes speeds or generated code (ISA env overrides included)."""
        env = [f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ]
        text = "|".join([self.model_name, self.capability, *sorted(self.flags), *env])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


@lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's features, read once per process."""
    model, flags = _cpuinfo()
    return CpuFeatures(model_name=model, flags=flags, capability=torch.backends.cpu.get_cpu_capability())
