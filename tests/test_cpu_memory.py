"""The engine's heap settings: a step's freed activations are reused, not faulted in afresh."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

STEPS = 20
# Steps of activations 4-30 MB, allocated and freed out of order; prints the minor page faults of the
# last STEPS steps and the pages they wrote.
SCRIPT = f"""
import resource, sys, torch
if sys.argv[1] == "keep":
    from batchgen.engine.backends.cpu.memory import keep_freed_memory
    assert keep_freed_memory()
def step(i):
    n = (1 + i % 5) << 20
    a = torch.empty(n).fill_(1); b = torch.empty(n // 2).fill_(1); del a; c = torch.empty(3 * n // 2).fill_(1)
    return 12 * n // 4096
for i in range(5):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pages = sum(step(i) for i in range({STEPS}))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, pages)
"""


def page_faults(mode: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    faults, pages = map(int, done.stdout.split()[-2:])
    return faults, pages


def test_freed_blocks_are_reused_without_page_faults():
    (default, pages), (kept, _) = page_faults("default"), page_faults("keep")
    assert kept < pages // 100, f"{kept} page faults for {pages} pages written into reused blocks"
    # glibc's defaults fault in some of them afresh (how many moves between runs: 7K-56K here)
    assert default > max(1000, 10 * kept), f"{default} faults under glibc's defaults, {kept} with the settings"
