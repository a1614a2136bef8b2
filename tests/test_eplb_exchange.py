"""Routing over expert replicas through both exchanges (three gloo ranks): every token's pairs arrive exactly
once, before and after the map is swapped, and the outputs equal one process's."""
from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch
import torch.distributed as dist

from batchgen.engine.parallel.eplb import initial_placement, rebalance
from batchgen.engine.parallel.expert import AllToAllExchange, TokenExchange
from batchgen.engine.parallel.expert_map import ExpertMap
from batchgen.engine.parallel.group import CommGroup

EXPERTS, REDUNDANT, TOP_K, HIDDEN, RANKS = 6, 3, 2, 8, 3
COUNTS = (7, 0, 12)  # tokens per replica; one idle
HOT = 4  # most tokens pick it first


def routed_tokens(replica: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(replica)
    n = COUNTS[replica]
    x = torch.randn(n, HIDDEN, generator=gen)
    others = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:TOP_K - 1] for _ in range(n)]) \
        if n else torch.zeros(0, TOP_K - 1, dtype=torch.long)
    others = others + (others >= HOT).long()  # anything but the hot expert
    return x, torch.rand(n, TOP_K, generator=gen), torch.cat([torch.full((n, 1), HOT), others], dim=1)


def placements():
    """The initial placement, then one rebalanced for a hot expert (the map swapped between steps)."""
    first = initial_placement(1, EXPERTS, REDUNDANT, RANKS)
    loads = torch.ones(1, EXPERTS)
    loads[0, HOT] = 20
    return [first, rebalance(loads, EXPERTS + REDUNDANT, RANKS, current=first)]


def stand_in_experts(x, weights, slot_ids, phy2log, local: range) -> torch.Tensor:
    """Slot s multiplies by its logical expert's id + 1; pairs of other ranks' slots (or -1) are skipped."""
    mine = (slot_ids >= local.start) & (slot_ids < local.stop)
    factor = (weights * (phy2log[slot_ids.clamp(min=0)] + 1) * mine).sum(1, keepdim=True)
    return x * factor


def rank_main(rank: int, init: str, kind: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
        group = CommGroup(rank, RANKS, dist.group.WORLD)
        exchange = (AllToAllExchange if kind == "all-to-all" else TokenExchange)(group)
        x, weights, ids = routed_tokens(rank)
        steps = []
        expert_map = None
        for placement in placements():
            log2phy = placement.log2phy(REDUNDANT + 1)[0]
            if expert_map is None:
                expert_map = ExpertMap(log2phy)
            else:
                expert_map.update(log2phy)
            exchange.begin_step(COUNTS)
            slots = expert_map.route(ids, exchange.first_token)
            routed = exchange.dispatch(x, weights, slots, placement.num_slots)
            per = placement.slots_per_rank
            local = range(rank * per, (rank + 1) * per)
            got = routed.topk_ids[(routed.topk_ids >= local.start) & (routed.topk_ids < local.stop)]
            arrived = torch.bincount(got, minlength=placement.num_slots)  # pairs computed here, per slot
            out = exchange.combine(stand_in_experts(routed.x, routed.topk_weights, routed.topk_ids,
                                                    placement.phy2log[0], local))
            steps.append((out.numpy(), arrived.numpy(), expert_map.take_loads().numpy()))
        results.put((rank, steps))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["all-gather", "all-to-all"])
def test_routing_over_replicas_delivers_every_pair_once(kind, tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, f"file://{tmp_path / 'init'}", kind, results))
             for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [v for v in got.values() if isinstance(v, str)]
    assert not errors, errors[0]
    all_ids = torch.cat([routed_tokens(r)[2] for r in range(RANKS)])
    expected_loads = torch.bincount(all_ids.flatten(), minlength=EXPERTS)
    for step, placement in enumerate(placements()):
        phy2log = placement.phy2log[0]
        arrived = sum(torch.from_numpy(got[r][step][1]) for r in range(RANKS))  # per slot, over ranks
        per_logical = torch.zeros(EXPERTS, dtype=torch.long).index_add_(0, phy2log, arrived)
        assert torch.equal(per_logical, expected_loads)  # nothing dropped, nothing computed twice
        if step == 1:  # rebalanced: the replicas of the hot expert share its tokens
            hot_slots = (phy2log == HOT).nonzero().flatten()
            assert len(hot_slots) > 1 and (arrived[hot_slots] > 0).all()
        counted = sum(torch.from_numpy(got[r][step][2]) for r in range(RANKS))
        assert torch.equal(counted, expected_loads)  # the map's load counts, over the replicas
        for r in range(RANKS):
            x, weights, ids = routed_tokens(r)
            reference = x * (weights * (ids + 1)).sum(1, keepdim=True)
            torch.testing.assert_close(torch.from_numpy(got[r][step][0]), reference)
    assert not torch.equal(placements()[0].phy2log, placements()[1].phy2log)
