"""Runs a throughput benchmark of the engine and reports tokens/s, MFU and the matmul roofline."""
from __future__ import annotations

import dataclasses
import logging
import platform
import time
from dataclasses import dataclass, field

import torch

from batchgen.bench.workload import Workload, synthetic
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.config import EngineConfig, engine_knobs
from batchgen.engine.flops import attention_flops, engine_peak_flops, linear_flops, mfu
from batchgen.engine.matmul_rate import measure_matmul_flops

log = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class BenchConfig:
    """The engine to measure (every EngineConfig knob) and the bench's own settings."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model=DEFAULT_MODEL))
    output_len: int = 1
    warmup_prompts: int = 2
    json_schema: dict | None = None  # constrain every output to this JSON Schema


def make_llm(cfg: BenchConfig) -> LLM:
    # Several devices: time the collectives, on CUDA too (it synchronises around each one).
    engine = cfg.engine
    return LLM.from_config(dataclasses.replace(
        engine, measure_communication=engine.measure_communication or engine.world_size > 1))


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
    device = llm.config.torch_device()
    # One GPU per rank; CPU ranks share the cores this process measures.
    devices = llm.config.world_size if device.type == "cuda" else 1
    matmul = measure_matmul_flops(llm.config.torch_dtype, device) * devices
    kv_bytes = llm.engine.executor.kv_layout.bytes_per_token(llm.config.torch_dtype)
    return {**summarize(workload, outputs, llm, wall, kv_bytes, matmul, cfg), "overlap": llm.engine.overlap}


def summarize(workload, outputs, llm: LLM, wall: float, kv_bytes_per_token: int, matmul_flops: float,
              cfg: BenchConfig) -> dict:
    """The engine's own figures (``LLM.metrics`` over the wall time) and the bench's: per-request attention
    FLOPs, the rate against a measured matmul, and the matmul roofline."""
    profile, engine, choice = llm.profile(), llm.config, llm.config.dtype_choice
    figures = llm.metrics(wall)
    # MFU counts the matmul weights each token really uses: for MoE its top-k and shared experts.
    lin = profile.active_params
    prompt_tokens = workload.prompt_tokens
    output_tokens = sum(len(o.token_ids) for o in outputs)
    flops, fp8_flops = linear_flops(profile, figures["tokens_computed"], figures["tokens_generated"])
    # Positions each request computed: its uncached prompt, then every generated token but the last.
    attn = sum(attention_flops(profile, o.num_cached_tokens,
                               len(o.prompt_token_ids) + max(len(o.token_ids) - 1, 0)) for o in outputs)
    prompt_tps = prompt_tokens / wall
    roofline_tps = matmul_flops / (2 * lin)
    peak = engine_peak_flops(engine)
    with_attention = peak.seconds(flops + attn, fp8_flops) if peak else None
    return {
        "model": engine.model, "dtype": choice.name, "dtype_requested": engine.dtype, "dtype_reason": choice.reason,
        "weight_format": profile.weight_format, "device": str(engine.torch_device()),
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        **{f.name: getattr(engine, f.name) for f in engine_knobs() if f.name not in ("dtype", "device")},
        "num_prompts": len(workload.prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "output_len": cfg.output_len,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(outputs) / wall, 3),
        "prompt_tokens_per_s": round(prompt_tps, 1),
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 1),
        **figures,
        "mask_ms_per_step": round(1e3 * figures["grammar_mask_time_s"] / figures["grammar_steps"], 3)
        if figures["grammar_steps"] else None,
        "total_params": profile.total_params, "active_params": lin, "fp8_active_params": profile.fp8_active_params,
        "kv_bytes_per_token": kv_bytes_per_token, "linear_flops": flops, "fp8_linear_flops": fp8_flops,
        "attention_flops": attn,
        "matmul_tflops_measured": round(matmul_flops / 1e12, 4),
        "mfu_vs_measured_matmul": round(flops / wall / matmul_flops, 4),
        "attention_tflops": round(attn / wall / 1e12, 4),
        "mfu_with_attention_vs_measured_matmul": round((flops + attn) / wall / matmul_flops, 4),
        # attention's FLOPs too, against the GPUs' datasheet peak (None on CPU or an unknown GPU)
        "mfu_with_attention": mfu(with_attention, wall) if with_attention else None,
        "roofline_prompt_tokens_per_s": round(roofline_tps, 1),
        "prompt_tokens_per_s_over_roofline": round(prompt_tps / roofline_tps, 4),
    }


def _sync(llm: LLM) -> None:
    if llm.config.torch_device().type == "cuda":
        torch.cuda.synchronize()
