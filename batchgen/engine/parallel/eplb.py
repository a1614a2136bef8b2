"""Expert placement for expert-parallel load balancing: which logical expert each physical slot holds.

The policy of DeepSeek's EPLB, written afresh: give the redundant slots, one at a time, to the expert
with the highest load per replica; then pack the physical experts (each carrying its expert's load
split evenly over its replicas) onto ranks, heaviest first into the least loaded rank that has room,
every rank getting the same number of slots. Where expert groups divide the nodes, groups are packed
onto nodes first and experts replicated and packed within their node (traffic stays in the node);
otherwise over all ranks. Three things of our own: the global policy's result loses to no balancing on some
loads, so each rank keeping its contiguous run of experts (its spare slots replicating its own busiest) is
a candidate too; a layer keeps its current placement unless the new one lowers its busiest rank's load; and
a new placement is matched to the current ranks and slots so that as few experts as possible change place.

Slot s of ``P`` lives on rank ``s // (P // N)``. Everything here is plain torch on the CPU (whatever the
default device: models are built under a device context).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """``phy2log`` (layers, slots): the logical expert every physical slot holds, over ``num_ranks`` ranks."""

    phy2log: torch.Tensor
    num_logical: int
    num_ranks: int

    def __post_init__(self) -> None:
        if self.phy2log.shape[1] % self.num_ranks:
            raise ValueError(f"{self.phy2log.shape[1]} expert slots cannot be split evenly over "
                             f"{self.num_ranks} ranks")

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def replica_counts(self) -> torch.Tensor:
        """(layers, logical experts): how many slots hold each expert."""
        counts = torch.zeros(self.num_layers, self.num_logical, dtype=torch.long, device=CPU)
        return counts.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """(layers, ranks): the tokens each rank computes when each expert's ``loads`` (layers, experts)
        are split evenly over its replicas."""
        per_replica = loads.cpu().double() / self.replica_counts().clamp(min=1)
        return per_replica.gather(1, self.phy2log).view(self.num_layers, self.num_ranks, -1).sum(-1)

    def log2phy(self, max_replicas: int) -> torch.Tensor:
        """(layers, logical experts, ``max_replicas``): each expert's slots in ascending order, -1 padded."""
        out = torch.full((self.num_layers, self.num_logical, max_replicas), -1, dtype=torch.long, device=CPU)
        for layer, row in enumerate(self.phy2log.tolist()):
            seen = [0] * self.num_logical
            for slot, expert in enumerate(row):
                out[layer, expert, seen[expert]] = slot
                seen[expert] += 1
        return out

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank


def balancedness(rank_loads: torch.Tensor) -> float:
    """Mean over max tokens per rank, summed over layers (each layer waits for its busiest rank); 1.0 is even."""
    busiest = float(rank_loads.max(-1).values.sum())
    return float(rank_loads.mean(-1).sum()) / busiest if busiest > 0 else 1.0


def contiguous_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """Rank r holds experts r*E/N ... (r+1)*E/N - 1: the placement without load balancing."""
    return Placement(torch.arange(num_experts, device=CPU).repeat(num_layers, 1), num_experts, num_ranks)


def initial_placement(num_layers: int, num_experts: int, num_redundant: int, num_ranks: int,
                      num_groups: int = 1, num_nodes: int = 1) -> Placement:
    """Before any load is measured: contiguous, or (with redundant slots) the policy on even loads."""
    if num_redundant == 0:
        return contiguous_placement(num_layers, num_experts, num_ranks)
    return rebalance(torch.ones(num_layers, num_experts, device=CPU), num_experts + num_redundant, num_ranks,
                     num_groups, num_nodes)


def rebalance(loads: torch.Tensor, num_slots: int, num_ranks: int, num_groups: int = 1, num_nodes: int = 1,
              current: Placement | None = None) -> Placement:
    """The placement for ``loads`` (layers, logical experts) over ``num_slots`` slots on ``num_ranks`` ranks.

    Hierarchical (groups -> nodes -> ranks) when ``num_nodes`` > 1 divides ``num_groups``, else global.
    A layer keeps ``current``'s placement (default: contiguous when there are no redundant slots) unless
    the new one lowers its busiest rank's load.
    """
    layers, experts = loads.shape
    _check_shape(experts, num_slots, num_ranks, num_groups, num_nodes)
    if current is None and num_slots == experts:
        current = contiguous_placement(layers, experts, num_ranks)
    if current is not None and (current.num_slots, current.num_ranks, current.num_layers) != (
            num_slots, num_ranks, layers):
        raise ValueError("the current placement has another shape than the one asked for")
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    rows = []
    for layer in range(layers):
        load = loads[layer].cpu().double().tolist()
        old = current.phy2log[layer].tolist() if current is not None else None
        if hierarchical:
            ranks = _place_hierarchical(load, num_slots, num_ranks, num_groups, num_nodes, old)
        else:
            ranks = _pack_into_ranks(load, list(range(experts)), num_slots, num_ranks,
                                     _by_rank(old, num_ranks) if old else None)
        row = _order_slots(ranks, _by_rank(old, num_ranks) if old else None)
        if not hierarchical and experts % num_ranks == 0:
            # The greedy packing can lose to no balancing at all: then each rank keeps its contiguous run of
            # experts and spends its spare slots on replicas of its own busiest ones (never worse than contiguous).
            plain = _order_slots(_contiguous_with_replicas(load, num_slots, num_ranks),
                                 _by_rank(old, num_ranks) if old else None)
            if _max_rank_load(plain, load, num_ranks) < _max_rank_load(row, load, num_ranks):
                row = plain
        if old is not None and _max_rank_load(old, load, num_ranks) <= _max_rank_load(row, load, num_ranks):
            row = old
        rows.append(row)
    return Placement(torch.tensor(rows, dtype=torch.long, device=CPU), experts, num_ranks)


def _contiguous_with_replicas(load: list[float], slots: int, ranks: int) -> list[list[int]]:
    """Rank r's experts r*E/N ... (r+1)*E/N - 1, its spare slots given one at a time to the expert of its own with
    the most load per replica."""
    per, spare = len(load) // ranks, slots // ranks - len(load) // ranks
    placed = []
    for r in range(ranks):
        own = list(range(r * per, (r + 1) * per))
        copies = Counter(own)
        for _ in range(spare):
            copies[max(own, key=lambda e: load[e] / copies[e])] += 1
        placed.append(sorted(copies.elements()))
    return placed


def _check_shape(experts: int, slots: int, ranks: int, groups: int, nodes: int) -> None:
    if slots < experts:
        raise ValueError(f"{slots} expert slots cannot hold {experts} experts")
    if slots % ranks:
        raise ValueError(f"{slots} expert slots cannot be split evenly over {ranks} ranks")
    if experts % groups:
        raise ValueError(f"{experts} experts cannot form {groups} equal groups")
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks cannot be split evenly over {nodes} nodes")


def _place_hierarchical(load: list[float], slots: int, ranks: int, groups: int, nodes: int,
                        old: list[int] | None) -> list[list[int]]:
    """Groups packed onto nodes, then each node's experts replicated and packed onto its ranks."""
    size = len(load) // groups
    group_load = [sum(load[g * size:(g + 1) * size]) for g in range(groups)]
    node_groups = _balanced_packing(group_load, nodes)
    if old is not None:  # nodes are interchangeable: keep each node's groups where most of them are now
        old_nodes = [Counter(e // size for e in part) for part in _by_rank(old, nodes)]
        node_groups = _match(node_groups, old_nodes)
    per_node, old_ranks = ranks // nodes, _by_rank(old, ranks) if old else None
    placed = []
    for node, members in enumerate(node_groups):
        experts = [g * size + i for g in sorted(members) for i in range(size)]
        placed += _pack_into_ranks(load, experts, slots // nodes, per_node,
                                   old_ranks[node * per_node:(node + 1) * per_node] if old_ranks else None)
    return placed


def _pack_into_ranks(load: list[float], experts: list[int], slots: int, ranks: int,
                     old_ranks: list[list[int]] | None) -> list[list[int]]:
    """``experts`` replicated into ``slots`` physical experts, packed onto ``ranks`` equal ranks."""
    counts = _replicate([load[e] for e in experts], slots)
    items = [e for e, n in zip(experts, counts) for _ in range(n)]
    weights = [load[e] / n for e, n in zip(experts, counts) for _ in range(n)]
    packs = [[items[i] for i in pack] for pack in _balanced_packing(weights, ranks)]
    if old_ranks is not None:  # ranks are interchangeable: keep experts on the rank that holds them now
        packs = _match([Counter(p) for p in packs], [Counter(r) for r in old_ranks])
        packs = [sorted(p.elements()) for p in packs]
    return packs


def _replicate(load: list[float], slots: int) -> list[int]:
    """Replicas per expert: each spare slot goes to the expert with the most load per replica."""
    counts = [1] * len(load)
    for _ in range(slots - len(load)):
        best = max(range(len(load)), key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def _balanced_packing(weights: list[float], packs: int) -> list[list[int]]:
    """Item indices in ``packs`` packs of equal count: heaviest first into the lightest pack with room."""
    per_pack = len(weights) // packs
    contents: list[list[int]] = [[] for _ in range(packs)]
    totals = [0.0] * packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        pack = min((p for p in range(packs) if len(contents[p]) < per_pack), key=lambda p: (totals[p], p))
        contents[pack].append(item)
        totals[pack] += weights[item]
    return contents


def _match(new: list, old: list) -> list:
    """``new``'s parts reordered so that part i overlaps ``old``'s part i the most (greedy by overlap)."""
    pairs = sorted((-sum((_as_counter(a) & _as_counter(b)).values()), i, j)
                   for i, a in enumerate(new) for j, b in enumerate(old))
    out: list = [None] * len(old)
    used: set[int] = set()
    for _, i, j in pairs:
        if i not in used and out[j] is None:
            out[j] = new[i]
            used.add(i)
    return out


def _as_counter(part) -> Counter:
    return part if isinstance(part, Counter) else Counter(part)


def _by_rank(row: list[int], ranks: int) -> list[list[int]]:
    per = len(row) // ranks
    return [row[r * per:(r + 1) * per] for r in range(ranks)]


def _order_slots(ranks: list[list[int]], old_ranks: list[list[int]] | None) -> list[int]:
    """The slot row: on each rank, experts that stay keep their slot; the others fill the free ones."""
    row = []
    for r, experts in enumerate(ranks):
        if old_ranks is None:
            row += sorted(experts)
            continue
        todo = Counter(experts)
        slots: list[int | None] = []
        for e in old_ranks[r]:
            keep = todo[e] > 0
            slots.append(e if keep else None)
            todo[e] -= keep
        rest = iter(sorted(todo.elements()))
        row += [e if e is not None else next(rest) for e in slots]
    return row


def _max_rank_load(row: list[int], load: list[float], ranks: int) -> float:
    counts = Counter(row)
    return max(sum(load[e] / counts[e] for e in part) for part in _by_rank(row, ranks))
