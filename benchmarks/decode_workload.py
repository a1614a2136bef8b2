"""The decode benchmarks' shared workload and roofline: random prompts, and the M-row rate of the model's own matmuls.

Used by profile_decode.py and compare_hf_decode.py (scripts in this folder import it by name).
"""
from __future__ import annotations

import time

import torch
from batchgen.engine import LLM
from batchgen.engine.layers.linear import LinearBase, ParallelLMHead


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly (ids 3.. skip the usual special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=gen).tolist()


def linear_weights(llm: LLM) -> list[torch.Tensor]:
    """The weights of the model's linear layers and its lm_head, before any prepacking (a tied lm_head once)."""
    model = llm.engine.executor.runner.model
    return [m.weight for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead)) and m.weight.dim() == 2]


def rows_matmul_rate(weights: list[torch.Tensor], rows: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of ``x @ W^T`` with ``rows`` rows over the model's distinct linear shapes, weighted as the
    model runs them (each layer once): the rate a decode step of ``rows`` sequences could reach."""
    shapes = [tuple(w.shape) for w in weights]
    mats = {s: torch.randn(*s).to(dtype) for s in set(shapes)}
    inputs = {s: torch.randn(rows, s[1]).to(dtype) for s in set(shapes)}
    flops = sum(2 * rows * n * k for n, k in shapes)

    def one_pass() -> None:
        for s in shapes:
            torch.nn.functional.linear(inputs[s], mats[s])

    one_pass()
    passes, start = 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - start < seconds:
        one_pass()
        passes += 1
    return flops * passes / (time.perf_counter() - start)


def decode_flops_per_token(weights: list[torch.Tensor]) -> int:
    """Linear-layer FLOPs of one decoded token (lm_head included: every decode row samples)."""
    return sum(2 * n * k for n, k in (w.shape for w in weights))


def amx_bf16_in_cpuinfo() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False
