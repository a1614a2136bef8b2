"""The host-memory tier: KV blocks by chain hash under a byte budget, least recently used out first."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class HostCache:
    """Thread-safe: background loads fill it while the scheduler reads it."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self.evictions = 0
        self._blocks: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is None or entry[0] != tokens:
                return None
            self._blocks.move_to_end(block_hash)
            return entry[1]

    def put(self, block_hash: int, tokens: tuple[int, ...], row: torch.Tensor) -> None:
        """Keeps ``row`` (the block's bytes, uint8), evicting the least recently used blocks to fit."""
        size = row.numel()
        if size > self.budget:
            return
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self.used -= old[1].numel()
            while self.used + size > self.budget:
                _, (_, evicted) = self._blocks.popitem(last=False)
                self.used -= evicted.numel()
                self.evictions += 1
            self._blocks[block_hash] = (tokens, row)
            self.used += size
