"""How one process's model is split: its tensor-parallel group, its data-parallel replica, its experts."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.parallel.eplb import Placement, initial_placement
from batchgen.engine.parallel.expert import TokenExchange
from batchgen.engine.parallel.group import SINGLE, CommClock, CommGroup


@dataclass(frozen=True)
class ParallelContext:
    """What the model's layers are built with.

    ``tp``: the ranks sharing this replica's layers (heads, intermediate features, vocabulary split).
    ``dp``: the ranks holding the same tensor-parallel shard in every data-parallel replica; they only
    talk to each other in the expert exchange. With ``expert_parallel`` the routed experts are split over
    all ``dp.size * tp.size`` ranks instead of each expert's features over the ``tp`` ranks.
    ``balance_experts`` (expert-parallel load balancing): the ranks hold ``redundant_experts`` slots beyond
    the experts, and MoE layers route through a logical -> physical map and count their experts' tokens;
    ``ep`` is the group of every expert-parallel rank (which moves expert weights between them).
    """

    tp: CommGroup = SINGLE
    dp: CommGroup = SINGLE
    expert_parallel: bool = False
    clock: CommClock = field(default_factory=CommClock)
    exchange: TokenExchange = field(default_factory=TokenExchange)
    balance_experts: bool = False
    redundant_experts: int = 0
    ep: CommGroup = SINGLE

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

    def expert_slots(self, num_experts: int) -> tuple[range, list[int]]:
        """The physical expert slots this rank holds (of ``num_experts + redundant_experts``) and the logical
        expert each starts with; without redundant slots, ``local_experts``."""
        if not self.redundant_experts:
            local = self.local_experts(num_experts)
            return local, list(local)
        placement = self.expert_placement(num_experts)
        per_rank = placement.slots_per_rank
        slots = range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
        return slots, placement.phy2log[0, slots.start:slots.stop].tolist()

    def expert_placement(self, num_experts: int) -> Placement:
        """The placement (one layer) every MoE layer starts with, over all expert-parallel ranks."""
        if not self.redundant_experts:
            self.local_experts(num_experts)  # its clear error where the experts do not split evenly
        return initial_placement(1, num_experts, self.redundant_experts, self.ep_size)

    @property
    def expert_tp(self) -> CommGroup:
        """The group each expert's intermediate features are split over (none under expert parallelism)."""
        return SINGLE if self.expert_parallel else self.tp


SINGLE_PROCESS = ParallelContext()
