"""Every Triton kernel launch of the GPU path compiles to a CUDA binary for Hopper, and each kernel for Blackwell
(no GPU needed)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow


RUNS = (("sm_90", "--shard=0/2"), ("sm_90", "--shard=1/2"), ("sm_100", "--first-per-kernel"))


@pytest.mark.timeout(1500)
def test_kernels_compile_for_sm90_and_sm100():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    # Fresh processes (the interpreter setting is read when triton is first imported) compile side by side:
    # Hopper's launches split in two halves, and Blackwell's first launch of each kernel.
    procs = [subprocess.Popen([sys.executable, "-m", "tests.triton_aot", *run], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
             for run in RUNS]
    try:
        outputs = [proc.communicate(timeout=1500)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert len(outputs) == len(procs)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    counts = [int(re.search(r"compiled (\d+) kernel launches", output).group(1)) for output in outputs]
    # 12 kernels across dtypes, head dims, tile sizes, scale layouts and causal/prefix/split variants, over
    # KV caches of each dtype and, in bf16, of fp8 (e4m3, e5m2), and the FP8 launches of real-shaped FP8 models
    # (tests/triton_aot.py: fp8_model_kernel_calls).
    assert abs(counts[0] - counts[1]) <= 1 and counts[0] + counts[1] >= 300
    assert 12 <= counts[2] < counts[0]
    assert not any("skipped" in output for output in outputs)  # both targets have FP8 tensor cores
