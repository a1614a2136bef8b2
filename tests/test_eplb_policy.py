"""The expert placement policy against hand-worked cases and the contiguous placement."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine.parallel.eplb import (
    Placement, balancedness, contiguous_placement, initial_placement, rebalance,
)


def test_even_loads_keep_the_contiguous_placement():
    loads = torch.full((3, 8), 10.0)
    placement = rebalance(loads, num_slots=8, num_ranks=4)
    assert torch.equal(placement.phy2log, torch.arange(8).repeat(3, 1))
    assert balancedness(placement.rank_loads(loads)) == 1.0


def test_one_hot_expert_is_replicated_and_spread():
    # Worked by hand: 6 -> 3 + 3 -> 2 + 2 + 2; items 2,2,2,1,1,1 packed three per rank: {2,2,1} and {2,1,1}.
    loads = torch.tensor([[6.0, 1.0, 1.0, 1.0]])
    placement = rebalance(loads, num_slots=6, num_ranks=2)
    assert placement.replica_counts().tolist() == [[3, 1, 1, 1]]
    assert sorted(placement.rank_loads(loads)[0].tolist()) == [4.0, 5.0]
    ranks = placement.phy2log.view(2, 3).tolist()
    assert all(0 in r for r in ranks)  # the hot expert on both ranks
    assert balancedness(placement.rank_loads(loads)) == pytest.approx(4.5 / 5)
    contiguous = balancedness(torch.tensor([[7.0, 2.0]]))  # {6, 1} and {1, 1}
    assert balancedness(placement.rank_loads(loads)) > contiguous
    log2phy = placement.log2phy(3)[0]
    assert sorted(log2phy[0].tolist()) == sorted(s for s, e in enumerate(placement.phy2log[0].tolist()) if e == 0)
    assert log2phy[1].tolist()[1:] == [-1, -1]


def test_groups_stay_within_one_node():
    # 4 groups of 2 experts, loads 10, 10, 1, 1 per group: groups 0 and 2 on one node, 1 and 3 on the other;
    # within a node the two heavy experts on different ranks: every rank 5 + 0.5.
    loads = torch.tensor([[5.0, 5, 5, 5, 0.5, 0.5, 0.5, 0.5]])
    placement = rebalance(loads, num_slots=8, num_ranks=4, num_groups=4, num_nodes=2)
    assert placement.rank_loads(loads)[0].tolist() == [5.5] * 4
    row = placement.phy2log[0].tolist()
    nodes = [{e // 2 for e in row[:4]}, {e // 2 for e in row[4:]}]
    assert sorted(map(sorted, nodes)) == [[0, 2], [1, 3]]
    # With redundant slots, replicas stay in their group's node too.
    loads = torch.tensor([[40.0, 1, 1, 1, 1, 1, 1, 1]])
    placement = rebalance(loads, num_slots=12, num_ranks=4, num_groups=4, num_nodes=2)
    row = placement.phy2log[0].tolist()
    home = [{e // 2 for e in row[:6]}, {e // 2 for e in row[6:]}]
    assert not home[0] & home[1] and home[0] | home[1] == {0, 1, 2, 3}
    # Each node's 6 slots hold its 4 experts and 2 spares: both go to expert 0, on its own node.
    own = row[:6] if 0 in home[0] else row[6:]
    assert placement.replica_counts()[0, 0] == 3 == own.count(0)


def test_groups_that_do_not_divide_the_nodes_use_the_global_policy():
    loads = torch.tensor([[40.0, 1, 1, 1, 1, 1]])
    hierarchical_shape = rebalance(loads, num_slots=8, num_ranks=4, num_groups=3, num_nodes=2)
    assert torch.equal(hierarchical_shape.phy2log, rebalance(loads, num_slots=8, num_ranks=4).phy2log)


def test_never_worse_than_contiguous_on_skewed_loads():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        experts, ranks = 16, 4
        loads = (torch.rand(3, experts, generator=gen) ** 4 * 1000).round()  # a few hot experts
        contiguous = balancedness(contiguous_placement(3, experts, ranks).rank_loads(loads))
        for redundant in (0, 4, 8):
            placement = rebalance(loads, experts + redundant, ranks)
            assert placement.replica_counts().sum(1).tolist() == [experts + redundant] * 3
            assert (placement.replica_counts() >= 1).all()
            assert balancedness(placement.rank_loads(loads)) >= contiguous - 1e-12
        assert balancedness(rebalance(loads, experts + 8, ranks).rank_loads(loads)) > contiguous


def test_never_worse_than_contiguous_where_greedy_packing_loses():
    """[100, 200, 0, 300] in 6 slots on 2 ranks: replicating the hot expert then packing gives [350, 250]; each
    rank keeping its run and replicating its own busiest expert gives [300, 300]."""
    loads = torch.tensor([[100.0, 200.0, 0.0, 300.0]])
    assert rebalance(loads, 6, 2).rank_loads(loads).tolist() == [[300.0, 300.0]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        loads = (torch.rand(1, 8, generator=gen) * 1000).round()
        contiguous = contiguous_placement(1, 8, 2).rank_loads(loads).max()
        assert rebalance(loads, 10, 2).rank_loads(loads).max() <= contiguous


def test_a_layer_keeps_its_placement_unless_the_new_one_is_better():
    loads = torch.tensor([[9.0, 1, 1, 1], [1.0, 1, 1, 1]])
    first = rebalance(loads, num_slots=6, num_ranks=2)
    again = rebalance(loads, num_slots=6, num_ranks=2, current=first)
    assert torch.equal(again.phy2log, first.phy2log)  # nothing to gain: nothing moves
    shifted = rebalance(loads.flip(1), num_slots=6, num_ranks=2, current=first)
    moved = (shifted.phy2log != first.phy2log).sum().item()
    assert 0 < moved < 12 and shifted.replica_counts()[0, 3] == 3


def test_initial_placement_and_bad_shapes():
    assert torch.equal(initial_placement(2, 8, 0, 4).phy2log, torch.arange(8).repeat(2, 1))
    spread = initial_placement(1, 8, 4, 4)
    assert spread.replica_counts().sum().item() == 12 and spread.slots_per_rank == 3
    with pytest.raises(ValueError, match="split evenly over 4 ranks"):
        rebalance(torch.ones(1, 8), 10, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        rebalance(torch.ones(1, 8), 4, 4)
    with pytest.raises(ValueError, match="split evenly"):
        Placement(torch.zeros(1, 6, dtype=torch.long), 6, 4)
