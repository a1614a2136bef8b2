"""One MoE layer's logical -> physical expert map on the device, and the tokens it routed this step."""
from __future__ import annotations

import torch


class ExpertMap:
    """``log2phy`` (logical experts, max replicas): each expert's physical slots, -1 padded; ``loads``: tokens
    routed to each logical expert since the last ``take_loads`` (this replica's tokens only).

    A token goes to replica ``token index % replicas`` of each of its experts, the index counted over the
    step's tokens of every data-parallel replica, so the replicas share a hot expert's tokens evenly. The
    tensors keep their shapes, so ``update`` swaps a placement in place (between steps; CUDA graphs stay valid).
    """

    def __init__(self, log2phy: torch.Tensor, device: torch.device | str | None = None):
        self.log2phy = log2phy.to(device=device, dtype=torch.long)
        self.replicas = (self.log2phy >= 0).sum(1)
        self.loads = torch.zeros(self.log2phy.shape[0], dtype=torch.long, device=self.log2phy.device)

    @property
    def num_logical(self) -> int:
        return self.log2phy.shape[0]

    def route(self, topk_ids: torch.Tensor, first_token: int = 0) -> torch.Tensor:
        """Logical expert ids (T, k) -> physical slot ids, counting the tokens of each logical expert."""
        flat = topk_ids.reshape(-1)
        self.loads.scatter_add_(0, flat, torch.ones_like(flat))  # no bincount: no host sync, graph-safe
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None] + first_token
        pick = token % self.replicas[topk_ids]
        return self.log2phy[topk_ids, pick]

    def update(self, log2phy: torch.Tensor) -> None:
        """Installs a new placement's map (same shape)."""
        if log2phy.shape != self.log2phy.shape:
            raise ValueError(f"a map of shape {tuple(log2phy.shape)} cannot replace {tuple(self.log2phy.shape)}")
        self.log2phy.copy_(log2phy)
        self.replicas.copy_((self.log2phy >= 0).sum(1))

    def take_loads(self) -> torch.Tensor:
        """The tokens counted since the last call (a copy), and the counter reset."""
        loads = self.loads.clone()
        self.loads.zero_()
        return loads
