"""Joining the torch.distributed world and carving it into tensor- and data-parallel groups."""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from batchgen.engine.parallel.context import ParallelContext
from batchgen.engine.parallel.expert import make_exchange
from batchgen.engine.parallel.group import CommClock, CommGroup


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(rank: int, tp_size: int, dp_size: int, expert_parallel: bool, device: torch.device,
                     init_method: str, timeout_s: float, clock: CommClock,
                     expert_capacity_factor: float | None = None) -> ParallelContext:
    """Joins the world of ``tp_size * dp_size`` ranks; rank = replica * tp_size + tensor-parallel rank.

    Every rank creates every group, in the same order, as torch.distributed requires.
    """
    world = tp_size * dp_size
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    replica, tp_rank = divmod(rank, tp_size)
    tp_handles = [dist.new_group(list(range(r * tp_size, (r + 1) * tp_size))) for r in range(dp_size)]
    dp_handles = [dist.new_group(list(range(t, world, tp_size))) for t in range(tp_size)]
    tp = CommGroup(tp_rank, tp_size, tp_handles[replica], clock)
    dp = CommGroup(replica, dp_size, dp_handles[tp_rank], clock)
    return ParallelContext(tp=tp, dp=dp, expert_parallel=expert_parallel, clock=clock,
                           exchange=make_exchange(dp, tp, expert_capacity_factor),
                           ep=CommGroup(rank, world, dist.group.WORLD, clock))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
