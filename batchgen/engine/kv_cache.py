"""Sizing and allocating the paged KV cache from a memory budget."""
from __future__ import annotations

import logging

import torch
from torch import nn

from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.layers.attention import Attention

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_BYTES = 2 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block of tokens."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def kv_budget_bytes(engine: EngineConfig, device: torch.device, activation_reserve: int) -> int:
    """The configured budget, else 2 GiB on CPU or a share of free GPU memory minus activations."""
    if engine.kv_cache_memory is not None:
        return engine.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * engine.gpu_memory_utilization) - used - activation_reserve)
    return CPU_DEFAULT_KV_BYTES


def allocate_kv_cache(model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> list[Attention]:
    """Allocates per-layer K/V tensors (num_blocks, block_size, kv_heads, head_dim) and binds them."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    for attn in layers:
        attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)", num_blocks, block_size,
             num_blocks * block_size, num_blocks * bytes_per_block(cfg, block_size, dtype) / 2**20)
    return layers
