"""The KV cache's memory: the CPU budget from the available memory, and CPU caches backed as their blocks are used."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core import kv_cache
from batchgen.engine.core.kv_cache import CPU_KV_SHARE, CPU_MIN_KV_BYTES, KVLayout, kv_budget_bytes, lazy_zeros

CPU = torch.device("cpu")
GIB = 1 << 30


def engine(**kw) -> EngineConfig:
    return EngineConfig(model="m", **kw)


def test_cpu_budget_is_a_share_of_the_available_memory_less_activations():
    reserve = 300 << 20
    assert kv_budget_bytes(engine(), CPU, reserve, available=24 * GIB) == int(24 * GIB * CPU_KV_SHARE) - reserve
    # A small machine keeps the floor; a configured budget wins over both.
    assert kv_budget_bytes(engine(), CPU, reserve, available=4 * GIB) == CPU_MIN_KV_BYTES
    assert kv_budget_bytes(engine(kv_cache_memory=GIB), CPU, reserve, available=64 * GIB) == GIB
    # Worker processes on one host split the share.
    two_by_two = engine(tensor_parallel_size=2, data_parallel_size=2)
    assert kv_budget_bytes(two_by_two, CPU, reserve, available=64 * GIB) == int(64 * GIB * CPU_KV_SHARE / 4) - reserve


def test_cpu_budget_falls_back_to_the_floor_where_memory_is_unknown(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_memory", lambda: None)
    assert kv_budget_bytes(engine(), CPU, 0) == CPU_MIN_KV_BYTES


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/meminfo")
def test_available_memory_reads_the_os_figure():
    available = kv_cache.available_memory()
    total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    assert available is not None and 0 < available <= total


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(platform.system() != "Linux", reason="counts page faults")
def test_cpu_cache_is_zeros_that_take_memory_only_as_blocks_are_written():
    layout = KVLayout((((3, 64), (3, 64)),) * 4)
    before = faults()
    cache = layout.allocate(2048, 16, torch.float32, CPU)  # 8 tensors of 24 MiB
    allocated = faults() - before
    pages = 8 * 2048 * 16 * 3 * 64 * 4 // 4096
    assert allocated < pages // 20, f"{allocated} page faults allocating {pages} pages"
    k = cache[2][0]
    assert k.shape == (2048, 16, 3, 64) and k.dtype == torch.float32 and k.is_contiguous()
    assert not k[1000].any()
    block = torch.arange(16 * 3 * 64, dtype=torch.float32).view(16, 3, 64)  # 12 KiB
    before = faults()
    k[7] = block
    assert faults() - before < 64  # its pages (and the copy's own), not the cache's
    assert torch.equal(k[7], block)
    assert not k[6].any() and not k[8].any() and not cache[2][1][7].any()


def test_lazy_zeros_of_every_dtype_and_of_no_elements():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8):
        x = lazy_zeros((5, 3), dtype)
        assert x.dtype == dtype and x.shape == (5, 3) and not x.any()
        x[1, 2] = 1
        assert x.sum().item() == 1
    assert lazy_zeros((0, 4), torch.float32).shape == (0, 4)
