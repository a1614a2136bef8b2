"""The staged GPU check: its plan fits one device window, and its in-memory random checkpoints load."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_dry_run_prints_a_plan_that_fits_ten_minutes():
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stages = re.findall(r"^stage (\w+): expected (\d+) s, stopped at (\d+) s$", proc.stdout, re.M)
    assert [name for name, _, _ in stages] == ["correctness", "headline", "extras"]
    expected = {name: int(e) for name, e, _ in stages}
    assert sum(expected.values()) <= 400  # the first H200 run took about 290 s
    assert all(int(e) <= int(limit) for _, e, limit in stages)
    assert sum(int(limit) for _, _, limit in stages) <= 600
    runs = [int(s) for s in re.findall(r"^  [\w-]+: ~(\d+) s$", proc.stdout, re.M)]
    assert sum(runs) == sum(expected.values())  # every run's estimate is printed before the stage runs


@pytest.mark.timeout(300)
def test_random_checkpoint_loads_without_weight_files(tmp_path):
    from gpu_check import random_checkpoint
    from random_llama import BASE, shapes

    from batchgen.engine import LLM, SamplingParams

    cfg = {**BASE, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}
    with random_checkpoint(tmp_path / "m", cfg, shapes(cfg), device="cpu") as path:
        assert [p.stat().st_size for p in Path(path).glob("*.safetensors")] == [0]
        with LLM(path, dtype="float32", device="cpu", kv_cache_memory=4 << 20) as llm:
            out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            lm_head = llm.engine.executor.runner.model.lm_head.weight
    assert len(out[0].token_ids) == 3
    assert 0.01 < float(lm_head.float().std()) < 0.03  # the drawn weights, not zeros or an empty tensor
