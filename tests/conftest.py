"""Shared fixtures: tiny random-weight models and the real SmolLM2 GGUF."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors in tests

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.tiny_models import ARCH_CONFIGS, MLA_ARCHS, MOE_ARCHS, VISION_ARCHS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_loaded():
    """The fused CPU kernels built (once per machine) and loaded from the real batchgen cache before any
    test points BATCHGEN_CACHE elsewhere; where they cannot be built, the engine's fallback applies."""
    from batchgen.engine.backends.cpu.build import load_kernels

    load_kernels()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns build(arch) -> folder of a tiny random model, built once per architecture."""
    built: dict[str, Path] = {}

    def build(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return built[arch]

    return build


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


# Dense text architectures; the MoE and DeepSeek ones get their own, fuller parity tests, vision
# checkpoints a shorter one.
@pytest.fixture(scope="session",
                params=sorted(set(ARCH_CONFIGS) - set(MOE_ARCHS) - set(MLA_ARCHS) - set(VISION_ARCHS)))
def tiny_model_any(request, tiny_model_factory) -> Path:
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF, fetched once into the batchgen cache."""
    from batchgen.engine.loading.hub import resolve_builtin

    return Path(resolve_builtin("smollm2-135m-instruct"))
