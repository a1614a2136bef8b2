"""Builds the fused CPU kernels on first use and loads them as ``torch.ops.batchgen_cpu``.

The C++ sources in ``csrc/`` are compiled with ``torch.utils.cpp_extension`` against the installed torch's
headers (they call its internal brgemm entry points), once per machine: the build folder under the batchgen
cache is keyed by the sources, the torch version and the CPU's features. Where no compiler is found or the
build fails, :func:`load_kernels` logs one warning and returns False, and the engine runs torch's own ops.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from batchgen.engine.backends.cpu.features import CpuFeatures, cpu_features

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("amx_linear.cpp", "attention.cpp", "decode.cpp", "dot_linear.cpp", "elementwise.cpp", "latent_decode.cpp",
           "moe.cpp", "replay.cpp", "small_linear.cpp")
HEADERS = ("activation.h", "amx.h", "attention_amx.h", "decode_ahead.h", "decode_dots.h", "decode_tiles.h",
           "decode_values.h", "dot_blocks.h", "fp8.h", "paged.h", "small_linear.h", "small_linear_tiles.h",
           "softmax_rows.h", "split_walk.h", "varlen.h", "vec.h")
DISABLE_ENV = "BATCHGEN_CPU_KERNELS"  # "0" turns the fused kernels off
# -fopenmp: at::parallel_for runs its work on torch's threads only in code compiled with OpenMP (without it the
# pragma in ATen's header is ignored and every kernel runs on one thread).
COMMON_FLAGS = ["-O3", "-std=c++17", "-fopenmp"]
ISA_FLAGS = {
    "avx512": ["-march=native", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def build_dir(features: CpuFeatures) -> Path:
    """``<cache>/cpu/kernels-torch<version>-<isa>-<hash of sources, compiler and CPU>``."""
    from batchgen.io.paths import cache_dir

    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((SOURCE_DIR / name).read_bytes())
    # What the generated code depends on: the sources, the compiler, the CPU it is tuned for (-march=native)
    # and the vector level; not the ISA caps of oneDNN, which its micro-kernels apply at run time.
    digest.update("|".join([compiler(), features.model_name, *sorted(features.flags), str(features.isa),
                            *COMMON_FLAGS]).encode())
    version = torch.__version__.replace("+", "_")
    return cache_dir() / "cpu" / f"kernels-torch{version}-{features.isa}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs ``ninja`` from PATH; the pip package's binary may not be there (venv not activated)."""
    path = os.environ.get("PATH", "")
    try:
        import ninja

        if shutil.which("ninja") is None:
            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{path}"
    except ImportError:
        pass
    try:
        yield
    finally:
        os.environ["PATH"] = path


def build_and_load(features: CpuFeatures) -> str | None:
    """Compiles (or reuses) the kernels for this CPU and loads them; returns why not, or None on success."""
    if features.isa is None:
        return f"the CPU has neither AVX-512 nor AVX2 ({features.describe()})"
    if shutil.which(compiler()) is None:
        return f"no C++ compiler found ({compiler()!r}; set CXX to one)"
    from torch.utils import cpp_extension

    from batchgen.io.lease import file_lock

    folder = build_dir(features)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"batchgen_cpu_{folder.name.rsplit('-', 1)[-1]}"
    library = folder / f"{name}.so"
    try:
        with file_lock(folder / "build.lock"):
            if library.exists():  # built before: load it without cpp_extension's lock-file protocol
                try:
                    torch.ops.load_library(str(library))
                    return None
                except OSError:  # a build killed while linking left half a library
                    library.unlink()
            # We hold the folder: a lock file of cpp_extension's there is a killed build's leftover, and
            # would make cpp_extension wait for it forever.
            (folder / "lock").unlink(missing_ok=True)
            log.info("compiling CPU kernels, about a minute, once (into %s)", folder)
            with _ninja_on_path():
                cpp_extension.load(
                    name=name, sources=[str(SOURCE_DIR / source) for source in SOURCES],
                    extra_cflags=[*COMMON_FLAGS, *ISA_FLAGS[features.isa]], extra_ldflags=["-fopenmp"],
                    build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - any build or load failure means: run torch's ops instead
        lines = [line for line in str(e).splitlines() if line.strip()]
        return f"building them in {folder} failed: {lines[-1] if lines else type(e).__name__}"
    return None


@lru_cache(maxsize=1)
def load_kernels() -> bool:
    """Whether ``torch.ops.batchgen_cpu`` is loaded; the first call builds it (a minute, once per machine)."""
    if os.environ.get(DISABLE_ENV) == "0":
        log.info("fused CPU kernels disabled by %s=0; using torch's ops", DISABLE_ENV)
        return False
    reason = build_and_load(cpu_features())
    if reason:
        log.warning("fused CPU kernels unavailable, using torch's ops (slower): %s", reason)
        return False
    return True
