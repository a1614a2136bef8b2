"""Runs a throughput benchmark of the engine and reports tokens/s, MFU and the matmul roofline."""
from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass

import torch

from batchgen.bench.flops import PeakFlops, attention_flops, engine_peak_flops, linear_flops, measure_matmul_flops
from batchgen.bench.workload import Workload, synthetic
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.core.metrics import EngineMetrics
from batchgen.engine.dtype import DtypeChoice
from batchgen.engine.models.base import ModelProfile

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    output_len: int = 1
    max_batch_tokens: int = 8192
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    cuda_graphs: str = "auto"
    warmup_prompts: int = 2
    json_schema: dict | None = None  # constrain every output to this JSON Schema
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    fp8_weights: str = "auto"  # FP8 checkpoints: see EngineConfig.fp8_weights
    overlap_schedule: str = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


def make_llm(cfg: BenchConfig) -> LLM:
    # Several devices: time the collectives, on CUDA too (it synchronises around each one).
    return LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, max_num_batched_tokens=cfg.max_batch_tokens,
               max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
               attention_backend=cfg.attention_backend, cuda_graphs=cfg.cuda_graphs,
               tensor_parallel_size=cfg.tensor_parallel_size, data_parallel_size=cfg.data_parallel_size,
               enable_expert_parallel=cfg.enable_expert_parallel, measure_communication=cfg.world_size > 1,
               fp8_weights=cfg.fp8_weights, overlap_schedule=cfg.overlap_schedule)


def run_bench(llm: LLM, workload: Workload, cfg: BenchConfig) -> dict:
    """Times ``llm.generate`` over the workload (after a warm-up) and derives throughput figures."""
    model_cfg = llm.engine.model_config
    params = SamplingParams(max_tokens=cfg.output_len, temperature=0, ignore_eos=True, json_schema=cfg.json_schema)
    longest = max(map(len, workload.prompts))
    if longest + cfg.output_len > llm.max_model_len:
        raise ValueError(f"prompts of up to {longest} tokens + {cfg.output_len} output tokens exceed "
                         f"max_model_len {llm.max_model_len}")
    warm = synthetic(cfg.warmup_prompts, str(min(longest, 512)), model_cfg.vocab_size, seed=12345)
    llm.generate(warm.prompts, params)
    llm.engine.reset_metrics()
    _sync(llm)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    _sync(llm)
    wall = time.perf_counter() - start
    metrics = llm.engine.metrics
    device = llm.config.torch_device()
    # One GPU per rank; CPU ranks share the cores this process measures.
    devices = cfg.world_size if device.type == "cuda" else 1
    matmul = measure_matmul_flops(llm.config.torch_dtype, device) * devices
    executor = llm.engine.executor
    kv_bytes = executor.kv_layout.bytes_per_token(llm.config.torch_dtype)
    result = summarize(workload, outputs, metrics, wall, executor.profile, kv_bytes, matmul,
                       engine_peak_flops(llm.config), cfg, device, llm.config.dtype_choice)
    return {**result, "overlap": llm.engine.overlap, **host_times(metrics)}


def summarize(workload, outputs, m: EngineMetrics, wall: float, profile: ModelProfile, kv_bytes_per_token: int,
              matmul_flops: float, peak: PeakFlops | None, cfg: BenchConfig, device, choice: DtypeChoice) -> dict:
    # MFU counts the matmul weights each token really uses: for MoE its top-k and shared experts.
    lin = profile.active_params
    prompt_tokens = workload.prompt_tokens
    output_tokens = sum(len(o.token_ids) for o in outputs)
    flops, fp8_flops = linear_flops(profile, m.tokens_computed, m.tokens_generated)
    # Positions each request computed: its uncached prompt, then every generated token but the last.
    attn = sum(attention_flops(profile, o.num_cached_tokens,
                               len(o.prompt_token_ids) + max(len(o.token_ids) - 1, 0)) for o in outputs)
    prompt_tps = prompt_tokens / wall
    roofline_tps = matmul_flops / (2 * lin)
    result = {
        "model": cfg.model, "dtype": choice.name, "dtype_requested": cfg.dtype, "dtype_reason": choice.reason,
        "weight_format": profile.weight_format, "device": str(device),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "num_prompts": len(workload.prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "output_len": cfg.output_len, "max_batch_tokens": cfg.max_batch_tokens,
        "prefix_caching": cfg.enable_prefix_caching,
        "tensor_parallel_size": cfg.tensor_parallel_size, "data_parallel_size": cfg.data_parallel_size,
        "expert_parallel": cfg.enable_expert_parallel,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(outputs) / wall, 3),
        "prompt_tokens_per_s": round(prompt_tps, 1),
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 1),
        "decode_tokens_per_s": round(m.decode_tokens / m.decode_time_s, 1) if m.decode_time_s else None,
        # Prompt tokens over the time of the steps that computed them (decode-only steps aside).
        "prefill_tokens_per_s": round(m.prompt_tokens_computed / m.prefill_time_s, 1) if m.prefill_time_s else None,
        "prefill_time_s": round(m.prefill_time_s, 3), "decode_time_s": round(m.decode_time_s, 3),
        "prompt_tokens_computed": m.prompt_tokens_computed,
        "prefix_cache_hit_rate": round(m.prefix_cache_hit_rate, 4),
        "preemptions": m.preemptions,
        **step_times(m),
        "total_params": profile.total_params, "active_params": lin, "fp8_active_params": profile.fp8_active_params,
        "kv_bytes_per_token": kv_bytes_per_token, "linear_flops": flops, "fp8_linear_flops": fp8_flops,
        "attention_flops": attn,
        "matmul_tflops_measured": round(matmul_flops / 1e12, 4),
        "achieved_tflops": round(flops / wall / 1e12, 4),
        "mfu_vs_measured_matmul": round(flops / wall / matmul_flops, 4),
        "attention_tflops": round(attn / wall / 1e12, 4),
        "mfu_with_attention_vs_measured_matmul": round((flops + attn) / wall / matmul_flops, 4),
        "roofline_prompt_tokens_per_s": round(roofline_tps, 1),
        "prompt_tokens_per_s_over_roofline": round(prompt_tps / roofline_tps, 4),
    }
    if m.grammar_steps:
        result["grammar_steps"] = m.grammar_steps
        result["mask_ms_per_step"] = round(1e3 * m.grammar_mask_time_s / m.grammar_steps, 3)
    ideal = peak.seconds(flops, fp8_flops) if peak else None
    if ideal:  # FP8 matmuls against the FP8 peak, the others (and attention) against the bf16 peak
        result["gpu_peak_tflops"] = peak.bf16 / 1e12
        if fp8_flops:
            result["gpu_peak_fp8_tflops"] = peak.fp8 / 1e12
        result["mfu_vs_gpu_peak"] = round(ideal / wall, 4)
        result["mfu_with_attention_vs_gpu_peak"] = round(peak.seconds(flops + attn, fp8_flops) / wall, 4)
        if m.prefill_time_s:  # the linear layers over the prompt tokens, in the steps that computed them
            prefill = peak.seconds(*linear_flops(profile, m.prompt_tokens_computed, 0))
            result["prefill_mfu_vs_gpu_peak"] = round(prefill / m.prefill_time_s, 4)
    return result


def step_times(m: EngineMetrics) -> dict:
    """Milliseconds per step in collectives between devices and in everything else, and each replica's tokens."""
    steps = m.prefill_steps + m.decode_steps
    if not steps:
        return {}
    busy = m.prefill_time_s + m.decode_time_s
    out = {"steps": steps, "comm_ms_per_step": round(1e3 * m.comm_time_s / steps, 3),
           "compute_ms_per_step": round(1e3 * (busy - m.comm_time_s) / steps, 3)}
    if m.replica_tokens:
        out["replica_tokens"] = list(m.replica_tokens)
    return out


def host_times(m: EngineMetrics) -> dict:
    """The host's work per decode step outside the model (scheduling, writing the step down and building
    its tensors, applying its tokens), and its share of a step in which nothing overlaps it."""
    if not m.decode_steps:
        return {}
    host = m.decode_host_time_s + m.decode_prepare_time_s
    step = m.decode_host_time_s + m.decode_time_s
    return {"decode_host_ms_per_step": round(1e3 * host / m.decode_steps, 3),
            "decode_step_ms": round(1e3 * step / m.decode_steps, 3),
            "decode_host_share_of_step": round(host / step, 4) if step else None}


def _sync(llm: LLM) -> None:
    if llm.config.torch_device().type == "cuda":
        torch.cuda.synchronize()
