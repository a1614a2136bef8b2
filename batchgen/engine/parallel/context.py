"""How one process's model is split: its tensor-parallel group, its data-parallel replica, its experts."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.parallel.expert import TokenExchange
from batchgen.engine.parallel.group import SINGLE, CommClock, CommGroup


@dataclass(frozen=True)
class ParallelContext:
    """What the model's layers are built with.

    ``tp``: the ranks sharing this replica's layers (heads, intermediate features, vocabulary split).
    ``dp``: the ranks holding the same tensor-parallel shard in every data-parallel replica; they only
    talk to each other in the expert exchange. With ``expert_parallel`` the routed experts are split over
    all ``dp.size * tp.size`` ranks instead of each expert's features over the ``tp`` ranks.
    """

    tp: CommGroup = SINGLE
    dp: CommGroup = SINGLE
    expert_parallel: bool = False
    clock: CommClock = field(default_factory=CommClock)
    exchange: TokenExchange = field(default_factory=TokenExchange)

    @property
    def ep_rank(self) -> int:
        return self.dp.rank * self.tp.size + self.tp.rank if self.expert_parallel else 0

    @property
    def ep_size(self) -> int:
        return self.dp.size * self.tp.size if self.expert_parallel else 1

    @property
    def exchanges_tokens(self) -> bool:
        """Whether MoE layers exchange tokens between replicas (so every replica must run each step)."""
        return self.expert_parallel and self.dp.size > 1

    def local_experts(self, num_experts: int) -> range:
        """The routed experts this rank holds."""
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.ep_size} "
                             "expert-parallel ranks")
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    @property
    def expert_tp(self) -> CommGroup:
        """The group each expert's intermediate features are split over (none under expert parallelism)."""
        return SINGLE if self.expert_parallel else self.tp


SINGLE_PROCESS = ParallelContext()
