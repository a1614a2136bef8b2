"""Host-to-device copies that never make the host wait: through pinned memory, queued on the stream."""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(data: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a host tensor, or numbers in nested lists) as a tensor on ``device``.

    A copy from pageable memory (``torch.tensor(list, device=cuda)``, ``t.to(cuda)``) makes the host wait
    for all the work queued before it, which undoes the overlap of host and device in a step. This one
    stages the data in pinned memory and queues the copy behind that work; the caching host allocator
    keeps the staging buffer until the copy has run.
    """
    device = torch.device(device)
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type == "cpu" or t.device == device:
        return t
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
