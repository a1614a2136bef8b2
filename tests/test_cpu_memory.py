"""Host memory for CPU steps: freed activations reused, not faulted in afresh; weights moved onto huge pages."""
from __future__ import annotations

import mmap
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from batchgen.engine import LLM
from batchgen.engine.backends.cpu import prepack
from batchgen.engine.backends.cpu.memory import HUGE_PAGE, mapped_zeros, weights_on_huge_pages
from tests.engine_helpers import model_runner
from tests.tiny_models import build_tiny_model

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

STEPS = 20
# Steps of activations 4-30 MB, allocated and freed out of order; prints the minor page faults of the last STEPS
# steps beyond the pages the process newly holds after them (a heap that grows to a new peak faults its new pages
# in once: Python's own small allocations land between the blocks, and by the hash seed a later step extended the
# heap by 26 MB in a third of runs), and the pages the steps wrote. glibc left to its defaults raises its mmap
# threshold as large blocks are freed, at times far enough to keep them all, so the comparison fixes its initial
# thresholds instead.
SCRIPT = f"""
import resource, sys, torch
from batchgen.engine.backends.cpu.memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, glibc, keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:
    assert glibc().mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1 and glibc().mallopt(M_TRIM_THRESHOLD, 128 << 10) == 1
def step(i):
    n = (1 + i % 5) << 20
    a = torch.empty(n).fill_(1); b = torch.empty(n // 2).fill_(1); del a; c = torch.empty(3 * n // 2).fill_(1)
    return 12 * n // 4096
def resident_pages():
    return int(open("/proc/self/statm").read().split()[1])
for i in range(5):
    step(i)
faults, resident = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, resident_pages()
pages = sum(step(i) for i in range({STEPS}))
grown = max(0, resident_pages() - resident)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults - grown, pages)
"""


def page_faults(mode: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    faults, pages = map(int, done.stdout.split()[-2:])
    return faults, pages


@glibc
def test_freed_blocks_are_reused_without_page_faults():
    (default, pages), (kept, _) = page_faults("default"), page_faults("keep")
    assert kept < pages // 100, f"{kept} page faults for {pages} pages written into reused blocks"
    # under glibc's initial thresholds every block is mapped afresh and each page written faults in
    assert default > max(pages // 2, 10 * kept), f"{default} faults under glibc's thresholds, {kept} with the settings"


def huge_pages_advisable() -> bool:
    """Whether madvise(MADV_HUGEPAGE) takes here: Linux with transparent huge pages not set to "never"."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return hasattr(mmap, "MADV_HUGEPAGE") and setting.exists() and "[never]" not in setting.read_text()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(3000, 96)
        self.proj = nn.Linear(96, 500)
        with torch.inference_mode():  # as the CPU kernels' prepacking makes its packed weights
            self.proj.weight = nn.Parameter(torch.randn(500, 96), requires_grad=False)
        self.head = nn.Linear(96, 3000, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules
        self.norm = nn.Parameter(torch.randn(96))  # below the size moved
        self.register_buffer("table", torch.randn(200, 96))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.norm + self.table[ids % 200]
        return self.head(h) + self.proj(h).sum(-1, keepdim=True)


def test_weights_move_onto_huge_pages_with_their_values_and_ties():
    torch.manual_seed(0)
    model = Tied().requires_grad_(False)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.randint(0, 3000, (7,))
    expected = model(ids)
    small = {"norm": model.norm.data_ptr(), "bias": model.proj.bias.data_ptr()}
    moved = weights_on_huge_pages(model)
    if not huge_pages_advisable():
        assert moved == 0
        return
    big = [model.embed.weight, model.proj.weight, model.table]
    assert moved >= sum(t.numel() * 4 for t in big)
    # one mapping, from a 2 MiB boundary; the small ones (under 64 KiB) stay where they were
    assert len({t.untyped_storage().data_ptr() for t in big}) == 1
    assert min(t.data_ptr() for t in big) % HUGE_PAGE == 0
    assert {"norm": model.norm.data_ptr(), "bias": model.proj.bias.data_ptr()} == small
    assert model.head.weight is model.embed.weight
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    assert torch.equal(model(ids), expected)


def test_a_weight_viewed_from_outside_the_model_stays_where_it_is():
    layer = nn.Linear(256, 512).requires_grad_(False)
    outside = layer.weight[100:]  # a view the module tree does not know of
    ptr = layer.weight.data_ptr()
    weights_on_huge_pages(layer)
    assert layer.weight.data_ptr() == ptr  # moving it would leave the view reading the old memory
    layer.weight[100:].fill_(2.0)
    assert torch.equal(outside, layer.weight[100:])
    assert layer.bias.data_ptr() != ptr  # the bias, below the size moved, stays too
    del outside
    if huge_pages_advisable():
        assert weights_on_huge_pages(layer, smallest=1) > 0 and layer.weight.data_ptr() != ptr


def test_mapped_zeros_are_zeros_of_the_size_asked():
    for huge in (False, True):
        zeros, advised = mapped_zeros(3 * HUGE_PAGE + 5, huge_pages=huge)
        assert zeros.shape == (3 * HUGE_PAGE + 5,) and not zeros.any()
        assert advised == (huge and huge_pages_advisable())
        if advised:
            assert zeros.data_ptr() % HUGE_PAGE == 0


# Weights of 4 MB (served from the heap once keep_freed_memory is set), moved; prints the growth of the resident
# set in MB and the MB moved.
MOVE_SCRIPT = """
import torch
from torch import nn
from batchgen.engine.backends.cpu.memory import keep_freed_memory, weights_on_huge_pages
def rss():
    return int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmRSS")][0]) // 1024
assert keep_freed_memory()
model = nn.Module()
for i in range(64):
    model.register_buffer(f"w{i}", torch.ones(1 << 20))
before = rss()
moved = weights_on_huge_pages(model)
print(rss() - before, moved >> 20)
"""


@glibc
def test_the_weights_old_blocks_go_back_to_the_os():
    if not huge_pages_advisable():
        pytest.skip("no transparent huge pages here")
    done = subprocess.run([sys.executable, "-c", MOVE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    growth, moved = map(int, done.stdout.split()[-2:])
    assert moved == 256
    assert growth < 32, f"the resident set grew by {growth} MB moving {moved} MB: the heap kept the old blocks"


def loose_tensors(model: nn.Module, cache: set[int]) -> list[str]:
    """Tensors that ``model``'s modules hold as plain attributes (outside their parameters and buffers), the KV
    cache's views (``cache``: its storages' addresses) apart."""
    known = {id(t) for t in (*model.parameters(), *model.buffers())}
    return [f"{name}.{key}" for name, module in model.named_modules() for key, value in vars(module).items()
            if isinstance(value, torch.Tensor) and id(value) not in known and
            (value.layout != torch.strided or value.untyped_storage().data_ptr() not in cache)]


@pytest.mark.parametrize("arch", ["llama", "deepseek-v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_engines_weights_prepacked_or_not_lie_on_huge_pages(tmp_path, arch, dtype):
    """Whatever the CPU kernels make of the loaded weights (dot_linear's or oneDNN's packed copies, the latent
    products' own W_UK), the model holds them as parameters and buffers, which the runner moves onto huge pages."""
    folder = build_tiny_model(tmp_path / arch, arch, hidden=256, heads=4, kv_heads=2)
    llm = LLM(str(folder), dtype=dtype, device="cpu", max_num_seqs=2, kv_cache_memory=4 << 20)
    runner = model_runner(llm)
    cache = {t.untyped_storage().data_ptr() for layer in runner.kv_cache for t in layer}
    assert loose_tensors(runner.model, cache) == []
    if arch == "deepseek-v3":
        assert all(isinstance(m.absorbed, nn.Module) for m in runner.model.modules() if hasattr(m, "absorbed"))
    def large(tensors):  # what the move takes: plain tensors of 64 KiB or more
        return [t for t in tensors if t.layout == torch.strided and t.untyped_storage().nbytes() >= 1 << 16]

    weights = large([*runner.model.parameters(), *runner.model.buffers()])
    # dot_linear's packed copies are plain tensors that move; oneDNN's (where it runs instead) are opaque and stay
    packed = [m.packed for m in runner.model.modules() if isinstance(m, prepack.PrepackedLinear)]
    if dtype == "bfloat16" and prepack.dot_linear_runs():
        assert packed and all(p.layout == torch.strided for p in packed)
    assert len(weights) >= 2 and {id(p) for p in large(packed)} <= {id(t) for t in weights}
    if huge_pages_advisable():
        assert len({t.untyped_storage().data_ptr() for t in weights}) == 1
        assert min(t.data_ptr() for t in weights) % HUGE_PAGE == 0
