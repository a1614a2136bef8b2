"""The architecture registry: Hugging Face ``architectures[0]`` (and llama.cpp's GGUF name) -> model class."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from batchgen.engine.backends.interface import KernelSet
    from batchgen.engine.config import ModelConfig
    from batchgen.engine.models.base import CausalLM
    from batchgen.engine.parallel.context import ParallelContext
    from batchgen.engine.quantization import WeightMethods


class UnsupportedModelError(ValueError):
    """The model's architecture or settings are not ones the engine implements."""


@dataclass(frozen=True)
class Architecture:
    """One supported architecture; its class is imported only when a model of it is built."""

    name: str  # the Hugging Face class name in config.json's "architectures"
    module: str  # file under batchgen/engine/models holding the class of that name
    model_type: str  # config.json's "model_type"
    gguf: str | None = None  # llama.cpp's general.architecture, when GGUF files of it load
    moe: bool = False  # tells apart GGUF architectures shared by dense and MoE models (llama, Mixtral)

    def model_class(self) -> type:
        return getattr(importlib.import_module(f"batchgen.engine.models.{self.module}"), self.name)


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", "llama", gguf="llama"),
    Architecture("MistralForCausalLM", "llama", "mistral"),
    Architecture("Phi3ForCausalLM", "llama", "phi3", gguf="phi3"),
    Architecture("Gemma2ForCausalLM", "gemma", "gemma2", gguf="gemma2"),
    Architecture("Gemma3ForCausalLM", "gemma", "gemma3_text", gguf="gemma3"),
    Architecture("Gemma3ForConditionalGeneration", "gemma", "gemma3"),
    Architecture("Qwen2ForCausalLM", "qwen", "qwen2", gguf="qwen2"),
    Architecture("Qwen3ForCausalLM", "qwen", "qwen3", gguf="qwen3"),
    Architecture("MixtralForCausalLM", "mixtral", "mixtral", gguf="llama", moe=True),
    Architecture("Qwen2MoeForCausalLM", "qwen_moe", "qwen2_moe", gguf="qwen2moe", moe=True),
    Architecture("Qwen3MoeForCausalLM", "qwen_moe", "qwen3_moe", gguf="qwen3moe", moe=True),
    # llama.cpp's deepseek2 holds both; its sigmoid gating marks V3 (see gguf_loader).
    Architecture("DeepseekV2ForCausalLM", "deepseek", "deepseek_v2", gguf="deepseek2", moe=True),
    Architecture("DeepseekV3ForCausalLM", "deepseek", "deepseek_v3"),
)
_BY_NAME = {a.name: a for a in ARCHITECTURES}


def supported_names() -> list[str]:
    return [a.name for a in ARCHITECTURES]


def architecture_of(hf_config: dict[str, Any]) -> Architecture:
    """The registered architecture named in a config.json dict, or an error listing the supported ones."""
    names = hf_config.get("architectures") or []
    arch = next((_BY_NAME[n] for n in names if n in _BY_NAME), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {names or hf_config.get('model_type')!r}; "
            f"supported: {', '.join(supported_names())}")
    return arch


def gguf_architecture(gguf_name: str, has_experts: bool) -> Architecture:
    """The registered architecture for a GGUF file's general.architecture (and whether it has experts)."""
    matches = [a for a in ARCHITECTURES if a.gguf == gguf_name]
    arch = next((a for a in matches if a.moe == has_experts), None)
    if arch is None:
        known = sorted({a.gguf for a in ARCHITECTURES if a.gguf})
        kind = "with experts " if has_experts else ""
        raise UnsupportedModelError(f"GGUF architecture {gguf_name!r} {kind}is not supported; "
                                    f"supported: {', '.join(known)}")
    return arch


def build_model(cfg: "ModelConfig", kernels: "KernelSet", max_positions: int, dtype: torch.dtype,
                device: torch.device | str, parallel: "ParallelContext | None" = None,
                methods: "WeightMethods | None" = None) -> "CausalLM":
    """The model allocated directly in ``dtype`` on ``device`` (no fp32 copy first; "meta" allocates nothing),
    holding this rank's share of the weights under ``parallel``; ``methods`` (from
    ``quantization.choose_weight_methods``) gives its layers quantized weights."""
    from batchgen.engine.layers.linear import weight_methods

    cls = _BY_NAME[cfg.architecture].model_class()
    extra = {}
    if parallel is not None and (parallel.tp.size > 1 or parallel.ep_size > 1):
        if "parallel" not in inspect.signature(cls.__init__).parameters:
            raise UnsupportedModelError(f"{cfg.architecture} cannot be split over several devices yet")
        extra["parallel"] = parallel
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    device = torch.device(device)
    # Row chunks bound the CPU's activation traffic; a GPU wants each matmul as large as the step. 2048 rows:
    # oneDNN's bf16 linears run at ~1.6 TFLOP/s on 1024 rows and ~2.5 on 2048-4096 (AMX, 2 threads), and an
    # 8192-row MLP output no longer fits the caches (fp32 on AVX2 measured the same at 1024 and 2048).
    chunk_tokens = 2048 if device.type == "cpu" else 1 << 30
    try:
        with device, weight_methods(methods):
            model = cls(cfg, kernels, max_positions=max_positions, chunk_tokens=chunk_tokens, **extra)
    finally:
        torch.set_default_dtype(default)
    return model.requires_grad_(False)
