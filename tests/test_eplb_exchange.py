"""Routing over expert replicas through both exchanges (three gloo ranks): every token's pairs arrive exactly
once, before and after the map is swapped, and the outputs equal one process's; FP8 experts moved between
two ranks with their scales."""
from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch
import torch.distributed as dist

from batchgen.engine.parallel.eplb import initial_placement, rebalance
from batchgen.engine.parallel.expert import AllToAllExchange, PaddedAllToAllExchange, TokenExchange
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


def spawn_ranks(target, ranks: int, tmp_path, *args) -> dict:
    """Runs ``target(rank, init, *args, results)`` on gloo ranks; their results by rank (a failure re-raised)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, f"file://{tmp_path / 'init'}", *args, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:  # no rank outlives the test
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [v for v in got.values() if isinstance(v, str)]
    assert not errors, errors[0]
    return got


# The padded all-to-all at capacity 1.0: fixed-size parts, yet no pair can be dropped.
EXCHANGES = {"all-gather": TokenExchange, "all-to-all": AllToAllExchange, "padded-all-to-all": PaddedAllToAllExchange}


def rank_main(rank: int, init: str, kind: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
        group = CommGroup(rank, RANKS, dist.group.WORLD)
        exchange = EXCHANGES[kind](group)
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
            dropped = int(getattr(exchange, "dropped_pairs", None) or 0)
            steps.append((out.numpy(), arrived.numpy(), expert_map.take_loads().numpy(), dropped))
        results.put((rank, steps))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(EXCHANGES))
def test_routing_over_replicas_delivers_every_pair_once(kind, tmp_path):
    got = spawn_ranks(rank_main, RANKS, tmp_path, kind)
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
        assert all(got[r][step][3] == 0 for r in range(RANKS))
        counted = sum(torch.from_numpy(got[r][step][2]) for r in range(RANKS))
        assert torch.equal(counted, expected_loads)  # the map's load counts, over the replicas
        for r in range(RANKS):
            x, weights, ids = routed_tokens(r)
            reference = x * (weights * (ids + 1)).sum(1, keepdim=True)
            torch.testing.assert_close(torch.from_numpy(got[r][step][0]), reference)
    assert not torch.equal(placements()[0].phy2log, placements()[1].phy2log)


FP8_EXPERTS, FP8_SIZE = 4, 128  # per expert: gate|up (256, 128), down (128, 128): whole 128x128 blocks


def fp8_experts() -> list[tuple[torch.Tensor, ...]]:
    """(gate_up, its scales, down, its scales) per expert, blocks of different magnitudes."""
    from tests.test_fp8_models import quantized

    gen = torch.Generator().manual_seed(3)
    return [(*quantized(2 * FP8_SIZE, FP8_SIZE, "block", gen), *quantized(FP8_SIZE, FP8_SIZE, "block", gen))
            for _ in range(FP8_EXPERTS)]


def fp8_rank_main(rank: int, init: str, results) -> None:
    try:
        from batchgen.engine.backends.triton.fp8.format import dequantize_fp8_weight
        from batchgen.engine.layers.moe import FusedMoE
        from batchgen.engine.backends.select import make_kernel_set
        from batchgen.engine.parallel.context import ParallelContext
        from batchgen.engine.parallel.expert_moves import plan_moves, move_slots
        from tests.test_fp8_models import fp8_layers

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        group = CommGroup(rank, 2, dist.group.WORLD)
        parallel = ParallelContext(dp=group, expert_parallel=True, balance_experts=True, redundant_experts=2,
                                   ep=group)
        with fp8_layers("block"):
            moe = FusedMoE(FP8_EXPERTS, FP8_SIZE, FP8_SIZE, make_kernel_set("torch"), parallel)
        experts = fp8_experts()
        for name, part in (("gate_up_proj", 0), ("down_proj", 2)):
            for offset in (0, 1):  # stacked weights, then their scales
                param = getattr(moe, name + ("_scale" if offset else ""))
                param.weight_loader(param, torch.stack([e[part + offset] for e in experts]))
        loaded = list(moe.slot_experts)
        old = parallel.expert_placement(FP8_EXPERTS).phy2log[0].tolist()
        new = rebalance(torch.tensor([[1.0, 1.0, 1.0, 30.0]]), FP8_EXPERTS + 2, 2,
                        current=parallel.expert_placement(FP8_EXPERTS)).phy2log[0].tolist()
        sent = move_slots(moe, plan_moves(old, new, 3), group)
        dense = [(dequantize_fp8_weight(moe.gate_up_proj[j], moe.gate_up_proj_scale[j], torch.float32),
                  dequantize_fp8_weight(moe.down_proj[j], moe.down_proj_scale[j], torch.float32)) for j in range(3)]
        results.put((rank, (loaded, old, new, sent, [(a.numpy(), b.numpy()) for a, b in dense])))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


@pytest.mark.timeout(240)
def test_fp8_experts_move_with_their_scales(tmp_path):
    from batchgen.engine.backends.triton.fp8.format import dequantize_fp8_weight

    got = spawn_ranks(fp8_rank_main, 2, tmp_path)
    experts = fp8_experts()
    expected = [(dequantize_fp8_weight(gu, gus, torch.float32), dequantize_fp8_weight(d, ds, torch.float32))
                for gu, gus, d, ds in experts]
    total_sent = 0
    for rank, (loaded, old, new, sent, dense) in got.items():
        assert loaded == old[3 * rank:3 * rank + 3]  # the loader filled every slot, replicas included
        assert new.count(3) > 1 and new != old
        for j, (gate_up, down) in enumerate(dense):
            logical = new[3 * rank + j]
            torch.testing.assert_close(torch.from_numpy(gate_up), expected[logical][0], rtol=0, atol=0)
            torch.testing.assert_close(torch.from_numpy(down), expected[logical][1], rtol=0, atol=0)
        total_sent += sent
    assert total_sent > 0
