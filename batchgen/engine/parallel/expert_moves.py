"""Moving expert weights between expert-parallel ranks when a layer's placement changes."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.engine.parallel.group import CommGroup


@dataclass(frozen=True)
class SlotMove:
    """Slot ``dst_slot`` (global) gets the weights ``src_slot`` (global) holds now."""

    dst_slot: int
    src_slot: int


def plan_moves(old: list[int], new: list[int], slots_per_rank: int) -> list[SlotMove]:
    """The copies that turn slot row ``old`` into ``new``: from the same rank where it already holds the
    expert, else from the old holders in turn (so that no single rank sends every copy of a hot expert)."""
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old):
        holders.setdefault(expert, []).append(slot)
    moves, turn = [], dict.fromkeys(holders, 0)
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        if expert not in holders:
            raise ValueError(f"expert {expert} is held by no slot of the current placement")
        rank = slot // slots_per_rank
        local = [s for s in holders[expert] if s // slots_per_rank == rank]
        if local:
            src = local[0]
        else:
            src = holders[expert][turn[expert] % len(holders[expert])]
            turn[expert] += 1
        moves.append(SlotMove(slot, src))
    return moves


def slot_params(moe: nn.Module) -> list[torch.Tensor]:
    """The experts' stacked tensors (weights and any scales), first dim = local slots."""
    slots = len(moe.slots)
    return [p.data for p in moe.parameters(recurse=False) if p.dim() > 0 and p.shape[0] == slots]


def slot_bytes(params: list[torch.Tensor]) -> int:
    """Bytes of one slot's weights and scales."""
    return sum(p[0].numel() * p.element_size() for p in params)


def move_slots(moe: nn.Module, moves: list[SlotMove], ep: CommGroup) -> int:
    """Carries out ``moves`` (the same list on every rank) for one MoE layer; returns the bytes this rank sent.

    One all-to-all over ``ep`` carries every cross-rank copy, each slot's tensors packed as bytes (FP8 scales
    travel with their weights); copies within a rank are local. Sources are read before anything is written.
    """
    params, per_rank = slot_params(moe), len(moe.slots)
    me, first = ep.rank, ep.rank * per_rank
    width = slot_bytes(params)

    def rank(slot: int) -> int:
        return slot // per_rank

    incoming = [m for m in moves if rank(m.dst_slot) == me]
    outgoing = sorted((m for m in moves if rank(m.src_slot) == me and rank(m.dst_slot) != me),
                      key=lambda m: rank(m.dst_slot))  # stable: plan order within a destination
    device = params[0].device
    local_rows = {m.src_slot for m in incoming if rank(m.src_slot) == me}
    staged = {s: _pack(params, s - first) for s in local_rows}
    send = torch.stack([_pack(params, m.src_slot - first) for m in outgoing]) if outgoing else \
        torch.zeros(0, width, dtype=torch.uint8, device=device)
    remote = sorted((m for m in incoming if rank(m.src_slot) != me), key=lambda m: rank(m.src_slot))
    if any(rank(m.src_slot) != rank(m.dst_slot) for m in moves):  # every rank joins, or none does
        send_counts = [sum(rank(m.dst_slot) == r for m in outgoing) for r in range(ep.size)]
        recv_counts = [sum(rank(m.src_slot) == r for m in remote) for r in range(ep.size)]
        got = ep.all_to_all(send, send_counts, recv_counts)
        for m, row in zip(remote, got):
            _unpack(params, m.dst_slot - first, row)
    for m in incoming:
        if rank(m.src_slot) == me:
            _unpack(params, m.dst_slot - first, staged[m.src_slot])
    return send.numel()


def _pack(params: list[torch.Tensor], slot: int) -> torch.Tensor:
    return torch.cat([p[slot].reshape(-1).view(torch.uint8) for p in params])


def _unpack(params: list[torch.Tensor], slot: int, row: torch.Tensor) -> None:
    offset = 0
    for p in params:
        target = p[slot].view(-1).view(torch.uint8)
        target.copy_(row[offset:offset + target.numel()])
        offset += target.numel()
