"""The `batchgen bench` command: prompt throughput of the engine, as figures and JSON."""
from __future__ import annotations

import dataclasses
import json
import logging

import click

from batchgen.bench.options import engine_config, engine_options
from batchgen.bench.runner import DEFAULT_MODEL, BenchConfig, make_llm, run_bench
from batchgen.bench.workload import from_documents, parse_length, synthetic


def _read_texts(path: str, column: str) -> list[str]:
    from batchgen.io import expand_inputs, read_rows

    texts = [str(r.values[column]) for r in read_rows(expand_inputs(path)) if r.values.get(column)]
    if not texts:
        raise click.UsageError(f"no rows with a {column!r} value in {path}")
    return texts


@click.command("bench")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Built-in name, model folder, or GGUF file.")
@click.option("--num-prompts", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--input-len", default="1024", show_default=True, callback=lambda ctx, param, value: _length(value),
              help="Prompt length: N, or LOW:HIGH (uniform for synthetic, log-uniform for --dataset).")
@click.option("--dataset", default=None, help="JSONL/Parquet file of documents to cut prompts from.")
@click.option("--column", default="text", show_default=True, help="Text column of --dataset.")
@click.option("--whole-documents", is_flag=True, help="With --dataset: one whole document per prompt.")
@click.option("--prefix-len", default=0, show_default=True, type=click.IntRange(min=0), help="Tokens of a prefix shared by all prompts.")
@click.option("--output-len", default=1, show_default=True, type=click.IntRange(min=1), help="Generated tokens (1 = prefill only).")
@click.option("--json-schema", "json_schema_file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Also run the workload with every output constrained to this JSON Schema, and compare.")
@click.option("--seed", default=0, show_default=True)
@click.option("--output-json", default=None, help="Also write the results to this file.")
@engine_options
def bench(model, num_prompts, input_len, dataset, column, whole_documents, prefix_len, output_len, json_schema_file,
          seed, output_json, **engine):
    """Measure prompt (prefill) and output throughput of the engine."""
    logging.basicConfig(level=logging.WARNING)
    cfg = BenchConfig(engine=engine_config(model, engine), output_len=output_len)
    with make_llm(cfg) as llm:
        longest = prefix_len + parse_length(input_len)[1] + output_len
        if not dataset and longest > llm.engine.max_model_len:
            raise click.BadParameter(f"prompts of up to {longest - output_len} tokens and {output_len} generated do "
                                     f"not fit the engine's context of {llm.engine.max_model_len}",
                                     param_hint="'--input-len' / '--prefix-len' / '--output-len'")
        result = _bench(llm, cfg, dataset, column, whole_documents, num_prompts, input_len, prefix_len, seed,
                        json_schema_file)
    text = json.dumps(result, indent=2)
    click.echo(text)
    if output_json:
        with open(output_json, "w") as f:
            f.write(text + "\n")


def _length(value: str) -> str:
    try:
        parse_length(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected N or LOW:HIGH with 1 <= LOW <= HIGH") from None
    return value


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
         "mfu_vs_measured_matmul", "mfu_with_attention_vs_measured_matmul", "mfu", "mfu_with_attention",
         "prefill_mfu")
COMPARED = ("output_tokens", "wall_s", "requests_per_s", "output_tokens_per_s", "decode_tokens_per_s",
            "decode_time_s", "mask_ms_per_step", "grammar_steps")


SPECULATIVE_SHOWN = ("proposed_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "steps_saved",
                     "drafting_share")


def _print(result: dict) -> None:
    for key in SHOWN:
        if result.get(key) is not None:
            click.echo(f"{key:>38}: {result[key]}")
    for method, figures in (result.get("speculative") or {}).items():
        for key in SPECULATIVE_SHOWN:
            click.echo(f"{f'speculative {method} {key}':>38}: {figures.get(key)}")


def _print_side_by_side(free: dict, constrained: dict) -> None:
    """The same workload without and with the schema; the ratio is constrained / free."""
    click.echo(f"{'':>38}  {'free':>12}  {'json_schema':>12}  {'ratio':>7}")
    for key in COMPARED:
        a, b = free.get(key), constrained.get(key)
        if a is None and b is None:
            continue
        ratio = f"{b / a:7.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else ""
        click.echo(f"{key:>38}  {'' if a is None else a:>12}  {'' if b is None else b:>12}  {ratio:>7}")

