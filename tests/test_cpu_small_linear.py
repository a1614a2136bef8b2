"""The fused small-row fp32 linear (``batchgen_cpu.small_linear``): against fp64, batch-invariant rows,
bit-identical across thread counts, and the layer that routes steps to it or to ``F.linear``."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.backends.cpu import build
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.cpu.prepack import prepack_linears
from batchgen.engine.backends.cpu.row_methods import SMALL_ROWS, SMALL_ROWS_METHOD


@pytest.fixture(scope="module")
def op():
    if cpu_features().isa is None or shutil.which(build.compiler()) is None:
        pytest.skip("no AVX2 CPU or no C++ compiler: the engine runs torch's ops (test_cpu_kernels tests that)")
    assert build.load_kernels(), "the fused CPU kernels failed to build; see the warning above"
    return torch.ops.batchgen_cpu.small_linear


def small_linear(op, x, weight, bias=None):
    out = torch.empty(x.shape[0], weight.shape[0])
    op(x, weight, bias, out)
    return out


# (K, N): SmolLM2's projections and LM-head-like widths, K with a tail past the vector width, N not a
# multiple of the 4-row tile, and K a multiple of 1,024 (W's rows a multiple of 4 KB apart).
SHAPES = [(576, 960), (1536, 576), (2048, 30), (64, 49), (37, 13), (8, 4), (3, 7)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_matches_fp64_at_every_small_row_count(op, k, n):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for m in [*range(1, 67), 127, 128, 129, SMALL_ROWS - 1, SMALL_ROWS, SMALL_ROWS + 1]:  # 64 rows at a time
        x = torch.randn(m, k, generator=gen)
        expected = x.double() @ weight.double().T + bias.double()
        got = small_linear(op, x, weight, bias)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * k ** 0.5)
        torch.testing.assert_close(small_linear(op, x, weight), (x.double() @ weight.double().T).float(),
                                   rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_rows_result_does_not_depend_on_the_other_rows(op):
    """Each output is summed in one order whatever the layout: row i of an M-row step equals that row alone,
    bit for bit (so a verification step's rows give plain decode's numbers). Widths with tails past every tile."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(303, 579, generator=gen)
    x = torch.randn(SMALL_ROWS, 579, generator=gen)
    alone = torch.cat([small_linear(op, x[i:i + 1], weight) for i in range(len(x))])
    for m in range(1, SMALL_ROWS + 1):
        assert torch.equal(small_linear(op, x[:m], weight), alone[:m]), m


def test_bit_identical_across_thread_counts(op):
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to compare against")
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(3075, 579, generator=gen), torch.randn(3075, generator=gen)
    previous = torch.get_num_threads()
    for rows in (1, 3, 7, 23, 33, SMALL_ROWS):  # both layouts: one group, three, five, pairs of groups
        x = torch.randn(rows, 579, generator=gen)
        try:
            torch.set_num_threads(1)
            reference = small_linear(op, x, weight, bias)
            torch.set_num_threads(previous)
            for _ in range(5):
                assert torch.equal(small_linear(op, x, weight, bias), reference), rows
        finally:
            torch.set_num_threads(previous)


def test_strided_rows_and_bad_input(op):
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(20, 32, generator=gen)
    wide = torch.randn(4, 48, generator=gen)
    x = wide[:, 8:40]  # rows 48 apart
    torch.testing.assert_close(small_linear(op, x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        small_linear(op, x.to(torch.bfloat16), weight.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        small_linear(op, x, weight.T.contiguous().T)
    with pytest.raises(RuntimeError, match="bias"):
        small_linear(op, x, weight, torch.randn(19))


def test_layers_route_small_steps_to_the_op_and_stay_themselves(op, monkeypatch):
    from batchgen.engine.layers.linear import ColumnParallelLinear, ParallelLMHead

    layer = ColumnParallelLinear(40, 24, bias=True)
    head = ParallelLMHead(50, 40)
    for t in (layer.weight, layer.bias, head.weight):
        torch.nn.init.normal_(t)
    model = torch.nn.Sequential(layer, head, torch.nn.Linear(8, 8))
    assert prepack_linears(model) == 2  # our projection and LM head; torch's own Linear is not ours
    assert model[0] is layer and model[1] is head  # same modules, weights and attributes: only the method changed
    assert layer.quant_method is SMALL_ROWS_METHOD and head.quant_method is SMALL_ROWS_METHOD
    calls = []
    monkeypatch.setattr(torch.ops.batchgen_cpu, "small_linear", lambda *a: (calls.append(a[0].shape[0]), op(*a)))
    for rows in (1, SMALL_ROWS, SMALL_ROWS + 1):
        x = torch.randn(1, rows, 40)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-4)
    assert calls == [1, 1, SMALL_ROWS, SMALL_ROWS]


def test_rows_whose_inputs_are_not_contiguous_still_take_the_op(op, monkeypatch):
    """Latent attention hands o_proj its values as a permuted view (tokens innermost): the layer copies the few
    rows and runs the op, so they get the same bits as contiguous rows (F.linear sums in another order)."""
    from batchgen.engine.layers.linear import RowParallelLinear

    gen = torch.Generator().manual_seed(11)
    layer = RowParallelLinear(4 * 512, 96, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 4 * 512, generator=gen))
    assert prepack_linears(torch.nn.Sequential(layer)) == 1
    per_head = torch.randn(4, 512, 24, generator=gen)  # (heads, v, tokens), as W_UV @ out^T leaves them
    strided = per_head.permute(2, 0, 1).flatten(1)  # (tokens, heads x v): a view, inputs 24 apart
    assert strided.stride(-1) != 1
    calls = []
    monkeypatch.setattr(torch.ops.batchgen_cpu, "small_linear", lambda *a: (calls.append(a[0].stride()), op(*a)))
    got = layer(strided)
    assert calls == [(4 * 512, 1)]
    assert torch.equal(got, layer(strided.contiguous()))
    exact = F.linear(strided.double(), layer.weight.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-3)


def test_routers_take_the_op_so_a_tokens_experts_do_not_depend_on_its_step(op):
    """A router's logits are its method's multiply: fp32 routers take the small-row op (F.linear's sums depend on
    the row count) and stay routers. A token's logits, weights and experts are then its own, bit for bit, in any
    step; a float32 router in a bf16 model (DeepSeek's) gets its bf16 input cast, as ``F.linear``'s method does."""
    from batchgen.engine.layers.linear import ReplicatedLinear
    from batchgen.engine.layers.moe import TopKRouter

    gen = torch.Generator().manual_seed(13)
    hidden, experts = 320, 24
    routers = [TopKRouter(hidden, experts, top_k=4, renormalize=True, params_dtype=torch.float32)
               for _ in range(2)]
    for router in routers:
        with torch.no_grad():
            router.weight.copy_(torch.randn(experts, hidden, generator=gen))
    model = torch.nn.Sequential(*routers)
    assert prepack_linears(model) == 2
    assert all(model[i] is router and router.quant_method is SMALL_ROWS_METHOD for i, router in enumerate(routers))
    x = torch.randn(SMALL_ROWS, hidden, generator=gen)
    for router, rows in ((routers[0], x), (routers[1], x.to(torch.bfloat16))):
        logits = ReplicatedLinear.forward(router, rows)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits.double(), rows.double() @ router.weight.double().T, rtol=1e-5, atol=1e-4)
        weights, ids = router(rows)
        assert weights.shape == ids.shape == (SMALL_ROWS, 4)
        for m in (1, 3, 7, 9, 64, 65, SMALL_ROWS):
            assert torch.equal(ReplicatedLinear.forward(router, rows[:m]), logits[:m]), m
            some_weights, some_ids = router(rows[-m:])
            assert torch.equal(some_ids, ids[-m:]) and torch.equal(some_weights, weights[-m:]), m


@pytest.mark.parametrize("bias", [False, True])
def test_wide_layers_multiply_larger_steps_slice_by_slice(op, bias, monkeypatch):
    """Past SMALL_ROWS rows a layer of WIDE_OUTPUTS or more outputs (the vocabulary head) multiplies slice by
    slice of COLUMN_SLICE outputs, the last one partial: the product of F.linear, to fp32 rounding."""
    from batchgen.engine.backends.cpu.row_methods import COLUMN_SLICE, WIDE_OUTPUTS
    from batchgen.engine.layers.linear import ColumnParallelLinear

    outputs = WIDE_OUTPUTS + COLUMN_SLICE // 2 + 3
    layer = ColumnParallelLinear(24, outputs, bias=bias)
    for t in layer.parameters():
        torch.nn.init.normal_(t)
    assert prepack_linears(torch.nn.Sequential(layer)) == 1 and layer.quant_method is SMALL_ROWS_METHOD
    x = torch.randn(2, SMALL_ROWS, 24, dtype=torch.float64)
    name = "addmm" if bias else "mm"
    slices, multiply = [], getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a, out: (slices.append(out.shape[1]), multiply(*a, out=out)))
    got = layer(x[:, :SMALL_ROWS // 2 + 3].float())  # SMALL_ROWS + 6 rows
    assert slices == [COLUMN_SLICE] * (outputs // COLUMN_SLICE) + [outputs % COLUMN_SLICE]
    exact = F.linear(x[:, :SMALL_ROWS // 2 + 3], layer.weight.double(), None if not bias else layer.bias.double())
    assert got.shape == exact.shape
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


# (batch, heads, K, N): DeepSeek's absorbed shapes in miniature (nope 32 -> rank 64, rank 64 -> v 40), rows of the
# few-row layout, past one chunk of 64, no rows, and more threads than heads.
BMM_SHAPES = [(5, 4, 32, 64), (7, 3, 64, 40), (70, 2, 37, 13), (0, 2, 32, 48), (9, 1, 130, 17)]


@pytest.mark.parametrize("batch,heads,k,n", BMM_SHAPES)
def test_per_head_products_against_fp64_and_each_head_alone(op, batch, heads, k, n):
    """``small_bmm`` (x (B, H, K) with strided rows, as the query's nope slice is): against fp64, each head bit for
    bit the small-row linear of that head alone, and the same bits for any thread count."""
    gen = torch.Generator().manual_seed(batch * 31 + k)
    weight = torch.randn(heads, n, k, generator=gen)
    x = torch.randn(batch, heads, k + 6, generator=gen)[..., 3:3 + k]
    previous, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(torch.empty(batch, heads, n))
            torch.ops.batchgen_cpu.small_bmm(x, weight, outs[-1])
    finally:
        torch.set_num_threads(previous)
    exact = torch.einsum("bhk,hnk->bhn", x.double(), weight.double())
    assert outs[0].shape == exact.shape
    torch.testing.assert_close(outs[0].double(), exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
    for h in range(heads):
        assert torch.equal(outs[0][:, h], small_linear(op, x[:, h], weight[h])), h
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_per_head_products_refuse_wrong_arguments(op):
    bmm = torch.ops.batchgen_cpu.small_bmm
    weight = torch.randn(2, 48, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        bmm(torch.zeros(3, 2, 10), weight, torch.empty(3, 2, 48))
    with pytest.raises(RuntimeError, match="weight must be"):
        bmm(torch.zeros(3, 4, 8), weight, torch.empty(3, 4, 48))
    with pytest.raises(RuntimeError, match="weight must be"):
        bmm(torch.zeros(3, 2, 8), weight.transpose(1, 2).contiguous().transpose(1, 2), torch.empty(3, 2, 48))
    with pytest.raises(RuntimeError, match="float32"):
        bmm(torch.zeros(3, 2, 8, dtype=torch.bfloat16), weight, torch.empty(3, 2, 48))
    with pytest.raises(RuntimeError, match="out of shape"):
        bmm(torch.zeros(3, 2, 8), weight, torch.empty(3, 2, 47))


def test_latent_layers_take_the_per_head_products_up_to_latent_rows(op, monkeypatch):
    """fp32 W_UK and W_UV (views of one weight, as the latent layer holds them): the products against bmm's, the
    values in (B, H, v) rows; steps past LATENT_ROWS rows keep bmm."""
    from batchgen.engine.backends.cpu.row_methods import LATENT_ROWS, SmallRowsProducts
    from batchgen.engine.layers.mla import BMM_PRODUCTS

    gen = torch.Generator().manual_seed(9)
    heads, nope, v, rank = 3, 32, 40, 64

    class Layer:
        w = torch.randn(heads, nope + v, rank, generator=gen)
        w_uk, w_uv = w[:, :nope], w[:, nope:]

    products = SmallRowsProducts(Layer.w_uk)
    calls = []
    real = torch.ops.batchgen_cpu.small_bmm
    monkeypatch.setattr(torch.ops.batchgen_cpu, "small_bmm", lambda *a: (calls.append(a[0].shape[0]), real(*a)))
    for batch in (1, LATENT_ROWS, LATENT_ROWS + 1):
        q_nope = torch.randn(batch, heads, nope + 16, generator=gen)[..., :nope]
        latent = torch.randn(batch, heads, rank, generator=gen)
        query, values = products.query(Layer, q_nope), products.values(Layer, latent)
        assert values.is_contiguous() or batch > LATENT_ROWS
        for ours, reference in ((query, BMM_PRODUCTS.query(Layer, q_nope)), (values, BMM_PRODUCTS.values(Layer, latent))):
            assert ours.shape == reference.shape
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-4)
    assert calls == [1, 1, LATENT_ROWS, LATENT_ROWS]
