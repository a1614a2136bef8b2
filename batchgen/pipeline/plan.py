"""``batchgen plan``: a dry run that counts a job's rows and prompt tokens exactly, with the tokenizer alone.

The rows go through the job's own stages (reading, id assignment, skip on resume, render + tokenize,
truncation, sort windows), so the counts are the ones the run will record in stats.json. With a prefix
store, a sample of the prompts is looked up in it (the store's keys digest each weight file's first and
last MiB: only those are read).
"""
from __future__ import annotations

import json
from array import array
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import polars as pl

from batchgen.engine.kv_store.estimate import PromptSample, estimate_store_hits, has_local_weights
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.registry import model_config
from batchgen.io import OutputError, OutputFolder, redact
from batchgen.io.paths import filesystem
from batchgen.pipeline import identity, preflight
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.rows import Request, ResultRow
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.stages import input_rows, job_preparer, sorted_requests
from batchgen.pipeline.steps import estimate_steps


@dataclass
class Rates:
    """What the time estimate assumes; ``source`` says where the figures came from."""

    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    prefix_cache_hit_rate: float = 0.0
    completion_tokens_per_row: float | None = None
    source: str = "options"


def rates_from(path: str, storage_options: dict[str, Any] | None = None) -> Rates:
    """The measured rates of an earlier job: its output folder, or its stats.json."""
    try:
        if path.rstrip("/").endswith(".json"):
            fs, inner = filesystem(path, storage_options)
            with fs.open(inner, "rb") as f:
                stats = json.load(f)
        else:
            stats = OutputFolder(path, storage_options).read_json("stats.json")
    except (OSError, ValueError, OutputError) as e:
        raise JobError(redact(f"cannot read the stats of {path}: {e}")) from None
    engine = (stats or {}).get("engine") or {}
    if not engine.get("prefill_tokens_per_s"):
        raise JobError(redact(f"{path} holds no engine rates (no stats.json, or one written before they were "
                              f"recorded); give --prefill-tok-s and --decode-tok-s instead"))
    ok_rows = stats.get("ok_rows") or 0
    return Rates(prefill_tokens_per_s=engine["prefill_tokens_per_s"],
                 decode_tokens_per_s=engine.get("decode_tokens_per_s"),
                 prefix_cache_hit_rate=float(stats.get("prefix_cache_hit_rate") or 0.0),
                 completion_tokens_per_row=stats.get("completion_tokens", 0) / ok_rows if ok_rows else None,
                 source=redact(path))


def _length_stats(lengths: array) -> dict[str, Any]:
    """Prompt length percentiles and a histogram in power-of-two bins."""
    if not lengths:
        return {"rows": 0}
    s = pl.Series("n", lengths, dtype=pl.Int64)
    q = {f"p{p}": int(s.quantile(p / 100, "nearest")) for p in (50, 90, 99)}
    bins = (pl.DataFrame({"n": s}).group_by(pl.col("n").log(2).floor().cast(pl.Int64).alias("k"))
            .len().sort("k"))
    return {"rows": len(s), "min": int(s.min()), "mean": round(float(s.mean()), 1), **q, "max": int(s.max()),
            "histogram": [{"from": 1 << k, "to": (1 << (k + 1)) - 1, "rows": n}
                          for k, n in bins.iter_rows()]}


def plan_job(spec: JobSpec, limit: int | None = None, rates: Rates | None = None,
             completion_tokens: int | None = None) -> dict[str, Any]:
    """Counts what running ``spec`` would do now, without loading weights or writing anything; raises JobError
    where the run would be refused (the output holds rows of another job).

    ``completion_tokens`` per row (default: the earlier job's mean from ``rates``, else the spec's
    ``max_tokens``, an upper bound) drives the expected engine steps; ``rates`` gives the time estimate.
    """
    rates = rates or Rates()
    files = preflight.check_inputs(spec)
    try:
        folder = OutputFolder(spec.output.path, spec.storage_options)
        committed, complete = folder.committed_row_ids(), folder.read_json("_SUCCESS") is not None
    except OutputError as e:
        raise JobError(str(e)) from None
    tokenizer, model_len = preflight.load_tokenizer(spec)
    identity.check_recorded(spec, identity.job_identity(spec))  # what run would refuse, plan refuses too
    preparer = job_preparer(spec, tokenizer, model_len, preflight.carry_columns(spec), committed)
    errors: Counter[str] = Counter()
    over_tokens = 0  # prompt_too_long rows refused for their tokens (not for max_prompt_chars)

    def requests() -> Iterator[Request]:
        nonlocal over_tokens
        for item in preparer.prepare(input_rows(spec, files, limit)):
            if isinstance(item, ResultRow):
                errors[item.error["code"] if item.error else "unknown"] += 1
                over_tokens += bool(item.error) and item.error["code"] == "prompt_too_long" \
                    and "max_prompt_chars" not in item.error["message"]
            else:
                yield item

    lengths = array("q")
    sample = PromptSample() if spec.engine.prefix_cache_store else None

    per_row = completion_tokens or round(rates.completion_tokens_per_row or 0) or spec.sampling.max_tokens

    def prompt_lengths() -> Iterator[tuple[int, int]]:
        """Each request's prompt length and the tokens it generates: ``per_row``, or fewer where its own max_tokens
        (an OpenAI Batch line's) or the context allows fewer."""
        for req in sorted_requests(requests(), spec.batching.sort_window, spec.batching.sort):
            lengths.append(len(req.prompt_ids))
            if sample is not None:
                sample.add(req.prompt_ids)
            yield lengths[-1], max(1, min(per_row, req.params.max_tokens, model_len - lengths[-1]))

    b, engine = spec.batching, spec.engine
    # One engine step runs a step of each data-parallel replica: budgets as the job's stats count them.
    steps = estimate_steps(prompt_lengths(), per_row, engine.token_budget,
                           engine.max_num_seqs * engine.data_parallel_size)
    prompt_tokens = sum(lengths)
    plan = {
        "job": spec.name, "model": spec.resolved()["model"]["path"], "input_files": len(files),
        "complete": complete, "committed_rows": preparer.skipped,
        "rows": len(lengths) + sum(errors.values()), "requests": len(lengths),
        "error_rows": dict(sorted(errors.items())), "prompt_tokens": prompt_tokens,
        "max_prompt_tokens": preparer.max_prompt_tokens,
        "over_max_prompt_tokens": preparer.truncated + over_tokens,
        "truncate": b.truncate, "prompt_length": _length_stats(lengths),
        "completion_tokens_per_row": per_row, "token_budget": engine.token_budget,
        "max_num_batched_tokens": engine.max_num_batched_tokens, "max_num_seqs": engine.max_num_seqs,
        "data_parallel_size": engine.data_parallel_size, "expected_steps": steps.to_dict(),
        "rates": asdict(rates), "estimated_s": None,
        "prefix_store": store_estimate(spec, sample, model_len, prompt_tokens) if sample is not None else None,
    }
    # The earlier job's prefix-cache hit rate, or the store's where it is higher.
    plan["assumed_hit_rate"] = max(rates.prefix_cache_hit_rate, (plan["prefix_store"] or {}).get("hit_rate") or 0.0)
    if rates.prefill_tokens_per_s and rates.decode_tokens_per_s:
        computed = prompt_tokens * (1 - plan["assumed_hit_rate"])
        plan["estimated_s"] = round(computed / rates.prefill_tokens_per_s
                                    + steps.decode_step_tokens / rates.decode_tokens_per_s, 1)
    return plan


def store_estimate(spec: JobSpec, sample: PromptSample, model_len: int, prompt_tokens: int) -> dict[str, Any]:
    """How many prompt tokens the job's prefix store would serve now, from a sample of the prompts; or why
    that cannot be told here."""
    config = spec.engine_config()
    out: dict[str, Any] = {"url": redact(config.prefix_cache_store), "sample_limit": sample.size}
    source = load_model_source(spec.model.path, spec.storage_options, weights=False)
    if not has_local_weights(source):
        return {**out, "unavailable": "the model's weight files are not on this machine (the store's keys "
                                      "digest them): run the job once to fetch them"}
    try:
        found = estimate_store_hits(config, source, model_config(source.config), model_len, sample)
    except Exception as e:  # noqa: BLE001 - an unreachable store, refused credentials: said, not raised
        return {**out, "unavailable": redact(f"cannot look the store up: {type(e).__name__}: {e}")}
    return {**out, "namespace": found.namespace, "dtype": found.dtype, "prompts": found.prompts,
            "sampled_prompts": found.sampled, "hit_rate": round(found.hit_rate, 4),
            "expected_store_tokens": round(found.hit_rate * prompt_tokens)}


def _store_line(store: dict[str, Any], prompt_tokens: int) -> str:
    if "unavailable" in store:
        return f"prefix store {store['url']}: hit rate unknown ({store['unavailable']})"
    return (f"prefix store {store['url']}: {store['expected_store_tokens']:,} of {prompt_tokens:,} prompt "
            f"tokens expected from it ({store['hit_rate']:.1%}), looked up in {store['sampled_prompts']:,} of "
            f"{store['prompts']:,} prompts (a sample of at most {store['sample_limit']}; namespace "
            f"{store['namespace'][:12]}, {store['dtype']})")


def _duration(seconds: float) -> str:
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def format_plan(plan: dict[str, Any], cost_per_hour: float | None = None) -> str:
    """The plan as a few lines for a person."""
    n = plan["prompt_length"]
    steps = plan["expected_steps"]
    lines = [f"{plan['job']}: {plan['rows']:,} rows to run ({plan['requests']:,} to the engine, "
             f"{sum(plan['error_rows'].values()):,} error rows), {plan['committed_rows']:,} already committed"
             + (" (the job is complete: running it does nothing)" if plan["complete"] else ""),
             f"prompt tokens: {plan['prompt_tokens']:,}"]
    if n["rows"]:
        lines.append(f"prompt length: min {n['min']}, p50 {n['p50']}, p90 {n['p90']}, p99 {n['p99']}, "
                     f"max {n['max']}, mean {n['mean']}")
        width = max(h["rows"] for h in n["histogram"])
        lines += [f"  {h['from']:>7}-{h['to']:<7} {h['rows']:>9,} {'#' * max(1, round(30 * h['rows'] / width))}"
                  for h in n["histogram"]]
    lines.append(f"over max_prompt_tokens ({plan['max_prompt_tokens']}): {plan['over_max_prompt_tokens']:,} "
                 f"(truncate: {plan['truncate']})")
    if plan["error_rows"]:
        lines.append("error rows: " + ", ".join(f"{k} {v:,}" for k, v in plan["error_rows"].items()))
    replicas = plan["data_parallel_size"]
    per_replica = f" ({replicas} data-parallel replicas of {plan['max_num_batched_tokens']:,} tokens and " \
        f"{plan['max_num_seqs']} sequences)" if replicas > 1 else ""
    lines.append(f"expected engine steps at a token budget of {plan['token_budget']:,} tokens and "
                 f"{plan['max_num_seqs'] * replicas} sequences per step{per_replica}, "
                 f"{plan['completion_tokens_per_row']} generated tokens per row: "
                 f"{steps['steps']:,} ({steps['prefill_steps']:,} with prompt tokens, "
                 f"{steps['decode_steps']:,} decode only)")
    if plan.get("prefix_store"):
        lines.append(_store_line(plan["prefix_store"], plan["prompt_tokens"]))
    if plan["estimated_s"] is None:
        lines.append("estimated time: give --prefill-tok-s and --decode-tok-s, or --rates-from an earlier job")
    else:
        r = plan["rates"]
        line = (f"estimated time: {_duration(plan['estimated_s'])} at {r['prefill_tokens_per_s']:,.0f} prompt "
                f"and {r['decode_tokens_per_s']:,.0f} decode tok/s, prefix-cache hit rate "
                f"{plan['assumed_hit_rate']:.0%} (rates from {r['source']}; the prefix store's where it is higher)")
        if cost_per_hour is not None:
            line += f"; cost {plan['estimated_s'] / 3600 * cost_per_hour:,.2f} at {cost_per_hour:g} per hour"
        lines.append(line)
    return "\n".join(lines)
