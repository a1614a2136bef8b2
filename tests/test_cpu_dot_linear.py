"""The bf16 linear on CPUs with AVX512-BF16 (``batchgen_cpu.dot_linear`` over ``pack_dot_weight``'s blocks): as close
to an fp64 product as torch's bf16 linear, rows that do not depend on the step's other rows or the thread count,
and the layers that take it; its gated form (``dot_gated_linear``: a SwiGLU MLP's gate|up and activation in one op);
its per-head form (``dot_bmm``) for the latent attention's absorbed products."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.backends.cpu import prepack
from batchgen.engine.backends.cpu.prepack import DOT_BLOCK, PrepackedLinear, dot_linear_runs, pack_dot_weight

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def dot_tiles():
    if not dot_linear_runs():
        pytest.skip("no AVX512-BF16 dot tiles here (or an AMX CPU, whose layers take amx_linear and oneDNN)")


def layer(n: int, k: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(BF16), torch.randn(n, generator=gen).to(BF16) if bias else None


# (N, K): SmolLM2's projections, N past a whole block (577) or under one (13, 50), K of one pair or a few.
SHAPES = [(960, 576), (576, 1536), (577, 64), (50, 34), (13, 2), (96, 130)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_as_close_to_fp64_as_torch(n, k, bias):
    weight, b = layer(n, k, bias, seed=n * 7 + k)
    linear = PrepackedLinear(weight, b)
    assert linear.dot
    gen = torch.Generator().manual_seed(k)
    assert linear(torch.empty(0, k, dtype=BF16)).shape == (0, n)
    for m in (1, 2, 7, 8, 9, 23, 64, 65, 200):  # whole tiles of 8 rows and tails
        x = torch.randn(m, k, generator=gen).to(BF16)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        ours, torch_bf16 = linear(x).double(), F.linear(x, weight, b).double()
        assert ours.shape == exact.shape
        # Both round the same fp32 sums to bf16 (added in another order): one bf16 step of the output apart.
        ulp = exact.abs().clamp_min(1e-3) * 2 ** -7
        assert ((ours - exact).abs() <= 2 * ulp + (torch_bf16 - exact).abs()).all(), (m, (ours - exact).abs().max())


def test_each_row_is_the_same_whatever_the_step_and_thread_count():
    """A row's output is one lane's sum over its inputs in order: the same alone, among 2,000 rows (several chunks
    of rows), at a tile tail, or on one thread."""
    weight, b = layer(200, 4096, True, seed=1)  # 4,096 inputs: 384 rows a chunk, so 2,000 rows take six
    linear = PrepackedLinear(weight, b)
    x = torch.randn(2000, 4096, generator=torch.Generator().manual_seed(2)).to(BF16)
    full = linear(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x), full)
    finally:
        torch.set_num_threads(threads)
    for rows in (slice(0, 1), slice(383, 390), slice(1995, 2000)):
        assert torch.equal(linear(x[rows]), full[rows])
    for _ in range(3):
        assert torch.equal(linear(x), full)


def test_packed_layout_and_strided_rows():
    weight, _ = layer(50, 6, False, seed=3)
    packed = pack_dot_weight(weight)
    assert packed.shape == (2, 3, DOT_BLOCK, 2)
    assert torch.equal(packed[1, 2, 1], weight[DOT_BLOCK + 1, 4:6])  # block 1, input pair 2, its column 1
    assert not packed[1, :, 50 - DOT_BLOCK:].any()  # the columns past N are zero
    x = torch.randn(5, 12).to(BF16)[:, ::2]  # rows whose inputs are not contiguous
    torch.testing.assert_close(PrepackedLinear(weight, None)(x), F.linear(x, weight), rtol=1e-2, atol=1e-2)


def test_odd_inputs_take_onednn_and_wrong_arguments_are_refused():
    weight, b = layer(48, 7, True, seed=4)
    odd = PrepackedLinear(weight, b)
    assert not odd.dot  # pairs of inputs: an odd K stays with oneDNN's prepacked linear
    x = torch.randn(3, 7).to(BF16)
    torch.testing.assert_close(odd(x), F.linear(x, weight, b), rtol=1e-2, atol=1e-2)
    packed = pack_dot_weight(layer(48, 8, False, seed=5)[0])
    op = torch.ops.batchgen_cpu.dot_linear
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.zeros(2, 10, dtype=BF16), packed, None, torch.empty(2, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.zeros(2, 8), packed, None, torch.empty(2, 48))
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.zeros(2, 8, dtype=BF16), packed, torch.zeros(48, dtype=BF16), torch.empty(2, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match="out must"):
        op(torch.zeros(2, 8, dtype=BF16), packed, None, torch.empty(2, 97, dtype=BF16))


def test_bf16_projections_take_it():
    from batchgen.engine.layers.linear import ReplicatedLinear

    model = torch.nn.Sequential(ReplicatedLinear(64, 40, bias=True, params_dtype=BF16))
    torch.nn.init.normal_(model[0].weight)
    torch.nn.init.normal_(model[0].bias)
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    assert prepack.prepack_linears(model) == 1
    assert isinstance(model[0], PrepackedLinear) and model[0].dot
    x = torch.randn(4, 64).to(BF16)
    torch.testing.assert_close(model(x), F.linear(x, weight, bias), rtol=1e-2, atol=1e-2)


# (I, K): SmolLM2's MLP, I past a whole block and not a multiple of 16 (100), under one block, K of one pair.
GATED_SHAPES = [(1536, 576), (100, 64), (16, 34), (40, 2)]


@pytest.mark.parametrize("intermediate,k", GATED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gated_op_is_the_projection_then_silu_and_mul(intermediate, k, bias):
    """``dot_gated_linear`` over gate and up blocks in turn gives what ``dot_linear``'s gate|up then the
    ``silu_and_mul`` op give, bit for bit (both round gate, up and their product alike), at any row count;
    the packed layer's plain forward is the gate|up projection."""
    from batchgen.engine.backends.cpu import ops

    weight, b = layer(2 * intermediate, k, bias, seed=intermediate + k)
    plain, gated = PrepackedLinear(weight, b), prepack.PrepackedGateUp(weight, b)
    gen = torch.Generator().manual_seed(k)
    assert gated.activated(torch.empty(0, k, dtype=BF16)).shape == (0, intermediate)
    for m in (1, 7, 9, 64, 200):
        x = torch.randn(m, k, generator=gen).to(BF16)
        reference, ours = ops.silu_and_mul(plain(x)), gated.activated(x)
        assert ours.shape == reference.shape == (m, intermediate)
        assert torch.equal(ours, reference), (m, (ours.float() - reference.float()).abs().max())
        assert torch.equal(gated(x), plain(x))


def test_gated_packing_and_thread_counts():
    weight, _ = layer(2 * 50, 4, False, seed=6)
    packed = prepack.pack_dot_gated(weight, 50)
    assert packed.shape == (4, 2, DOT_BLOCK, 2)  # gate block 0, up block 0, gate block 1, up block 1
    assert torch.equal(packed[1, 1, 3], weight[50 + 3, 2:4])  # up block 0, input pair 1, its column 3
    assert torch.equal(packed[2, 0, 1], weight[DOT_BLOCK + 1, 0:2])  # gate block 1, its column 1 (gate row 49)
    assert not packed[3, :, 50 - DOT_BLOCK:].any()
    big, _ = layer(2 * 96, 4096, False, seed=7)  # 2,000 rows of 4,096 inputs: six chunks
    gated = prepack.PrepackedGateUp(big, None)
    x = torch.randn(2000, 4096, generator=torch.Generator().manual_seed(8)).to(BF16)
    full = gated.activated(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gated.activated(x), full)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(gated.activated(x[1995:]), full[1995:])


def test_gated_op_refuses_wrong_arguments():
    packed = prepack.pack_dot_gated(layer(2 * 48, 8, False, seed=9)[0], 48)  # (2, 4, 48, 2)
    op = torch.ops.batchgen_cpu.dot_gated_linear
    x = torch.zeros(2, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.zeros(2, 10, dtype=BF16), packed, None, torch.empty(2, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(x.float(), packed, None, torch.empty(2, 48))
    with pytest.raises(RuntimeError, match="out must"):
        op(x, packed, None, torch.empty(2, 49, dtype=BF16))
    with pytest.raises(RuntimeError, match="out must"):
        op(x, packed[:1], None, torch.empty(2, 1, dtype=BF16))  # a gate block without its up block
    with pytest.raises(RuntimeError, match="bias"):
        op(x, packed, torch.zeros(48), torch.empty(2, 48, dtype=BF16))


def test_swiglu_mlps_take_the_gated_op():
    """``prepack_weights`` gives a bf16 SwiGLU MLP the packed gate|up and the one-op activation, its output the
    same as the packed layers' and the silu_and_mul op's; a GeGLU MLP keeps the two steps."""
    from batchgen.engine.backends.cpu import ops
    from batchgen.engine.backends.select import make_kernel_set
    from batchgen.engine.layers.mlp import PROJECT_THEN_ACTIVATE, GatedMLP

    kernels = make_kernel_set("cpu")
    swiglu, geglu = (GatedMLP(64, 96, kernels, activation=a).to(BF16) for a in ("silu", "gelu_tanh"))
    gen = torch.Generator().manual_seed(10)
    for mlp in (swiglu, geglu):
        for p in mlp.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen))
    gate_up, down = swiglu.gate_up_proj.weight.detach().clone(), swiglu.down_proj.weight.detach().clone()
    model = torch.nn.Sequential(swiglu, geglu)
    x = torch.randn(5, 64, generator=gen).to(BF16)
    before = geglu(x)
    prepack.prepack_weights(model)
    assert isinstance(swiglu.gate_up_proj, prepack.PrepackedGateUp) and swiglu.gate_up_activation is prepack.DOT_GATE_UP
    assert type(geglu.gate_up_proj) is PrepackedLinear and geglu.gate_up_activation is PROJECT_THEN_ACTIVATE
    expected = PrepackedLinear(down, None)(ops.silu_and_mul(PrepackedLinear(gate_up, None)(x)))
    assert torch.equal(swiglu(x), expected)
    torch.testing.assert_close(geglu(x), before, rtol=2e-2, atol=2e-2)


# (batch, heads, K, N): DeepSeek's absorbed shapes in miniature (nope 32 -> rank 64, rank 64 -> v 40: N past a
# whole block), one row, no rows, N under a block.
BMM_SHAPES = [(5, 4, 32, 64), (7, 3, 64, 40), (1, 2, 130, 13), (0, 2, 32, 48)]


@pytest.mark.parametrize("batch,heads,k,n", BMM_SHAPES)
def test_per_head_products_against_fp64_and_bmm(batch, heads, k, n):
    """``dot_bmm`` (x (B, H, K) with strided rows, as the query's nope slice is) against bmm per head, and the latent
    layer's products over packed W_UK and W_UV against torch's."""
    from batchgen.engine.layers.mla import BMM_PRODUCTS

    gen = torch.Generator().manual_seed(batch * 31 + k)
    weight = torch.randn(heads, n, k, generator=gen).to(BF16)
    x = torch.randn(batch, heads, k + 6, generator=gen).to(BF16)[..., 3:3 + k]
    out = torch.empty(batch, heads, n, dtype=BF16)
    torch.ops.batchgen_cpu.dot_bmm(x, prepack.pack_dot_experts(weight), out)
    exact = torch.einsum("bhk,hnk->bhn", x.double(), weight.double())
    theirs = torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1).double()
    ulp = exact.abs().clamp_min(1e-3) * 2 ** -7
    assert out.shape == exact.shape
    assert ((out.double() - exact).abs() <= 2 * ulp + (theirs - exact).abs()).all()

    class Layer:  # W_UK (H, nope, R), W_UV (H, v, R) as views of one weight, as the latent layer holds them
        w = torch.randn(heads, k + n, k, generator=gen).to(BF16)
        w_uk, w_uv = w[:, :k], w[:, k:]

    products = prepack.DotAbsorbedProducts(Layer.w_uk, Layer.w_uv)
    q_nope, latent = x, torch.randn(batch, heads, k, generator=gen).to(BF16)
    for ours, reference in ((products.query(Layer, q_nope), BMM_PRODUCTS.query(Layer, q_nope)),
                            (products.values(Layer, latent), BMM_PRODUCTS.values(Layer, latent))):
        assert ours.shape == reference.shape
        scale = reference.abs().max().item() if reference.numel() else 0.0
        torch.testing.assert_close(ours.float(), reference.float(), rtol=2 ** -7, atol=2 ** -7 * scale)


def test_per_head_products_refuse_wrong_arguments():
    packed = prepack.pack_dot_experts(torch.randn(2, 48, 8).to(BF16))
    op = torch.ops.batchgen_cpu.dot_bmm
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.zeros(3, 2, 10, dtype=BF16), packed, torch.empty(3, 2, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.zeros(3, 4, 8, dtype=BF16), packed, torch.empty(3, 4, 48, dtype=BF16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.zeros(3, 2, 8), packed, torch.empty(3, 2, 48))
    with pytest.raises(RuntimeError, match="out must"):
        op(torch.zeros(3, 2, 8, dtype=BF16), packed, torch.empty(3, 2, 97, dtype=BF16))
