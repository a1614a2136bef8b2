"""Loads a model (HF safetensors folder, GGUF file, built-in name or remote URL) as a ModelSource."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from batchgen.engine.loading.hub import resolve_model_path
from batchgen.engine.loading.model_source import LazyTensor, ModelSource
from batchgen.engine.tokenizer import ModelTokenizer

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class UnsupportedWeightsError(ValueError):
    """The folder holds weights in a format we refuse to load (pickle-based checkpoints)."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors shards, in index order when there is an index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (tensor name -> shard file)")
        names = dict.fromkeys(weight_map.values())
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists missing shards: {', '.join(missing)}")
        return files
    return sorted(folder.glob("*.safetensors"))


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, LazyTensor]]:
    """Yields ``(name, lazy tensor)``; nothing is read until a tensor is loaded (in the stored dtype). A name in
    two files (a stray copy of a shard beside the others) is refused: which one loads would be a guess."""
    from safetensors import safe_open

    seen: dict[str, Path] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors' own errors do not name the file
            raise ValueError(f"cannot read {file}: {e}") from None
        with handle as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} is in both {seen[name].name} and {file.name} in "
                                     f"{file.parent}: remove the stray file")
                seen[name] = file
                yield name, LazyTensor(f.get_slice(name))


def _no_weights() -> Iterator[tuple[str, torch.Tensor]]:
    raise RuntimeError("this model was loaded without its weights (tokenizer and config only)")


def load_hf_dir(folder: str | Path, name: str = "", weights: bool = True) -> ModelSource:
    """A Hugging Face model folder: config.json, safetensors weights, tokenizer files."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json (expected a Hugging Face model folder or a .gguf file)")
    files = safetensors_files(folder) if weights else []
    if weights and not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        found = f" (found {', '.join(pickled)})" if pickled else ""
        raise UnsupportedWeightsError(
            f"{folder} has no *.safetensors weights{found}; only safetensors folders and GGUF files are "
            "accepted, pickle-based checkpoints are never loaded. Convert them to safetensors first.")
    gen_file = folder / "generation_config.json"
    return ModelSource(
        config=_read_json(config_file),
        weights=(lambda: iter_safetensors(files)) if weights else _no_weights,
        tokenizer=ModelTokenizer.from_hf_dir(folder),
        generation_config=_read_json(gen_file) if gen_file.is_file() else {},
        name=name or folder.name,
    )


def load_model_source(path_or_name: str, storage_options: dict | None = None, weights: bool = True) -> ModelSource:
    """Resolves ``path_or_name`` (folder, .gguf, built-in name, remote URL) and loads it.

    Weights are only read when ``ModelSource.weights()`` is iterated. ``weights=False`` is the
    tokenizer-only path (``batchgen plan``): config and tokenizer, no weight files fetched or checked
    (a GGUF file is only memory-mapped for its metadata), and ``weights()`` raises.
    """
    path = Path(resolve_model_path(path_or_name, storage_options, weights))
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:  # a folder that only holds one GGUF file
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        from batchgen.engine.loading.gguf.loader import load_gguf

        source = load_gguf(str(path))
        source.name = str(path_or_name)
        if not weights:
            source.weights = _no_weights
    else:
        source = load_hf_dir(path, name=str(path_or_name), weights=weights)
    source.path = str(path)
    return source
