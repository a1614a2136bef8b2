"""The architecture registry: Hugging Face ``architectures[0]`` (and llama.cpp's GGUF name) -> model class,
and a config.json parsed into the ModelConfig its architecture reads."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.engine.config import MLAConfig, MoEConfig, ModelConfig
from batchgen.engine.layers.rotary import SCALINGS
from batchgen.engine.models.errors import UnsupportedModelError
from batchgen.engine.quantization.config import parse_quantization

if TYPE_CHECKING:
    from batchgen.engine.backends.interface import KernelSet
    from batchgen.engine.models.base import CausalLM
    from batchgen.engine.parallel.context import ParallelContext
    from batchgen.engine.quantization import WeightMethods

ROPE_SCALINGS = tuple(SCALINGS)
_ROPE_ALIASES = {"su": "longrope"}  # early Phi-3 configs name LongRoPE "su"


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
    # llama.cpp's deepseek2 holds both; its sigmoid gating marks V3 (see loading/gguf/arch.py).
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


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(base, scaling dict or None) from a config dict, either transformers' layout."""
    rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5 keeps rope settings here
    rope.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    kind = _ROPE_ALIASES.get(kind, kind)
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_SCALINGS)}")
    scaling = {**rope, "rope_type": kind}
    if cfg.get("original_max_position_embeddings"):  # older configs keep it at the top level
        scaling.setdefault("original_max_position_embeddings", int(cfg["original_max_position_embeddings"]))
    if kind == "yarn":  # transformers' default for the pre-scaling context
        scaling.setdefault("original_max_position_embeddings", int(cfg.get("max_position_embeddings", 4096)))
    if kind == "longrope" and not scaling.get("factor"):  # transformers' default: the context extension
        scaling["factor"] = int(cfg["max_position_embeddings"]) / scaling["original_max_position_embeddings"]
    return theta, scaling


# What every architecture reads from config.json: positive integers.
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_config(cfg: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a config.json dict, normalised by its architecture's model class (``hf_config``); a
    missing or mistyped field is named (ValueError), never a bare KeyError."""
    if not isinstance(cfg, dict):
        raise ValueError(f"the model's config (config.json) must be a JSON object, got {type(cfg).__name__}")
    try:
        return _model_config(cfg)
    except KeyError as e:
        raise ValueError(f"the model's config has no {e.args[0]!r}, which this model needs") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"the model's config holds a value of the wrong type: {e}") from None


def _model_config(cfg: dict[str, Any]) -> ModelConfig:
    arch = architecture_of(cfg)
    model_class = arch.model_class()
    cfg = model_class.hf_config(cfg)
    for key in _REQUIRED_SIZES:
        value = cfg.get(key)
        if value is None:
            raise ValueError(f"the model's config has no {key!r}, which this model needs")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"the model's config: {key} must be a positive integer, got {value!r}")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if activation not in model_class.activations:
        raise UnsupportedModelError(f"unsupported hidden activation {activation!r} for {arch.name}; "
                                    f"supported: {', '.join(model_class.activations)}")
    rope_theta, rope_scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    rotary_factor = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=window or None,
        rotary_dim=int(head_dim * rotary_factor),
        moe=MoEConfig.from_hf(cfg),
        mla=MLAConfig.from_hf(cfg),
        quantization=parse_quantization(cfg),
        hf=cfg,
    )


def build_model(cfg: ModelConfig, kernels: "KernelSet", max_positions: int, dtype: torch.dtype,
                device: torch.device | str, parallel: "ParallelContext | None" = None,
                methods: "WeightMethods | None" = None, mtp: bool = False) -> "CausalLM":
    """The model allocated directly in ``dtype`` on ``device`` (no fp32 copy first; "meta" allocates nothing),
    holding this rank's share of the weights under ``parallel``; ``methods`` (from
    ``quantization.choose_weight_methods``) gives its layers quantized weights. ``mtp``: with the checkpoint's
    multi-token-prediction layer (speculative method "mtp")."""
    from batchgen.engine.layers.linear import weight_methods

    cls = _BY_NAME[cfg.architecture].model_class()
    extra = {}
    if parallel is not None and (parallel.tp.size > 1 or parallel.ep_size > 1):
        if "parallel" not in inspect.signature(cls.__init__).parameters:
            raise UnsupportedModelError(f"{cfg.architecture} cannot be split over several devices yet")
        extra["parallel"] = parallel
    if mtp:
        if "mtp" not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"speculative method 'mtp' needs a DeepSeek-V3-style checkpoint with multi-token-"
                             f"prediction layers; {cfg.architecture} has none (try 'ngram', 'suffix' or "
                             f"'draft_model')")
        extra["mtp"] = True
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
