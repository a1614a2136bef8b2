"""Quantized checkpoints: their config, the weight methods the layers consult, and the load sequence.

A model is built inside ``weight_methods(...)`` (``layers/linear.py``) so that each linear and MoE
layer creates its weights as the checkpoint stores them; ``load_checkpoint`` then loads and
finishes them. Which layers are quantized is read from the checkpoint itself (a layer with a scale
tensor is; routers, ``lm_head`` and whatever ``modules_to_not_convert`` lists have none), because
the ignore lists of real checkpoints use checkpoint names and are incomplete (DeepSeek-V3 lists
nothing yet keeps its routers in bf16).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from batchgen.engine.quantization.config import (
    FP8_WEIGHTS_MODES, QuantizationConfig, UnsupportedQuantizationError, parse_quantization,
)

if TYPE_CHECKING:
    from batchgen.engine.backends.interface import KernelSet
    from batchgen.engine.layers.linear import LinearMethod
    from batchgen.engine.layers.moe import MoEMethod
    from batchgen.engine.loading.model_source import Weight
    from batchgen.engine.models.base import CausalLM

__all__ = ["FP8_WEIGHTS_MODES", "QuantizationConfig", "UnsupportedQuantizationError", "WeightMethods",
           "choose_weight_methods", "fp8_tensor_cores", "keeps_fp8_weights", "load_checkpoint", "parse_quantization"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class WeightMethods:
    """What the linear and MoE layers of a model built now use to hold and multiply their weights."""

    linear: "LinearMethod"
    moe: "MoEMethod"


def fp8_tensor_cores(device: torch.device) -> bool:
    """Ada, Hopper and Blackwell GPUs (sm_89 and newer) multiply FP8 natively."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def keeps_fp8_weights(mode: str, fp8_gemm: bool, device: torch.device) -> bool:
    """Whether an FP8 checkpoint's weights stay FP8 (activations quantized too) rather than being dequantized at
    load: ``mode`` is ``EngineConfig.fp8_weights``; ``fp8_gemm``, whether the kernel set has the FP8 GEMM."""
    if mode == "fp8" and not fp8_gemm:
        raise ValueError("fp8_weights='fp8' needs attention_backend='triton' (the FP8 GEMM is a Triton kernel)")
    return mode == "fp8" or (mode == "auto" and fp8_gemm and fp8_tensor_cores(device))


def choose_weight_methods(config: QuantizationConfig | None, kernels: "KernelSet", device: torch.device,
                          dtype: torch.dtype, mode: str = "auto") -> WeightMethods | None:
    """The weight methods for a checkpoint quantized as ``config`` (None: unquantized), logging the choice;
    ``mode`` is one of ``FP8_WEIGHTS_MODES`` (``EngineConfig.fp8_weights``)."""
    if config is None:
        return None
    from batchgen.engine.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod, Fp8Scales

    keep = keeps_fp8_weights(mode, kernels.fp8_linear is not None, device)
    if keep:
        log.info("%s checkpoint: weights stay FP8 (w8a8 GEMM and FP8 fused MoE, activations quantized per "
                 "token and 128 columns)", config.describe())
    else:
        why = "asked" if mode == "dequantize" else f"{device} has no FP8 tensor cores or FP8 kernels"
        log.info("%s checkpoint: weights dequantized to %s at load (%s)", config.describe(),
                 str(dtype).removeprefix("torch."), why)
    scales = Fp8Scales(config)
    return WeightMethods(Fp8LinearMethod(scales, kernels, keep), Fp8MoEMethod(scales, keep))


def load_checkpoint(model: "CausalLM", weights: Callable[[], Iterable[tuple[str, "Weight"]]]) -> None:
    """Loads every checkpoint tensor into ``model``, finishes its quantized layers, then calls the
    ``after_loading()`` of modules that derive tensors from their layers' weights (latent attention).

    ``weights`` is called twice for a quantized checkpoint: first only for the tensor names (lazy
    safetensors read nothing), to return the layers stored without scales to the model dtype.
    """
    if model.cfg.quantization is not None:
        scaled = _scaled_modules(model, (name for name, _ in weights()))
        for path, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if hasattr(method, "unquantize") and path not in scaled:
                method.unquantize(module)
    model.load_weights(weights())
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.finish_loading(module)
    for module in model.modules():  # then what modules derive from their layers' final weights
        if callable(after := getattr(module, "after_loading", None)):
            after()


def _scaled_modules(model: "CausalLM", names: Iterable[str]) -> set[str]:
    """Modules (by path in the model) that a checkpoint scale tensor loads into."""
    roles = model.cfg.quantization
    modules = set()
    for name in names:
        if roles.tensor_role(name) == "scale" and (target := model.checkpoint_target(name)) is not None:
            modules.add(target[0].rsplit(".", 1)[0])
    return modules
