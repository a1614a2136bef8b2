"""Model and engine configuration, as plain data (``models.registry.model_config`` parses a config.json)."""
from __future__ import annotations

import math
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

import torch

from batchgen.engine.dtype import DTYPE_NAMES, KV_CACHE_DTYPES, DtypeChoice, kv_cache_torch_dtype, resolve_dtype
from batchgen.engine.parallel.balancer import EplbConfig
from batchgen.engine.quantization.config import FP8_WEIGHTS_MODES, QuantizationConfig
from batchgen.engine.speculative.config import SpeculativeConfig


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


@dataclass
class ModelConfig:
    """The architecture facts every model needs, parsed from a Hugging Face config dict
    (:func:`batchgen.engine.models.registry.model_config`).

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

    def context_len(self, requested: int | None = None) -> int:
        """The longest sequence an engine runs: the model's context, or ``requested`` (max_model_len)."""
        if requested is not None and requested > self.max_position_embeddings:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit of "
                             f"{self.max_position_embeddings} tokens")
        return requested if requested is not None else self.max_position_embeddings


ATTENTION_BACKENDS = ("torch", "cpu", "triton")
DEVICES = ("auto", "cpu", "cuda")
CUDA_GRAPHS_MODES = ("auto", "off", "emulate")
OVERLAP_MODES = ("auto", "on", "off")


def knob(default: Any, help: str, choices: tuple | None = None, **limits: float) -> Any:
    """An EngineConfig field: its default, one line of help, its choices and its bounds (pydantic's ``ge``,
    ``gt``, ``le``), which the job spec and ``bench`` read to declare their own options."""
    meta = {"help": help, "choices": choices, "limits": limits}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


_CHECKS = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"), "le": (lambda v, b: v <= b, "<=")}


def _type_problem(annotation: str, value: Any) -> str | None:
    """What ``value`` is instead of the knob's type (bool is no number here, and an int is a float), or None."""
    kind = annotation.removesuffix(" | None")
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind in ("str", "dict"):
        ok = isinstance(value, {"str": str, "dict": dict}[kind])
    else:
        return None
    names = {"bool": "true or false", "int": "an integer", "float": "a finite number", "str": "a string",
             "dict": "a mapping"}
    return None if ok else f"must be {names[kind]}, got {value!r}"


@dataclass
class EngineConfig:
    """Engine knobs, the one declaration of each (name, type, default, help, choices, bounds): the job spec's
    ``engine`` section and ``bench``'s options are derived from these fields. Names are vLLM's where it has one."""

    model: str
    dtype: str = knob("auto", "auto: bf16 where the device computes it natively, else fp32 "
                              "(fp16 on GPUs without bf16)", DTYPE_NAMES)
    device: str = knob("auto", "auto: cuda when a GPU is visible, else cpu", DEVICES)
    max_num_batched_tokens: int = knob(8192, "tokens one step may compute, per data-parallel replica", ge=1)
    max_num_seqs: int = knob(256, "sequences one step may run, per data-parallel replica", ge=1)
    max_model_len: int | None = knob(None, "longest prompt + output, in tokens (default: the model's context)",
                                     ge=1)
    block_size: int = knob(16, "tokens per KV cache block", ge=1)
    kv_cache_memory: int | None = knob(None, "KV cache bytes (default: on CPU a quarter of the available memory, "
                                             "at least 2 GiB; gpu_memory_utilization of the free GPU memory)", ge=1)
    kv_cache_dtype: str = knob("auto", "what the KV cache holds (auto: the model's dtype; bfloat16: under an "
                                       "fp32 model, twice its tokens and half its decode reads; fp8 = fp8_e4m3, "
                                       "or fp8_e5m2: one byte a value, so twice bf16's tokens in the same memory; "
                                       "values stored unscaled, e4m3 saturating at +-448)", tuple(KV_CACHE_DTYPES))
    gpu_memory_utilization: float = knob(0.9, "share of the free GPU memory the KV cache may take", gt=0, le=1)
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of prompt prefixes already computed")
    prefix_cache_host_bytes: int = knob(0, "host-memory tier below the device prefix cache, in bytes (LRU; 0: none)",
                                        ge=0)
    prefix_cache_store: str | None = knob(None, "fsspec URL (a folder, s3://, memory://) of a prefix KV store "
                                                "that later jobs and other replicas reuse")
    attention_backend: str | None = knob(None, "kernels (default: triton on CUDA, cpu's fused C++ kernels "
                                               "on CPU)", ATTENTION_BACKENDS)
    cuda_graphs: str = knob("auto", "replay captured CUDA graphs for decode and mixed steps (auto: on CUDA with "
                                    "triton, and on CPU with the cpu kernels decode steps replay their recorded "
                                    "ops; emulate: the padded fixed-shape steps, eagerly)", CUDA_GRAPHS_MODES)
    fp8_weights: str = knob("auto", "FP8 checkpoints: fp8 keeps the weights FP8, dequantize widens them at load "
                                    "(auto: fp8 on GPUs with FP8 tensor cores)", FP8_WEIGHTS_MODES)
    storage_options: dict = knob({}, "fsspec options for a remote model")
    # Parallelism: each of data_parallel_size replicas, with its own scheduler and KV cache, spreads its
    # layers over tensor_parallel_size devices. More than one device in all runs one worker process per device.
    tensor_parallel_size: int = knob(1, "devices each replica's layers are split over", ge=1)
    data_parallel_size: int = knob(1, "engine replicas, each with its own scheduler and KV cache", ge=1)
    enable_expert_parallel: bool = knob(False, "split a mixture of experts' experts over all the devices")
    distributed_timeout_s: float = knob(600.0, "longest wait for a worker's step (and a collective's peers)",
                                        gt=0, le=86400)
    expert_capacity_factor: float | None = knob(None, "data + expert parallel at TP 1: a padded all-to-all with "
                                                      "no host waits, sending this times a replica's most tokens "
                                                      "(1.0 exact; below, overflow is dropped)", gt=0, le=1)
    measure_communication: bool = knob(False, "time collectives on CUDA too (synchronises: benchmarks only)")
    overlap_schedule: str = knob("auto", "the host prepares step N+1 while the device runs step N (auto: on for "
                                         "one CUDA device)", OVERLAP_MODES)
    enable_eplb: bool = knob(False, "expert-parallel load balancing: measure expert loads, replicate hot experts "
                                    "and rebalance placements during the job")
    eplb_config: dict = knob({}, "EPLB settings: num_redundant_experts, window_size, step_interval, "
                                 "log_balancedness, calibrate_once, skip_unprofitable")
    speculative_config: dict = knob({}, "speculative decoding (vLLM's keys): method (ngram, suffix, "
                                        "draft_model with its model, mtp), num_speculative_tokens, prompt_lookup_min, "
                                        "prompt_lookup_max; a cost "
                                        "model picks 0..num_speculative_tokens drafts per sequence and step")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None or not meta:
                continue
            problem = _type_problem(str(f.type), value)
            if problem:
                raise ValueError(f"{f.name} {problem}")
            if meta["choices"] and value not in meta["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(meta['choices'])}, got {value!r}")
            for kind, bound in meta["limits"].items():
                holds, sign = _CHECKS[kind]
                if not holds(value, bound):
                    raise ValueError(f"{f.name} must be {sign} {bound}, got {value!r}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        EplbConfig.from_dict(self.eplb_config)
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.method == "mtp" and self.world_size > 1:
            raise ValueError("speculative method 'mtp' runs on one device for now: it needs tensor_parallel_size "
                             f"and data_parallel_size 1, got {self.tensor_parallel_size} and "
                             f"{self.data_parallel_size}")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (it balances experts split over ranks)")
        if self.dtype == "float16":  # refused here already, not only once the engine has loaded the model
            kv_cache_torch_dtype(self.kv_cache_dtype, torch.float16)
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

    @property
    def world_size(self) -> int:
        """Devices (and, above one, worker processes) the engine runs on."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def logits_rows_per_seq(self) -> int:
        """Logits rows one sequence may need in a step: 1, and its draft tokens with speculative decoding."""
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        return 1 + (spec.num_speculative_tokens if spec is not None else 0)

    @property
    def token_budget(self) -> int:
        """Tokens one engine step may compute: max_num_batched_tokens for each data-parallel replica."""
        return self.max_num_batched_tokens * self.data_parallel_size

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

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype: ``kv_cache_dtype``'s, or the model's."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def engine_knobs() -> list[Field]:
    """EngineConfig's fields but ``model`` and ``storage_options`` (what to run and how to read it): the knobs
    the job spec's ``engine`` section and ``bench``'s options declare, in order."""
    return [f for f in fields(EngineConfig) if f.name not in ("model", "storage_options")]


def knob_default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
