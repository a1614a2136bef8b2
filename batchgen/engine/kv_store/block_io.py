"""Copies whole KV blocks between the paged cache and flat byte rows (one uint8 row per block, every
layer's tensors in order): what the lower prefix tiers keep. Under tensor parallelism a tier's row is
every rank's row in rank order (``join_shards``), and each rank restores its own part (``rank_shard``)."""
from __future__ import annotations

import torch

KVCache = list[list[torch.Tensor]]  # per layer, its tensors of (num_blocks, block_size, *shape)


def _tensors(kv: KVCache) -> list[torch.Tensor]:
    return [t for layer in kv for t in layer]


def block_nbytes(kv: KVCache) -> int:
    return sum(t[0].numel() * t.element_size() for t in _tensors(kv))


def gather_blocks(kv: KVCache, block_ids: list[int]) -> torch.Tensor:
    """(len(block_ids), block_nbytes) uint8 on the host; on CUDA a pinned copy queued on the stream."""
    tensors = _tensors(kv)
    device = tensors[0].device
    index = torch.tensor(block_ids, dtype=torch.int64, device=device)
    rows = torch.cat([t.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for t in tensors], 1)
    if device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    return host.copy_(rows, non_blocking=True)


def scatter_blocks(kv: KVCache, block_ids: list[int], rows: torch.Tensor) -> None:
    """Writes byte rows (as ``gather_blocks`` makes them) into the given blocks."""
    tensors = _tensors(kv)
    device = tensors[0].device
    index = torch.tensor(block_ids, dtype=torch.int64, device=device)
    rows = rows.to(device, non_blocking=True)
    offset = 0
    for t in tensors:
        width = t[0].numel() * t.element_size()
        # As bytes: every dtype's blocks alike (torch's index_copy_ takes no fp8 on CPU).
        t.view(torch.uint8).view(t.shape[0], width).index_copy_(0, index, rows[:, offset:offset + width])
        offset += width


def rank_shard(rows: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of whole-group byte rows (as ``join_shards`` makes them)."""
    width = rows.shape[1] // tp_size
    return rows[:, tp_rank * width:(tp_rank + 1) * width].contiguous()


def join_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """The byte rows of every tensor-parallel rank (equal widths), as one row per block, in rank order."""
    return torch.cat(shards, 1)
