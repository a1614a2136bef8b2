"""The AMX kernels (bf16, CPUs with amx_bf16). Prefill attention: against fp64 and the op's brgemm path, the
running max's rescaling, head dims whose output does and does not fit the tiles, bit-identical results. Decode
(both products in tiles): against fp64, the torch path and the op's portable path, windows, chunk and split
edges, KV heads side by side in the lanes, fallbacks. Small-row linears: against fp64 and F.linear, batch invariance, threads, bad input, the routing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from batchgen.engine.backends.cpu import build, ops
from batchgen.engine.backends.cpu.features import cpu_features
from tests.test_cpu_decode import EDGE_CONTEXTS, assert_as_good_as_torch, decode_step, fp64_decode, torch_path
from tests.test_cpu_kernels import LENGTHS, PREFIXES, ROOT, attention_step, checked_rows, fp64_attention

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def amx():
    if "amx_bf16" not in cpu_features().flags:
        pytest.skip("no amx_bf16 on this CPU: bf16 attention runs in brgemm (test_cpu_kernels covers it)")
    assert build.load_kernels(), "the fused CPU kernels failed to build; see the warning above"
    assert ops.amx_tiles(), "built for an AMX CPU, but the AMX path is off"
    return ops


def run(q, k, v, k_cache, v_cache, meta, scale, use_amx: bool) -> torch.Tensor:
    return ops.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                       meta.block_tables, scale, amx=use_amx)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])  # output in 2 or 4 tiles (32, 64), or in L1 (96, 128)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-prefix"])
def test_amx_against_fp64_and_brgemm(amx, head_dim, group, cached):
    prefixes = PREFIXES if cached else [0] * len(LENGTHS)
    q, k, v, k_cache, v_cache, meta = attention_step(BF16, group, head_dim, prefixes)
    scale = head_dim ** -0.5
    tiles, brgemm = (run(q, k, v, k_cache, v_cache, meta, scale, use) for use in (True, False))
    rows = checked_rows(meta)
    exact = fp64_attention(q, k_cache, v_cache, meta, scale, rows)
    assert tiles.shape == brgemm.shape == q.shape and tiles.dtype == BF16 and exact.shape[0] == len(rows)
    tiles_err, brgemm_err = (tiles[rows].double() - exact).abs(), (brgemm[rows].double() - exact).abs()
    # The same arithmetic as the brgemm path but for the exponential's polynomial form and sums in another
    # order: its worst error up to a bf16 rounding step, and its mean within 10 %.
    ulp = torch.finfo(BF16).eps * exact.abs().max().item()
    assert tiles_err.max() <= brgemm_err.max() + ulp, (tiles_err.max(), brgemm_err.max())
    assert tiles_err.mean() <= 1.1 * brgemm_err.mean(), (tiles_err.mean(), brgemm_err.mean())


@pytest.mark.parametrize("head_dim", [64, 128])  # the output rescaled in the tiles, and in L1
def test_rising_scores_rescale_the_output(amx, head_dim):
    """Keys whose scores climb along the sequence (about 16 doublings every 64 keys, twice kRescaleLog2 per 32-key
    step) move every row's running max again and again: the output so far is rescaled each time."""
    q, k, v, k_cache, v_cache, meta = attention_step(BF16, 3, head_dim, PREFIXES, seed=1)
    q.fill_(16 / head_dim)  # every query alike: a key's score is the mean of its dims times 16 * scale
    flat = k_cache.view(-1, *k_cache.shape[2:])
    gen = torch.Generator().manual_seed(2)
    for i, (ctx, prefix) in enumerate(zip(meta.context_lens_list, PREFIXES)):
        pos = torch.arange(ctx)
        climb = pos[:, None, None] / 64 * 0.6875 * head_dim ** 0.5  # scores climb 11 nats every 64 keys
        keys = (climb + 0.01 * torch.randn(ctx, *flat.shape[1:], generator=gen)).to(BF16)
        flat[meta.block_tables[i].long()[pos // 16] * 16 + pos % 16] = keys
        k[meta.cu_seqlens_q[i]:meta.cu_seqlens_q[i + 1]] = keys[prefix:]  # the step's own rows, as stored
    scale = head_dim ** -0.5
    tiles, brgemm = (run(q, k, v, k_cache, v_cache, meta, scale, use) for use in (True, False))
    rows = checked_rows(meta)
    exact = fp64_attention(q, k_cache, v_cache, meta, scale, rows)
    ulp = torch.finfo(BF16).eps * exact.abs().max().item()
    assert not tiles.isnan().any()
    assert (tiles[rows].double() - exact).abs().max() <= (brgemm[rows].double() - exact).abs().max() + ulp


def test_bit_identical_across_runs_and_thread_counts(amx):
    """An item runs on one thread from start to end, so neither the thread count nor the run changes a bit."""
    q, k, v, k_cache, v_cache, meta = attention_step(BF16, 3, 64, PREFIXES)
    scale = 0.125
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 1, 2):
            torch.set_num_threads(n)
            outs.append(run(q, k, v, k_cache, v_cache, meta, scale, True))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_onednn_isa_cap_below_amx_turns_the_tiles_off(amx):
    """The tests simulate CPUs without AMX by capping oneDNN's ISA; the AMX path follows that cap."""
    script = ("from batchgen.engine.backends.cpu import build, ops\n"
              "assert build.load_kernels()\n"
              "print('amx', ops.amx_tiles())\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("amx False")


def decode(step, scale: float, use_amx: bool, window=None, softcap=None, split_keys=ops.SPLIT_KEYS):
    return ops.paged_decode_attention(step.q, step.k_cache, step.v_cache, step.tables, step.context_lens, scale,
                                      window, softcap, split_keys, amx=use_amx)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 8, 16])
@pytest.mark.parametrize("window", [None, 37, 100], ids=["full", "window-37", "window-100"])
def test_decode_scores_in_tiles_against_fp64_and_torch(amx, head_dim, group, window):
    """Contexts on either side of chunk (16), block and split (256) edges; windows that start inside a chunk,
    with the blocks before them freed (-1): never read."""
    step = decode_step(BF16, group, head_dim, contexts=EDGE_CONTEXTS, seed=5, kv_heads=2 if group < 8 else 1,
                       freed_before=window)
    scale = head_dim ** -0.5
    tiles, portable = decode(step, scale, True, window), decode(step, scale, False, window)
    exact, theirs = fp64_decode(step, scale, window), torch_path(step, scale, window)
    assert tiles.shape == step.q.shape and tiles.dtype == BF16
    assert_as_good_as_torch(tiles, theirs, exact, BF16)
    assert_as_good_as_torch(tiles, portable, exact, BF16)


def test_decode_splits_that_start_inside_a_chunk(amx):
    step = decode_step(BF16, 3, 64, seed=6)
    exact, theirs = fp64_decode(step, 0.125), torch_path(step, 0.125)
    for split_keys in (7, 40, 1000):
        assert_as_good_as_torch(decode(step, 0.125, True, split_keys=split_keys), theirs, exact, BF16)


def test_decode_in_tiles_is_bit_identical_across_runs_and_thread_counts(amx):
    step = decode_step(BF16, 3, 64, seed=7)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 1, 2):
            torch.set_num_threads(n)
            outs.append(decode(step, 0.125, True))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.parametrize("group, kv_heads, head_dim", [(3, 8, 64), (1, 20, 64), (4, 4, 128), (16, 2, 64)],
                         ids=["tasks-of-5-and-3", "tasks-of-16-and-4", "one-full-task", "a-head-a-task"])
def test_decode_rows_alone_and_in_a_batch_are_bit_identical(amx, group, kv_heads, head_dim):
    """A large step puts several KV heads side by side in a task's lanes (as many as fill 16); a row alone runs
    a head a task. Either way each head's output is the same to the bit, and as good as torch's."""
    step = decode_step(BF16, group, head_dim, contexts=[1, 17, 100, 256, 300, 700] * 2, seed=9, kv_heads=kv_heads)
    scale = head_dim ** -0.5
    together = decode(step, scale, True)
    assert_as_good_as_torch(together, torch_path(step, scale), fp64_decode(step, scale), BF16)
    for r in range(step.q.shape[0]):
        alone = ops.paged_decode_attention(step.q[r:r + 1], step.k_cache, step.v_cache, step.tables[r:r + 1],
                                           step.context_lens[r:r + 1], scale, None, None, ops.SPLIT_KEYS, amx=True)
        assert torch.equal(alone, together[r:r + 1]), f"row {r}"


@pytest.mark.parametrize("softcap, head_dim", [(5.0, 64), (None, 48)], ids=["softcap", "head-dim-48"])
def test_decode_outside_the_tiles_runs_the_portable_path(amx, softcap, head_dim):
    """Soft caps and head dims that are no multiple of 32 run the portable path, whatever ``amx`` says."""
    step = decode_step(BF16, 3, head_dim, seed=8)
    assert torch.equal(decode(step, 0.2, True, softcap=softcap), decode(step, 0.2, False, softcap=softcap))


# Rows around the linear's tiles (16 rows a group, 1, 2 or 4 groups) and outputs around its blocks (16, 4 a unit).
LINEAR_ROWS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 63, 64]


@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 96), (960, 576), (576, 1536), (4112, 64)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_amx_linear_against_fp64_and_f_linear(amx, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(BF16)
    bias = torch.randn(out_features, generator=gen).to(BF16) if with_bias else None
    x = torch.randn(max(LINEAR_ROWS), in_features, generator=gen).to(BF16)
    for rows in LINEAR_ROWS:
        out = torch.empty(rows, out_features, dtype=BF16)
        torch.ops.batchgen_cpu.amx_linear(x[:rows], weight, bias, out)
        exact = x[:rows].double() @ weight.double().T + (bias.double() if with_bias else 0)
        reference = torch.nn.functional.linear(x[:rows], weight, bias)
        # fp32 sums of exact bf16 products, rounded once to bf16 (as oneDNN does): at most its worst error
        # (a different summation order moves a rounding boundary by an ulp at most).
        ulp = torch.finfo(BF16).eps * exact.abs().max().item()
        assert (out.double() - exact).abs().max() <= (reference.double() - exact).abs().max() + ulp, rows
        # A row's result does not depend on the rows beside it (verification steps get decode's numbers).
        alone = torch.empty(1, out_features, dtype=BF16)
        torch.ops.batchgen_cpu.amx_linear(x[rows - 1:rows], weight, bias, alone)
        assert torch.equal(out[rows - 1], alone[0]), rows


def test_amx_linear_is_bit_identical_across_thread_counts(amx):
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(960, 576, generator=gen).to(BF16), torch.randn(40, 576, generator=gen).to(BF16)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(torch.empty(40, 960, dtype=BF16))
            torch.ops.batchgen_cpu.amx_linear(x, weight, None, outs[-1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_amx_linear_rejects_what_it_does_not_take(amx):
    weight, x = torch.randn(48, 64).to(BF16), torch.randn(65, 64).to(BF16)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        torch.ops.batchgen_cpu.amx_linear(x, weight, None, torch.empty(65, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match="N of 16"):
        torch.ops.batchgen_cpu.amx_linear(x[:4], weight[:40], None, torch.empty(4, 40, dtype=BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.batchgen_cpu.amx_linear(x[:4].float(), weight.float(), None, torch.empty(4, 48))


def test_amx_rows_method_routes_by_step_size(amx, monkeypatch):
    """Steps of up to AMX_ROWS rows take amx_linear; larger ones (prefill) F.linear on the same weight."""
    from batchgen.engine.backends.cpu import prepack, row_methods
    from batchgen.engine.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(96, 48, bias=True, params_dtype=BF16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    assert prepack.prepack_linears(torch.nn.Sequential(layer)) == 1
    assert layer.quant_method is row_methods.AMX_ROWS_METHOD
    calls = []
    real = torch.ops.batchgen_cpu.amx_linear
    monkeypatch.setattr(prepack.torch.ops.batchgen_cpu, "amx_linear", lambda *a: calls.append(a[0].shape) or real(*a),
                        raising=False)
    for rows in (1, row_methods.AMX_ROWS, row_methods.AMX_ROWS + 1):
        x = torch.randn(rows, 96).to(BF16)
        out = layer(x)
        ulp = torch.finfo(BF16).eps * out.abs().max().item()
        assert (out.float() - torch.nn.functional.linear(x, layer.weight, layer.bias).float()).abs().max() <= ulp
    strided = torch.randn(96, 8).to(BF16).T  # 8 rows whose inputs lie 8 apart: copied, then the op
    assert torch.equal(layer(strided), layer(strided.contiguous()))
    assert calls == [(1, 96), (row_methods.AMX_ROWS, 96), (8, 96), (8, 96)]
