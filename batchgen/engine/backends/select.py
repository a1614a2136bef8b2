"""Which kernel set a model runs with: the backend for a device, and the set a backend name builds."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.backends.torch.kernels import torch_kernels


def make_kernel_set(backend: str) -> KernelSet:
    """Build the kernel set for ``backend``: "torch", "cpu" (fused C++ kernels; torch's ops where they
    cannot be built) or "triton" (torch's ops fill the fields a backend does not implement)."""
    if backend == "torch":
        return torch_kernels()
    if backend == "cpu":
        from batchgen.engine.backends.cpu.kernels import cpu_kernels
        kernels = cpu_kernels()
        return replace(torch_kernels(), **kernels) if kernels else torch_kernels()
    if backend == "triton":
        from batchgen.engine.backends.triton.backend import triton_kernels
        return replace(torch_kernels(), **triton_kernels())
    raise ValueError(f"unknown attention_backend {backend!r}; expected 'torch', 'cpu' or 'triton'")


def backend_for(requested: str | None, device: torch.device) -> str:
    """The attention backend an engine on ``device`` runs: ``requested`` (attention_backend), else the default.
    Triton's kernels need a CUDA device, or its interpreter (TRITON_INTERPRET=1, for tests)."""
    backend = requested or default_backend(device)
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' runs on CUDA GPUs, not on {device.type} (elsewhere only in "
                         "Triton's interpreter, TRITON_INTERPRET=1, for tests): leave it unset or use 'cpu'")
    return backend


def default_backend(device: torch.device) -> str:
    """Triton on CUDA when it is installed, the fused CPU kernels on CPU, torch otherwise."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
            return "triton"
        except ImportError:
            return "torch"
    return "cpu" if device.type == "cpu" else "torch"
