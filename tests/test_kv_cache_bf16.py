"""The bf16 KV cache under fp32 models: the setting, and the CPU store and decode op over bf16 rows. A step over a
bf16 prefix, latent attention over bf16 rows, the prefix store's namespaces, and whole models against
transformers with K and V rounded to bf16 are test_kv_cache_fp8.py's tests, with bf16 among their cases."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM
from batchgen.engine.backends.cpu import ops
from batchgen.engine.config import EngineConfig
from tests.engine_helpers import model_runner
from tests.test_cpu_decode import (F32, BF16, DecodeStep, assert_as_good_as_torch, decode_step, fp64_decode, fused,
                                   torch_path)
from tests.test_cpu_decode import kernels  # noqa: F401  (the fixture)


def test_setting_halves_an_fp32_cache_and_refuses_fp16_models(tiny_model):
    assert EngineConfig(model="m", dtype="float32", kv_cache_dtype="bfloat16").kv_torch_dtype == BF16
    assert EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="bfloat16").kv_torch_dtype == BF16
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs a model dtype of bfloat16 or float32, "
                                         "this one is float16"):
        EngineConfig(model="m", dtype="float16", kv_cache_dtype="bfloat16")
    blocks = {}
    for kv in ("auto", "bfloat16"):
        runner = model_runner(LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=8 << 20,
                                  kv_cache_dtype=kv))
        blocks[kv] = runner.num_blocks
        assert all(t.dtype == (F32 if kv == "auto" else BF16) for layer in runner.kv_cache for t in layer)
    assert blocks["bfloat16"] == 2 * blocks["auto"]


@pytest.mark.parametrize("group, head_dim, window, softcap", [(3, 64, None, None), (8, 128, None, None),
                                                              (5, 72, 100, None), (3, 32, 37, 2.0)])
def test_bf16_rows_compute_what_their_fp32_values_do(kernels, group, head_dim, window, softcap):
    """The op over bf16 caches with fp32 queries is bit for bit the op over the same values in fp32, and as good
    as torch's path against fp64."""
    step = decode_step(F32, group, head_dim, kv_heads=1 if group == 8 else 2, freed_before=window)
    narrow = DecodeStep(step.q, step.k_cache.bfloat16(), step.v_cache.bfloat16(), step.tables, step.context_lens)
    wide = DecodeStep(step.q, narrow.k_cache.float(), narrow.v_cache.float(), step.tables, step.context_lens)
    scale = head_dim ** -0.5
    ours = fused(kernels, narrow, scale, window, softcap)
    assert ours.dtype == F32 and torch.equal(ours, fused(kernels, wide, scale, window, softcap))
    assert_as_good_as_torch(ours, torch_path(narrow, scale, window, softcap), fp64_decode(wide, scale, window, softcap),
                            F32)


def test_the_op_refuses_an_fp32_cache_under_bf16_queries(kernels):
    step = decode_step(BF16, 3, 64, contexts=[5, 40])
    with pytest.raises(RuntimeError, match="or bf16 under fp32 q"):
        kernels.paged_decode_attention(step.q, step.k_cache.float(), step.v_cache.float(), step.tables,
                                       step.context_lens, 0.125)
    k = torch.zeros(2, 2, 64, dtype=BF16)
    assert not ops.store_kv(k, k, step.k_cache.float(), step.v_cache.float(), torch.arange(2))


def bf16_edges() -> torch.Tensor:
    """fp32 values at every kind of bf16 rounding edge: ties to even both ways, a bit either side of a tie,
    subnormals, values that round up to inf, infinities and NaN; both signs."""
    base = torch.tensor([1.0, 1.0078125, 3.0, 1e-3, 7e4, 1e-39, 1e-41], dtype=F32).view(torch.int32)
    ties = torch.cat([base | 0x8000, (base + 0x10000) | 0x8000, (base | 0x8000) + 1, (base | 0x8000) - 1,
                      base | 0x7FFF, base]).view(F32)
    special = torch.tensor([torch.finfo(F32).max, 3.3961e38, float("inf"), float("nan"), 0.0, 1e-45])
    values = torch.cat([ties, special])
    return torch.cat([values, -values])


def test_the_cpu_store_writes_the_bytes_torch_s_cast_would(kernels):
    """Random rows over twelve decades and every rounding edge, a row width with a scalar tail (3 x 24); slots of
    -1 (padding) write nothing."""
    if F32 not in ops.usable_dtypes():
        pytest.skip("the store op does not run fp32 here")
    gen = torch.Generator().manual_seed(9)
    k, v = (torch.randn(40, 3, 24, generator=gen).mul(torch.logspace(-7, 5, 40)[:, None, None]) for _ in range(2))
    edges = bf16_edges()
    k.view(-1)[:len(edges)] = edges
    v.view(-1)[-len(edges):] = edges
    caches = [torch.randn(8, 16, 3, 24, generator=gen).bfloat16() for _ in range(2)]
    before = [c.clone() for c in caches]
    slots = torch.randperm(128, generator=gen)[:40]
    slots[3] = -1
    assert ops.store_kv(k, v, *caches, slots)
    kept = torch.ones(128, dtype=torch.bool)
    kept[slots[slots >= 0]] = False
    written = slots >= 0
    for cache, rows, old in zip(caches, (k, v), before, strict=True):
        flat = cache.view(128, 3, 24)
        got, want = flat[slots[written]], rows[written].bfloat16()
        numbers = ~want.isnan()  # a NaN's sign and payload are the vector unit's: any NaN is NaN
        assert torch.equal(got.isnan(), ~numbers) and numbers.sum() > 0
        assert torch.equal(got[numbers].view(torch.int16), want[numbers].view(torch.int16))
        assert torch.equal(flat[kept].view(torch.int16), old.view(128, 3, 24)[kept].view(torch.int16))
