"""Expert parallelism across data-parallel replicas: the token exchange around each MoE layer.

Every replica runs attention on its own tokens; the routed experts are split over all ranks. Before a
MoE layer each rank gathers every replica's tokens (all-gather), routes them all and runs its own
experts on the pairs that chose them; after it, the partial outputs are summed and each replica takes
its own rows back (reduce-scatter). Token counts differ between replicas: the engine puts every
replica's count in the step, so no collective is spent on sizes, and rows are padded to the largest.
"""
from __future__ import annotations

import torch

from batchgen.engine.parallel.group import CommGroup, SINGLE


class TokenExchange:
    """All-gather + reduce-scatter of MoE tokens over the data-parallel group (identity for one replica)."""

    def __init__(self, dp: CommGroup = SINGLE):
        self.dp = dp
        self.sizes: tuple[int, ...] = ()
        self._rows: torch.Tensor | None = None  # the real rows of the padded gathered layout

    @property
    def active(self) -> bool:
        return self.dp.size > 1

    def begin_step(self, sizes: tuple[int, ...]) -> None:
        """Every replica's token count for the coming forward (index: data-parallel rank)."""
        if self.active and len(sizes) != self.dp.size:
            raise ValueError(f"expected {self.dp.size} token counts for the expert exchange, got {len(sizes)}")
        self.sizes = tuple(sizes)
        self._rows = None

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """This replica's tokens (T, H) -> every replica's tokens (sum of T, H), in replica order."""
        if not self.active:
            return x
        width = self._width(x)
        padded = x.new_zeros(width, x.shape[1])
        padded[: x.shape[0]] = x
        return self.dp.all_gather(padded).index_select(0, self._real_rows(x.device))

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """Partial outputs for every replica's tokens -> the sum over ranks of this replica's rows."""
        if not self.active:
            return y
        width = max(self.sizes)
        padded = y.new_zeros(self.dp.size * width, y.shape[1])
        padded.index_copy_(0, self._real_rows(y.device), y)
        return self.dp.reduce_scatter(padded)[: self.sizes[self.dp.rank]]

    def _width(self, x: torch.Tensor) -> int:
        if not self.sizes or self.sizes[self.dp.rank] != x.shape[0]:
            raise RuntimeError(f"the expert exchange expected {self.sizes[self.dp.rank] if self.sizes else '?'} "
                               f"tokens on data-parallel rank {self.dp.rank}, got {x.shape[0]}")
        return max(self.sizes)

    def _real_rows(self, device: torch.device) -> torch.Tensor:
        if self._rows is None or self._rows.device != device:
            width = max(self.sizes)
            self._rows = torch.cat([torch.arange(n, device=device) + r * width for r, n in enumerate(self.sizes)])
        return self._rows
