"""Prints `batchgen bench --output-json` results side by side, one row per file.

    python benchmarks/bench_table.py /tmp/gpu_check/bench-*.json
    python benchmarks/bench_table.py --decode /tmp/gpu_check/bench-*-decode-*.json


MFU counts the matmul weights each token passes through (active parameters: for a mixture of
experts its routed top-k and shared experts) and the LM head; the attention column adds attention's
FLOPs (for latent attention, as the model writes it: q/k over nope + rope dims, v over v dims).
With --decode: decode tok/s and the host's work per decode step (outside the model) and its share of a step.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (("run", "{}"), ("weight_format", "{}"), ("total_params", "{:.3g}"), ("active_params", "{:.3g}"), ("kv_bytes_per_token", "{}"),
           ("prompt_tokens", "{}"), ("prompt_tokens_per_s", "{:.0f}"), ("mfu", "{:.3f}"),
           ("mfu_with_attention", "{:.3f}"))
DECODE_COLUMNS = (("run", "{}"), ("overlap", "{}"), ("decode_tokens_per_s", "{:.0f}"), ("decode_step_ms", "{:.3f}"),
                  ("decode_host_ms_per_step", "{:.3f}"), ("decode_host_share_of_step", "{:.3f}"))


def row(path: Path) -> dict:
    r = json.loads(path.read_text())
    # Against the GPUs' datasheet peak (``mfu``; ``mfu_vs_gpu_peak`` in files of earlier releases), else
    # against the measured matmul rate: CPUs have no datasheet peak here.
    peak = r.get("mfu", r.get("mfu_vs_gpu_peak"))
    with_attention = r.get("mfu_with_attention", r.get("mfu_with_attention_vs_gpu_peak"))
    if peak is None:
        peak, with_attention = r["mfu_vs_measured_matmul"], r["mfu_with_attention_vs_measured_matmul"]
    return {"run": path.stem.removeprefix("bench-"), **r, "mfu": peak, "mfu_with_attention": with_attention}


def main(args: list[str]) -> None:
    columns = DECODE_COLUMNS if args[:1] == ["--decode"] else COLUMNS
    rows = [row(Path(p)) for p in args if p != "--decode"]
    cells = [[fmt.format(r[key]) if r.get(key) is not None else "-" for key, fmt in columns] for r in rows]
    widths = [max(len(key), *(len(c[i]) for c in cells)) for i, (key, _) in enumerate(columns)]
    print("  ".join(key.rjust(w) for (key, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(value.rjust(w) for value, w in zip(c, widths)))


if __name__ == "__main__":
    main(sys.argv[1:])
