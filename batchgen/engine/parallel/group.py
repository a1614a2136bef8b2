"""A group of ranks that run collectives together, with the time they spend in them."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass
class CommClock:
    """Seconds spent inside collectives since the last ``reset`` (waiting for a slower rank included).

    On CUDA the collectives are asynchronous, so they are only timed when ``sync`` is set: then each
    one is bracketed by device synchronisations, which costs throughput (benchmarks only). A collective
    recorded into a CUDA graph is not timed at all: a synchronisation during stream capture is illegal,
    and the host time of a capture says nothing of the replays (graph steps report no communication).
    """

    enabled: bool = True
    sync: bool = False
    seconds: float = 0.0

    def reset(self) -> float:
        spent, self.seconds = self.seconds, 0.0
        return spent

    @contextmanager
    def measure(self) -> Iterator[None]:
        if not self.enabled or (self.sync and torch.cuda.is_current_stream_capturing()):
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start


@dataclass(frozen=True)
class CommGroup:
    """This process's ``rank`` among ``size`` ranks joined by the torch process group ``handle``.

    The default is a group of one: every collective is then the identity and nothing is communicated,
    so layers built without parallelism pay nothing.
    """

    rank: int = 0
    size: int = 1
    handle: Any = None  # torch.distributed ProcessGroup
    clock: CommClock = field(default_factory=CommClock, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the group, in place."""
        if self.size > 1:
            with self.clock.measure():
                dist.all_reduce(x, group=self.handle)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (equal shapes) stacked along dim 0, rank order."""
        if self.size == 1:
            return x
        out = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        with self.clock.measure():
            dist.all_gather_single(out, x.contiguous(), group=self.handle)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` (size equal parts along dim 0) over the group; rank r keeps part r."""
        if self.size == 1:
            return x
        out = x.new_empty(x.shape[0] // self.size, *x.shape[1:])
        with self.clock.measure():
            dist.reduce_scatter_single(out, x.contiguous(), group=self.handle)
        return out

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows ``x`` split by ``send_counts`` (part r to rank r); returns the parts every rank sent here,
        ``recv_counts`` rows each, in rank order."""
        if self.size == 1:
            return x
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        with self.clock.measure():
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.handle)
        return out

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, on the first rank; others get ``x`` back."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        with self.clock.measure():
            dist.gather(x, parts, group=self.handle, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else x


SINGLE = CommGroup()
