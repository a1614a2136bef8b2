"""The fused-MoE Triton kernel (float and FP8 experts) against the torch path, under the interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from batchgen.engine.backends.triton.common import INTERPRET  # noqa: E402
from batchgen.engine.backends.triton.fp8.format import WEIGHT_BLOCK, quantize_fp8  # noqa: E402
from batchgen.engine.backends.triton.fused_moe import fused_moe, moe_align_block_size  # noqa: E402
from tests.kernel_references import fp8_moe_reference_and_bound, reference_moe  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
F32, BF16 = torch.float32, torch.bfloat16
# fp32: accumulation order only. bf16: the kernel rounds the weighted expert outputs, the torch
# path the unweighted ones; a few bf16 ulps (2^-8 relative each) apart.
TOL = {F32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype = F32):
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def route(tokens: int, num_experts: int, top_k: int):
    """Softmax top-k routing over random logits: fp32 weights, int64 ids (T, k)."""
    logits = torch.randn(tokens, num_experts, device=DEVICE)
    return logits.softmax(-1).topk(top_k)


def check_moe(x, w13, w2, weights, ids):
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), reference_moe(x, w13, w2, weights, ids).float(), **TOL[x.dtype])


# --- alignment ------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 4, 1, 16), (37, 8, 2, 16), (50, 3, 3, 64),
                                                              (5, 64, 6, 16)])
def test_align_groups_pairs_by_expert_in_padded_runs(tokens, num_experts, top_k, block_m):
    ids = route(tokens, num_experts, top_k)[1].to(torch.int32)
    align = moe_align_block_size(ids, num_experts, block_m)
    num_pairs = tokens * top_k
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=num_experts)
    used = int(align.num_padded)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert align.sorted_ids.shape[0] >= used and align.sorted_ids.shape[0] % block_m == 0
    rows = align.sorted_ids[:used].cpu()
    assert sorted(rows[rows < num_pairs].tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (align.sorted_ids[used:] == num_pairs).all()
    tile_experts = align.expert_ids[:used // block_m].cpu().long()
    for tile, expert in enumerate(tile_experts.tolist()):
        pairs = rows[tile * block_m:(tile + 1) * block_m]
        pairs = pairs[pairs < num_pairs].long()
        assert len(pairs) > 0 and (ids.flatten().cpu()[pairs] == expert).all()
    # Experts without tokens get no tiles; the others as many as their rows need.
    assert torch.equal(torch.bincount(tile_experts, minlength=num_experts), (counts + block_m - 1) // block_m)


def test_pairs_of_other_expert_parallel_ranks_are_skipped():
    tokens, num_experts, top_k = 29, 8, 3
    w13, w2 = experts(num_experts, 64, 32)
    x = torch.randn(tokens, 64, device=DEVICE)
    weights, ids = route(tokens, num_experts, top_k)
    elsewhere = torch.rand(tokens, top_k, device=DEVICE) < 0.6
    elsewhere[0] = True  # a token none of whose experts is here
    align = moe_align_block_size(ids.masked_fill(elsewhere, -1), num_experts, 16, skip_negative=True)
    rows = align.sorted_ids[:int(align.num_padded)].cpu()
    assert sorted(rows[rows < tokens * top_k].tolist()) == (~elsewhere).flatten().nonzero().flatten().tolist()
    out = fused_moe(x, w13, w2, weights, ids.masked_fill(elsewhere, -1), skip_negative=True)
    expected = reference_moe(x, w13, w2, weights.masked_fill(elsewhere, 0.0), ids)
    torch.testing.assert_close(out, expected, **TOL[F32])
    assert torch.equal(out[0], torch.zeros_like(out[0]))


# --- float experts --------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,num_experts,top_k,dtype", [
    (1, 4, 1, F32),  # one token
    (37, 8, 2, F32),  # ragged
    (21, 16, 6, BF16),
    (70, 2, 2, F32),  # 70 rows per expert: 64-row tiles
    pytest.param(200, 64, 6, BF16, marks=pytest.mark.slow),
])
def test_fused_moe_matches_torch(tokens, num_experts, top_k, dtype):
    w13, w2 = experts(num_experts, 96, 40, dtype)  # H and I not multiples of the tiles
    weights, ids = route(tokens, num_experts, top_k)
    x = torch.randn(tokens, 96, device=DEVICE).to(dtype)
    check_moe(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_moe_routes_to_all_experts(dtype):
    w13, w2 = experts(5, 64, 32, dtype)
    weights, ids = route(9, 5, 5)
    check_moe(torch.randn(9, 64, device=DEVICE).to(dtype), w13, w2, weights, ids.to(torch.int32))


def test_fused_moe_one_expert_takes_every_token_others_none():
    w13, w2 = experts(6, 64, 32)
    x = torch.randn(20, 64, device=DEVICE)
    ids = torch.full((20, 2), 4, device=DEVICE)
    ids[:, 1] = 1  # experts 0, 2, 3 and 5 get nothing
    weights = torch.rand(20, 2, device=DEVICE)
    check_moe(x, w13, w2, weights, ids)
    align = moe_align_block_size(ids, 6, 16)
    assert set(align.expert_ids[:int(align.num_padded) // 16].tolist()) == {1, 4}


def test_fused_moe_strided_input_and_no_tokens():
    w13, w2 = experts(4, 64, 32)
    weights, ids = route(7, 4, 2)
    x = torch.randn(7, 100, device=DEVICE)[:, 10:74]  # rows 100 apart
    check_moe(x, w13, w2, weights, ids)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 64)


def test_fused_moe_rejects_bad_input():
    w13, w2 = experts(4, 64, 32)
    weights, ids = route(3, 4, 2)
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="must be \\(E, 2I, H\\)"):
        fused_moe(x, w13[:, :, :32], w2, weights, ids)
    with pytest.raises(ValueError, match="both be \\(T, k\\)"):
        fused_moe(x, w13, w2, weights[:2], ids)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="x's dtype"):
        fused_moe(x.to(BF16), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="w13_scale and w2_scale"):
        fused_moe(x, quantize_fp8(w13, WEIGHT_BLOCK)[0], w2, weights, ids)


# --- FP8 experts ----------------------------------------------------------------------------

def fp8_experts(num_experts: int, hidden: int, inter: int, layout: str):
    """Random experts quantized to FP8 with one scale per 128x128 block, per row or per expert."""
    quantized = []
    for w in experts(num_experts, hidden, inter):
        n, k = w.shape[1:]
        q, scale = quantize_fp8(w, {"block": WEIGHT_BLOCK, "row": (1, k), "expert": (n, k)}[layout])
        quantized += [q, scale.flatten() if layout == "expert" else scale]
    return quantized


@pytest.mark.parametrize("tokens,num_experts,top_k,inter,layout,dtype", [
    (1, 4, 2, 128, "block", F32),
    (37, 8, 2, 128, "block", BF16),  # ragged tokens; H = 96 is a partial K group
    (19, 4, 4, 64, "row", F32),  # every expert used
    (12, 4, 1, 128, "expert", BF16),
])
def test_fp8_fused_moe_within_error_bound(tokens, num_experts, top_k, inter, layout, dtype):
    w13, w13_scale, w2, w2_scale = fp8_experts(num_experts, 96, inter, layout)
    weights, ids = route(tokens, num_experts, top_k)
    x = (2 * torch.randn(tokens, 96, device=DEVICE)).to(dtype)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale, w2_scale)
    assert out.shape == x.shape and out.dtype == dtype
    expected, bound = fp8_moe_reference_and_bound(x, w13, w13_scale, w2, w2_scale, weights, ids)
    # Tight in fp32 (~1e-3 of the output); in bf16 the rounded intermediate often lands on the other
    # side of an e4m3 rounding boundary, so the bound is wider there but still far below the output.
    assert bound.max() < 0.5 * expected.abs().max()
    excess = (out.double() - expected).abs() - bound
    assert excess.max() <= 0, f"over the bound by up to {excess.max().item():.3g}"
