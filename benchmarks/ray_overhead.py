"""The same job locally and on Ray with 1 and 2 engine replicas: rows/s and what Ray costs per row.

    python benchmarks/ray_overhead.py [--model smollm2-135m-instruct] [--rows 64] [--max-tokens 16]

Writes jobs/data/articles.jsonl repeated to --rows rows into a temp folder, runs the job with the local executor,
then starts a local Ray and runs it with ``executor: ray`` and 1, then 2 replicas, each into a fresh output
folder. The replicas share this machine's cores as the local run has them: each reserves cores / replicas CPUs,
which Ray also gives it as threads (``OMP_NUM_THREADS``); Ray's logical CPUs are twice the cores, so the read and
prepare tasks always find one. Prints, side by side:

- wall: the whole ``run_job`` (model load, Ray's actors and planning included), and rows/s over it;
- generate: first request to last result (on Ray: first window begun to last one committed), rows/s over it;
- replicas: each replica's rows/s over its active time (first window to last), and its model-load time;
- Ray overhead per row: (Ray's generate time - the local one) / rows, in milliseconds; what Ray adds once
  (starting actors, loading a model per replica) is the difference of the wall times.

Figures, not assertions: take them on a quiet machine. On a 2-core CPU two replicas share the same cores,
so they show Ray's overhead rather than a speed-up; replicas scale with GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def job(model: str, inputs: str, out: str, max_tokens: int, replicas: int | None, window: int) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "ray-overhead", "model": {"path": model},
        "engine": {"device": "cpu", "max_num_seqs": 16, "max_num_batched_tokens": 4096},
        "input": {"path": inputs, "id_column": "id"},
        "prompt": {"system": "You are a concise assistant.",
                   "template": "Summarize the following article in three sentences.\n\n{{ text }}"},
        "sampling": {"max_tokens": max_tokens},
        "batching": {"sort_window": window},
        "output": {"path": out, "rows_per_part": 16},
    }
    if replicas:
        cores = os.cpu_count() or 1
        data["executor"] = {"kind": "ray", "num_replicas": replicas, "num_cpus": max(1, cores // replicas)}
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    import ray
    import torch

    from batchgen.pipeline.runner import run_job
    from batchgen.pipeline.spec import spec_from_dict

    folder = Path(tempfile.mkdtemp(prefix="ray-overhead-"))
    docs = [json.loads(line) for line in (ROOT / "jobs/data/articles.jsonl").read_text().splitlines() if line]
    inputs = folder / "in.jsonl"
    inputs.write_text("".join(json.dumps({**docs[i % len(docs)], "id": f"doc-{i:04d}"}) + "\n"
                              for i in range(args.rows)))
    print(f"{args.rows} rows, {args.max_tokens} tokens each, model {args.model}, "
          f"CPU {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores")

    results: list[tuple[str, dict[str, Any], float]] = []
    for replicas in (None, 1, 2):
        if replicas and not ray.is_initialized():
            started = time.perf_counter()
            ray.init(num_cpus=2 * (os.cpu_count() or 1), include_dashboard=False, logging_level="WARNING")
            print(f"ray.init: {time.perf_counter() - started:.1f} s (not counted below)")
        name = f"ray x{replicas}" if replicas else "local"
        spec = spec_from_dict(job(args.model, str(inputs), str(folder / name.replace(" ", "-")), args.max_tokens,
                                  replicas, window=max(1, args.rows // 8)))  # 8 windows to share out
        started = time.perf_counter()
        stats = run_job(spec, quiet=True)
        results.append((name, stats, time.perf_counter() - started))
    ray.shutdown()

    local_generate = results[0][1]["generate_s"]
    print(f"\n{'executor':<9} {'wall s':>7} {'rows/s':>7} {'generate s':>10} {'rows/s':>7} "
          f"{'overhead ms/row':>15}  replicas (rows/s active, load s)")
    for name, stats, wall in results:
        rows, generate = stats["rows"], stats["generate_s"]
        overhead = f"{(generate - local_generate) / rows * 1000:.1f}" if name != "local" else "-"
        replicas = ", ".join(f"{r['rows_per_s']:.1f} ({r['startup_s']:.1f})"
                             for r in stats["executor"].get("replicas", []))
        print(f"{name:<9} {wall:>7.1f} {rows / wall:>7.2f} {generate:>10.1f} {rows / generate:>7.2f} "
              f"{overhead:>15}  {replicas}")


if __name__ == "__main__":
    main()
