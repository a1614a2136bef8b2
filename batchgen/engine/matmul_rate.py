"""The matmul-rate probe: FLOP/s of one representative matmul, for dtype "auto", bench and the rooflines."""
from __future__ import annotations

import time

import torch

BENCH_MATMUL_SHAPE = {"cpu": (2048, 576, 1536), "cuda": (8192, 8192, 8192)}  # tokens x hidden @ hidden x ffn


def measure_matmul_flops(dtype: torch.dtype, device: torch.device | None = None,
                         shape: tuple[int, int, int] | None = None, *, seconds: float = 1.0, repeats: int = 1,
                         min_iters: int = 1, threads: int | None = None) -> float:
    """FLOP/s of one representative matmul on ``device``: the best of ``repeats`` rounds, each of at least
    ``min_iters`` matmuls and ``seconds`` (``threads``: CPU threads to use meanwhile; default: torch's)."""
    device = device or torch.device("cpu")
    m, k, n = shape or BENCH_MATMUL_SHAPE.get(device.type, BENCH_MATMUL_SHAPE["cuda"])
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(k, n, generator=gen).to(device, dtype)
    out = torch.empty(m, n, dtype=dtype, device=device)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for _ in range(3):
            torch.mm(a, b, out=out)
        _sync(device)
        best = float("inf")
        for _ in range(repeats):
            iters, start = 0, time.perf_counter()
            while iters < min_iters or time.perf_counter() - start < seconds:
                torch.mm(a, b, out=out)
                iters += 1
                if device.type != "cpu" and iters % 10 == 0:
                    _sync(device)
            _sync(device)
            best = min(best, (time.perf_counter() - start) / iters)
    finally:
        torch.set_num_threads(before)
    return 2 * m * k * n / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
