"""Where decode time goes: batchgen's engine on random prompts under torch's profiler (profile_prefill.py's method).

    python benchmarks/profile_decode.py [--model smollm2-135m-instruct] [--batch 64] [--prompt-len 128] [--steps 32]

Queues ``--batch`` random prompts of ``--prompt-len`` tokens (max_num_seqs = batch), runs the prefill step and
two decode steps unprofiled, then ``--steps`` decode steps under the profiler, so only decode steps are measured.
It prints each kind of work's share: the linear layers (with their FLOP rate beside the M-row rate the roofline
uses), attention, the elementwise kernels, the sampler, the rest of torch's ops, and the host (Python:
scheduling, metadata), the wall time no op accounts for. The roofline's M-row rate keeps each shape's weight in
the caches; beside it, the rate of the model's own linears called back to back, whose weights (all of them read
once a step) stream from memory as in a step. A mixture of experts' roofline adds its routed experts: their
top-k FLOPs a token, and the weights of the experts a step reads, as many as uniform routing would pick. Where
decode steps replay recorded ops (CPU), ``--steps`` more steps then run without the profiler, each op of the
replay timed on its own (by the replay's C++ program where it runs from one: a clock read around each op, tens
of nanoseconds; else by the replay's Python loop, about a microsecond an op), and the same split is printed for
them (the ops outside the recorded forward, the sampler's, then count as host time).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.dtype import KV_CACHE_DTYPES
from batchgen.engine.loading.hub import resolve_model_path
from op_kinds import kind_of
from decode_workload import (kv_bytes_per_token, linear_shapes, mean_context, random_prompts, read_bandwidth, roofline,
                             routed_experts, streamed_linears_rate)


def profiled_decode(llm: LLM, prompts, steps: int) -> tuple[float, dict[str, tuple[float, int]], Timed | None]:
    """Wall seconds of ``steps`` decode steps under the profiler and each op's (self seconds, calls); then, where
    the steps replay recorded ops (CPU), as many more steps without the profiler, each op timed alone."""
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * steps + 4, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):  # the prefill step, then two decode steps
        engine.step()
    if any(s.num_completion_tokens < 2 for s in seqs):
        raise SystemExit("prompts did not all prefill in one step: raise --max-batch-tokens")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    timed = timed_decode(engine, len(prompts), steps)
    while engine.has_unfinished():
        engine.step()
    return wall, {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}, timed


@dataclass
class Timed:
    wall_s: float  # the steps' wall time
    op_seconds: dict[str, float]  # per op name, as the profiler names ops


def timed_decode(engine, batch: int, steps: int) -> Timed | None:
    """``steps`` decode steps with no profiler, each recorded op timed on its own; None where decode steps do
    not replay recorded ops."""
    recording = getattr(getattr(engine.executor.runner, "graphs", None), "recordings", {}).get(batch)
    if recording is None or not hasattr(recording, "op_seconds"):
        return None
    recording.op_seconds = seconds = {}
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    recording.op_seconds = None
    # "batchgen_cpu.dot_linear.default" -> "batchgen_cpu::dot_linear"
    return Timed(wall, {name.replace(".", "::", 1).rsplit(".", 1)[0]: sec for name, sec in seconds.items()})


def kinds_of(op_seconds: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds per kind of work; the host's is the wall time no op accounts for."""
    by_kind: dict[str, float] = defaultdict(float)
    for name, seconds in op_seconds.items():
        by_kind[kind_of(name)] += seconds
    by_kind["host (Python, no op)"] = max(0.0, wall_s - sum(by_kind.values()))
    return by_kind


def print_kinds(by_kind: dict[str, float], steps: int, wall_s: float, linear_flops: float) -> None:
    print(f"{'kind of work':>32} {'ms/step':>8} {'share':>6} {'GFLOP/s':>8}")
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        rate = f"{linear_flops / seconds / 1e9:8.0f}" if kind == "linear layers" and seconds > 0 else f"{'':>8}"
        print(f"{kind:>32} {seconds / steps * 1e3:8.2f} {seconds / wall_s:6.1%} {rate}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default=None, help="torch: the unfused path, for comparison")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"],
                    help="off: decode steps run eagerly instead of replaying their recorded ops")
    ap.add_argument("--top", type=int, default=14, help="ops listed by self time")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(resolve_model_path(args.model), dtype=args.dtype, device="cpu", max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, args.batch * args.prompt_len), enable_prefix_caching=False,
              attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
              cuda_graphs=args.cuda_graphs)
    prompts = random_prompts(llm.tokenizer.vocab_size, args.batch, args.prompt_len)
    # Warm-up over as many blocks as the profiled run takes, so it writes into mapped cache pages as a running
    # job does, not into never-touched ones.
    llm.generate(prompts, SamplingParams(max_tokens=2 * args.steps + 4, temperature=0, ignore_eos=True))
    decode_s, ops, timed = profiled_decode(llm, prompts, args.steps)
    ops = {k: (sec, n) for k, (sec, n) in ops.items() if n}
    by_kind = kinds_of({name: seconds for name, (seconds, _) in ops.items()}, decode_s)

    dtype = llm.config.dtype_choice
    shapes = linear_shapes(llm)
    # The profiled steps follow the prefill and two decode steps: the first reads the prompt and 3 new tokens.
    cache_bytes_per_row = round(kv_bytes_per_token(llm) * mean_context(args.prompt_len + 3, args.steps))
    roof = roofline(shapes, args.batch, dtype.torch_dtype, read_bandwidth(), cache_bytes_per_row, routed_experts(llm))
    tokens = args.batch * args.steps
    linear = roof.flops_per_token * tokens
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}, "
          f"dtype {dtype.name}, attention backend {llm.engine.executor.runner.kernels.attention.name}; "
          f"{args.batch} prompts of {args.prompt_len} tokens, {args.steps} decode steps")
    print(f"decode {tokens / decode_s:,.0f} tok/s ({decode_s / args.steps * 1e3:.1f} ms/step, under the profiler)")
    print_kinds(by_kind, args.steps, decode_s, linear)
    unprofiled = None
    if timed is not None:
        unprofiled = kinds_of(timed.op_seconds, timed.wall_s)
        print(f"the next {args.steps} steps without the profiler, each replayed op timed alone: "
              f"{tokens / timed.wall_s:,.0f} tok/s ({timed.wall_s / args.steps * 1e3:.1f} ms/step)")
        print_kinds(unprofiled, args.steps, timed.wall_s, linear)
    print(f"{args.batch}-row matmul rate over the model's shapes: {roof.matmul_rate / 1e9:,.0f} GFLOP/s "
          f"({roof.compute_tok_s:,.0f} tok/s); weights read at {roof.bandwidth / 1e9:.1f} GB/s "
          f"({roof.memory_tok_s:,.0f} tok/s); roofline {roof.tok_s:,.0f} tok/s, measured (profiled) "
          f"{tokens / decode_s / roof.tok_s:.0%} of it"
          + (f", unprofiled {tokens / timed.wall_s / roof.tok_s:.0%}" if timed else "")
          + f"; with each row's K/V read too, "
          f"{roof.with_cache_tok_s:,.0f} tok/s ({tokens / decode_s / roof.with_cache_tok_s:.0%})")
    streamed = streamed_linears_rate(llm, args.batch)
    experts = any("fused_moe" in name for name in ops)  # counted as linear layers, but not among these
    print(f"the model's linears back to back, their weights streamed from memory as a step streams them: "
          f"{streamed / 1e9:,.0f} GFLOP/s ({streamed / roof.matmul_rate:.0%} of the {args.batch}-row rate)"
          + (f"; the profiled steps' linears ran at {linear / by_kind['linear layers'] / streamed:.0%} of that"
             if by_kind["linear layers"] and not experts else ""))
    print(f"\ntop {args.top} ops by self time in the decode steps" + (" (unprofiled beside)" if timed else "") + ":")
    for name, (seconds, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:args.top]:
        alone = timed.op_seconds.get(name) if timed else None
        alone = f"{alone / args.steps * 1e3:8.3f}" if alone is not None else f"{'':>8}"
        print(f"  {seconds / args.steps * 1e3:8.3f} {alone} ms/step {calls / args.steps:7.1f} calls/step  {name}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "decode_tok_s_profiled": tokens / decode_s, "ms_per_step_by_kind":
                {k: v / args.steps * 1e3 for k, v in by_kind.items()},
            "rows_matmul_gflops": roof.matmul_rate / 1e9, "roofline_tok_s": roof.tok_s,
            "flop_bound_tok_s": roof.compute_tok_s, "read_bound_tok_s": roof.memory_tok_s,
            "with_cache_bound_tok_s": roof.with_cache_tok_s, "streamed_linears_gflops": streamed / 1e9,
            "decode_tok_s_unprofiled": tokens / timed.wall_s if timed else None,
            "unprofiled_ms_per_step_by_kind": {k: v / args.steps * 1e3 for k, v in unprofiled.items()}
            if unprofiled else None}, indent=2) + "\n")


if __name__ == "__main__":
    main()
