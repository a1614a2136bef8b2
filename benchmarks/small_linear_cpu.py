"""The fused small-row fp32 linear (``batchgen_cpu.small_linear``) against ``F.linear``, on SmolLM2's shapes.

    python benchmarks/small_linear_cpu.py [--rows 1 2 5 8 16 32 64] [--threads N] [--repeats 25]

Per row count M, one layer's worth of SmolLM2-135M projections (qkv 576x960, gate-up 576x3072, down 1536x576,
o 576x576), eight copies each so that the weights (113 MB) stream from memory as in a model: the median time of
the whole set under each path, interleaved shape by shape, the ratio, and the weight bandwidth each reaches.
Prints ``get_cpu_capability()``. Rows up to ``row_methods.SMALL_ROWS`` run the op in the engine.
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from attention_cpu import median_seconds
from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.row_methods import SMALL_ROWS

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 576)]  # (in, out)
COPIES = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 24, 32, 40, 64])
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not load_kernels():
        raise SystemExit("the fused CPU kernels could not be built here")
    op = torch.ops.batchgen_cpu.small_linear
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=gen) for _ in range(COPIES)] for k, n in SHAPES]
    weight_bytes = sum(w.numel() * 4 for ws in layers for w in ws)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{weight_bytes / 1e6:.0f} MB of fp32 weights, engine threshold {SMALL_ROWS} rows")
    print(f"{'rows':>4} {'F.linear ms':>11} {'op ms':>8} {'ratio':>6} {'F GB/s':>7} {'op GB/s':>8}")
    with torch.inference_mode():
        for m in args.rows:
            plain = fused = 0.0
            for (k, n), weights in zip(SHAPES, layers):
                x = torch.randn(m, k, generator=gen)
                outs = [torch.empty(m, n) for _ in weights]
                op(x, weights[0], None, outs[0])
                torch.testing.assert_close(outs[0], F.linear(x, weights[0]), rtol=1e-4, atol=1e-4)
                plain += median_seconds(lambda: [F.linear(x, w) for w in weights], args.repeats)
                fused += median_seconds(lambda: [op(x, w, None, o) for w, o in zip(weights, outs)], args.repeats)
            print(f"{m:>4} {plain * 1e3:>11.2f} {fused * 1e3:>8.2f} {plain / fused:>6.2f} "
                  f"{weight_bytes / plain / 1e9:>7.1f} {weight_bytes / fused / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
