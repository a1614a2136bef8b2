"""Where prefill time goes: batchgen's engine on compare_hf.py's prompts under torch's profiler.

    python benchmarks/profile_prefill.py [--model smollm2-135m-instruct] [--num-prompts 40]

Runs the prompts with max_tokens=1 (prefix caching off) once to warm up, once timed without the profiler and
once under it, then prints each kind of work's share of the profiled wall time: the linear layers, the
attention op, the elementwise kernels, the rest of torch's ops, and the host (Python: scheduling, metadata,
sampling), which is the wall time no op accounts for. The linear layers' and attention's FLOP rates inside the
model are printed beside the standalone matmul rate the roofline of compare_hf.py uses, so the gap between
that roofline and the measured speed can be read off: how much is linear layers slower than the benchmark
matmul, how much attention, how much everything else.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.engine.flops import attention_flops
from batchgen.engine.matmul_rate import measure_matmul_flops
from batchgen.bench.workload import from_documents
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.loading.hub import resolve_model_path
from op_kinds import kind_of

DATA = Path(__file__).resolve().parent.parent / "jobs" / "data" / "articles.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--lengths", default="100:2000")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=12, help="ops listed by self time")
    ap.add_argument("--output-json")
    args = ap.parse_args()

    llm = LLM(resolve_model_path(args.model), dtype=args.dtype, device="cpu",
              max_num_batched_tokens=args.max_batch_tokens, enable_prefix_caching=False)
    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    prompts = from_documents(texts, llm.tokenizer, args.num_prompts, args.lengths).prompts
    tokens = sum(map(len, prompts))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts, params)  # warm-up: kernels built, buffers sized
    start = time.perf_counter()
    llm.generate(prompts, params)
    plain_s = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        profiled_s = time.perf_counter() - start

    by_kind: dict[str, float] = defaultdict(float)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    for event in ops:
        by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e6
    by_kind["host (Python, no op)"] = max(0.0, profiled_s - sum(by_kind.values()))

    cfg = llm.profile()
    linear = 2 * cfg.active_params * tokens + 2 * cfg.lm_head_params * len(prompts)
    attention = sum(attention_flops(cfg, 0, len(p)) for p in prompts)
    dtype = llm.config.dtype_choice
    matmul_rate = measure_matmul_flops(dtype.torch_dtype, torch.device("cpu"))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}, "
          f"dtype {dtype.name} ({dtype.reason}); {len(prompts)} prompts, {tokens} tokens")
    print(f"prefill {tokens / plain_s:,.0f} tok/s ({plain_s:.2f} s); under the profiler {profiled_s:.2f} s")
    print(f"{'kind of work':>32} {'seconds':>8} {'share':>6} {'GFLOP/s':>8}")
    rates = {"linear layers": linear, "attention": attention}
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        rate = f"{rates[kind] / seconds / 1e9:8.0f}" if kind in rates and seconds else f"{'':>8}"
        print(f"{kind:>32} {seconds:8.2f} {seconds / profiled_s:6.1%} {rate}")
    print(f"standalone {dtype.name} matmul (the roofline's rate): {matmul_rate / 1e9:,.0f} GFLOP/s")
    roof = (linear + attention) / matmul_rate
    print(f"roofline (all matmul FLOPs at that rate): {tokens / roof:,.0f} tok/s; measured is "
          f"{roof / plain_s:.0%} of it")
    print(f"\ntop {args.top} ops by self time:")
    for event in ops[:args.top]:
        print(f"  {event.self_cpu_time_total / 1e6:7.3f} s {event.count:7d} calls  {event.key}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "tokens": tokens, "prefill_tok_s": tokens / plain_s, "profiled_s": profiled_s,
            "seconds_by_kind": dict(by_kind), "linear_flops": linear, "attention_flops": attention,
            "matmul_flops_per_s": matmul_rate}, indent=2) + "\n")


if __name__ == "__main__":
    main()
