"""The paged KV cache: the layout a model declares, sizing from a memory budget, and allocation."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from batchgen.engine.config import EngineConfig

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_BYTES = 2 << 30


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
        return [[torch.zeros(num_blocks, block_size, *shape, dtype=dtype, device=device) for shape in layer]
                for layer in self.layers]


def kv_budget_bytes(engine: EngineConfig, device: torch.device, activation_reserve: int) -> int:
    """The configured budget, else 2 GiB on CPU or a share of free GPU memory minus activations."""
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * engine.gpu_memory_utilization) - used - activation_reserve)
    return CPU_DEFAULT_KV_BYTES
