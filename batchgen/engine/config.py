"""Model and engine configuration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen.engine.dtype import DtypeChoice, check_dtype_name, resolve_dtype
from batchgen.engine.layers.rotary import SCALINGS
from batchgen.engine.models.registry import UnsupportedModelError, architecture_of  # noqa: F401 (re-export)
from batchgen.engine.quantization import FP8_WEIGHTS_MODES, QuantizationConfig, parse_quantization

ROPE_SCALINGS = tuple(SCALINGS)
_ROPE_ALIASES = {"su": "longrope"}  # early Phi-3 configs name LongRoPE "su"


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value or ())


@dataclass(frozen=True)
class MoEConfig:
    """The routed (and shared) experts of a mixture-of-experts model, as its config.json states them.

    Which layers are sparse and how the router scores experts is decided by the model's own file;
    these are the facts it reads (names as in transformers, aliases folded).
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # of all shared experts together
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "MoEConfig | None":
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
        if not experts:
            return None
        expert_size = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        shared = int(cfg.get("n_shared_experts") or 0)
        shared_size = int(cfg.get("shared_expert_intermediate_size") or shared * expert_size)
        return cls(
            num_experts=int(experts), top_k=int(cfg["num_experts_per_tok"]), intermediate_size=expert_size,
            num_shared_experts=shared or int(shared_size > 0), shared_intermediate_size=shared_size,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            scoring_func=cfg.get("scoring_func") or "softmax", topk_method=cfg.get("topk_method") or "greedy",
            n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=_ints(cfg.get("mlp_only_layers")),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and a compressed KV latent per token."""

    q_lora_rank: int | None  # None: a plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "MLAConfig | None":
        if not cfg.get("kv_lora_rank"):
            return None
        q_rank = cfg.get("q_lora_rank")
        return cls(q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]))

    @property
    def latent_dim(self) -> int:
        """Values the paged cache holds per token and layer: the KV latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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


@dataclass
class ModelConfig:
    """The architecture facts every model needs, parsed from a Hugging Face config dict.

    Model-specific switches (biases, q/k norm, which layers are sparse or local, soft caps) are not
    fields: each model's file reads them from ``hf`` (the config.json dict as the model class's
    ``hf_config`` normalises it, under its ``config_defaults``).
    """

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
    attention_bias: bool = False
    sliding_window: int | None = None
    rotary_dim: int = 0  # leading dims of each head that rotary rotates (partial_rotary_factor); 0: head_dim
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    quantization: QuantizationConfig | None = None  # how the checkpoint's weights are quantized (FP8)
    hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.rotary_dim = self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = architecture_of(cfg)
        model_class = arch.model_class()
        cfg = model_class.hf_config(cfg)
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
        return cls(
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
    prefix_cache_host_bytes: int = 0  # host-memory tier below the device prefix cache, in bytes (LRU; 0: none)
    prefix_cache_store: str | None = None  # fsspec URL (dir, s3://, memory://) of a prefix KV store later jobs reuse
    attention_backend: str | None = None
    # "auto": CUDA graphs on CUDA with the Triton backend; "off"; "emulate": the same padded
    # fixed-shape steps run eagerly without capture, so the graph path can be checked on CPU.
    cuda_graphs: str = "auto"
    # FP8 checkpoints: "auto" keeps the weights FP8 on GPUs with FP8 tensor cores (sm_89+) and dequantizes
    # them at load elsewhere; "fp8" always keeps them (Triton kernel set; under the interpreter on CPU);
    # "dequantize" always dequantizes. Unquantized checkpoints ignore it.
    fp8_weights: str = "auto"
    storage_options: dict = field(default_factory=dict)
    # Parallelism (vLLM's names): each of data_parallel_size replicas, with its own scheduler and KV cache,
    # spreads its layers over tensor_parallel_size devices; with enable_expert_parallel a mixture of experts
    # splits its experts over all of them. More than one device in all runs one worker process per device.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_timeout_s: float = 600.0  # longest wait for a worker's step (and a collective's peers)
    measure_communication: bool = False  # time collectives on CUDA too (synchronises: benchmarks only)
    # Overlapped scheduling: the host schedules and prepares step N+1 while the device runs step N.
    # "auto": on for one CUDA device; off on CPU, where the host's work would take cores from the model.
    overlap_schedule: str = "auto"

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.cuda_graphs not in ("auto", "off", "emulate"):
            raise ValueError(f"cuda_graphs must be 'auto', 'off' or 'emulate', got {self.cuda_graphs!r}")
        if self.fp8_weights not in FP8_WEIGHTS_MODES:
            raise ValueError(f"fp8_weights must be one of {', '.join(FP8_WEIGHTS_MODES)}, got {self.fp8_weights!r}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be 'auto', 'on' or 'off', got {self.overlap_schedule!r}")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if self.distributed_timeout_s <= 0:
            raise ValueError("distributed_timeout_s must be > 0")
        self._check_prefix_tiers()

    def _check_prefix_tiers(self) -> None:
        if self.prefix_cache_host_bytes < 0:
            raise ValueError("prefix_cache_host_bytes must be >= 0")
        if self.prefix_cache_store is not None and not str(self.prefix_cache_store).strip():
            raise ValueError("prefix_cache_store must be a URL (a folder, s3://..., memory://...) or None")
        if not (self.prefix_cache_host_bytes or self.prefix_cache_store):
            return
        if not self.enable_prefix_caching:
            raise ValueError("prefix_cache_store and prefix_cache_host_bytes need enable_prefix_caching")
        if self.world_size > 1:
            raise ValueError("prefix_cache_store and prefix_cache_host_bytes run on one device for now "
                             "(tensor_parallel_size and data_parallel_size 1)")

    @property
    def world_size(self) -> int:
        """Devices (and, above one, worker processes) the engine runs on."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def overlap(self) -> bool:
        """Whether steps overlap: only on one device (worker ranks learn the sampled tokens through the engine)."""
        if self.overlap_schedule == "auto":
            return self.world_size == 1 and self.torch_device().type == "cuda"
        return self.overlap_schedule == "on" and self.world_size == 1

    def expert_parallel(self, model: ModelConfig) -> bool:
        """Whether the model's experts are split over the ranks (only a mixture of experts has any)."""
        return self.enable_expert_parallel and model.moe is not None

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
