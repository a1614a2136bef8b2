"""MLA's absorbed decode on CPU: the torch MLA backend (rows gathered into a padded batch, SDPA with a mask)
against batchgen's fused latent decode op (rows read in place from the paged latent cache).

Prints milliseconds per call of both (medians of ``--repeats``), their ratio and the fused op's GFLOP/s (QK^T
over the R + P wide rows and PV over their first R dims) and the rate at which it reads the cache (GB/s), for
each batch and context, every row at the same context, the rows' blocks shuffled through the cache. bf16 on
CPUs with AMX also times the op's portable path (``amx=False``) against its tiles.

    python benchmarks/mla_decode_cpu.py                                  # B 1 8 64, context 512 2048, fp32
    python benchmarks/mla_decode_cpu.py --batches 64 --contexts 4096 --threads 1
"""
from __future__ import annotations

import argparse

import torch
from attention_cpu import median_seconds

from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.cpu.ops import amx_tiles, latent_decode_attention
from batchgen.engine.backends.torch.mla import TorchMLABackend

BLOCK = 16


def case(batch: int, context: int, heads: int, rank: int, rope: int, dtype: torch.dtype):
    """q (B, H, R + P), a latent cache whose blocks are shuffled, and the block tables."""
    gen = torch.Generator().manual_seed(0)
    per_row = -(-context // BLOCK)
    cache = torch.randn(batch * per_row, BLOCK, rank + rope, generator=gen).to(dtype)
    tables = torch.randperm(batch * per_row, generator=gen).to(torch.int32).view(batch, per_row)
    q = torch.randn(batch, heads, rank + rope, generator=gen).to(dtype)
    return q, cache, tables, torch.full((batch,), context, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rank", type=int, default=512, help="kv_lora_rank R (the value width)")
    ap.add_argument("--rope", type=int, default=64, help="rotary key dims P")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not load_kernels():
        raise SystemExit("the fused CPU kernels could not be built here (see the warning above)")
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_features().describe()}; get_cpu_capability() {torch.backends.cpu.get_cpu_capability()}; "
          f"threads {torch.get_num_threads()}; torch {torch.__version__}; {args.dtype}, H {args.heads}, "
          f"R {args.rank}, P {args.rope}")
    tiles = dtype == torch.bfloat16 and amx_tiles()
    print(f"{'B':>4} {'context':>8} {'torch ms':>10} {'fused ms':>10} {'ratio':>6} {'fused GFLOP/s':>14} "
          f"{'cache GB/s':>10}" + (f" {'portable ms':>12} {'AMX / portable':>15}" if tiles else ""))
    torch_backend, scale = TorchMLABackend(), 192 ** -0.5
    for context in args.contexts:
        for batch in args.batches:
            q, cache, tables, ctx = case(batch, context, args.heads, args.rank, args.rope, dtype)
            ref = median_seconds(lambda: torch_backend.decode(q, cache, tables, ctx, context, args.rank, scale),
                                 args.repeats)
            fused = median_seconds(lambda: latent_decode_attention(q, cache, tables, ctx, args.rank, scale),
                                   args.repeats)
            flops = 2 * batch * args.heads * context * (2 * args.rank + args.rope)
            cache_bytes = batch * context * (args.rank + args.rope) * cache.element_size()
            line = (f"{batch:>4} {context:>8} {ref * 1e3:>10.2f} {fused * 1e3:>10.2f} {ref / fused:>6.2f} "
                    f"{flops / fused / 1e9:>14.1f} {cache_bytes / fused / 1e9:>10.1f}")
            if tiles:
                portable = median_seconds(
                    lambda: latent_decode_attention(q, cache, tables, ctx, args.rank, scale, amx=False), args.repeats)
                line += f" {portable * 1e3:>12.2f} {portable / fused:>15.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
