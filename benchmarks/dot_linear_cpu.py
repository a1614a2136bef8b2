"""The bf16 linear in dot-product blocks (``batchgen_cpu.dot_linear``) against oneDNN's prepacked linear and
``F.linear``, on SmolLM2's shapes, with weights streamed from memory as a model streams them.

    python benchmarks/dot_linear_cpu.py [--rows 1 8 64 512 2048 8192] [--repeats 5]

Per row count M, one layer's worth of SmolLM2-135M projections (qkv 576x960, gate-up 576x3072, down 1536x576,
o 576x576), ``--copies`` of each (default: 8, so that the weights, 56 MB, stream from memory; 2 past 512 rows,
where the products take long enough for the weights either way): each path's best time for the whole set (paths
taking turns), its GFLOP/s, and the ratio to oneDNN's. Prints ``get_cpu_capability()`` and whether ``amx_bf16``
is in /proc/cpuinfo: the engine runs ``dot_linear`` on CPUs with AVX512-BF16 and no AMX.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from batchgen.engine.backends.cpu import prepack
from decode_workload import amx_bf16_in_cpuinfo

SHAPES = [(960, 576), (3072, 576), (576, 1536), (576, 576)]  # (out, in)


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 24, 64, 128, 512, 2048, 8192])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not prepack.dot_linear_runs():
        raise SystemExit("dot_linear does not run here: it needs AVX512-BF16 (and no AMX)")
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 in /proc/cpuinfo: "
          f"{amx_bf16_in_cpuinfo()}, threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    weights = {s: [torch.randn(*s, generator=gen).to(torch.bfloat16) for _ in range(args.copies)] for s in SHAPES}
    dot = {s: [prepack.PrepackedLinear(w, None) for w in ws] for s, ws in weights.items()}
    runs = prepack.dot_linear_runs
    prepack.dot_linear_runs = lambda: False  # the same class over oneDNN's blocked layout
    try:
        onednn = {s: [prepack.PrepackedLinear(w, None) for w in ws] for s, ws in weights.items()}
    finally:
        prepack.dot_linear_runs = runs
    assert all(m.dot for ms in dot.values() for m in ms) and not any(m.dot for ms in onednn.values() for m in ms)
    print("| rows | dot_linear ms | GFLOP/s | oneDNN prepacked ms | GFLOP/s | F.linear ms | dot_linear / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for m in args.rows:
        copies = args.copies if m <= 512 else min(args.copies, 2)
        xs = {s: torch.randn(m, s[1], generator=gen).to(torch.bfloat16) for s in SHAPES}

        def over(layers):
            return lambda: [layer(xs[s]) for s in SHAPES for layer in layers[s][:copies]]

        plain = {s: [lambda x, w=w: F.linear(x, w) for w in ws] for s, ws in weights.items()}
        times = {name: float("inf") for name in ("dot", "onednn", "plain")}
        for _ in range(2):  # the paths take turns
            for name, layers in (("dot", dot), ("onednn", onednn), ("plain", plain)):
                times[name] = min(times[name], best_seconds(over(layers), args.repeats))
        flops = sum(2 * m * n * k for n, k in SHAPES) * copies
        print(f"| {m} | {times['dot'] * 1e3:.3f} | {flops / times['dot'] / 1e9:.0f} | {times['onednn'] * 1e3:.3f} | "
              f"{flops / times['onednn'] / 1e9:.0f} | {times['plain'] * 1e3:.3f} | "
              f"**{times['onednn'] / times['dot']:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
