"""Expert parallelism across data-parallel replicas: the token exchange around each MoE layer.

Every replica runs attention on its own tokens and routes them; the routed experts are split over all
ranks. ``dispatch`` brings a rank the tokens (with their routing) whose pairs it may compute, ``combine``
returns each replica the sum of its tokens' expert outputs. Two exchanges:

- :class:`TokenExchange`, all-gather + reduce-scatter: every rank sees every replica's tokens. Always
  correct, whatever the tensor-parallel split; it moves each token to every rank and back.
- :class:`AllToAllExchange`: a token goes only to the ranks holding one of its experts (once per rank, however
  many of its experts are there), and only those partial outputs come back: under a group-limited
  router (DeepSeek-V3: 8 experts from at most 4 of 8 groups) half the volume or less.
- :class:`PaddedAllToAllExchange`: the same routing in fixed-size parts, so the host never waits on the
  device for counts (the exact all-to-all reads them back four times per MoE layer).
"""
from __future__ import annotations

import math
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
        ranks, k = self.dp.size, topk_ids.shape[1]
        owner, wanted = self._route(x, topk_ids, num_experts)
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

    def _route(self, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank holding each pair's expert (N, k), and which ranks each token goes to (N, ranks)."""
        self._check_count(x)
        ranks = self.dp.size
        if num_experts % ranks:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {ranks} expert-parallel ranks")
        owner = topk_ids // (num_experts // ranks)
        wanted = torch.zeros(x.shape[0], ranks, dtype=torch.bool, device=x.device).scatter_(1, owner, True)
        return owner, wanted

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


class PaddedAllToAllExchange(AllToAllExchange):
    """The all-to-all in parts of ``capacity`` rows from every rank to every rank: a destination's tokens
    first, in token order, then zero rows whose expert ids are all -1 (the experts skip them). No counts
    are swapped and nothing is read back to the host, at the price of the padding rows.

    The capacity is the most tokens a replica has in the step (every rank knows the counts from the
    step: no collective), times ``capacity_factor``. At 1.0 no token can overflow (a token goes to a
    rank at most once), so the result is the exact exchange's, as DeepEP's low-latency buffers are sized
    for the most tokens a rank may send. Below 1.0 less travels, and a destination's tokens past the
    capacity are dropped, in token order (the Switch/GShard capacity rule): their pairs on that rank
    contribute nothing. ``dropped_pairs`` (on the device) counts the (token, rank) pairs dropped.
    """

    def __init__(self, dp: CommGroup = SINGLE, capacity_factor: float = 1.0):
        super().__init__(dp)
        if not 0 < capacity_factor <= 1:
            raise ValueError(f"the expert capacity factor must be in (0, 1], got {capacity_factor}")
        self.capacity_factor = capacity_factor
        self.dropped_pairs: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None

    def capacity(self) -> int:
        """Rows each rank sends each rank in this step."""
        most = max(self.sizes)
        return max(1, math.ceil(self.capacity_factor * most))

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int) -> RoutedTokens:
        if not self.active:
            return RoutedTokens(x, topk_weights, topk_ids)
        ranks, k, cap = self.dp.size, topk_ids.shape[1], self.capacity()
        owner, wanted = self._route(x, topk_ids, num_experts)
        place = wanted.long().cumsum(0) - 1  # a token's place among the tokens bound for each rank
        kept = wanted & (place < cap)
        self.dropped_pairs = (wanted & ~kept).sum()
        # Row of the send buffer per (token, rank); the extra last row takes every pair that is not sent.
        discard = ranks * cap
        slots = torch.where(kept, torch.arange(ranks, device=x.device) * cap + place, discard)
        data = torch.cat([x.view(torch.uint8), topk_weights.float().view(torch.uint8)], dim=1)
        width = data.shape[1]
        send = torch.zeros(discard + 1, width + 4 * k, dtype=torch.uint8, device=x.device)
        send[:, width:] = 255  # expert id -1 (all bits set) in every row no token fills
        for rank in range(ranks):
            ids = torch.where(owner == rank, topk_ids, -1).to(torch.int32)
            send[:, :width].index_put_((slots[:, rank],), data)
            send[:, width:].index_put_((slots[:, rank],), ids.view(torch.uint8))
        got = self.dp.all_to_all(send[:discard], [cap] * ranks, [cap] * ranks)
        rows, weights, got_ids = got.split([x.shape[1] * x.element_size(), 4 * k, 4 * k], dim=1)
        self._slots = slots
        return RoutedTokens(rows.contiguous().view(x.dtype), weights.contiguous().view(torch.float32),
                            got_ids.contiguous().view(torch.int32).long())

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return y
        if self._slots is None:
            raise RuntimeError("combine without a dispatch before it")
        slots, self._slots = self._slots, None
        cap = self.capacity()
        back = self.dp.all_to_all(y, [cap] * self.dp.size, [cap] * self.dp.size).float()
        back = torch.cat([back, back.new_zeros(1, back.shape[1])])  # the discard row: no contribution
        out = torch.zeros(slots.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for rank in range(self.dp.size):
            out += back[slots[:, rank]]
        return out.to(y.dtype)


def make_exchange(dp: CommGroup, tp: CommGroup, padded_capacity: float | None = None) -> TokenExchange:
    """All-to-all where the data-parallel group holds all the experts (tensor-parallel size 1), in fixed
    parts of ``padded_capacity`` times the most tokens of a replica when given; else all-gather, whose
    every rank sees the same tokens as the tensor-parallel ranks it sums with."""
    if tp.size > 1:
        return TokenExchange(dp)
    return AllToAllExchange(dp) if padded_capacity is None else PaddedAllToAllExchange(dp, padded_capacity)
