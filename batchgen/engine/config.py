"""Model and engine configuration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen.engine.dtype import DtypeChoice, check_dtype_name, resolve_dtype

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)


class UnsupportedModelError(ValueError):
    """The model's architecture or settings are not ones the engine implements."""


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, parsed from a Hugging Face config dict."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5 keeps rope settings here
        rope.update(cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_scaling and rope_type not in ("llama3", "linear"):
            raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}; supported: llama3, linear")
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
        )


@dataclass
class EngineConfig:
    """Engine knobs. ``kv_cache_memory`` is the KV budget in bytes (default: 2 GiB on CPU, 90 % of free GPU memory).

    ``dtype`` "auto" is the fast dtype of the device: see :func:`batchgen.engine.dtype.resolve_dtype`.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    # "auto": CUDA graphs on CUDA with the Triton backend; "off"; "emulate": the same padded
    # fixed-shape steps run eagerly without capture, so the graph path can be checked on CPU.
    cuda_graphs: str = "auto"
    storage_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.cuda_graphs not in ("auto", "off", "emulate"):
            raise ValueError(f"cuda_graphs must be 'auto', 'off' or 'emulate', got {self.cuda_graphs!r}")

    @property
    def dtype_choice(self) -> DtypeChoice:
        return resolve_dtype(self.dtype, self.torch_device())

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice.torch_dtype

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
