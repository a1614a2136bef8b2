"""The CPU expert op (one call a mixture-of-experts layer) against the torch reference it stands for.

Prints milliseconds per layer of both (medians of ``--repeats``, the two taking turns, each timed call running
``--layers`` layers of their own random experts in turn, so the weights come from memory as in a model's step),
their ratio, the rate the op reads the experts its tokens chose, and the largest difference between the two
outputs. Where the engine packs bf16 experts in ``dot_linear``'s blocks (AVX512-BF16 without AMX), the op over
the packed experts runs too, taking turns with the others. Shapes default to DeepSeek-V3-small's
(benchmarks/random_deepseek.py): 64 experts, hidden 2048, intermediate 768, top-6, random routing.

    python benchmarks/moe_cpu.py                                    # bf16 and fp32, 1 8 64 256 tokens
    python benchmarks/moe_cpu.py --dtypes bfloat16 --tokens 8 --layers 7
    python benchmarks/moe_cpu.py --baseline HEAD    # also the op of a git revision, taking turns with the others
"""
from __future__ import annotations

import argparse
import time

import torch

from batchgen.engine.backends.cpu import build, ops, prepack
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.torch.ops import fused_moe as reference
from decode_cpu import load_baseline


def revision_op(namespace: str):
    """ops.fused_moe's signature, calling the op of a revision built by load_baseline."""
    def call(x, w13, w2, topk_weights, topk_ids):
        out = torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype)
        getattr(torch.ops, namespace).fused_moe(x, w13, w2, topk_weights, topk_ids, False, out)
        return out
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--layers", type=int, default=3, help="layers of experts timed in turn (cold weights)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", help="a git revision whose op also runs (its ms and its time over the op's)")
    args = ap.parse_args()
    features = cpu_features()
    assert build.load_kernels(), "the CPU kernels did not build"
    amx = "amx_bf16" in features.flags
    print(f"CPU: {features.model_name}; get_cpu_capability() {torch.backends.cpu.get_cpu_capability()}; "
          f"avx512_bf16 {'yes' if 'avx512_bf16' in features.flags else 'no'}; amx_bf16 {'yes' if amx else 'no'}; "
          f"threads {torch.get_num_threads()}; {args.experts} experts, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, top-{args.top_k}, {args.layers} layers in turn")
    paths = {"torch": reference, "op": ops.fused_moe}
    if args.baseline:
        paths["baseline"] = revision_op(load_baseline(args.baseline, "moe.cpp"))
    print(f"{'dtype':>9} {'tokens':>7} {'torch ms':>9} {'op ms':>7} {'ratio':>6} {'op GB/s':>8} {'max |diff|':>11}"
          + (f" {'baseline ms':>12} {'over op':>8}" if args.baseline else "")
          + (f" {'packed ms':>10} {'op/packed':>9} {'packed GB/s':>12}" if prepack.dot_linear_runs() else ""))
    gen = torch.Generator().manual_seed(0)
    E, H, inter = args.experts, args.hidden, args.intermediate
    for name in args.dtypes:
        dtype = getattr(torch, name)
        layers = [((torch.randn(E, 2 * inter, H, generator=gen) * 0.02).to(dtype),
                   (torch.randn(E, H, inter, generator=gen) * 0.02).to(dtype)) for _ in range(args.layers)]
        expert_bytes = 3 * inter * H * dtype.itemsize
        packed = dtype == torch.bfloat16 and prepack.dot_linear_runs()
        # Each path: the layers' (w13, w2) it takes (packed ones for the packed op) and its call.
        runs = {label: (layers, fn) for label, fn in paths.items()}
        if packed:
            runs["packed"] = ([prepack.pack_dot_moe(w13, w2) for w13, w2 in layers],
                              lambda x, w13, w2, weights, ids: ops.fused_moe_packed(x, w13, w2, inter, weights, ids))
        for tokens in args.tokens:
            x = torch.randn(tokens, H, generator=gen).to(dtype)
            ids = torch.rand(tokens, E, generator=gen).argsort(dim=1)[:, :args.top_k]
            weights = torch.rand(tokens, args.top_k, generator=gen)
            times: dict[str, list[float]] = {label: [] for label in runs}
            for _ in range(args.repeats):
                for label, (its_layers, fn) in runs.items():
                    start = time.perf_counter()
                    for w13, w2 in its_layers:
                        fn(x, w13, w2, weights, ids)
                    times[label].append((time.perf_counter() - start) * 1e3 / args.layers)
            ms = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            w13, w2 = layers[0]
            diff = (ops.fused_moe(x, w13, w2, weights, ids).float() - reference(x, w13, w2, weights, ids).float())
            chosen = ids.unique().numel()
            print(f"{name:>9} {tokens:>7} {ms['torch']:>9.2f} {ms['op']:>7.2f} {ms['torch'] / ms['op']:>5.2f}x "
                  f"{chosen * expert_bytes / ms['op'] / 1e6:>8.1f} {diff.abs().max().item():>11.3g}"
                  + (f" {ms['baseline']:>12.2f} {ms['baseline'] / ms['op']:>7.2f}x" if args.baseline else "")
                  + (f" {ms['packed']:>10.2f} {ms['op'] / ms['packed']:>8.2f}x "
                     f"{chosen * expert_bytes / ms['packed'] / 1e6:>12.1f}" if packed else ""))


if __name__ == "__main__":
    main()
