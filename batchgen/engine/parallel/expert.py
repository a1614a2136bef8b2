"""Expert parallelism across data-parallel replicas: the token exchange around each MoE layer.

Every replica runs attention on its own tokens and routes them; the routed experts are split over all
ranks. ``dispatch`` brings a rank the tokens (with their routing) whose pairs it may compute, ``combine``
returns each replica the sum of its tokens' expert outputs. Two exchanges:

- :class:`TokenExchange`, all-gather + reduce-scatter: every rank sees every replica's tokens. Always
  correct, whatever the tensor-parallel split; it moves each token to every rank and back.
- :class:`AllToAllExchange`: a token goes only to the ranks holding one of its experts (once per rank, however
  many of its experts are there), and only those partial outputs come back: under a group-limited
  router (DeepSeek-V3: 8 experts from at most 4 of 8 groups) half the volume or less.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.parallel.group import CommGroup, SINGLE


@dataclass
class RoutedTokens:
    """A rank's share of an MoE layer's work: token rows (N, H), each row's top-k global expert ids and
    their float32 weights (N, k). The experts skip the pairs of experts another rank holds (the all-to-all
    marks those -1)."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


class TokenExchange:
    """All-gather + reduce-scatter of MoE tokens over the data-parallel group (identity for one replica).

    Token counts differ between replicas: the engine puts every replica's count in the step, so no
    collective is spent on sizes, and rows are padded to the largest.
    """

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

    @property
    def first_token(self) -> int:
        """This replica's first token's index among the step's tokens of every replica."""
        return sum(self.sizes[: self.dp.rank]) if self.active else 0

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int) -> RoutedTokens:
        """This replica's routed tokens (T, H) -> every replica's, in replica order."""
        if not self.active:
            return RoutedTokens(x, topk_weights, topk_ids)
        self._check_count(x)
        return RoutedTokens(self._gather(x), self._gather(topk_weights), self._gather(topk_ids))

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """Partial outputs for every replica's tokens -> the sum over ranks of this replica's rows."""
        if not self.active:
            return y
        width = max(self.sizes)
        padded = y.new_zeros(self.dp.size * width, y.shape[1])
        padded.index_copy_(0, self._real_rows(y.device), y)
        return self.dp.reduce_scatter(padded)[: self.sizes[self.dp.rank]]

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(max(self.sizes), *x.shape[1:])
        padded[: x.shape[0]] = x
        return self.dp.all_gather(padded).index_select(0, self._real_rows(x.device))

    def _check_count(self, x: torch.Tensor) -> None:
        if not self.sizes or self.sizes[self.dp.rank] != x.shape[0]:
            raise RuntimeError(f"the expert exchange expected {self.sizes[self.dp.rank] if self.sizes else '?'} "
                               f"tokens on data-parallel rank {self.dp.rank}, got {x.shape[0]}")

    def _real_rows(self, device: torch.device) -> torch.Tensor:
        if self._rows is None or self._rows.device != device:
            width = max(self.sizes)
            self._rows = torch.cat([torch.arange(n, device=device) + r * width for r, n in enumerate(self.sizes)])
        return self._rows


class AllToAllExchange(TokenExchange):
    """Tokens sent only to the ranks that hold their experts; the data-parallel group must be the whole
    expert-parallel group (no tensor parallelism: rank r holds the r-th contiguous slice of experts).

    One collective swaps the per-rank counts, one sends each token's row, weights and ids packed as bytes
    (a pair whose expert lives on another rank gets id -1 there), one returns the partial outputs, which the
    sender sums per token in float32.
    """

    def __init__(self, dp: CommGroup = SINGLE):
        super().__init__(dp)
        self._plan: tuple[torch.Tensor, list[int], list[int], torch.dtype] | None = None

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int) -> RoutedTokens:
        if not self.active:
            return RoutedTokens(x, topk_weights, topk_ids)
        self._check_count(x)
        ranks, k = self.dp.size, topk_ids.shape[1]
        if num_experts % ranks:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {ranks} expert-parallel ranks")
        owner = topk_ids // (num_experts // ranks)
        wanted = torch.zeros(x.shape[0], ranks, dtype=torch.bool, device=x.device)
        wanted.scatter_(1, owner, True)
        dest, token = wanted.t().nonzero(as_tuple=True)  # by destination rank, then token
        send_counts = wanted.sum(0).tolist()
        recv_counts = self.dp.all_to_all(torch.tensor(send_counts, device=x.device), [1] * ranks,
                                         [1] * ranks).tolist()
        ids = torch.where(owner[token] == dest[:, None], topk_ids[token], -1).to(torch.int32)
        row_bytes = [x.shape[1] * x.element_size(), 4 * k, 4 * k]
        packed = torch.cat([x[token].view(torch.uint8), topk_weights[token].float().view(torch.uint8),
                            ids.view(torch.uint8)], dim=1)
        got = self.dp.all_to_all(packed, send_counts, recv_counts)
        rows, weights, got_ids = got.split(row_bytes, dim=1)
        self._plan = (token, send_counts, recv_counts, x.dtype)
        return RoutedTokens(rows.contiguous().view(x.dtype), weights.contiguous().view(torch.float32),
                            got_ids.contiguous().view(torch.int32).long())

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return y
        if self._plan is None:
            raise RuntimeError("combine without a dispatch before it")
        token, send_counts, recv_counts, dtype = self._plan
        self._plan = None
        back = self.dp.all_to_all(y, recv_counts, send_counts)
        out = torch.zeros(self.sizes[self.dp.rank], y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, token, back.float()).to(dtype)


def make_exchange(dp: CommGroup, tp: CommGroup) -> TokenExchange:
    """All-to-all where the data-parallel group holds all the experts (tensor-parallel size 1); else
    all-gather, whose every rank sees the same tokens as the tensor-parallel ranks it sums with."""
    return AllToAllExchange(dp) if tp.size == 1 else TokenExchange(dp)
