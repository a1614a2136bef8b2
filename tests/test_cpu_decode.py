"""The fused CPU paged decode attention against fp64 and the torch backend; bit-identical across threads and runs."""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch

from batchgen.engine.backends.cpu import build, ops
from batchgen.engine.backends.cpu.attention import CpuAttentionBackend
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.torch.attention import TorchAttentionBackend, paged_decode

F32, BF16 = torch.float32, torch.bfloat16
BLOCK = 16
# Mixed contexts: mostly short, a few long (one past 16 splits), block and split edges included.
CONTEXTS = [1, 2, 15, 16, 17, 100, 255, 256, 257, 600, 1000, 4096]


@pytest.fixture(scope="module")
def kernels():
    if cpu_features().isa is None or shutil.which(build.compiler()) is None:
        pytest.skip("no AVX2 CPU or no C++ compiler: the engine runs torch's ops (test_cpu_kernels tests that)")
    assert build.load_kernels(), "the fused CPU kernels failed to build; see the warning above"
    return ops


@dataclass
class DecodeStep:
    q: torch.Tensor  # (B, Hq, D), a strided view of a fused qkv as the model makes it
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # int32 (B, widest), -1 past each row's blocks
    context_lens: torch.Tensor  # int32 (B,)


def decode_step(dtype, group: int, head_dim: int, contexts=CONTEXTS, seed: int = 0, kv_heads: int = 2,
                freed_before: int | None = None) -> DecodeStep:
    """One decode query per context, the caches' blocks shuffled, with unused blocks (holes) between them.
    ``freed_before``: each row's blocks wholly before its last ``freed_before`` keys are -1 in its table (freed
    by a sliding window), so an op reading them fails. Values are bf16-representable, so the fp32 and bf16
    steps hold the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    heads = group * kv_heads
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16().to(dtype)
    q = qkv[:, :heads * head_dim].view(len(contexts), heads, head_dim)
    per_row = [-(-c // BLOCK) for c in contexts]
    total = sum(per_row)
    ids = torch.randperm(2 * total, generator=gen)[:total].int()  # half the cache's blocks never used: holes
    tables = torch.full((len(contexts), max(per_row) + 2), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_row):
        tables[i, :n] = ids[start:start + n]
        if freed_before is not None:
            tables[i, :max(0, contexts[i] - freed_before) // BLOCK] = -1
        start += n
    shape = (2 * total, BLOCK, kv_heads, head_dim)
    k_cache, v_cache = (3 * torch.randn(shape, generator=gen).bfloat16().to(dtype) for _ in range(2))
    return DecodeStep(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32))


def fp64_decode(step: DecodeStep, scale: float, window: int | None = None, softcap: float | None = None):
    """Softmax attention in float64, row by row from the blocks its table names."""
    group = step.q.shape[1] // step.k_cache.shape[2]
    out = torch.empty(step.q.shape, dtype=torch.float64)
    for i, ctx in enumerate(step.context_lens.tolist()):
        first = 0 if window is None else max(0, ctx - window)
        positions = torch.arange(first, ctx)
        blocks = step.tables[i, positions // BLOCK].long()
        keys, values = (c[blocks, positions % BLOCK].double().repeat_interleave(group, 1).transpose(0, 1)
                        for c in (step.k_cache, step.v_cache))  # (Hq, n, D)
        scores = (keys @ step.q[i].double()[:, :, None]).squeeze(-1) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = (scores.softmax(-1)[:, None, :] @ values).squeeze(1)
    return out


def fused(kernels, step: DecodeStep, scale: float, window=None, softcap=None, split_keys=ops.SPLIT_KEYS):
    return kernels.paged_decode_attention(step.q, step.k_cache, step.v_cache, step.tables, step.context_lens, scale,
                                          window, softcap, split_keys)


def torch_path(step: DecodeStep, scale: float, window=None, softcap=None):
    return paged_decode(step.q, step.k_cache, step.v_cache, step.tables, step.context_lens,
                        int(step.context_lens.max()), scale, sliding_window=window, softcap=softcap)


def assert_as_good_as_torch(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor, dtype) -> None:
    """The worst error within 1.5x the torch path's (plus a rounding step of the dtype: both round in other
    orders, so their worst elements differ by that much either way), and no worse on average."""
    ours_err, theirs_err = (ours.double() - exact).abs(), (theirs.double() - exact).abs()
    ulp = torch.finfo(dtype).eps * exact.abs().max().item()
    assert ours_err.max() <= 1.5 * theirs_err.max() + ulp, (ours_err.max(), theirs_err.max())
    assert ours_err.mean() <= 1.25 * theirs_err.mean() + 1e-7, (ours_err.mean(), theirs_err.mean())


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_against_fp64_and_torch(kernels, dtype, head_dim, group):
    # The op computes bf16 without oneDNN (fp32 math on converted rows), so it runs on AVX2 CPUs too.
    step = decode_step(dtype, group, head_dim, kv_heads=2 if group < 8 else 1)
    scale = head_dim ** -0.5
    ours = fused(kernels, step, scale)
    assert ours.shape == step.q.shape and ours.dtype == dtype
    assert_as_good_as_torch(ours, torch_path(step, scale), fp64_decode(step, scale), dtype)


@pytest.mark.parametrize("window, softcap", [(100, None), (None, 5.0), (37, 2.0), (5000, None)],
                         ids=["window", "softcap", "window+softcap", "window-over-context"])
@pytest.mark.parametrize("head_dim", [24, 64])  # 24: Gemma 2's tiny test model; no whole vector steps
def test_windows_and_soft_caps(kernels, window, softcap, head_dim):
    """Freed blocks (-1 in the tables) before the window are never read."""
    step = decode_step(F32, 3, head_dim, seed=1, freed_before=window)
    scale = 0.3
    ours = fused(kernels, step, scale, window, softcap)
    assert_as_good_as_torch(ours, torch_path(step, scale, window, softcap), fp64_decode(step, scale, window, softcap),
                            F32)


# Around the op's edges: chunks of 16 rows (paged.h's kChunk), blocks of 16, splits of 256.
EDGE_CONTEXTS = [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 255, 256, 257, 4095, 4096]


@pytest.mark.parametrize("dtype, group, head_dim, window, softcap", [
    (F32, 2, 40, None, None),  # one score tile of 2 heads, a value tile of 2; 40: a vector step past whole pairs
    (BF16, 4, 128, None, None),  # tiles filled exactly
    (F32, 5, 72, 21, None),  # 2 + 2 + 1 score heads, 4 + 1 value heads; windows that start inside a chunk
    (BF16, 7, 20, 37, 3.0),  # 2 + 2 + 2 + 1 and 4 + 3; 20: less than a pair of vectors, then a scalar tail
    (BF16, 3, 96, 21, 3.0),  # AVX512-BF16's dot tiles: values in 64 dims then 32; keys in pairs, odd counts
], ids=["g2-d40", "g4-d128-bf16", "g5-d72-window", "g7-d20-bf16-window-softcap", "g3-d96-bf16-window-softcap"])
def test_tile_and_chunk_edges(kernels, dtype, group, head_dim, window, softcap):
    """Group sizes that do not fill a register tile, head dims that are no multiple of one, context lengths
    (and window starts) on either side of chunk, block and split edges."""
    step = decode_step(dtype, group, head_dim, contexts=EDGE_CONTEXTS, seed=4, kv_heads=2, freed_before=window)
    scale = head_dim ** -0.5
    ours = fused(kernels, step, scale, window, softcap)
    assert_as_good_as_torch(ours, torch_path(step, scale, window, softcap), fp64_decode(step, scale, window, softcap),
                            dtype)


def test_split_size_changes_nothing_but_rounding(kernels):
    step = decode_step(F32, 3, 64, seed=2)
    exact, theirs = fp64_decode(step, 0.125), torch_path(step, 0.125)
    # Within a split the output sums key after key: splits much longer than the default lose that bound.
    for split_keys in (7, 64, 1000):
        assert_as_good_as_torch(fused(kernels, step, 0.125, split_keys=split_keys), theirs, exact, F32)


def test_decode_rejects_bad_input(kernels):
    step = decode_step(F32, 3, 64, contexts=[5, 40])
    with pytest.raises(RuntimeError, match="the caches one"):
        kernels.paged_decode_attention(step.q, step.k_cache.bfloat16(), step.v_cache, step.tables,
                                       step.context_lens, 0.125)
    with pytest.raises(RuntimeError, match="outside 1.."):
        kernels.paged_decode_attention(step.q, step.k_cache, step.v_cache, step.tables,
                                       torch.tensor([5, 10_000], dtype=torch.int32), 0.125)
    holed = step.tables.clone()
    holed[1, 1] = -1
    with pytest.raises(RuntimeError, match="reads block -1 outside the cache"):
        kernels.paged_decode_attention(step.q, step.k_cache, step.v_cache, holed, step.context_lens, 0.125)


def meta_for(step: DecodeStep) -> AttentionMetadata:
    ctx = step.context_lens.tolist()
    rows = torch.arange(len(ctx) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(ctx).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(cu_seqlens_q=rows, cu_seqlens_k=cu_k, context_lens=step.context_lens, max_seqlen_q=1,
                             max_seqlen_k=max(ctx), slot_mapping=torch.zeros(len(ctx), dtype=torch.int64),
                             block_tables=step.tables, query_lens=[1] * len(ctx), context_lens_list=ctx)


def test_backend_sends_decode_steps_to_the_op_and_others_to_torch(kernels, monkeypatch):
    step = decode_step(F32, 3, 64, contexts=[3, 70, 300], seed=3)
    meta, backend = meta_for(step), CpuAttentionBackend()
    calls = []
    monkeypatch.setattr(ops, "paged_decode_attention", lambda *a, **k: calls.append(a) or torch.zeros(1))
    backend.forward(step.q, None, None, step.k_cache, step.v_cache, meta, 0.125, sliding_window=50, softcap=3.0)
    assert len(calls) == 1
    monkeypatch.undo()
    # fp16 is not the op's: the torch backend computes it.
    half = DecodeStep(step.q.half(), step.k_cache.half(), step.v_cache.half(), step.tables, step.context_lens)
    got = backend.forward(half.q, None, None, half.k_cache, half.v_cache, meta, 0.125)
    expected = TorchAttentionBackend().forward(half.q, None, None, half.k_cache, half.v_cache, meta, 0.125)
    assert torch.equal(got, expected)


def verify_meta(step: DecodeStep, counts: list[int]) -> AttentionMetadata:
    """The step's rows as sequences of several new tokens each: sequence i owns the next counts[i] rows of
    step.q and its context is the context length of its last row (the rows' lengths count up by one)."""
    assert sum(counts) == len(step.context_lens)
    ends = torch.tensor(counts).cumsum(0)
    ctx = [int(step.context_lens[e - 1]) for e in ends]
    tables = step.tables[ends - 1]
    cu_q = torch.tensor([0, *ends.tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(ctx).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, context_lens=torch.tensor(ctx, dtype=torch.int32),
                             max_seqlen_q=max(counts), max_seqlen_k=max(ctx),
                             slot_mapping=torch.zeros(sum(counts), dtype=torch.int64), block_tables=tables,
                             query_lens=counts, context_lens_list=ctx)


def verify_step(counts: list[int], last_contexts: list[int], window=None, dtype=F32) -> DecodeStep:
    """Rows whose contexts count up to each sequence's last one, every row of a sequence on one block table."""
    contexts = [c - n + 1 + j for n, c in zip(counts, last_contexts, strict=True) for j in range(n)]
    step = decode_step(dtype, 3, 64, contexts=contexts, seed=5)
    ends = torch.tensor(counts).cumsum(0)
    tables = step.tables[ends - 1].repeat_interleave(torch.tensor(counts), 0)
    if window is not None:  # blocks wholly before the first new token's window are freed (the block manager's rule)
        firsts = [c - n + 1 for n, c in zip(counts, last_contexts)]
        for row, first in enumerate(torch.tensor(firsts).repeat_interleave(torch.tensor(counts)).tolist()):
            tables[row, :max(0, first - window) // BLOCK] = -1
    return DecodeStep(step.q, step.k_cache, step.v_cache, tables, step.context_lens)


@pytest.mark.parametrize("window, softcap", [(None, None), (40, 3.0)], ids=["plain", "window+softcap"])
def test_verification_steps_run_the_decode_op_row_by_row(kernels, window, softcap):
    """A step of a few new tokens per sequence (a speculative verification, a short prompt: the 5-token one
    has no cached prefix) runs in the decode op: each row attends causally, and computes bit for bit what a
    decode step at its position computes."""
    counts, last = [1, 5, 3, 8, 5], [70, 300, 257, 1000, 5]
    step = verify_step(counts, last, window)
    meta = verify_meta(step, counts)
    got = CpuAttentionBackend().forward(step.q, None, None, step.k_cache, step.v_cache, meta, 0.125,
                                        sliding_window=window, softcap=softcap)
    assert torch.equal(got, fused(kernels, step, 0.125, window, softcap))
    for row in (0, 3, 12, 21):  # one row alone as its own decode step
        alone = DecodeStep(step.q[row:row + 1], step.k_cache, step.v_cache, step.tables[row:row + 1],
                           step.context_lens[row:row + 1])
        assert torch.equal(got[row:row + 1], fused(kernels, alone, 0.125, window, softcap))
    assert_as_good_as_torch(got, torch_path(step, 0.125, window, softcap),
                            fp64_decode(step, 0.125, window, softcap), F32)


def test_steps_of_more_queries_run_the_prefill_op(kernels, monkeypatch):
    from batchgen.engine.backends.cpu.attention import MAX_DECODE_QUERIES

    counts = [2, MAX_DECODE_QUERIES + 1]
    step = verify_step(counts, [50, 90])
    meta = verify_meta(step, counts)
    assert ops.usable_dtypes(), "the prefill op does not run here"  # tried once, before it is replaced
    calls = []
    monkeypatch.setattr(ops, "varlen_causal_attention", lambda *a, **k: calls.append(a) or torch.zeros(1))
    monkeypatch.setattr(ops, "paged_decode_attention", lambda *a, **k: pytest.fail("the decode op ran"))
    CpuAttentionBackend().forward(step.q, None, None, step.k_cache, step.v_cache, meta, 0.125)
    assert len(calls) == 1


# Shapes for the determinism tests: GQA groups, head dims, windows and caps, a long context over many splits.
STRESS = [(F32, 1, 64, None, None), (F32, 3, 64, 100, None), (F32, 8, 128, None, 4.0), (BF16, 3, 64, None, None),
          (F32, 3, 24, 37, 2.0), (BF16, 5, 72, 21, 3.0), (F32, 7, 20, None, None), (BF16, 8, 96, 100, 4.0)]


def stress_runs(kernels, threads: int, repeats: int) -> list[list[torch.Tensor]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for _ in range(repeats):
            outs = []
            for seed, (dtype, group, head_dim, window, softcap) in enumerate(STRESS):
                step = decode_step(dtype, group, head_dim, seed=seed, kv_heads=1 if group == 8 else 2)
                outs.append(fused(kernels, step, head_dim ** -0.5, window, softcap))
            runs.append(outs)
        return runs
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_row_alone_equals_the_row_among_many(kernels, dtype):
    """Few rows take one KV head per task, many rows all KV heads of a split per task (and prefetch the next
    task's rows): either way each head's sums run in one order, so a row's output is bit for bit the same."""
    contexts = [5, 300, 17, 64, 1, 700, 33, 129] * 2
    step = decode_step(dtype, 3, 64, contexts=contexts, seed=11, kv_heads=4)
    together = fused(kernels, step, 0.125, window=200, softcap=3.0)
    for i in (0, 1, 5, 15):
        alone = DecodeStep(step.q[i:i + 1], step.k_cache, step.v_cache, step.tables[i:i + 1],
                           step.context_lens[i:i + 1])
        assert torch.equal(fused(kernels, alone, 0.125, window=200, softcap=3.0)[0], together[i])


def test_bit_identical_across_thread_counts_and_runs(kernels):
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to compare against")
    reference = stress_runs(kernels, 1, 1)[0]
    for run in stress_runs(kernels, 2, 3) + stress_runs(kernels, torch.get_num_threads(), 2):
        for got, expected in zip(run, reference, strict=True):
            assert torch.equal(got, expected)


def other_fused_ops(kernels) -> list[torch.Tensor]:
    """The prefill op over test_cpu_kernels' step, and the elementwise ops on a decode-sized batch."""
    from batchgen.engine.layers.rotary import cos_sin_cache
    from tests.test_cpu_kernels import PREFIXES, attention_step

    outs = []
    for group, head_dim in ((3, 64), (8, 128)):
        q, k, v, k_cache, v_cache, meta = attention_step(F32, group, head_dim, PREFIXES)
        outs.append(kernels.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                                    meta.block_tables, head_dim ** -0.5))
    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(2, 64, 576, generator=gen)
    weight = torch.rand(576, generator=gen)
    outs.extend(kernels.rms_norm(x, weight, 1e-5, residual))
    qkv = torch.randn(64, 15 * 64, generator=gen)
    kernels.apply_rotary(qkv[:, :576].view(64, 9, 64), qkv[:, 576:768].view(64, 3, 64),
                         torch.randint(0, 512, (64,), generator=gen), cos_sin_cache(64, 1e5, None, 512))
    outs += [qkv, kernels.silu_and_mul(torch.randn(64, 3072, generator=gen))]
    return outs


def test_other_fused_ops_bit_identical_across_thread_counts(kernels):
    """The prefill op hands its work items out dynamically and sizes its query blocks by the thread count;
    neither may change a result."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to compare against")
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = other_fused_ops(kernels)
        torch.set_num_threads(previous)
        for _ in range(3):
            for got, expected in zip(other_fused_ops(kernels), reference, strict=True):
                assert torch.equal(got, expected)
    finally:
        torch.set_num_threads(previous)

