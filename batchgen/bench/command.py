"""The `batchgen bench` command: prompt throughput of the engine, as figures and JSON."""
from __future__ import annotations

import dataclasses
import json
import logging

import click

from batchgen.bench.runner import BenchConfig, make_llm, run_bench
from batchgen.bench.workload import from_documents, synthetic
from batchgen.engine.dtype import DTYPE_NAMES


def _read_texts(path: str, column: str) -> list[str]:
    from batchgen.io import expand_inputs, read_rows

    texts = [str(r.values[column]) for r in read_rows(expand_inputs(path)) if r.values.get(column)]
    if not texts:
        raise click.UsageError(f"no rows with a {column!r} value in {path}")
    return texts


@click.command("bench")
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="Built-in name, model folder, or GGUF file.")
@click.option("--num-prompts", default=32, show_default=True)
@click.option("--input-len", default="1024", show_default=True,
              help="Prompt length: N, or LOW:HIGH (uniform for synthetic, log-uniform for --dataset).")
@click.option("--dataset", default=None, help="JSONL/Parquet file of documents to cut prompts from.")
@click.option("--column", default="text", show_default=True, help="Text column of --dataset.")
@click.option("--whole-documents", is_flag=True, help="With --dataset: one whole document per prompt.")
@click.option("--prefix-len", default=0, show_default=True, help="Tokens of a prefix shared by all prompts.")
@click.option("--output-len", default=1, show_default=True, help="Generated tokens (1 = prefill only).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(DTYPE_NAMES),
              help="auto: bf16 where the device computes it natively, else fp32 (fp16 on GPUs without bf16).")
@click.option("--device", default="auto", show_default=True)
@click.option("--max-batch-tokens", default=8192, show_default=True)
@click.option("--max-num-seqs", default=256, show_default=True)
@click.option("--no-prefix-caching", is_flag=True)
@click.option("--attention-backend", type=click.Choice(["torch", "cpu", "triton"]), default=None,
              help="Default: triton on CUDA, cpu (fused C++ kernels) on CPU.")
@click.option("--cuda-graphs", type=click.Choice(["auto", "off"]), default="auto", show_default=True,
              help="Replay captured CUDA graphs for decode and mixed steps (CUDA + Triton only).")
@click.option("--fp8-weights", type=click.Choice(["auto", "fp8", "dequantize"]), default="auto", show_default=True,
              help="FP8 checkpoints: keep the weights in FP8 (auto: on GPUs with FP8 tensor cores) or dequantize.")
@click.option("--json-schema", "json_schema_file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Also run the workload with every output constrained to this JSON Schema, and compare.")
@click.option("--tp", "tensor_parallel_size", default=1, show_default=True, type=click.IntRange(min=1),
              help="tensor_parallel_size: devices (worker processes) each replica's layers are split over.")
@click.option("--dp", "data_parallel_size", default=1, show_default=True, type=click.IntRange(min=1),
              help="data_parallel_size: engine replicas, each with its own scheduler and KV cache.")
@click.option("--ep", "enable_expert_parallel", is_flag=True,
              help="enable_expert_parallel: split a mixture of experts' experts over all tp x dp devices.")
@click.option("--overlap", "overlap_schedule", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True, help="Overlapped scheduling: the host prepares the next step while the device "
                                      "runs this one (auto: on for one CUDA device).")
@click.option("--seed", default=0, show_default=True)
@click.option("--output-json", default=None, help="Also write the results to this file.")
def bench(model, num_prompts, input_len, dataset, column, whole_documents, prefix_len, output_len, dtype,
          device, max_batch_tokens, max_num_seqs, no_prefix_caching, attention_backend, cuda_graphs, fp8_weights,
          json_schema_file, tensor_parallel_size, data_parallel_size, enable_expert_parallel, overlap_schedule, seed,
          output_json):
    """Measure prompt (prefill) and output throughput of the engine."""
    logging.basicConfig(level=logging.WARNING)
    cfg = BenchConfig(model=model, dtype=dtype, device=device, output_len=output_len,
                      max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                      enable_prefix_caching=not no_prefix_caching, attention_backend=attention_backend,
                      cuda_graphs=cuda_graphs, tensor_parallel_size=tensor_parallel_size,
                      data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel,
                      fp8_weights=fp8_weights, overlap_schedule=overlap_schedule)
    with make_llm(cfg) as llm:
        result = _bench(llm, cfg, dataset, column, whole_documents, num_prompts, input_len, prefix_len, seed,
                        json_schema_file)
    text = json.dumps(result, indent=2)
    click.echo(text)
    if output_json:
        with open(output_json, "w") as f:
            f.write(text + "\n")


def _bench(llm, cfg: BenchConfig, dataset, column, whole_documents, num_prompts, input_len, prefix_len, seed,
           json_schema_file) -> dict:
    """Runs the workload (twice, free and constrained, with a schema) and prints the figures."""
    if dataset:
        workload = from_documents(_read_texts(dataset, column), llm.tokenizer, num_prompts,
                                  None if whole_documents else input_len, seed=seed, prefix_len=prefix_len)
    else:
        workload = synthetic(num_prompts, input_len, llm.engine.model_config.vocab_size, seed=seed,
                             prefix_len=prefix_len)
    result = run_bench(llm, workload, cfg)
    if not json_schema_file:
        _print(result)
        return result
    with open(json_schema_file, encoding="utf-8") as f:
        schema = json.load(f)
    constrained = run_bench(llm, workload, dataclasses.replace(cfg, json_schema=schema))
    _print_side_by_side(result, constrained)
    return {"unconstrained": result, "json_schema": constrained}


SHOWN = ("dtype", "weight_format", "total_params", "active_params", "kv_bytes_per_token", "prompt_tokens",
         "wall_s", "requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s",
         "prefill_tokens_per_s", "decode_tokens_per_s", "prefix_cache_hit_rate", "compute_ms_per_step",
         "comm_ms_per_step", "replica_tokens", "overlap", "decode_step_ms", "decode_host_ms_per_step",
         "decode_host_share_of_step", "roofline_prompt_tokens_per_s", "prompt_tokens_per_s_over_roofline",
         "mfu_vs_measured_matmul", "mfu_with_attention_vs_measured_matmul", "mfu_vs_gpu_peak",
         "mfu_with_attention_vs_gpu_peak", "prefill_mfu_vs_gpu_peak")
COMPARED = ("output_tokens", "wall_s", "requests_per_s", "output_tokens_per_s", "decode_tokens_per_s",
            "decode_time_s", "mask_ms_per_step", "grammar_steps")


def _print(result: dict) -> None:
    for key in SHOWN:
        if result.get(key) is not None:
            click.echo(f"{key:>38}: {result[key]}")


def _print_side_by_side(free: dict, constrained: dict) -> None:
    """The same workload without and with the schema; the ratio is constrained / free."""
    click.echo(f"{'':>38}  {'free':>12}  {'json_schema':>12}  {'ratio':>7}")
    for key in COMPARED:
        a, b = free.get(key), constrained.get(key)
        if a is None and b is None:
            continue
        ratio = f"{b / a:7.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else ""
        click.echo(f"{key:>38}  {'' if a is None else a:>12}  {'' if b is None else b:>12}  {ratio:>7}")

