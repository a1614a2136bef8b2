"""The expert exchanges between data-parallel replicas (two gloo ranks on CPU) against one process."""
from __future__ import annotations

import math
import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from batchgen.engine.parallel.expert import AllToAllExchange, PaddedAllToAllExchange, TokenExchange
from batchgen.engine.parallel.group import CommGroup

EXPERTS, TOP_K, HIDDEN = 12, 3, 16
COUNTS = (5, 0, 9)  # tokens per replica; one replica idle


def routed_tokens(replica: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(replica)
    n = COUNTS[replica]
    x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(n)]) if n else \
        torch.zeros(0, TOP_K, dtype=torch.long)
    return x, torch.rand(n, TOP_K, generator=gen), ids


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, local: range) -> torch.Tensor:
    """A stand-in for the experts: expert e multiplies by e + 1; pairs of other ranks' experts are skipped."""
    mine = (ids >= local.start) & (ids < local.stop)
    factor = (weights * (ids + 1) * mine).sum(1, keepdim=True)
    return (x.float() * factor).to(x.dtype)


def make(kind: str, group: CommGroup):
    if kind.startswith("padded"):  # "padded-F": capacity factor F
        return PaddedAllToAllExchange(group, float(kind.split("-")[1]))
    return (AllToAllExchange if kind == "all-to-all" else TokenExchange)(group)


def rank_main(rank: int, world: int, init: str, kind: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        group = CommGroup(rank, world, dist.group.WORLD)
        exchange = make(kind, group)
        exchange.begin_step(COUNTS)
        x, weights, ids = routed_tokens(rank)
        per_rank = EXPERTS // world
        local = range(rank * per_rank, (rank + 1) * per_rank)
        routed = exchange.dispatch(x, weights, ids, EXPERTS)
        out = exchange.combine(experts(routed.x, routed.topk_weights, routed.topk_ids, local))
        # plain arrays: a tensor would travel as a handle to this process's memory, gone once it exits
        # Padding rows carry no expert (ids -1): the rows that reached this rank with work in them.
        rows = int((routed.topk_ids >= 0).any(1).sum())
        results.put((rank, (out.float().numpy(), str(out.dtype)), rows))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc(), -1))


def run_ranks(kind: str, tmp_path: Path) -> dict[int, tuple[torch.Tensor, int]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path / f'init-{kind}'}"
    procs = [ctx.Process(target=rank_main, args=(r, len(COUNTS), init, kind, results)) for r in range(len(COUNTS))]
    for p in procs:
        p.start()
    try:
        got = dict((rank, (out, rows)) for rank, out, rows in (results.get(timeout=120) for _ in procs))
    finally:  # no rank outlives the test, even one stuck in a collective
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [out for out, rows in got.values() if rows < 0]
    assert not errors, errors[0]
    return got


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["all-gather", "all-to-all"])
def test_exchange_sums_every_experts_output_for_each_replica(kind, tmp_path):
    got = run_ranks(kind, tmp_path)
    assert sorted(got) == list(range(len(COUNTS)))
    for rank, (out, _) in got.items():
        x, weights, ids = routed_tokens(rank)
        expected = experts(x, weights, ids, range(EXPERTS))
        values, dtype = out
        assert values.shape == tuple(expected.shape) and dtype == str(torch.bfloat16)
        torch.testing.assert_close(torch.from_numpy(values), expected.float(), atol=2e-2, rtol=2e-2)
    received = sum(rows for _, rows in got.values())
    if kind == "all-gather":
        assert received == len(COUNTS) * sum(COUNTS)  # every token on every rank
    else:  # a token reaches only the ranks holding one of its experts, once each
        expected_rows = sum(len({int(e) // (EXPERTS // len(COUNTS)) for e in row})
                            for r in range(len(COUNTS)) for row in routed_tokens(r)[2])
        assert received == expected_rows < len(COUNTS) * sum(COUNTS)


def routed_pairs(capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per replica, (tokens, ranks) masks: the ranks holding one of a token's experts, and of those the pairs
    that fit the rank's capacity (its first ``capacity`` tokens bound there, in token order)."""
    ranks, per_rank = len(COUNTS), EXPERTS // len(COUNTS)
    pairs = []
    for replica in range(ranks):
        ids = routed_tokens(replica)[2]
        wanted = torch.zeros(ids.shape[0], ranks, dtype=torch.bool).scatter_(1, ids // per_rank, True)
        pairs.append((wanted, wanted & (wanted.long().cumsum(0) <= capacity)))
    return pairs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_padded_exchange_is_exact_at_full_capacity_and_drops_overflow_in_token_order(factor, tmp_path):
    got = run_ranks(f"padded-{factor}", tmp_path)
    pairs = routed_pairs(max(1, math.ceil(factor * max(COUNTS))))
    dropped = sum(int((wanted & ~kept).sum()) for wanted, kept in pairs)
    assert (dropped == 0) if factor == 1.0 else (dropped > 0)
    per_rank = EXPERTS // len(COUNTS)
    for rank, (out, _) in got.items():
        x, weights, ids = routed_tokens(rank)
        kept = pairs[rank][1]
        # The sum of the expert outputs of the ranks each token's pairs were kept on.
        expected = torch.zeros(x.shape[0], HIDDEN)
        for r in range(len(COUNTS)):
            expected += experts(x, weights, ids, range(r * per_rank, (r + 1) * per_rank)).float() * kept[:, r:r + 1]
        values, dtype = out
        assert values.shape == tuple(expected.shape) and dtype == str(torch.bfloat16)
        torch.testing.assert_close(torch.from_numpy(values), expected, atol=3e-2, rtol=3e-2)
    assert sum(rows for _, rows in got.values()) == sum(int(kept.sum()) for _, kept in pairs)
