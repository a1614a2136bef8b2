"""The paged KV cache: the layout a model declares, sizing from a memory budget, and allocation."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.engine.backends.cpu.memory import mapped_zeros
from batchgen.engine.config import EngineConfig

log = logging.getLogger(__name__)
# On CPU, by default: a share of the memory available when the cache is sized, split over the engine's worker
# processes (which share the host), less a step's activations, and at least the floor. At 2 GiB flat, a
# 240-document summarization on SmolLM2 preempted 25 times and decoded at half the batch it could; with its share
# of a 24 GiB machine (5.3 GiB) it ran without preemption, in 0.91x the time.
CPU_KV_SHARE = 0.25
CPU_MIN_KV_BYTES = 2 << 30


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True)
class KVLayout:
    """What the paged cache holds per token: for each cache layer, the shape of each of its tensors.

    A GQA layer holds K and V of (kv_heads, head_dim); a latent-attention layer one row of
    (kv_lora_rank + rope_dim,). Every tensor is allocated as (num_blocks, block_size, *shape).
    ``window``: when every layer attends only to its latest keys, the most any of them reads (a query
    at position p never needs a key before p - window + 1, so older blocks can be freed); else None.
    """

    layers: tuple[tuple[tuple[int, ...], ...], ...]
    window: int | None = None

    def values_per_token(self) -> int:
        return sum(math.prod(shape) for layer in self.layers for shape in layer)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * element_size(dtype)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)

    def describe(self) -> str:
        """E.g. ``30 layers x [(3, 64), (3, 64)]``, runs of equal layers folded."""
        runs: list[list] = []
        for layer in self.layers:
            if runs and runs[-1][1] == layer:
                runs[-1][0] += 1
            else:
                runs.append([1, layer])
        return ", ".join(f"{n} layers x {list(shapes)}" for n, shapes in runs)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> list[list[torch.Tensor]]:
        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            if torch.device(device).type == "cpu":
                return lazy_zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        return [[zeros((num_blocks, block_size, *shape)) for shape in layer] for layer in self.layers]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory mapping: the OS backs each page only when it is first written,
    so a cache sized to a budget costs memory (and page faults, about a second per GiB on a small VM) as its
    blocks come into use, not all at once when the engine starts. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * element_size(dtype)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return mapped_zeros(nbytes)[0].view(dtype).view(shape)


def available_memory() -> int | None:
    """Bytes of memory the OS can give without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_budget_bytes(engine: EngineConfig, device: torch.device, activation_reserve: int,
                    available: int | None = None) -> int:
    """This rank's budget: the configured one, else a share of free GPU memory, or on CPU ``CPU_KV_SHARE`` of the
    available memory (``available``, default: :func:`available_memory`) over the engine's ranks, both less the
    activations, and on CPU at least ``CPU_MIN_KV_BYTES``."""
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * engine.gpu_memory_utilization) - used - activation_reserve)
    available = available_memory() if available is None else available
    if available is None:
        return CPU_MIN_KV_BYTES
    return max(CPU_MIN_KV_BYTES, int(available * CPU_KV_SHARE / engine.world_size) - activation_reserve)
