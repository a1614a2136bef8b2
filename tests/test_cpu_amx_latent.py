"""MLA's latent decode in AMX tiles (bf16, CPUs with amx_bf16): against fp64, the torch MLA backend and the op's
portable path, over chunk, block and split edges, head groups past 16, running maxes that move between key
blocks, stale rows beside the context, shapes outside the tiles, and bit-identical results."""
from __future__ import annotations

import pytest
import torch

from tests.test_cpu_amx import amx  # noqa: F401 - a fixture
from tests.test_cpu_decode import BLOCK, EDGE_CONTEXTS, assert_as_good_as_torch
from tests.test_cpu_mla_decode import DEEPSEEK, latent_step, fp64_latent, torch_path

BF16 = torch.bfloat16
NARROW = (64, 32)  # a latent of two 32-dim steps: the values' last 64-dim group is partial
# Around 16-row sub-blocks, 32-key chunks, 256-key blocks and splits.
LATENT_CONTEXTS = [c for c in EDGE_CONTEXTS if c <= 1000] + [300, 511, 512, 513]


def latent(ops, step, scale: float, use_amx: bool, split_keys: int | None = None) -> torch.Tensor:
    return ops.latent_decode_attention(step.q, step.cache, step.tables, step.context_lens, step.value_dim, scale,
                                       split_keys or ops.SPLIT_KEYS, amx=use_amx)


@pytest.mark.parametrize("heads", [1, 5, 16, 33])
@pytest.mark.parametrize("dims", [DEEPSEEK, NARROW], ids=["deepseek", "narrow"])
def test_latent_in_tiles_against_fp64_torch_and_portable(amx, heads, dims):
    step = latent_step(BF16, heads, dims, LATENT_CONTEXTS, seed=heads)
    scale = 0.1
    tiles, portable = latent(amx, step, scale, True), latent(amx, step, scale, False)
    exact = fp64_latent(step, scale)
    assert tiles.shape == (len(LATENT_CONTEXTS), heads, dims[0]) and tiles.dtype == BF16
    assert_as_good_as_torch(tiles, torch_path(step, scale), exact, BF16)
    assert_as_good_as_torch(tiles, portable, exact, BF16)


def test_splits_that_start_inside_a_chunk_and_span_blocks(amx):
    """Splits of 7 and 40 keys start inside 16-row sub-blocks; one of 1000 walks several 256-key blocks; the
    longest contexts split into many items."""
    step = latent_step(BF16, 16, DEEPSEEK, [5, 77, 600, 1000, 4095, 4096], seed=11)
    exact, theirs = fp64_latent(step, 0.1), torch_path(step, 0.1)
    for split_keys in (7, 40, 1000):
        assert_as_good_as_torch(latent(amx, step, 0.1, True, split_keys), theirs, exact, BF16)


def test_a_rising_max_rescales_the_output_between_blocks(amx):
    """Later keys score far higher (rows scaled up along the context): each 256-key block moves every head's
    max by more than the lazy rescale's margin, so the output so far is rescaled, more than once."""
    step = latent_step(BF16, 16, DEEPSEEK, [1000], seed=12)
    positions = torch.arange(1000)
    rows = step.tables[0, positions // BLOCK].long(), positions % BLOCK
    rising = (1 + positions / 100).view(-1, 1)
    step.cache[rows] = (step.cache[rows].float() * rising).to(BF16)
    step.q.copy_(step.q.abs())  # scores grow with the rows' scale
    exact = fp64_latent(step, 0.05)
    for split_keys in (256, 1000):
        assert_as_good_as_torch(latent(amx, step, 0.05, True, split_keys), torch_path(step, 0.05), exact, BF16)


def test_stale_rows_beside_the_context_are_never_used(amx):
    """NaN in the cache's rows past each context (the rest of its last block): the score tiles multiply those
    rows, but no probability or value of theirs reaches the output (their values are packed as zeros)."""
    step = latent_step(BF16, 16, DEEPSEEK, [17, 100, 250], seed=13)
    clean = latent(amx, step, 0.1, True, split_keys=40)
    for row, ctx in enumerate(step.context_lens.tolist()):
        last_block = step.tables[row, (ctx - 1) // BLOCK].long()
        step.cache[last_block, ctx % BLOCK or BLOCK:] = float("nan")
    dirty = latent(amx, step, 0.1, True, split_keys=40)
    assert torch.isfinite(dirty).all() and torch.equal(dirty, clean)


def test_latent_in_tiles_is_bit_identical_across_runs_and_thread_counts(amx):
    step = latent_step(BF16, 20, DEEPSEEK, [1, 33, 300, 777], seed=14)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 1, 2):
            torch.set_num_threads(n)
            outs.append(latent(amx, step, 0.1, True, split_keys=64))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.parametrize("dims", [(48, 16), (32, 8)], ids=["values-of-48", "rows-of-40"])
def test_latent_outside_the_tiles_runs_the_portable_path(amx, dims):
    """Values that are no multiple of 32 dims, or rows no multiple of 32, run the portable path."""
    step = latent_step(BF16, 16, dims, [5, 70, 300], seed=15)
    assert torch.equal(latent(amx, step, 0.2, True), latent(amx, step, 0.2, False))
