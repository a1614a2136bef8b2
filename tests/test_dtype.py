"""dtype "auto": bf16 only where the CPU computes it natively (capability simulated), explicit dtypes honoured."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from batchgen.engine import LLM, dtype as dtype_mod
from batchgen.engine.backends.cpu.features import CpuFeatures, _cpuinfo
from batchgen.engine.dtype import resolve_dtype
from batchgen.pipeline.spec import SpecError, spec_from_dict
from tests.engine_helpers import model_runner

CPU = torch.device("cpu")
AVX2_ONLY = CpuFeatures("AMD EPYC (simulated)", frozenset({"avx2", "fma", "f16c"}), "AVX2")
AMX = CpuFeatures("Xeon (simulated)", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                                                 "avx512_bf16", "amx_bf16"}), "AVX512")


@pytest.fixture
def simulate(monkeypatch, tmp_path):
    """Returns set(features, rates): the CPU the resolver sees and the matmul rates it would measure."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(dtype_mod, "_choices", {})
    measured: list[str] = []

    def set_(features: CpuFeatures, rates: dict[str, float] | None = None) -> list[str]:
        monkeypatch.setattr(dtype_mod, "cpu_features", lambda: features)

        def measure(dtype, *args, **kwargs):
            name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
            measured.append(name)
            assert rates is not None, "no measurement expected on this CPU"
            return rates[name] * 1e9  # FLOP/s

        monkeypatch.setattr(dtype_mod, "measure_matmul_flops", measure)
        return measured

    return set_


def test_auto_is_fp32_without_native_bf16(simulate):
    measured = simulate(AVX2_ONLY)
    choice = resolve_dtype("auto", CPU)
    assert choice.name == "float32" and choice.torch_dtype == torch.float32
    assert "no native bf16" in choice.reason and measured == []


def test_auto_is_bf16_with_native_bf16_and_cached_per_machine(simulate, tmp_path):
    measured = simulate(AMX, {"bfloat16": 2000.0, "float32": 300.0})
    choice = resolve_dtype("auto", CPU)
    assert choice.name == "bfloat16" and "amx_bf16" in choice.reason
    assert sorted(measured) == ["bfloat16", "float32"]
    files = list((tmp_path / "cpu").glob("matmul-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == {"bfloat16": 2000.0, "float32": 300.0}
    # A new process (fresh choices) reads the cached measurement instead of measuring again.
    dtype_mod._choices.clear()
    assert resolve_dtype("auto", CPU).name == "bfloat16" and len(measured) == 2


def test_auto_is_fp32_when_native_bf16_measures_slower(simulate):
    simulate(AMX, {"bfloat16": 200.0, "float32": 390.0})
    choice = resolve_dtype("auto", CPU)
    assert choice.name == "float32" and "200 GFLOP/s against 390" in choice.reason


def test_explicit_dtype_is_honoured_with_one_warning_when_slow(simulate, caplog):
    simulate(AVX2_ONLY)
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.dtype"):
        assert resolve_dtype("bfloat16", CPU).name == "bfloat16"
        assert resolve_dtype("bfloat16", CPU).name == "bfloat16"
        assert resolve_dtype("float32", CPU).name == "float32"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "bfloat16 is slow on this CPU" in warnings[0]


def test_no_warning_for_bf16_on_a_native_cpu(simulate, caplog):
    simulate(AMX, {"bfloat16": 2000.0, "float32": 300.0})
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.dtype"):
        assert resolve_dtype("bfloat16", CPU).name == "bfloat16"
    assert caplog.records == []


def test_bad_dtype_names():
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float16, float32"):
        resolve_dtype("fp8", CPU)
    with pytest.raises(SpecError, match="engine.dtype"):
        spec_from_dict({"name": "x", "model": {"path": "m"}, "engine": {"dtype": "half"}, "input": {"path": "i"},
                        "prompt": {"template": "t"}, "output": {"path": "o"}})


def test_llm_default_dtype_follows_the_cpu(simulate, tiny_model, caplog):
    simulate(AVX2_ONLY)
    with caplog.at_level(logging.INFO, logger="batchgen.engine.dtype"):
        llm = LLM(str(tiny_model), device="cpu", kv_cache_memory=4 << 20, attention_backend="torch")
    assert llm.config.dtype == "auto" and llm.config.dtype_choice.name == "float32"
    assert {p.dtype for p in model_runner(llm).model.parameters()} == {torch.float32}
    assert sum("dtype auto -> float32" in r.getMessage() for r in caplog.records) == 1


def test_cpuinfo_parsing(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert _cpuinfo(info) == ("Test CPU", frozenset({"fpu", "avx2", "avx512_bf16"}))
    assert _cpuinfo(tmp_path / "missing") == ("", frozenset())


@pytest.mark.parametrize("has_bf16, expected", [(True, "bfloat16"), (False, "float16")])
def test_auto_on_cuda(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: has_bf16)
    assert dtype_mod.auto_dtype(torch.device("cuda")).name == expected
