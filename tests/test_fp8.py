"""FP8 formats, the activation quantization kernel and the w8a8 GEMM, under the Triton interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from batchgen.engine.backends.triton.common import INTERPRET  # noqa: E402
from batchgen.engine.backends.triton.fp8.format import (  # noqa: E402
    ACTIVATION_GROUP, FP8_DTYPE, FP8_MAX, MIN_AMAX, WEIGHT_BLOCK, dequantize_fp8, dequantize_fp8_weight,
    quantize_fp8, weight_scale_group,
)
from batchgen.engine.backends.triton.fp8.gemm import fp8_linear, w8a8_matmul  # noqa: E402
from batchgen.engine.backends.triton.fp8.quant import quantize_fp8_activation  # noqa: E402
from tests.kernel_references import ACCUM_EPS, e4m3_error  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, 0 to 448."""
    return torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).double()


# --- formats in torch -----------------------------------------------------------------------

@pytest.mark.parametrize("shape,group", [
    ((300, 200), WEIGHT_BLOCK),  # partial blocks on both edges
    ((3, 256, 128), WEIGHT_BLOCK),  # stacked experts
    ((96, 200), (1, 200)),  # per row
    ((96, 200), (96, 200)),  # per tensor
    ((7, 300), ACTIVATION_GROUP),
])
def test_quantize_round_trip_within_e4m3_bound(shape, group):
    x = torch.randn(*shape, dtype=torch.float64) * torch.logspace(-3, 2, shape[-1], dtype=torch.float64)
    q, scale = quantize_fp8(x, group)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (*shape[:-2], -(-shape[-2] // group[0]), -(-shape[-1] // group[1]))
    back = dequantize_fp8(q, scale, group, torch.float64)
    error = (back - x).abs()
    assert (error <= e4m3_error(x, scale, group)).all()
    assert error.max() > 0.1 * e4m3_error(x, scale, group).max()  # values did need rounding
    # Each group's largest magnitude lands on +-448 (up to the fp32 rounding of its scale).
    assert q.float().abs().max() == FP8_MAX


def test_quantize_zero_group_and_weight_layouts():
    w = torch.zeros(130, 260)
    w[:, :128] = torch.randn(130, 128)
    q, scale = quantize_fp8(w, WEIGHT_BLOCK)
    assert (scale[:, 2] == MIN_AMAX / FP8_MAX).all() and (q[:, 256:].float() == 0).all()
    assert weight_scale_group(q, scale) == WEIGHT_BLOCK
    assert weight_scale_group(q, torch.ones(130, 1)) == (1, 260)
    assert weight_scale_group(q, torch.ones(130)) == (1, 260)
    assert weight_scale_group(q, torch.ones(())) == (130, 260)
    assert weight_scale_group(q.expand(4, 130, 260), torch.ones(4)) == (130, 260)
    torch.testing.assert_close(dequantize_fp8_weight(q, scale, F32), w, atol=0.07, rtol=2 ** -4)
    with pytest.raises(ValueError, match="fits no known layout"):
        weight_scale_group(q, torch.ones(2, 2))
    with pytest.raises(ValueError, match="no row per expert"):
        weight_scale_group(q.expand(4, 130, 260), torch.ones(3))


# --- activation quantization kernel ---------------------------------------------------------

@pytest.mark.parametrize("width", [64, 128, 300, 1100])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_activation_quantization_matches_torch_bit_for_bit(width, dtype):
    x = (torch.randn(5, width, device=DEVICE) * torch.logspace(-4, 3, width, device=DEVICE)).to(dtype)
    x[1] = 0  # all-zero groups
    q, scale = quantize_fp8_activation(x)
    q_ref, scale_ref = quantize_fp8(x.cpu(), ACTIVATION_GROUP)
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_activation_quantization_rounds_ties_to_even_and_subnormals():
    # A group whose amax is 448 has scale 1: its values are rounded as they are. Midpoints between
    # neighbouring e4m3 values round to the even one; the interpreter's own cast gets these wrong.
    values = e4m3_values()
    midpoints = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, midpoints, -midpoints, midpoints * 0.999, midpoints * 1.001]).float()
    x = torch.nn.functional.pad(x, (0, -x.numel() % 127)).view(-1, 127)
    rows = torch.cat([torch.full((x.shape[0], 1), FP8_MAX), x], dim=1)
    q, scale = quantize_fp8_activation(rows.to(DEVICE))
    assert (scale == 1).all()
    assert torch.equal(q.cpu().view(torch.uint8), rows.to(FP8_DTYPE).view(torch.uint8))
    assert torch.equal(q.cpu()[:, 1:].flatten()[:127].double(), values)


def test_activation_quantization_keeps_leading_dims_and_strides():
    x = torch.randn(2, 3, 400, device=DEVICE)[..., :300]
    q, scale = quantize_fp8_activation(x)
    assert q.shape == (2, 3, 300) and scale.shape == (2, 3, 3)
    q_ref, scale_ref = quantize_fp8(x.reshape(6, 300).cpu(), ACTIVATION_GROUP)
    assert torch.equal(q.reshape(6, 300).cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert quantize_fp8_activation(x[:0])[1].shape == (0, 3, 3)


# --- w8a8 GEMM ------------------------------------------------------------------------------

def gemm_bound(a_hat: torch.Tensor, w_hat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """|kernel - a_hat @ w_hat^T| for dequantized (exact, fp64) operands: the kernel multiplies the
    same values, so only fp32 accumulation ((K + 3) steps of ACCUM_EPS, the scale products included)
    and the final rounding to ``out_dtype`` (one eps: the interpreter truncates to bf16) remain."""
    k = a_hat.shape[-1]
    accumulation = (k + 3) * ACCUM_EPS * (a_hat.abs() @ w_hat.abs().T)
    return accumulation + torch.finfo(out_dtype).eps * ((a_hat @ w_hat.T).abs() + accumulation)


def quantized_weight(n: int, k: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=DEVICE) / k ** 0.5
    q, scale = quantize_fp8(w.cpu(), {"block": WEIGHT_BLOCK, "row": (1, k), "tensor": (n, k)}[layout])
    scale = scale.reshape(()) if layout == "tensor" else scale
    return q.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("m,n,k,layout,out_dtype", [
    (1, 256, 384, "block", BF16),
    (37, 200, 300, "block", F32),  # ragged M, N and K
    (130, 128, 128, "block", F16),  # two row tiles
    (20, 96, 200, "row", BF16),
    (9, 64, 72, "tensor", F32),
    pytest.param(300, 384, 1000, "block", BF16, marks=pytest.mark.slow),
])
def test_w8a8_matmul_matches_dequantized_matmul(m, n, k, layout, out_dtype):
    a, a_scale = quantize_fp8_activation(3 * torch.randn(m, k, device=DEVICE))
    w, w_scale = quantized_weight(n, k, layout)
    out = w8a8_matmul(a, a_scale, w, w_scale, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    a_hat = dequantize_fp8(a.cpu(), a_scale.cpu(), ACTIVATION_GROUP, torch.float64)
    w_hat = dequantize_fp8_weight(w.cpu(), w_scale.cpu(), torch.float64)
    excess = (out.cpu().double() - a_hat @ w_hat.T).abs() - gemm_bound(a_hat, w_hat, out_dtype)
    assert excess.max() <= 0, f"over the bound by up to {excess.max().item():.3g}"


def test_fp8_linear_adds_bias_and_keeps_leading_dims():
    x = torch.randn(2, 5, 160, device=DEVICE).to(BF16)
    w, w_scale = quantized_weight(72, 160, "block")
    bias = torch.randn(72, device=DEVICE).to(BF16)
    out = fp8_linear(x, w, w_scale, bias)
    assert out.shape == (2, 5, 72) and out.dtype == BF16
    a, a_scale = quantize_fp8(x.reshape(10, 160).cpu(), ACTIVATION_GROUP)
    a_hat = dequantize_fp8(a, a_scale, ACTIVATION_GROUP, torch.float64)
    w_hat = dequantize_fp8_weight(w.cpu(), w_scale.cpu(), torch.float64)
    expected = a_hat @ w_hat.T + bias.cpu().double()
    bound = gemm_bound(a_hat, w_hat, BF16) + torch.finfo(BF16).eps * bias.cpu().double().abs()
    assert ((out.reshape(10, 72).cpu().double() - expected).abs() <= bound).all()
    assert fp8_linear(x[:, :0], w, w_scale).shape == (2, 0, 72)


def test_w8a8_matmul_rejects_bad_operands():
    a, a_scale = quantize_fp8_activation(torch.randn(4, 256, device=DEVICE))
    w, w_scale = quantized_weight(128, 256, "block")
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        w8a8_matmul(a.float(), a_scale, w, w_scale, BF16)
    with pytest.raises(ValueError, match="K differs"):
        w8a8_matmul(a[:, :128], a_scale, w, w_scale, BF16)
    with pytest.raises(ValueError, match="activation scales"):
        w8a8_matmul(a, a_scale[:, :1], w, w_scale, BF16)
    with pytest.raises(ValueError, match="fits no known layout"):
        w8a8_matmul(a, a_scale, w, torch.ones(2, 2, device=DEVICE), BF16)
