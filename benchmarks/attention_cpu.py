"""Causal prefill attention on CPU: batchgen's fused op against torch's SDPA (its CPU flash kernel), and on CPUs
with AMX the op's AMX tiles against its brgemm path.

Prints GFLOP/s (causal QK^T and PV of the positions computed) of both and their ratio, medians of
``--repeats`` runs, for each sequence length, head dim, GQA group and dtype. Rows marked "packed" run several
sequences in one step; "prefix" rows attend to a cached prefix read from the paged KV cache (the torch
backend gathers it and runs SDPA with a mask, as the engine does).

    python benchmarks/attention_cpu.py                       # the full grid, both dtypes
    python benchmarks/attention_cpu.py --lens 512 2048 --dtypes bfloat16 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.cpu.ops import amx_tiles, varlen_causal_attention
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.torch.attention import TorchAttentionBackend

BLOCK = 16


def case(seq_lens: list[int], prefix: int, heads: int, group: int, head_dim: int, dtype: torch.dtype):
    """Inputs of one step: q/k/v as views of a fused qkv (as the model makes them) and a paged cache."""
    kv_heads = heads // group
    total = sum(seq_lens)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(total, -1, head_dim) for x in (q, k, v))
    ctx = [n + prefix for n in seq_lens]
    blocks_per_seq = -(-max(ctx) // BLOCK)
    k_cache = torch.randn(len(seq_lens) * blocks_per_seq, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(len(seq_lens) * blocks_per_seq, dtype=torch.int32).view(len(seq_lens), -1)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.cat([tables[i].repeat_interleave(BLOCK)[:c][prefix:] * BLOCK
                       + torch.arange(c)[prefix:] % BLOCK for i, c in enumerate(ctx)]).long()
    meta = AttentionMetadata(cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=torch.tensor(ctx, dtype=torch.int32),
                             max_seqlen_q=max(seq_lens), max_seqlen_k=max(ctx), slot_mapping=slots,
                             block_tables=tables, query_lens=list(seq_lens), context_lens_list=ctx)
    TorchAttentionBackend().store_kv(k, v, k_cache, v_cache, slots)
    flops = sum(4 * heads * head_dim * ((c * (c + 1) - prefix * (prefix + 1)) // 2) for c in ctx)
    return q, k, v, k_cache, v_cache, meta, flops


def median_seconds(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--thread-time", action="store_true",
                    help="with --threads 1 on a shared machine: time the CPU this thread used, not wall time")


def timing_clock(args: argparse.Namespace):
    """Sets torch's thread count from ``--threads``; returns the clock ``--thread-time`` asks for."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.thread_time and torch.get_num_threads() != 1:
        raise SystemExit("--thread-time needs --threads 1 (other threads' work would not be counted)")
    return time.thread_time if args.thread_time else time.perf_counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 3], help="query heads per KV head")
    ap.add_argument("--heads", type=int, default=9, help="query heads")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=7)
    add_timing_args(ap)
    args = ap.parse_args()
    clock = timing_clock(args)
    if not load_kernels():
        raise SystemExit("the fused CPU kernels could not be built here (see the warning above)")
    print(f"CPU: {cpu_features().describe()}; threads {torch.get_num_threads()}; torch {torch.__version__}")
    shapes = [([n], 0) for n in args.lens] + [([256] * 8, 0), ([512], 1536)]
    torch_backend = TorchAttentionBackend()
    tiles = amx_tiles()
    print(f"{'dtype':>8} {'D':>4} {'G':>2} {'case':>16} {'torch GFLOP/s':>14} {'fused GFLOP/s':>14} {'ratio':>6}"
          + (f" {'brgemm GFLOP/s':>15} {'AMX / brgemm':>12}" if tiles else ""))
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for head_dim in args.head_dims:
            for group in args.groups:
                if args.heads % group:
                    continue
                for lens, prefix in shapes:
                    q, k, v, kc, vc, meta, flops = case(lens, prefix, args.heads, group, head_dim, dtype)
                    scale = head_dim ** -0.5
                    ref = median_seconds(lambda: torch_backend.forward(q, k, v, kc, vc, meta, scale), args.repeats,
                                         clock)
                    def fused_op(amx: bool = True):
                        return varlen_causal_attention(q, k, v, kc, vc, meta.cu_seqlens_q, meta.context_lens,
                                                       meta.block_tables, scale, amx=amx)
                    fused = median_seconds(fused_op, args.repeats, clock)
                    name = (f"{len(lens)}x{lens[0]} packed" if len(lens) > 1
                            else f"{lens[0]}" + (f" +{prefix} cached" if prefix else ""))
                    line = (f"{dtype_name:>8} {head_dim:>4} {group:>2} {name:>16} {flops / ref / 1e9:>14.1f} "
                            f"{flops / fused / 1e9:>14.1f} {ref / fused:>6.2f}")
                    if tiles:  # the fused op's brgemm path on the same step (fp32 runs it either way)
                        brgemm = median_seconds(lambda: fused_op(False), args.repeats, clock)
                        line += f" {flops / brgemm / 1e9:>15.1f} {brgemm / fused:>12.2f}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
