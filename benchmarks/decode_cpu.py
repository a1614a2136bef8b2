"""The fused CPU paged decode attention alone: batchgen's op against torch's path (``paged_decode``: K/V gathered
into a padded batch, SDPA with a mask) and, with ``--baseline REF``, against the op as it was at a git revision.

Prints milliseconds per call (medians of ``--repeats`` runs, the variants interleaved run by run, so a shared
machine's load falls on all of them alike) and GFLOP/s (QK^T and PV: 4 B Hq context D), for each batch and
context, every row at the same context, the rows' blocks shuffled through the cache (``--blocks in-order``: each
row's blocks one after another, as a fresh engine hands them out; the hardware's prefetchers then follow the
reads, so software prefetch counts for less than in shuffled tables). For the fused op it also
prints the rate it reads the rows' K and V at, and that rate as a share of the rate this machine's threads read a
large buffer (decode_workload.read_bandwidth: the memory roofline of a cold call). With ``--layers N``
each timed call runs the op over N caches in turn and the figures are per cache: as in a model's decode step,
where each layer reads its own cache, cold (N = 30 at batch 64 holds more than the CPU's caches). The
baseline's sources
(``decode.cpp`` and the headers at REF) are built once under another op namespace into the batchgen
cache; nothing of it is kept in the tree. With ``--kv-cache-dtype fp8_e4m3`` (or fp8_e5m2, or bfloat16 under
``--dtype float32``) the fused op reads caches of that narrower dtype, and the op over the same values in caches of
``--dtype`` is timed beside it.

    python benchmarks/decode_cpu.py                                      # B 1 8 64, context 128 512 2048
    python benchmarks/decode_cpu.py --baseline main --threads 1 --repeats 15
    python benchmarks/decode_cpu.py --baseline main --batches 64 --contexts 160 --layers 30 --no-torch
    python benchmarks/decode_cpu.py --dtype bfloat16 --kv-cache-dtype fp8_e4m3 --layers 30 --no-torch
    python benchmarks/decode_cpu.py --kv-cache-dtype bfloat16 --batches 64 --contexts 192 --layers 30 --no-torch
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch
from attention_cpu import add_timing_args, timing_clock
from decode_workload import read_bandwidth

from batchgen.engine.backends.cpu import build
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.cpu.ops import SPLIT_KEYS, amx_tiles
from batchgen.engine.backends.torch.attention import paged_decode
from batchgen.engine.dtype import KV_CACHE_DTYPES, to_cache_dtype

BLOCK = 16
CSRC = "batchgen/engine/backends/cpu/csrc"
BASELINE_SOURCE = "decode.cpp"  # built with every header of its revision


def case(batch: int, context: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, layers: int = 1,
         shuffled: bool = True):
    """q (B, Hq, D) as a view of a fused qkv, ``layers`` pairs of paged K and V caches (one block table for all,
    its blocks shuffled or in order), the block tables and context lengths."""
    gen = torch.Generator().manual_seed(0)
    heads = kv_heads * group
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(batch, heads, head_dim)
    per_row = -(-context // BLOCK)
    caches = [tuple(torch.randn(batch * per_row, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
                    for _ in range(2)) for _ in range(layers)]
    order = torch.randperm(batch * per_row, generator=gen) if shuffled else torch.arange(batch * per_row)
    tables = order.to(torch.int32).view(batch, per_row)
    return q, caches, tables, torch.full((batch,), context, dtype=torch.int32)


def load_baseline(ref: str, source: str = BASELINE_SOURCE) -> str:
    """Builds the ops of ``source`` (a file of csrc/, the decode op's by default) at git revision ``ref`` as
    ``torch.ops.batchgen_cpu_<sha>``; returns that namespace."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", ref], check=True, capture_output=True,
                         text=True).stdout.strip()
    namespace = f"batchgen_cpu_{sha}"
    from batchgen.io.paths import cache_dir

    folder = cache_dir() / "cpu" / f"baseline-{sha}-{Path(source).stem}"
    folder.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{sha}:{CSRC}"], check=True,
                            capture_output=True, text=True).stdout.split()
    for name in [source] + [n for n in listed if n.endswith(".h")]:
        text = subprocess.run(["git", "-C", str(root), "show", f"{sha}:{CSRC}/{name}"], check=True,
                              capture_output=True, text=True).stdout
        (folder / name).write_text(text.replace("batchgen_cpu", namespace))
    from torch.utils import cpp_extension

    features = cpu_features()
    with build._ninja_on_path():
        cpp_extension.load(name=namespace, sources=[str(folder / source)],
                           extra_cflags=[*build.COMMON_FLAGS, *build.ISA_FLAGS[features.isa]],
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False)
    return namespace


def op_call(namespace: str, q, caches, tables, context_lens, scale: float, tiles: bool | None = None):
    """Calls of ``torch.ops.<namespace>.paged_decode_attention``, one per (K, V) pair of ``caches``, into an
    output allocated here, once; ``tiles`` for an op that takes it (the AMX choice; a revision's op from before
    it does not)."""
    op, out = getattr(torch.ops, namespace).paged_decode_attention, torch.empty_like(q)
    extra = () if tiles is None else (tiles,)

    def run() -> None:
        for k_cache, v_cache in caches:
            op(q, k_cache, v_cache, tables, context_lens, scale, 0, 0.0, SPLIT_KEYS, *extra, out)
    return run


def takes_tiles(namespace: str) -> bool:
    return any(a.name == "tiles" for a in getattr(torch.ops, namespace).paged_decode_attention.default._schema.arguments)


def interleaved_medians(fns: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Seconds per call of each function, median of ``repeats`` rounds that run each once, in turn; the order
    turns round by round, so no function always follows the same other one (whose data filled the caches)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--baseline", default=None, help="a git revision whose decode op to time too (e.g. main)")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's path out")
    ap.add_argument("--layers", type=int, default=1, help="caches each timed call runs over, in turn (cold)")
    ap.add_argument("--blocks", default="shuffled", choices=["shuffled", "in-order"],
                    help="the rows' blocks in the cache: shuffled, or each row's one after another")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="what the fused op's caches hold (narrower than --dtype: the op over --dtype caches is "
                         "timed too)")
    add_timing_args(ap)
    args = ap.parse_args()
    clock = timing_clock(args)
    if not build.load_kernels():
        raise SystemExit("the fused CPU kernels could not be built here (see the warning above)")
    baseline = load_baseline(args.baseline) if args.baseline else None
    dtype = getattr(torch, args.dtype)
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    print(f"CPU: {cpu_features().describe()}; get_cpu_capability() {torch.backends.cpu.get_cpu_capability()}; "
          f"amx_bf16 {'yes' if amx else 'no'}; threads {torch.get_num_threads()}; torch {torch.__version__}; "
          f"{args.dtype}, KV heads {args.kv_heads}, group {args.group}, head dim {args.head_dim}, "
          f"{args.layers} cache(s) in turn, blocks {args.blocks}; KV cache {args.kv_cache_dtype}; "
          f"{'thread' if args.thread_time else 'wall'} time; load average {Path('/proc/loadavg').read_text()[:14]}")
    bandwidth = read_bandwidth()
    print(f"memory read (a sum over 512 MB): {bandwidth / 1e9:.1f} GB/s")
    tiles = amx_tiles() and dtype == torch.bfloat16  # then also the op without its AMX scores
    narrow = KV_CACHE_DTYPES[args.kv_cache_dtype]
    names = (["torch"] if not args.no_torch else []) + (["baseline"] if baseline else []) + \
        (["no AMX"] if tiles else []) + ([f"{args.dtype} KV"] if narrow else []) + ["fused"]
    print(f"{'B':>4} {'context':>8} " + " ".join(f"{n + ' ms':>12} {n + ' GF/s':>12}" for n in names)
          + f" {'fused GB/s':>11} {'of read':>8}" + (f" {'fused/baseline':>15}" if baseline else "")
          + (f" {'narrow speedup':>15}" if narrow else ""))
    scale = args.head_dim ** -0.5
    for context in args.contexts:
        for batch in args.batches:
            q, caches, tables, ctx = case(batch, context, args.kv_heads, args.group, args.head_dim, dtype,
                                          args.layers, shuffled=args.blocks == "shuffled")
            wide = caches
            if narrow:
                caches = [tuple(to_cache_dtype(c, narrow) for c in pair) for pair in caches]
                wide = [tuple(c.to(dtype) for c in pair) for pair in caches]  # the same values
            # Both ops write into a tensor made once (the wrapper's allocation would cost the fused op alone).
            fns = {"fused": op_call("batchgen_cpu", q, caches, tables, ctx, scale, tiles=True)}
            if narrow:
                fns[f"{args.dtype} KV"] = op_call("batchgen_cpu", q, wide, tables, ctx, scale, tiles=True)
            if baseline:
                fns["baseline"] = op_call(baseline, q, caches, tables, ctx, scale,
                                          tiles=True if takes_tiles(baseline) else None)
            if tiles:
                fns["no AMX"] = op_call("batchgen_cpu", q, caches, tables, ctx, scale, tiles=False)
            if not args.no_torch:
                fns["torch"] = lambda: [paged_decode(q, k, v, tables, ctx, context, scale) for k, v in wide]
            seconds = {n: t / args.layers for n, t in interleaved_medians(fns, args.repeats, clock).items()}
            flops = 4 * batch * q.shape[1] * context * args.head_dim
            row = " ".join(f"{seconds[n] * 1e3:>12.3f} {flops / seconds[n] / 1e9:>12.1f}" for n in names)
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * caches[0][0].element_size()
            kv_rate = kv_bytes / seconds["fused"]
            ratio = f" {seconds['baseline'] / seconds['fused']:>15.2f}" if baseline else ""
            if narrow:
                ratio += f" {seconds[f'{args.dtype} KV'] / seconds['fused']:>15.2f}"
            read = f"{kv_rate / 1e9:>11.1f} {kv_rate / bandwidth:>8.0%}"
            print(f"{batch:>4} {context:>8} {row} {read}{ratio}", flush=True)


if __name__ == "__main__":
    main()
