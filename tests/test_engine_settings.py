"""Engine settings have one home: every EngineConfig knob is settable from a job spec and from `bench`, under
its own name, and reaches the EngineConfig actually built; the previous release's names still work, with a
warning naming the new one."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from dataclasses import Field, fields

import pytest
from click.testing import CliRunner

from batchgen.bench import options as bench_options
from batchgen.cli import main
from batchgen.engine import LLM
from batchgen.engine.config import EngineConfig, engine_knobs, knob_default
from batchgen.pipeline import engine_spec
from batchgen.pipeline.engine_spec import JOB_DEFAULTS, LEGACY_KEYS
from batchgen.pipeline.spec import SpecError, spec_from_dict

BASE = {"name": "j", "model": {"path": "m"}, "input": {"path": "in.jsonl"}, "prompt": {"template": "{{ text }}"},
        "output": {"path": "out/"}}


# The prefix-cache tiers need prefix caching on and one device, which the other probes change: they are probed
# in a set of their own (every knob is in exactly one set).
TIER_PROBES = {"prefix_cache_host_bytes": 1 << 20, "prefix_cache_store": "memory://kv"}


def probe_value(f: Field):
    """A valid value for the knob that is neither its engine default nor its job default."""
    default = JOB_DEFAULTS.get(f.name, knob_default(f))
    if f.name in TIER_PROBES:
        return TIER_PROBES[f.name]
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default * 3
    if isinstance(default, float):
        return default / 2
    none_probes = {"max_model_len": 777, "kv_cache_memory": 12345678, "expert_capacity_factor": 0.5}
    if default is None and f.name in none_probes:
        return none_probes[f.name]
    if default == {} and f.name == "eplb_config":
        return {"num_redundant_experts": 2, "calibrate_once": True}
    if default == {} and f.name == "speculative_config":
        return {"method": "ngram", "num_speculative_tokens": 3}
    raise AssertionError(f"add a test value for the new knob {f.name} (default {default!r})")


PROBES = {f.name: probe_value(f) for f in engine_knobs()}
PROBE_SETS = [{k: v for k, v in PROBES.items() if k not in TIER_PROBES}, {k: PROBES[k] for k in TIER_PROBES}]


def yaml_text(value) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_the_knobs_are_every_engine_config_field_but_the_model_and_its_storage():
    assert {f.name for f in fields(EngineConfig)} - set(PROBES) == {"model", "storage_options"}
    assert all(f.metadata["help"] for f in engine_knobs())


@pytest.mark.parametrize("probes", PROBE_SETS, ids=["knobs", "prefix-tiers"])
def test_every_knob_is_settable_with_set_and_reaches_the_engine_config(probes):
    overrides = [f"engine.{name}={yaml_text(value)}" for name, value in probes.items()]
    spec = spec_from_dict({**BASE, "storage_options": {"anon": True}}, overrides, env={})
    config = spec.engine_config()
    assert {name: getattr(config, name) for name in probes} == probes
    assert config.model == "m" and config.storage_options == {"anon": True}


def test_job_defaults_differ_from_the_engine_only_where_declared():
    config = spec_from_dict(BASE, env={}).engine_config()
    for f in engine_knobs():
        assert getattr(config, f.name) == JOB_DEFAULTS.get(f.name, knob_default(f)), f.name
    assert config.max_num_batched_tokens == 16384  # as batching.max_batch_tokens was


def test_a_bad_knob_value_is_a_spec_error_naming_its_key():
    errs = pytest.raises(SpecError, spec_from_dict, BASE, ["engine.cuda_graphs=sometimes",
                                                          "engine.gpu_memory_utilization=1.5"], env={}).value.errors
    assert sorted(e.split(":")[0] for e in errs) == ["engine.cuda_graphs", "engine.gpu_memory_utilization"]
    errs = pytest.raises(SpecError, spec_from_dict, BASE, ["engine.max_num_batched_tokens=8"], env={}).value.errors
    assert errs == ["engine: max_num_batched_tokens must be at least block_size"]
    # YAML's booleans: never a number, and a choice knob names the word typed
    errs = pytest.raises(SpecError, spec_from_dict, BASE, ["engine.max_num_seqs=true", "engine.cuda_graphs=on",
                                                          "engine.gpu_memory_utilization=yes"], env={}).value.errors
    assert sorted(errs) == ["engine.cuda_graphs: Input should be 'auto', 'off' or 'emulate' (got 'on')",
                            "engine.gpu_memory_utilization: expected a number, got true",
                            "engine.max_num_seqs: expected a number, got true"]


def test_the_python_api_checks_each_knobs_type_and_bounds():
    """LLM(...) takes the knobs as keywords: a wrong type is refused by name, never read as something else."""
    for knob, value, message in [("max_num_seqs", 2.5, "max_num_seqs must be an integer, got 2.5"),
                                 ("kv_cache_memory", 16e6, "kv_cache_memory must be an integer, got 16000000.0"),
                                 ("max_num_batched_tokens", "8192", "must be an integer, got '8192'"),
                                 ("block_size", True, "block_size must be an integer, got True"),
                                 ("enable_prefix_caching", "false", "must be true or false, got 'false'"),
                                 ("gpu_memory_utilization", float("nan"), "must be a finite number, got nan"),
                                 ("distributed_timeout_s", float("inf"), "must be a finite number, got inf"),
                                 ("distributed_timeout_s", 1e15, "distributed_timeout_s must be <= 86400")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="m", **{knob: value})
    assert EngineConfig(model="m", gpu_memory_utilization=1, max_num_seqs=8).gpu_memory_utilization == 1


def test_triton_off_a_gpu_is_refused_outside_its_interpreter(tiny_model, monkeypatch):
    from batchgen.engine import LLM

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA GPUs, not on cpu"):
        LLM(str(tiny_model), device="cpu", attention_backend="triton", kv_cache_memory=16 << 20)


class Built(Exception):
    pass


def bench_config(monkeypatch, args: list[str]) -> tuple[EngineConfig | None, str]:
    """The EngineConfig `bench` builds its engine from, stopped before any model loads."""
    built: list[EngineConfig] = []

    def capture(config):
        built.append(config)
        raise Built

    monkeypatch.setattr(LLM, "from_config", staticmethod(capture))
    result = CliRunner().invoke(main, ["bench", "--model", "m", *args])
    return (built[0] if built else None), result.output


def bench_args(values: dict) -> list[str]:
    out = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        out += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, yaml_text(value)]
    return out


def test_every_knob_is_a_bench_option_and_reaches_the_engine_config(monkeypatch):
    for probes in PROBE_SETS:
        config, output = bench_config(monkeypatch, bench_args(probes))
        assert config is not None, output
        assert {name: getattr(config, name) for name in probes} == probes and config.model == "m"


def test_bench_defaults_are_the_engine_defaults(monkeypatch):
    config, output = bench_config(monkeypatch, [])
    assert config is not None, output
    assert config == EngineConfig(model="m")


@pytest.fixture
def warnings_afresh(monkeypatch, caplog):
    monkeypatch.setattr(engine_spec, "_warned", set())
    caplog.set_level(logging.WARNING)
    return caplog


@pytest.mark.parametrize("old", [".".join(k) for k in LEGACY_KEYS])
def test_an_old_spec_key_still_works_and_warns_once_with_its_new_name(old, warnings_afresh):
    section, key = old.split(".")
    new = LEGACY_KEYS[(section, key)]
    value = PROBES[new]
    data = {**BASE, section: {**BASE.get(section, {}), key: value}}
    for _ in range(2):
        assert getattr(spec_from_dict(data, env={}).engine_config(), new) == value
    assert getattr(spec_from_dict(BASE, [f"{old}={yaml_text(value)}"], env={}).engine, new) == value
    warnings = [r.getMessage() for r in warnings_afresh.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and old in warnings[0] and f"engine.{new}" in warnings[0]


def test_an_old_and_a_new_spec_key_together_are_an_error_naming_both(warnings_afresh):
    data = {**BASE, "batching": {"max_batch_tokens": 512}, "engine": {"max_num_batched_tokens": 1024}}
    errs = pytest.raises(SpecError, spec_from_dict, data, env={}).value.errors
    assert len(errs) == 1 and "batching.max_batch_tokens" in errs[0] and "engine.max_num_batched_tokens" in errs[0]
    errs = pytest.raises(SpecError, spec_from_dict, {**BASE, "model": {"path": "m", "dtype": "float32"},
                                                     "engine": {"dtype": "float16"}}, env={}).value.errors
    assert errs == ["model.dtype: deprecated name of engine.dtype, and both are given; keep engine.dtype"]


def test_set_with_an_old_name_overrides_the_new_key_of_the_file(warnings_afresh):
    data = {**BASE, "engine": {"device": "auto", "max_num_batched_tokens": 1024}}
    spec = spec_from_dict(data, ["model.device=cpu", "batching.max_batch_tokens=64"], env={})
    assert (spec.engine.device, spec.engine.max_num_batched_tokens) == ("cpu", 64)


@pytest.mark.parametrize("old", list(bench_options.LEGACY_OPTIONS))
def test_an_old_bench_option_still_works_and_warns_with_its_new_name(old, monkeypatch, caplog):
    knob, flag_value = bench_options.LEGACY_OPTIONS[old]
    value = PROBES[knob] if flag_value is None else flag_value
    new = ("--no-" if flag_value is False else "--") + knob.replace("_", "-")  # the spelling that does the same
    with caplog.at_level(logging.WARNING, logger="batchgen.bench.options"):
        config, output = bench_config(monkeypatch, [old] + ([] if flag_value is not None else [str(value)]))
    assert config is not None, output
    assert getattr(config, knob) == value
    assert any(old in r.getMessage() and new in r.getMessage() for r in caplog.records)
    both, output = bench_config(monkeypatch, [old] + ([] if flag_value is not None else [str(value)])
                                + bench_args({knob: PROBES[knob]}))
    assert both is None and old in output and new in output


def test_the_settings_page_lists_every_engine_knob():
    page = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert [f.name for f in engine_knobs() if f"| `engine.{f.name}` |" not in page] == []
